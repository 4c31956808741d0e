//! SM state: free resources and the throughput-bound ("shared") groups resident on each SM. Blocks are never
//! simulated one by one: blocks of one kernel placed on one SM at one instant form a group with one end time.
//! Shared groups on an SM divide its issue rate (processor sharing: each block asks min(1, threads /
//! saturation_threads) of it, scaled down when the asks pass 1), so their ends move whenever the SM's
//! membership changes. An SM's version therefore changes on every reschedule, and the engine ignores events
//! of an older version (lazy invalidation) instead of searching the heap.

use crate::ops::{Groups, Need};

pub const EPSILON: f64 = 1e-12;

#[derive(Clone, Debug)]
pub struct Sm {
    pub free_warps: i64,
    pub free_blocks: i64,
    pub free_regs: i64,
    pub free_smem: i64,
    pub resident: i64,
    pub shared: Vec<u32>,
    pub last: f64,
    pub version: u64,
}

impl Sm {
    pub fn empty(warps: i64, blocks: i64, regs: i64, smem: i64) -> Self {
        Sm { free_warps: warps, free_blocks: blocks, free_regs: regs, free_smem: smem, resident: 0,
             shared: Vec::new(), last: 0.0, version: 0 }
    }

    pub fn fit(&self, need: &Need) -> i64 {
        fit_of(self.free_blocks, self.free_warps, self.free_regs, self.free_smem, need.warps, need.regs, need.smem)
    }

    #[inline]
    pub fn take(&mut self, need: &Need, count: i64) {
        self.free_blocks -= count;
        self.free_warps -= need.warps * count;
        self.free_regs -= need.regs * count;
        self.free_smem -= need.smem * count;
        self.resident += count;
    }

    #[inline]
    pub fn release(&mut self, need: &Need, count: i64) {
        self.free_blocks += count;
        self.free_warps += need.warps * count;
        self.free_regs += need.regs * count;
        self.free_smem += need.smem * count;
        self.resident -= count;
    }

    pub fn account(&mut self, now: f64, groups: &mut Groups) {
        let dt = now - self.last;
        if dt > 0.0 {
            for &g in &self.shared {
                let g = groups.at_mut(g);
                g.remaining -= dt * g.rate;
            }
        }
        self.last = now;
    }

    pub fn add_shared(&mut self, gid: u32, now: f64, groups: &mut Groups) {
        self.account(now, groups);
        self.shared.push(gid);
    }

    pub fn remove_shared(&mut self, gid: u32, now: f64, groups: &mut Groups) {
        self.account(now, groups);
        if let Some(p) = self.shared.iter().position(|&g| g == gid) {
            self.shared.remove(p);
        }
    }

    pub fn pop_finished(&mut self, now: f64, groups: &mut Groups) -> Vec<u32> {
        self.account(now, groups);
        let done: Vec<u32> = self.shared.iter().copied()
            .filter(|&g| { let g = groups.at(g); g.remaining <= EPSILON * g.rate }).collect();
        if !done.is_empty() {
            self.shared.retain(|&g| { let g = groups.at(g); g.remaining > EPSILON * g.rate });
        }
        done
    }

    pub fn reschedule(&mut self, groups: &mut Groups) -> Option<f64> {
        self.version += 1;
        if self.shared.is_empty() {
            return None;
        }
        let mut total = 0.0;
        for &g in &self.shared {
            let g = groups.at(g);
            total += g.count as f64 * g.demand;
        }
        let scale = if total <= 1.0 { 1.0 } else { 1.0 / total };
        let mut soonest = f64::INFINITY;
        for &g in &self.shared {
            let g = groups.at_mut(g);
            g.rate = g.demand * scale;
            let rem = if 0.0 > g.remaining { 0.0 } else { g.remaining };
            let t = self.last + rem / g.rate;
            if t < soonest {
                soonest = t;
            }
        }
        Some(soonest)
    }
}

#[inline]
pub fn fit_of(blocks: i64, warps: i64, regs: i64, smem: i64, nw: i64, nr: i64, ns: i64) -> i64 {
    let mut f = warps / nw;
    if blocks < f {
        f = blocks;
    }
    let n = smem / ns;
    if n < f {
        f = n;
    }
    if nr != 0 {
        let n = regs / nr;
        if n < f {
            f = n;
        }
    }
    f
}
