//! DRAM bandwidth, shared by every resident memory-bound ("dram") group of its domain (the device, or one MIG
//! partition, whose bandwidth is at most `cap`). A dram group's work is in seconds at the rate its threads
//! reach alone (threads times their `BlockCost.weight` times the first slope of `spec.dram_curve`). Together,
//! groups reach the curve's bandwidth at the sum over SMs of `threads()` (an SM's threads past the knee count
//! less, threads counting their weight everywhere), shared in proportion to threads, so every group runs at
//! the same fraction `rate` of its speed alone. One number therefore tracks them all: `progress`, the work
//! every resident group has done since the pool began; a group is done when progress reaches its target, and
//! a heap keeps the nearest first, so a group joining, leaving or finishing costs a heap operation, not a pass
//! over the others. As with an SM's shared groups, the engine pushes one event per reschedule and ignores
//! events of an older version. A spec without a curve gives every group its speed alone.

use crate::ops::{Groups, Ops};
use crate::sms::EPSILON;
use std::cmp::Ordering;
use crate::hash::Map;
use std::collections::BinaryHeap;

#[derive(Clone, Debug, Default)]
pub struct DramSpec {
    pub curve: Vec<(f64, f64)>,
    pub knee: i64,
    pub beyond: f64,
}

impl DramSpec {
    pub fn threads(&self, threads: f64) -> f64 {
        let knee = self.knee as f64;
        if self.knee == 0 || threads <= knee { threads } else { knee + self.beyond * (threads - knee) }
    }

    pub fn bandwidth(&self, threads: f64) -> f64 {
        let (mut lo_t, mut lo_b) = (0.0, 0.0);
        for &(t, b) in &self.curve {
            if threads <= t {
                return lo_b + (b - lo_b) * (threads - lo_t) / (t - lo_t);
            }
            lo_t = t;
            lo_b = b;
        }
        lo_b
    }
}

#[derive(Clone, Copy)]
struct Entry {
    target: f64,
    order: u64,
    gid: u32,
}
impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> Ordering {
        match o.target.partial_cmp(&self.target) {
            Some(Ordering::Equal) | None => o.order.cmp(&self.order),
            Some(x) => x,
        }
    }
}

pub struct DramPool {
    pub key: u64,
    pub cap: f64,
    /// Resident group -> (target, the order of its heap entry).
    targets: Map<u32, (f64, u64)>,
    heap: BinaryHeap<Entry>,
    order: u64,
    threads: f64,
    sm_threads: Vec<f64>,
    sm_present: Vec<bool>,
    sm_count: usize,
    axis: f64,
    progress: f64,
    pub last: f64,
    pub rate: f64,
    pub version: u64,
}

impl DramPool {
    pub fn new(key: u64, cap: f64, sms: usize) -> Self {
        DramPool { key, cap, targets: Map::default(), heap: BinaryHeap::new(), order: 0, threads: 0.0,
                   sm_threads: vec![0.0; sms], sm_present: vec![false; sms], sm_count: 0, axis: 0.0,
                   progress: 0.0, last: 0.0, rate: 1.0, version: 0 }
    }

    fn join(&mut self, spec: &DramSpec, gid: u32, sign: i64, groups: &Groups, ops: &Ops) {
        let g = groups.at(gid);
        let k = ops.at(g.run);
        let threads = (sign * g.count * k.threads as i64) as f64 * k.cost.weight;
        self.threads += threads;
        let sm = g.sm as usize;
        let before = if self.sm_present[sm] { self.sm_threads[sm] } else { 0.0 };
        let after = before + threads;
        if after > 1e-6 {
            if !self.sm_present[sm] {
                self.sm_present[sm] = true;
                self.sm_count += 1;
            }
            self.sm_threads[sm] = after;
        } else if self.sm_present[sm] {
            self.sm_present[sm] = false;
            self.sm_count -= 1;
        }
        if self.sm_count > 0 {
            self.axis += spec.threads(after) - spec.threads(before);
        } else {
            self.axis = 0.0;
            self.threads = 0.0;
        }
    }

    fn account(&mut self, now: f64) {
        let dt = now - self.last;
        if dt > 0.0 {
            self.progress += dt * self.rate;
        }
        self.last = now;
    }

    pub fn add(&mut self, spec: &DramSpec, gid: u32, now: f64, groups: &Groups, ops: &Ops) {
        self.account(now);
        let target = self.progress + groups.at(gid).remaining;
        let order = self.order;
        self.order += 1;
        self.targets.insert(gid, (target, order));
        self.heap.push(Entry { target, order, gid });
        self.join(spec, gid, 1, groups, ops);
    }

    pub fn remove(&mut self, spec: &DramSpec, gid: u32, now: f64, groups: &mut Groups, ops: &Ops) {
        self.account(now);
        let (target, _) = self.targets.remove(&gid).expect("a resident dram group");
        groups.at_mut(gid).remaining = target - self.progress;
        self.join(spec, gid, -1, groups, ops);
    }

    fn current(&self, e: &Entry) -> bool {
        self.targets.get(&e.gid) == Some(&(e.target, e.order))
    }

    pub fn pop_finished(&mut self, spec: &DramSpec, now: f64, groups: &mut Groups, ops: &Ops) -> Vec<u32> {
        self.account(now);
        let mut done = Vec::new();
        while let Some(&e) = self.heap.peek() {
            if !self.current(&e) {
                self.heap.pop();
                continue;
            }
            if e.target - self.progress > EPSILON * self.rate {
                break;
            }
            self.heap.pop();
            self.targets.remove(&e.gid);
            groups.at_mut(e.gid).remaining = e.target - self.progress;
            self.join(spec, e.gid, -1, groups, ops);
            done.push(e.gid);
        }
        done
    }

    pub fn reschedule(&mut self, spec: &DramSpec) -> Option<f64> {
        self.version += 1;
        while let Some(e) = self.heap.peek() {
            if self.current(e) {
                break;
            }
            self.heap.pop();
        }
        let top = self.heap.peek()?.target;
        if !spec.curve.is_empty() {
            let (threads0, rate0) = spec.curve[0];
            let bw = spec.bandwidth(self.axis);
            let bandwidth = if self.cap < bw { self.cap } else { bw };
            let r = bandwidth / (self.threads * rate0 / threads0);
            self.rate = if r < 1.0 { r } else { 1.0 };
        }
        let left = top - self.progress;
        let left = if 0.0 > left { 0.0 } else { left };
        Some(self.last + left / self.rate)
    }
}
