//! The policies that share the GPU block by block: round-robin, strict priority (with aging) and weighted
//! fair share (mpsd/sim/policies/shares.py, whose comments say why each shortcut is exact). What they derive
//! from the ready list (Turns) is kept until the ready queue's version changes.

use crate::engine::Core;
use crate::policy::{ClientConfig, Policy};
use crate::hash::{Map, Set};

/// Ready kernels as turn-taking reads them: by client (in order of first appearance), the clients
/// ascending, and which clients have kernels of each key.
#[derive(Default)]
pub struct Turns {
    pub queues: Vec<(i64, Vec<u64>)>,
    index: Map<i64, usize>,
    pub clients: Vec<i64>,
    /// Key -> the queues (by position) with a kernel of it.
    by_key: Map<u32, Vec<usize>>,
}

impl Turns {
    pub fn new(core: &Core, runs: &[u64]) -> Self {
        let mut t = Turns::default();
        for &r in runs {
            let o = core.ops.at(r);
            let i = *t.index.entry(o.client).or_insert_with(|| {
                t.queues.push((o.client, Vec::new()));
                t.queues.len() - 1
            });
            t.queues[i].1.push(r);
            let ks = t.by_key.entry(o.key).or_default();
            if !ks.contains(&i) {
                ks.push(i);
            }
        }
        t.clients = t.queues.iter().map(|q| q.0).collect();
        t.clients.sort_unstable();
        t
    }

    pub fn position(&self, client: i64) -> usize {
        self.index[&client]
    }

    pub fn queue(&self, client: i64) -> &[u64] {
        &self.queues[self.index[&client]].1
    }

    /// Which queues (by position) have a kernel of one of `open` keys.
    pub fn able(&self, open: &[u32]) -> Vec<bool> {
        let mut out = vec![false; self.queues.len()];
        for k in open {
            if let Some(qs) = self.by_key.get(k) {
                for &q in qs {
                    out[q] = true;
                }
            }
        }
        out
    }
}

/// Place one block of the client's first kernel that has room; false if none has.
fn serve_one(core: &mut Core, pol: &mut dyn Policy, queue: &[u64], open: &mut Vec<u32>) -> bool {
    for &r in queue {
        let (unplaced, key) = {
            let o = core.ops.at(r);
            (o.unplaced, o.key)
        };
        if unplaced != 0 && !core.ready.is_full(key) && core.place(pol, r, 1) != 0 {
            if core.fit.get(key).is_none_or(|t| t.room.is_empty()) {
                core.close_keys(open);
            }
            return true;
        }
    }
    false
}

/// Place everything of one client that fits, kernels in order; false if nothing fitted.
pub fn serve_all(core: &mut Core, pol: &mut dyn Policy, queue: &[u64]) -> bool {
    let mut placed = 0;
    for &r in queue {
        let n = core.ops.at(r).unplaced;
        if n != 0 {
            placed += core.place(pol, r, n);
        }
    }
    placed > 0
}

/// Clients place one block each in rotation (ascending id, starting after `after`) until none can; the
/// last client that placed a block (`after` if none did).
pub fn take_turns(core: &mut Core, pol: &mut dyn Policy, turns: &Turns, after: Option<i64>) -> Option<i64> {
    let mut open = core.open_keys();
    if open.is_empty() {
        return after;
    }
    let mut clients: Vec<i64> = turns.clients.clone();
    let mut last = after;
    if clients.len() > 1 {
        let able = turns.able(&open);
        let cut = match after {
            None => 0,
            Some(a) => clients.partition_point(|&c| c <= a),
        };
        let mut rotation: Vec<i64> = clients[cut..].iter().chain(clients[..cut].iter()).copied()
            .filter(|&c| able[turns.position(c)]).collect();
        loop {
            let mut still = Vec::new();
            for &c in &rotation {
                if core.ready.saturated() {
                    return last;
                }
                if serve_one(core, pol, turns.queue(c), &mut open) {
                    still.push(c);
                    last = Some(c);
                }
            }
            rotation = still.clone();
            clients = still;
            if clients.len() <= 1 {
                break;
            }
        }
    }
    if let Some(&c) = clients.first() {
        if serve_all(core, pol, turns.queue(c)) {
            last = Some(c);
        }
    }
    last
}

