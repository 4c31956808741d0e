//! The policies where one client holds the whole GPU at a time: exclusive-process compute mode, and
//! time-slicing without MPS with its timers and preemption (mpsd/sim/policies/tenancy.py holds the model
//! and its calibration; this is its steps in its order).

use crate::engine::Core;
use crate::policy::Policy;
use std::collections::BTreeMap;

/// Each client's eligible, unfinished kernels, in the order they became eligible.
#[derive(Default)]
struct Live {
    by_client: Vec<(i64, Vec<u64>)>,
}

impl Live {
    fn eligible(&mut self, client: i64, run: u64) {
        match self.by_client.iter_mut().find(|e| e.0 == client) {
            Some(e) => {
                if !e.1.contains(&run) {
                    e.1.push(run);
                }
            }
            None => self.by_client.push((client, vec![run])),
        }
    }
    fn retired(&mut self, client: i64, run: u64) {
        if let Some(i) = self.by_client.iter().position(|e| e.0 == client) {
            self.by_client[i].1.retain(|&r| r != run);
            if self.by_client[i].1.is_empty() {
                self.by_client.remove(i);
            }
        }
    }
    fn busy(&self, client: Option<i64>) -> bool {
        client.is_some_and(|c| self.by_client.iter().any(|e| e.0 == c))
    }
}

fn place_owner(core: &mut Core, pol: &mut dyn Policy, ready: &[u64], owner: i64) {
    for &r in ready {
        if core.ops.at(r).client == owner {
            let n = core.ops.at(r).unplaced;
            core.place(pol, r, n);
        }
    }
}

/// `exclusive`: one client's kernels at a time, never preempted; the GPU passes to the client whose oldest
/// eligible kernel is oldest.
#[derive(Default)]
pub struct Exclusive {
    live: Live,
    owner: Option<i64>,
}

impl Policy for Exclusive {
    fn name(&self) -> &str {
        "exclusive"
    }
    fn dispatch_when_idle(&self) -> bool {
        true
    }
    fn eligible(&mut self, core: &Core, run: u64) {
        self.live.eligible(core.ops.at(run).client, run);
    }
    fn retired(&mut self, core: &Core, run: u64) {
        self.live.retired(core.ops.at(run).client, run);
    }
    fn dispatch(&mut self, core: &mut Core, ready: &[u64]) {
        if !self.live.busy(self.owner) {
            self.owner = None;
            let mut best: Option<(f64, u64, i64)> = None;
            for (c, runs) in &self.live.by_client {
                let mut oldest: Option<(f64, u64)> = None;
                for &r in runs {
                    let o = core.ops.at(r);
                    let k = (o.run_eligible, o.seq);
                    if oldest.is_none_or(|m| k.0 < m.0 || (k.0 == m.0 && k.1 < m.1)) {
                        oldest = Some(k);
                    }
                }
                let (e, s) = oldest.unwrap();
                let k = (e, s, *c);
                let lt = |a: (f64, u64, i64), b: (f64, u64, i64)| {
                    if a.0 != b.0 { a.0 < b.0 } else if a.1 != b.1 { a.1 < b.1 } else { a.2 < b.2 }
                };
                if best.is_none_or(|b| lt(k, b)) {
                    best = Some(k);
                }
            }
            self.owner = best.map(|b| b.2);
        }
        if let Some(owner) = self.owner {
            place_owner(core, self, ready, owner);
        }
    }
}

/// `timeslice`: one context owns the GPU for a slice at a time; at a slice's end with others waiting its
/// blocks are preempted and, after a context switch, the next client in rotation gets a slice.
pub struct Timeslice {
    live: Live,
    owner: Option<i64>,
    slice: f64,
    switch: f64,
    state: Vec<(f64, f64, f64)>,
    warp_slots: f64,
    held: BTreeMap<i64, f64>,
    resident: Option<i64>,
    incoming: Option<i64>,
    epoch: u64,
    switches: i64,
}

impl Timeslice {
    pub fn new(slice: f64, switch: f64, state: Vec<(f64, f64, f64)>, warp_slots: i64) -> Self {
        Timeslice { live: Live::default(), owner: None, slice, switch, state, warp_slots: warp_slots as f64,
                    held: BTreeMap::new(), resident: None, incoming: None, epoch: 0, switches: 0 }
    }

    /// (extra switch seconds, slice seconds lost) for a context whose preempted blocks hold `held`.
    fn costs(&self, held: f64) -> (f64, f64) {
        let mut lo = (0.0, 0.0, 0.0);
        for &p in &self.state {
            if held <= p.0 {
                let f = (held - lo.0) / (p.0 - lo.0);
                return (lo.1 + f * (p.1 - lo.1), lo.2 + f * (p.2 - lo.2));
            }
            lo = p;
        }
        (lo.1, lo.2)
    }

