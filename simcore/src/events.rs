//! The event heap, in SimPy's manner: events ordered by (time, seq) with seq unique, so ties keep the order
//! they were pushed in and payloads are never compared. The fixed-cost groups an event ends live in lists
//! kept here (a wave is one event), and the event pushed last is remembered while it is surely still in the
//! heap (no pop since), so that groups ending at its very time can join its list (`Core::push_groups`).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

pub const READY: u8 = 0;
pub const GROUP_END: u8 = 1;
pub const SM: u8 = 2;
pub const COPY_END: u8 = 3;
pub const TIMER: u8 = 4;
pub const DRAM: u8 = 5;

#[derive(Clone, Copy, Debug)]
pub struct Event {
    pub time: f64,
    pub seq: u64,
    pub kind: u8,
    /// READY: the kernel's handle; GROUP_END: its list; SM: the SM; COPY_END: the lane; TIMER: the token;
    /// DRAM: the pool's key.
    pub a: u64,
    /// The version the SM, lane or pool had when the event was pushed.
    pub b: u64,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    /// Reversed, so that std's max-heap pops the earliest (time, seq) first; times compare as Python's floats
    /// do in a tuple (equal times fall through to seq).
    fn cmp(&self, other: &Self) -> Ordering {
        match other.time.partial_cmp(&self.time) {
            Some(Ordering::Equal) | None => other.seq.cmp(&self.seq),
            Some(o) => o,
        }
    }
}

#[derive(Default)]
pub struct Events {
    heap: BinaryHeap<Event>,
    seq: u64,
    /// The event pushed last, while no pop has happened since.
    pub last: Option<Event>,
    lists: Vec<Vec<u32>>,
    free_lists: Vec<usize>,
    /// Emptied lists kept for reuse (a wave's list is made and dropped per placement otherwise).
    spare: Vec<Vec<u32>>,
}

impl Events {
    pub fn push(&mut self, time: f64, kind: u8, a: u64, b: u64) {
        let ev = Event { time, seq: self.seq, kind, a, b };
        self.seq += 1;
        self.last = Some(ev);
        self.heap.push(ev);
    }

    pub fn push_list(&mut self, time: f64, groups: Vec<u32>) {
        let i = match self.free_lists.pop() {
            Some(i) => {
                let old = std::mem::replace(&mut self.lists[i], groups);
                if old.capacity() > 0 && self.spare.len() < 64 {
                    self.spare.push(old);
                }
                i
            }
            None => {
                self.lists.push(groups);
                self.lists.len() - 1
            }
        };
        self.push(time, GROUP_END, i as u64, 0);
    }

    pub fn list_mut(&mut self, i: u64) -> &mut Vec<u32> {
        &mut self.lists[i as usize]
    }

    pub fn list(&self, i: u64) -> &[u32] {
        &self.lists[i as usize]
    }

    /// Take a popped event's list (the slot is reused); hand it back to `recycle` when done with it.
    pub fn take_list(&mut self, i: u64) -> Vec<u32> {
        self.free_lists.push(i as usize);
        std::mem::take(&mut self.lists[i as usize])
    }

    pub fn recycle(&mut self, mut list: Vec<u32>) {
        if self.spare.len() < 64 {
            list.clear();
            self.spare.push(list);
        }
    }

    /// An empty list, with room, for the next wave.
    pub fn fresh_list(&mut self) -> Vec<u32> {
        self.spare.pop().unwrap_or_default()
    }

    pub fn peek(&self) -> Option<&Event> {
        self.heap.peek()
    }

    pub fn pop(&mut self) -> Option<Event> {
        self.last = None;
        self.heap.pop()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}