/// `round-robin`: clients take turns at block granularity, resuming after the last client served.
#[derive(Default)]
pub struct RoundRobin {
    last: Option<i64>,
    turns: Option<Turns>,
    version: u64,
}

impl Policy for RoundRobin {
    fn name(&self) -> &str {
        "round-robin"
    }
    fn dispatch(&mut self, core: &mut Core, ready: &[u64]) {
        let version = core.ready.version;
        let turns = match self.turns.take() {
            Some(t) if self.version == version => t,
            _ => Turns::new(core, ready),
        };
        self.version = version;
        let after = self.last;
        self.last = take_turns(core, self, &turns, after);
        self.turns = Some(turns);
    }
}

/// `priority`: strict client priority, round-robin within a level, optional aging.
#[derive(Default)]
pub struct Priority {
    aging: Option<f64>,
    levels_of: Map<i64, i64>,
    last: Map<i64, Option<i64>>,
    version: Option<u64>,
    levels: Vec<(i64, Turns)>,
    by_age: Vec<u64>,
}

impl Priority {
    pub fn new(aging: Option<f64>) -> Self {
        Priority { aging, ..Default::default() }
    }

    fn levels(&self, core: &Core, runs: &[u64]) -> Vec<(i64, Turns)> {
        let mut levels: Vec<(i64, Vec<u64>)> = Vec::new();
        for &r in runs {
            let o = core.ops.at(r);
            if o.unplaced == 0 {
                continue;
            }
            let level = self.levels_of.get(&o.client).copied().unwrap_or(0);
            match levels.iter_mut().find(|l| l.0 == level) {
                Some(l) => l.1.push(r),
                None => levels.push((level, vec![r])),
            }
        }
        levels.sort_by_key(|l| l.0);
        levels.into_iter().map(|(level, rs)| (level, Turns::new(core, &rs))).collect()
    }
}

impl Policy for Priority {
    fn name(&self) -> &str {
        "priority"
    }
    fn configure(&mut self, client: i64, config: ClientConfig) -> Result<(), String> {
        self.levels_of.insert(client, config.priority);
        self.version = None;
        Ok(())
    }
    fn forget(&mut self, client: i64) {
        // the engine drops the client's configuration: it is back at the default level
        self.levels_of.remove(&client);
    }
    fn dispatch(&mut self, core: &mut Core, ready: &[u64]) {
        if self.version != Some(core.ready.version) {
            self.version = Some(core.ready.version);
            self.levels = self.levels(core, ready);
            if self.aging.is_some() {
                let mut by_age = ready.to_vec();
                by_age.sort_by(|&a, &b| {
                    let (x, y) = (core.ops.at(a), core.ops.at(b));
                    x.run_eligible.partial_cmp(&y.run_eligible).unwrap().then(x.seq.cmp(&y.seq))
                });
                self.by_age = by_age;
            }
        }
        let levels = std::mem::take(&mut self.levels);
        let mut fresh = None;
        if let Some(aging) = self.aging {
            let horizon = core.now - aging;
            let by_age = std::mem::take(&mut self.by_age);
            let mut hold = false;
            for &r in &by_age {
                if core.ops.at(r).run_eligible > horizon {
                    break;
                }
                let n = core.ops.at(r).unplaced;
                if core.place(self, r, n) == 0 && core.ops.at(r).unplaced != 0 {
                    hold = true; // hold the line for the oldest starving kernel
                    break;
                }
            }
            self.by_age = by_age;
            if hold {
                self.levels = levels;
                return;
            }
            if core.ready.drained {
                fresh = Some(self.levels(core, ready));
            }
        }
        for (level, turns) in fresh.as_ref().unwrap_or(&levels) {
            if core.ready.saturated() {
                break;
            }
            let after = self.last.get(level).copied().flatten();
            let last = take_turns(core, self, turns, after);
            self.last.insert(*level, last);
        }
        self.levels = levels;
    }
}

#[derive(Clone, Copy, PartialEq, PartialOrd)]
struct Rank(f64, i64);

/// Python's `a > b` on (float, client) tuples.
fn rank_gt(a: Rank, b: Rank) -> bool {
    if a.0 != b.0 {
        a.0 > b.0
    } else {
        a.1 > b.1
    }
}

