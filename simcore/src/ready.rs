//! The ready queue: kernels past their launch overhead with blocks left to place, in hardware order (stream
//! priority, when eligible, launch order), and the keys that let a dispatch stop early. A kernel's key names
//! its block shape and the SM window its client may use; kernels with equal keys compete for the very same
//! room, so a key found without room for one block stands for all of them. Placing only takes room, so a key
//! filed full stays full until the dispatch ends, and once every key of the ready kernels is full nothing more
//! can be placed: a pass stops there instead of walking a long queue. `version` changes whenever the ready
//! list or its keys change, so a policy may keep what it derives from the list until then.

use crate::fit::FitIndex;
use crate::ops::{Need, Ops};
use crate::sms::Sm;
use crate::hash::Map;

pub type Window = Option<(usize, usize)>;

pub struct Part {
    pub need: Need,
    pub lo: usize,
    pub hi: usize,
}

#[derive(Default)]
pub struct ReadyQueue {
    pub runs: Vec<u64>,
    /// The key of each of `runs`, beside it (a pass over the keys reads no op).
    pub run_keys: Vec<u32>,
    /// Ready kernels with blocks unplaced, by key.
    counts: Vec<u32>,
    ncounts: usize,
    full: Vec<bool>,
    nfull: usize,
    full_list: Vec<u32>,
    pub drained: bool,
    pub version: u64,
    windows: Map<i64, Window>,
    keys: Map<(u32, Window), u32>,
    pub parts: Vec<Part>,
    sm_count: usize,
}

/// Python's `mps_key(a) < mps_key(b)` on (priority, eligible, seq).
#[inline]
pub fn key_lt(ops: &Ops, a: u64, b: u64) -> bool {
    let (x, y) = (ops.at(a), ops.at(b));
    if x.priority != y.priority {
        return x.priority < y.priority;
    }
    if x.run_eligible != y.run_eligible {
        return x.run_eligible < y.run_eligible;
    }
    x.seq < y.seq
}

impl ReadyQueue {
    pub fn new(sm_count: usize) -> Self {
        ReadyQueue { sm_count, ..Default::default() }
    }

    pub fn window(&mut self, client: i64, window_of: &dyn Fn(i64) -> Window) -> Window {
        *self.windows.entry(client).or_insert_with(|| window_of(client))
    }

    pub fn key(&mut self, run: u64, ops: &Ops, window_of: &dyn Fn(i64) -> Window) -> u32 {
        let o = ops.at(run);
        let window = self.window(o.client, window_of);
        let k = (o.shape, window);
        if let Some(&key) = self.keys.get(&k) {
            return key;
        }
        let key = self.parts.len() as u32;
        self.keys.insert(k, key);
        let (lo, hi) = window.unwrap_or((0, self.sm_count));
        self.parts.push(Part { need: o.need, lo, hi });
        key
    }