    fn next(&self) -> Option<i64> {
        let mut clients: Vec<i64> = self.live.by_client.iter().map(|e| e.0).collect();
        clients.sort_unstable();
        let first = *clients.first()?;
        Some(clients.into_iter().find(|&c| self.resident.is_none_or(|r| c > r)).unwrap_or(first))
    }

    fn hand_over(&mut self, core: &mut Core, saved: f64) {
        self.owner = None;
        self.epoch += 1;
        let Some(nxt) = self.next() else { return };
        let held = self.held.get(&nxt).copied().unwrap_or(0.0);
        let cost = self.switch + (self.costs(saved).0 + self.costs(held).0) / 2.0;
        if self.resident.is_none() || Some(nxt) == self.resident || cost == 0.0 {
            self.grant(core, nxt);
        } else {
            self.incoming = Some(nxt);
            self.switches += 1;
            core.set_timer(core.now + cost, self.epoch);
        }
    }

    fn grant(&mut self, core: &mut Core, client: i64) {
        self.owner = Some(client);
        self.resident = Some(client);
        self.incoming = None;
        self.epoch += 1;
        let held = self.held.remove(&client).unwrap_or(0.0);
        let loss = self.costs(held).1;
        core.set_timer(core.now + self.slice - loss, self.epoch);
    }
}

impl Policy for Timeslice {
    fn name(&self) -> &str {
        "timeslice"
    }
    fn dispatch_when_idle(&self) -> bool {
        true
    }
    fn eligible(&mut self, core: &Core, run: u64) {
        self.live.eligible(core.ops.at(run).client, run);
    }
    fn retired(&mut self, core: &Core, run: u64) {
        let c = core.ops.at(run).client;
        self.live.retired(c, run);
        if !self.live.busy(Some(c)) {
            self.held.remove(&c);
        }
    }
    fn timer_stale(&self, token: u64) -> bool {
        token != self.epoch
    }
    fn on_timer(&mut self, core: &mut Core, _token: u64) {
        if let Some(c) = self.incoming {
            self.grant(core, c);
        } else if self.live.by_client.iter().any(|e| Some(e.0) != self.owner) {
            let owner = self.owner;
            let warps = match owner {
                Some(o) => core.preempt(self, o),
                None => 0,
            };
            let saved = warps as f64 / self.warp_slots;
            if saved != 0.0 {
                if let Some(o) = owner {
                    self.held.insert(o, saved);
                }
            }
            self.hand_over(core, saved);
        } else {
            self.epoch += 1;
            core.set_timer(core.now + self.slice, self.epoch);
        }
    }
    fn dispatch(&mut self, core: &mut Core, ready: &[u64]) {
        if self.incoming.is_some() {
            return;
        }
        if self.owner.is_none() || !self.live.busy(self.owner) {
            self.hand_over(core, 0.0);
        }
        if let Some(owner) = self.owner {
            place_owner(core, self, ready, owner);
        }
    }
    fn counter(&self, name: &str) -> Option<i64> {
        (name == "switches").then_some(self.switches)
    }
}

/// `mig`: static partitions; a client's blocks only go on its partition's SMs, its copies on its
/// partition's engines, its memory-bound blocks share its partition's DRAM bandwidth.
pub struct Mig {
    /// (first SM, SMs, share of the device's DRAM bandwidth) per partition.
    partitions: Vec<(usize, usize, f64)>,
    bound: BTreeMap<i64, usize>,
}

impl Mig {
    pub fn new(partitions: Vec<(usize, usize, f64)>) -> Self {
        Mig { partitions, bound: BTreeMap::new() }
    }
    fn index(&self, client: i64) -> usize {
        self.bound.get(&client).copied().unwrap_or(0)
    }
}

impl Policy for Mig {
    fn name(&self) -> &str {
        "mig"
    }
    fn configure(&mut self, client: i64, config: crate::policy::ClientConfig) -> Result<(), String> {
        if config.partition >= self.partitions.len() {
            return Err(format!("partition {} out of range: the layout has {}", config.partition,
                               self.partitions.len()));
        }
        self.bound.insert(client, config.partition);
        Ok(())
    }
    fn forget(&mut self, client: i64) {
        self.bound.remove(&client);
    }
    fn window(&self, client: i64) -> crate::ready::Window {
        let p = self.partitions[self.index(client)];
        Some((p.0, p.0 + p.1))
    }
    fn copy_lane(&self, client: i64) -> u32 {
        self.index(client) as u32
    }
    fn dram_share(&self, client: i64) -> (u64, f64) {
        let i = self.index(client);
        (i as u64, self.partitions[i].2)
    }
    fn dispatch(&mut self, core: &mut Core, ready: &[u64]) {
        crate::policy::place_in_launch_order(core, self, ready);
    }
}