/// `fair`: weighted fair share of SM-time, work-conserving, newcomers levelled with the least served.
#[derive(Default)]
pub struct Fair {
    service: Map<i64, f64>,
    resident: Vec<(i64, i64)>,
    waiting: Set<i64>,
    /// `waiting` is `everyone` (Python's alias, without the copy).
    waiting_all: bool,
    weights: Map<i64, f64>,
    version: Option<u64>,
    turns: Turns,
    weight: Map<i64, f64>,
    everyone: Set<i64>,
    rank: Map<i64, Rank>,
    /// `rank` of each queue of `turns`, by position (what a dispatch reads, without hashing).
    qrank: Vec<Rank>,
    moved: Set<i64>,
    live: Map<i64, Set<u64>>,
    idle_since: Map<i64, f64>,
    joining: Set<i64>,
}

impl Fair {
    fn resident_mut(&mut self, c: i64) -> &mut i64 {
        let i = match self.resident.iter().position(|r| r.0 == c) {
            Some(i) => i,
            None => {
                self.resident.push((c, 0));
                self.resident.len() - 1
            }
        };
        &mut self.resident[i].1
    }

    fn level_newcomers(&mut self) {
        let newcomers: Vec<i64> = self.turns.queues.iter().map(|q| q.0).filter(|c| self.joining.contains(c)).collect();
        if newcomers.is_empty() {
            return;
        }
        for c in &newcomers {
            self.joining.remove(c);
        }
        let mut active: Vec<i64> = self.resident.iter().filter(|r| r.1 != 0).map(|r| r.0).collect();
        active.extend(self.waiting.iter().copied().filter(|c| self.turns.index.contains_key(c)));
        if active.is_empty() {
            return;
        }
        let mut floor = f64::NAN;
        for (k, c) in active.iter().enumerate() {
            let v = self.service.get(c).copied().unwrap_or(0.0) / self.weights.get(c).copied().unwrap_or(1.0);
            if k == 0 || v < floor {
                floor = v;
            }
        }
        for c in newcomers {
            let w = self.weight[&c];
            let s = self.service.get(&c).copied().unwrap_or(0.0);
            let f = floor * w;
            let s = if f > s { f } else { s };
            self.service.insert(c, s);
            self.rank.insert(c, Rank(s / w, c));
        }
    }

    /// Offer blocks one at a time to the least-served client that can place one, until one client is left
    /// (it then places all it can, once its service passes the most-served stuck client's) or everything is
    /// full (mpsd/sim/policies/shares.py's FairPolicy._offer said why that is the block-by-block answer).
    /// The clients that may place are few, so the least served is found by a scan rather than a heap: the
    /// same (service / weight, client) order, whose entries are all distinct.
    fn offer(&mut self, core: &mut Core, turns: &Turns, open: &mut Vec<u32>) {
        let able = turns.able(open);
        let mut heap: Vec<Rank> = (0..turns.queues.len()).filter(|&i| able[i]).map(|i| self.qrank[i]).collect();
        let mut stuck: Option<Option<Rank>> = None; // Some(None): no stuck client
        while !heap.is_empty() && !core.ready.saturated() {
            if heap.len() == 1 {
                if stuck.is_none() {
                    let mut most: Option<Rank> = None;
                    for c in &turns.clients {
                        let p = turns.position(*c);
                        if able[p] {
                            continue;
                        }
                        let r = self.qrank[p];
                        if most.is_none_or(|m| rank_gt(r, m)) {
                            most = Some(r);
                        }
                    }
                    stuck = Some(most);
                }
                let top = heap[0];
                let past = match stuck.unwrap() {
                    None => true,
                    Some(s) => rank_gt(top, s),
                };
                if past {
                    serve_all(core, self, turns.queue(top.1));
                    return;
                }
            }
            let mut m = 0;
            for k in 1..heap.len() {
                if rank_gt(heap[m], heap[k]) {
                    m = k;
                }
            }
            let c = heap.swap_remove(m).1;
            for &r in turns.queue(c) {
                let (unplaced, key) = {
                    let o = core.ops.at(r);
                    (o.unplaced, o.key)
                };
                if unplaced != 0 && !core.ready.is_full(key) && core.place(self, r, 1) != 0 {
                    if core.fit.get(key).is_none_or(|t| t.room.is_empty()) {
                        core.close_keys(open);
                    }
                    heap.push(Rank(self.service[&c] / self.weight[&c], c));
                    break;
                }
            }
        }
    }
}