    pub fn lookup<'a>(&self, fit: &'a mut FitIndex, sms: &[Sm], key: u32) -> &'a crate::fit::Table {
        let p = &self.parts[key as usize];
        fit.lookup(sms, key, p.need, p.lo, p.hi)
    }

    fn count_add(&mut self, key: u32) {
        let k = key as usize;
        if self.counts.len() <= k {
            self.counts.resize(k + 1, 0);
            self.full.resize(k + 1, false);
        }
        if self.counts[k] == 0 {
            self.ncounts += 1;
        }
        self.counts[k] += 1;
    }

    pub fn count(&self, key: u32) -> u32 {
        self.counts.get(key as usize).copied().unwrap_or(0)
    }

    pub fn add(&mut self, run: u64, ops: &mut Ops, window_of: &dyn Fn(i64) -> Window) {
        let key = self.key(run, ops, window_of);
        ops.at_mut(run).key = key;
        if let Some(&last) = self.runs.last() {
            if key_lt(ops, run, last) {
                // insort (bisect_right): after every kernel not after it
                let (mut lo, mut hi) = (0, self.runs.len());
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    if key_lt(ops, run, self.runs[mid]) {
                        hi = mid;
                    } else {
                        lo = mid + 1;
                    }
                }
                self.runs.insert(lo, run);
                self.run_keys.insert(lo, key);
            } else {
                self.runs.push(run);
                self.run_keys.push(key);
            }
        } else {
            self.runs.push(run);
            self.run_keys.push(key);
        }
        self.count_add(key);
        self.version += 1;
    }

    pub fn drained_key(&mut self, key: u32) {
        self.drained = true;
        let k = key as usize;
        self.counts[k] -= 1;
        if self.counts[k] == 0 {
            self.ncounts -= 1;
        }
    }

    pub fn prune(&mut self, ops: &Ops) {
        if self.drained {
            self.runs.retain(|&r| ops.at(r).unplaced != 0);
            self.run_keys = self.runs.iter().map(|&r| ops.at(r).key).collect();
            self.drained = false;
            self.version += 1;
        }
    }

    pub fn drop_cancelled(&mut self, ops: &mut Ops, window_of: &dyn Fn(i64) -> Window) {
        self.runs.retain(|&r| !ops.at(r).run_cancelled);
        self.rekey(ops, window_of);
    }

    pub fn forget_windows(&mut self, ops: &mut Ops, window_of: &dyn Fn(i64) -> Window) {
        self.windows.clear();
        self.rekey(ops, window_of);
    }

    pub fn rekey(&mut self, ops: &mut Ops, window_of: &dyn Fn(i64) -> Window) {
        self.version += 1;
        for c in self.counts.iter_mut() {
            *c = 0;
        }
        self.ncounts = 0;
        for i in 0..self.runs.len() {
            let r = self.runs[i];
            if ops.at(r).unplaced != 0 {
                let key = self.key(r, ops, window_of);
                ops.at_mut(r).key = key;
                self.count_add(key);
            }
        }
        self.run_keys = self.runs.iter().map(|&r| ops.at(r).key).collect();
    }

    pub fn clear_full(&mut self) {
        for k in self.full_list.drain(..) {
            self.full[k as usize] = false;
        }
        self.nfull = 0;
    }

    #[inline]
    pub fn is_full(&self, key: u32) -> bool {
        self.full.get(key as usize).copied().unwrap_or(false)
    }

    pub fn set_full(&mut self, key: u32) {
        let k = key as usize;
        if self.full.len() <= k {
            self.full.resize(k + 1, false);
            self.counts.resize(k + 1, 0);
        }
        if !self.full[k] {
            self.full[k] = true;
            self.full_list.push(key);
            self.nfull += 1;
        }
    }

    /// The keys of ready kernels with room in their window (the others are filed full), ascending.
    pub fn open_keys(&mut self, fit: &mut FitIndex, sms: &[Sm], open: &mut Vec<u32>) {
        for k in 0..self.counts.len() {
            if self.counts[k] == 0 || self.full[k] {
                continue;
            }
            let key = k as u32;
            let has_room = match fit.get(key) {
                Some(t) => !t.room.is_empty(),
                None => !self.lookup(fit, sms, key).room.is_empty(),
            };
            if has_room {
                open.push(key);
            } else {
                self.set_full(key);
            }
        }
    }

    /// Drop from `open` (and file full) the keys a placement has just filled up.
    pub fn close_keys(&mut self, open: &mut Vec<u32>, fit: &FitIndex) {
        let mut i = 0;
        while i < open.len() {
            let k = open[i];
            if fit.get(k).map_or(true, |t| t.room.is_empty()) {
                open.remove(i);
                if self.count(k) > 0 {
                    self.set_full(k);
                }
            } else {
                i += 1;
            }
        }
    }

    pub fn saturated(&self) -> bool {
        self.nfull >= self.ncounts
    }

    /// Keys with ready kernels (the sweep keeps their tables).
    pub fn counted(&self, key: u32) -> bool {
        self.count(key) > 0
    }
}
