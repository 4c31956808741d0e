//! What the engine keeps per op (its kernel run, its copy's progress) and per resident block group, in slabs
//! addressed by small integers. An op's handle carries its slot's generation, so that a reference kept after
//! the op was reclaimed (a waiter list, a launch-overhead event of a cancelled kernel) is seen to be stale.

use std::collections::VecDeque;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Kernel,
    Copy,
    Marker,
    /// Named in another op's `after` before it was submitted: it holds its waiters until it is.
    Placeholder,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Need {
    pub warps: i64,
    pub regs: i64,
    pub smem: i64,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Cost {
    pub seconds: f64,
    pub shared: bool,
    pub clocked: bool,
    pub dram: bool,
    pub weight: f64,
}

#[derive(Clone, Debug)]
pub struct Op {
    pub gen: u32,
    pub kind: Kind,
    pub client: i64,
    /// The engine's index of its client.
    pub ci: usize,
    pub stream: u64,
    pub seq: u64,
    pub after: Vec<u64>,
    pub submitted: f64,
    pub eligible: f64,
    pub started: f64,
    pub ended: f64,
    pub done: bool,
    pub cancelled: bool,
    /// Its eligible, started, ended, done or cancelled changed since the caller last looked.
    pub dirty: bool,
    // --- a kernel's run
    pub threads: u32,
    pub priority: i64,
    pub sm_cap: Option<i64>,
    pub cost: Cost,
    pub need: Need,
    pub shape: u32,
    pub seconds: f64,
    pub demand: f64,
    pub sm_share: f64,
    /// Its own launch overhead (a graph's node pays less than a kernel launched alone); NaN: the spec's.
    pub overhead: f64,
    pub has_run: bool,
    pub run_eligible: f64,
    pub unplaced: i64,
    pub running: i64,
    pub run_cancelled: bool,
    /// Resident groups in placement order; u32::MAX marks a removed one.
    pub groups: Vec<u32>,
    pub live_groups: u32,
    /// Preempted blocks waiting to resume: [count, seconds left (or deadline, if clocked)], oldest first.
    pub partial: VecDeque<(i64, f64)>,
    pub key: u32,
    pub ready_pending: bool,
    // --- a copy's
    pub engine: u8,
    pub nbytes: u64,
    pub copy_left: Option<f64>,
    pub copy_lane: Option<usize>,
}

impl Op {
    pub fn new(kind: Kind) -> Self {
        Op {
            gen: 0,
            kind,
            client: 0,
            ci: 0,
            stream: 0,
            seq: u64::MAX,
            after: Vec::new(),
            submitted: f64::NAN,
            eligible: f64::NAN,
            started: f64::NAN,
            ended: f64::NAN,
            done: false,
            cancelled: false,
            dirty: false,
            threads: 0,
            priority: 0,
            sm_cap: None,
            cost: Cost::default(),
            need: Need::default(),
            shape: 0,
            seconds: 0.0,
            demand: 1.0,
            sm_share: 1.0,
            overhead: f64::NAN,
            has_run: false,
            run_eligible: 0.0,
            unplaced: 0,
            running: 0,
            run_cancelled: false,
            groups: Vec::new(),
            live_groups: 0,
            partial: VecDeque::new(),
            key: u32::MAX,
            ready_pending: false,
            engine: 0,
            nbytes: 0,
            copy_left: None,
            copy_lane: None,
        }
    }

    pub fn add_group(&mut self, gid: u32) -> u32 {
        self.groups.push(gid);
        self.live_groups += 1;
        (self.groups.len() - 1) as u32
    }

    /// The live groups in placement order.
    pub fn group_ids(&self) -> Vec<u32> {
        self.groups.iter().copied().filter(|&g| g != u32::MAX).collect()
    }
}

pub fn slot(handle: u64) -> usize {
    (handle & 0xffff_ffff) as usize
}

#[derive(Default)]
pub struct Ops {
    pub v: Vec<Op>,
    free: Vec<usize>,
    /// Handles whose ops are over, to be reclaimed once the caller has read them.
    pub released: Vec<u64>,
    pub dirty: Vec<u64>,
}

impl Ops {
    pub fn insert(&mut self, op: Op) -> u64 {
        match self.free.pop() {
            Some(i) => {
                let gen = self.v[i].gen;
                self.v[i] = Op { gen, ..op };
                ((gen as u64) << 32) | i as u64
            }
            None => {
                self.v.push(op);
                (self.v.len() - 1) as u64
            }
        }
    }

    pub fn handle(&self, i: usize) -> u64 {
        ((self.v[i].gen as u64) << 32) | i as u64
    }

    /// The op of `handle`, or None if it was reclaimed (it was then done or cancelled).
    pub fn get(&self, handle: u64) -> Option<&Op> {
        let op = self.v.get(slot(handle))?;
        (op.gen == (handle >> 32) as u32).then_some(op)
    }

    pub fn valid(&self, handle: u64) -> bool {
        self.get(handle).is_some()
    }

    #[inline]
    pub fn at(&self, handle: u64) -> &Op {
        &self.v[slot(handle)]
    }

    #[inline]
    pub fn at_mut(&mut self, handle: u64) -> &mut Op {
        &mut self.v[slot(handle)]
    }

    pub fn touch(&mut self, handle: u64) {
        let op = &mut self.v[slot(handle)];
        if !op.dirty {
            op.dirty = true;
            self.dirty.push(handle);
        }
    }

    pub fn release(&mut self, handle: u64) {
        self.released.push(handle);
    }

    /// Reuse the slots of the released ops (their handles go stale).
    pub fn reclaim(&mut self) {
        for h in std::mem::take(&mut self.released) {
            let i = slot(h);
            let op = &mut self.v[i];
            if op.gen == (h >> 32) as u32 {
                let gen = op.gen.wrapping_add(1);
                *op = Op::new(Kind::Marker);
                op.gen = gen;
                self.free.push(i);
            }
        }
    }
}

/// Blocks of one kernel placed together on one SM at one instant.
#[derive(Clone, Copy, Debug)]
pub struct Group {
    pub run: u64,
    pub sm: u32,
    pub count: i64,
    pub start: f64,
    pub end: f64,
    pub remaining: f64,
    pub demand: f64,
    pub rate: f64,
    pub evicted: bool,
    pub planned: f64,
    /// Its place in its run's `groups`.
    pub slot: u32,
    /// The DRAM pool it is resident in (dram groups), else u64::MAX.
    pub pool: u64,
}

#[derive(Default)]
pub struct Groups {
    pub v: Vec<Group>,
    free: Vec<u32>,
}

impl Groups {
    pub fn insert(&mut self, g: Group) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.v[i as usize] = g;
                i
            }
            None => {
                self.v.push(g);
                (self.v.len() - 1) as u32
            }
        }
    }
    pub fn free(&mut self, i: u32) {
        self.free.push(i);
    }
    #[inline]
    pub fn at(&self, i: u32) -> &Group {
        &self.v[i as usize]
    }
    #[inline]
    pub fn at_mut(&mut self, i: u32) -> &mut Group {
        &mut self.v[i as usize]
    }
}