impl Policy for Fair {
    fn name(&self) -> &str {
        "fair"
    }
    fn group_hooks(&self) -> bool {
        true
    }
    fn eligible(&mut self, core: &Core, run: u64) {
        let c = core.ops.at(run).client;
        let live = self.live.entry(c).or_default();
        if live.is_empty() && self.idle_since.get(&c).copied().unwrap_or(f64::NEG_INFINITY) < core.now {
            self.joining.insert(c);
        }
        live.insert(run);
    }
    fn retired(&mut self, core: &Core, run: u64) {
        let c = core.ops.at(run).client;
        if let Some(live) = self.live.get_mut(&c) {
            if live.remove(&run) && live.is_empty() {
                self.idle_since.insert(c, core.now);
            }
        }
    }
    fn configure(&mut self, client: i64, config: ClientConfig) -> Result<(), String> {
        self.weights.insert(client, config.weight);
        self.moved.insert(client);
        self.version = None;
        Ok(())
    }
    fn forget(&mut self, client: i64) {
        self.service.remove(&client);
        self.resident.retain(|r| r.0 != client);
        self.weights.remove(&client);
        self.rank.remove(&client);
        self.live.remove(&client);
        self.idle_since.remove(&client);
        self.moved.remove(&client);
        self.joining.remove(&client);
        self.version = None;
    }
    fn placed(&mut self, core: &Core, gid: u32) {
        let g = core.groups.at(gid);
        let o = core.ops.at(g.run);
        let c = o.client;
        let s = self.service.get(&c).copied().unwrap_or(0.0) + g.count as f64 * g.planned * o.sm_share;
        self.service.insert(c, s);
        self.moved.insert(c);
        *self.resident_mut(c) += g.count;
    }
    fn vacated(&mut self, core: &Core, gid: u32) {
        let g = core.groups.at(gid);
        let o = core.ops.at(g.run);
        let c = o.client;
        let held = g.end - g.start;
        *self.service.get_mut(&c).unwrap() += g.count as f64 * (held - g.planned) * o.sm_share;
        self.moved.insert(c);
        *self.resident_mut(c) -= g.count;
    }
    fn dispatch(&mut self, core: &mut Core, ready: &[u64]) {
        let moved: Vec<i64> = self.moved.drain().collect();
        for &c in &moved {
            let r = Rank(self.service.get(&c).copied().unwrap_or(0.0) / self.weights.get(&c).copied().unwrap_or(1.0), c);
            self.rank.insert(c, r);
        }
        if self.version == Some(core.ready.version) {
            for c in moved {
                if let Some(&p) = self.turns.index.get(&c) {
                    self.qrank[p] = self.rank[&c];
                }
            }
        } else {
            self.version = Some(core.ready.version);
            self.turns = Turns::new(core, ready);
            self.weight = self.turns.queues.iter().map(|q| (q.0, self.weights.get(&q.0).copied().unwrap_or(1.0))).collect();
            if self.waiting_all {
                // the clients left waiting are the ready list's of then, not of now
                self.waiting = std::mem::take(&mut self.everyone);
                self.waiting_all = false;
            }
            self.everyone = self.turns.queues.iter().map(|q| q.0).collect();
            self.level_newcomers();
            for q in &self.turns.queues {
                let c = q.0;
                if !self.rank.contains_key(&c) {
                    let w = self.weight[&c];
                    self.rank.insert(c, Rank(self.service.get(&c).copied().unwrap_or(0.0) / w, c));
                }
            }
            self.qrank = self.turns.queues.iter().map(|q| self.rank[&q.0]).collect();
        }
        let mut open = core.open_keys();
        let turns = std::mem::take(&mut self.turns);
        if !open.is_empty() {
            self.offer(core, &turns, &mut open);
        }
        if core.ready.drained {
            self.waiting = turns.queues.iter()
                .filter(|q| q.1.iter().any(|&r| core.ops.at(r).unplaced != 0)).map(|q| q.0).collect();
            self.waiting_all = false;
        } else {
            self.waiting_all = true;
        }
        self.turns = turns;
    }
}
