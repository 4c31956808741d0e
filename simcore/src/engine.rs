//! The event loop, in SimPy's manner: a heap of (time, seq) events with seq unique, so ties keep the order they
//! were pushed in. Work is handled an instant at a time: every event at time t first (blocks ending, kernels
//! passing their launch overhead, copies ending, policy timers), then freed capacity is dispatched once, so
//! blocks that end together free their SMs together. `Core` owns time and bookkeeping; stream order is in
//! streams.rs, SM accounting and processor sharing in sms.rs, the shared DRAM bandwidth in dram.rs, placing
//! blocks and taking them off in blocks.rs, the ready kernels and their keys in ready.rs, the copy engines in
//! copies.rs, the choice of which kernel goes next and which SMs a client may use in the policies. The policy
//! is passed to every method that may call it, so that its `dispatch` can call back into `Core::place`.
//! What keeps an instant cheap on a busy device (each exact, not an approximation): ready kernels are kept in
//! hardware order, so policies never sort; a dispatch stops once every (shape, window) key of the ready
//! kernels is full (ready.rs says why that is exact); the fit tables say which SMs have room; the fixed-cost
//! groups of one placement, and of placements pushed back to back with the same end time, share one event
//! (`push_groups`), and such a wave ends in one pass with one fit-table update (blocks.rs).
//! Floats are computed in the Python engine's order, step for step (it was the reference this one matched to
//! the bit before it went: tests/sim_golden.json.gz): Rust does not contract a * b + c, sums run left to
//! right, and min/max keep the first of equals as Python's do. The clock is the caller's: `run` for virtual
//! time, or any external clock driving `advance`.

use crate::copies::{CopyEngines, CopySpec};
use crate::dram::{DramPool, DramSpec};
use crate::events::{Events, COPY_END, DRAM, GROUP_END, READY, SM, TIMER};
use crate::fit::FitIndex;
use crate::ops::{Groups, Kind, Op, Ops};
use crate::policy::{ClientConfig, Policy};
use crate::ready::ReadyQueue;
use crate::sms::Sm;
use crate::streams::Streams;
use crate::hash::Map;
use std::collections::VecDeque;

const SWEEP: u64 = 1 << 12; // SM changes between sweeps of the fit tables no ready kernel needs

#[derive(Clone, Debug, Default)]
pub struct Spec {
    pub sm_count: usize,
    pub warps_per_sm: i64,
    pub blocks_per_sm: i64,
    pub regs_per_sm: i64,
    pub smem_per_sm: i64,
    pub min_block_time: f64,
    pub kernel_overhead: f64,
    pub dram: DramSpec,
    pub copy: CopySpec,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counters {
    pub kernels: i64,
    pub blocks: i64,
    pub block_seconds: f64,
    pub sm_seconds: f64,
    pub copies: i64,
    pub bytes_copied: i64,
    pub max_sms: i64,
}

pub struct Client {
    pub id: i64,
    pub counters: Option<Counters>,
    /// SM -> its resident blocks there (made at its first placement, as Python's client_sms entry).
    pub occupied: Vec<i64>,
    pub occ_len: i64,
}

pub struct Stats {
    pub now: f64,
    pub kernels: i64,
    pub blocks: i64,
    pub copies: i64,
    pub per_client: Vec<(i64, Counters)>,
    pub sm_seconds: f64,
}

/// A trace entry: (kernel handle, SM, blocks, start, end).
pub type TraceEntry = (u64, u32, i64, f64, f64);

pub struct Core {
    pub spec: Spec,
    pub now: f64,
    pub record: bool,
    pub trace: Vec<TraceEntry>,
    pub sms: Vec<Sm>,
    pub fit: FitIndex,
    pub ev: Events,
    op_seq: u64,
    pub streams: Streams,
    pub ops: Ops,
    pub groups: Groups,
    next_sweep: u64,
    pub dirty: bool,
    pub touched: Vec<usize>,
    touched_mark: Vec<bool>,
    pub dram: Map<u64, DramPool>,
    pub dram_touched: Vec<u64>,
    clients: Map<i64, usize>,
    pub cl: Vec<Client>,
    counter_order: Vec<usize>,
    pub copies: CopyEngines,
    completed: Vec<u64>,
    departed_sm_seconds: f64,
    pub kernels: i64,
    pub blocks: i64,
    pub copies_done: i64,
    pub ready: ReadyQueue,
    /// Buffers the hot paths reuse instead of allocating per call.
    pub open_mask: Vec<bool>,
    pub sm_buf: Vec<usize>,
    key_buf: Vec<u32>,
    pub place_buf: Vec<(usize, i64)>,
}

/// What a kernel's submit hands the engine (the shape's numbers come from Python's cached shapes).
#[derive(Clone, Debug)]
pub struct KernelArgs {
    pub client: i64,
    pub stream: u64,
    pub after: Vec<u64>,
    pub threads: u32,
    pub priority: i64,
    pub sm_cap: Option<i64>,
    pub cost: crate::ops::Cost,
    pub need: crate::ops::Need,
    pub shape: u32,
    pub seconds: f64,
    pub demand: f64,
    pub sm_share: f64,
    pub blocks: i64,
    /// Its own launch overhead, or NaN for the spec's kernel_overhead.
    pub overhead: f64,
}

impl Core {
    pub fn new(spec: Spec, record: bool) -> Self {
        let sms = (0..spec.sm_count)
            .map(|_| Sm::empty(spec.warps_per_sm, spec.blocks_per_sm, spec.regs_per_sm, spec.smem_per_sm))
            .collect();
        let n = spec.sm_count;
        Core {
            copies: CopyEngines::new(spec.copy.clone()),
            ready: ReadyQueue::new(n),
            spec,
            now: 0.0,
            record,
            trace: Vec::new(),
            sms,
            fit: FitIndex::default(),
            ev: Events::default(),
            op_seq: 0,
            streams: Streams::default(),
            ops: Ops::default(),
            groups: Groups::default(),
            next_sweep: SWEEP,
            dirty: false,
            touched: Vec::new(),
            touched_mark: vec![false; n],
            dram: Map::default(),
            dram_touched: Vec::new(),
            clients: Map::default(),
            cl: Vec::new(),
            counter_order: Vec::new(),
            completed: Vec::new(),
            departed_sm_seconds: 0.0,
            kernels: 0,
            blocks: 0,
            copies_done: 0,
            open_mask: Vec::new(),
            sm_buf: Vec::new(),
            key_buf: Vec::new(),
            place_buf: Vec::new(),
        }
    }

    // --- clients and counters ---------------------------------------------------------------

    pub fn client(&mut self, id: i64) -> usize {
        if let Some(&i) = self.clients.get(&id) {
            return i;
        }
        self.cl.push(Client { id, counters: None, occupied: Vec::new(), occ_len: 0 });
        self.clients.insert(id, self.cl.len() - 1);
        self.cl.len() - 1
    }

    pub fn client_of(&self, id: i64) -> Option<usize> {
        self.clients.get(&id).copied()
    }

    pub fn counter(&mut self, ci: usize) -> &mut Counters {
        if self.cl[ci].counters.is_none() {
            self.cl[ci].counters = Some(Counters::default());
            self.counter_order.push(ci);
        }
        self.cl[ci].counters.as_mut().unwrap()
    }

    pub fn touch_sm(&mut self, i: usize) {
        if !self.touched_mark[i] {
            self.touched_mark[i] = true;
            self.touched.push(i);
        }
    }

    pub fn touch_pool(&mut self, key: u64) {
        if !self.dram_touched.contains(&key) {
            self.dram_touched.push(key);
        }
    }

    // --- submitting ---------------------------------------------------------------------------

    /// A stand-in for an op named in an `after` before it is submitted.
    pub fn placeholder(&mut self) -> u64 {
        self.ops.insert(Op::new(Kind::Placeholder))
    }

    fn fill(&mut self, into: Option<u64>, op: Op) -> u64 {
        match into {
            Some(h) => {
                let gen = self.ops.at(h).gen;
                *self.ops.at_mut(h) = Op { gen, ..op };
                h
            }
            None => self.ops.insert(op),
        }
    }

    fn enter(&mut self, pol: &mut dyn Policy, h: u64) {
        let client = self.ops.at(h).client;
        let ci = self.client(client);
        let o = self.ops.at_mut(h);
        o.ci = ci;
        o.seq = self.op_seq;
        self.op_seq += 1;
        o.submitted = self.now;
        if self.streams.add(h, &self.ops) {
            self.settle(pol, vec![h]);
        }
    }

    pub fn submit_kernel(&mut self, pol: &mut dyn Policy, into: Option<u64>, a: KernelArgs) -> u64 {
        let mut op = Op::new(Kind::Kernel);
        op.client = a.client;
        op.stream = a.stream;
        op.after = a.after;
        op.threads = a.threads;
        op.priority = a.priority;
        op.sm_cap = a.sm_cap;
        op.cost = a.cost;
        op.need = a.need;
        op.shape = a.shape;
        op.seconds = a.seconds;
        op.demand = a.demand;
        op.sm_share = a.sm_share;
        op.overhead = a.overhead;
        op.has_run = true;
        op.unplaced = a.blocks;
        let h = self.fill(into, op);
        self.enter(pol, h);
        h
    }

    pub fn submit_copy(&mut self, pol: &mut dyn Policy, into: Option<u64>, client: i64, stream: u64,
                       after: Vec<u64>, engine: u8, nbytes: u64) -> u64 {
        let mut op = Op::new(Kind::Copy);
        op.client = client;
        op.stream = stream;
        op.after = after;
        op.engine = engine;
        op.nbytes = nbytes;
        let h = self.fill(into, op);
        self.enter(pol, h);
        h
    }

    pub fn submit_marker(&mut self, pol: &mut dyn Policy, into: Option<u64>, client: i64, stream: u64,
                         after: Vec<u64>) -> u64 {
        let mut op = Op::new(Kind::Marker);
        op.client = client;
        op.stream = stream;
        op.after = after;
        let h = self.fill(into, op);
        self.enter(pol, h);
        h
    }

    // --- stream order -------------------------------------------------------------------------

    /// Start what became eligible now: markers complete, kernels wait out the launch overhead, copies join
    /// their engine's queue.
    pub fn settle(&mut self, pol: &mut dyn Policy, ops: Vec<u64>) {
        if ops.is_empty() {
            return;
        }
        let mut work: VecDeque<u64> = ops.into();
        let mut lanes: Vec<(u8, u32)> = Vec::new();
        let now = self.now;
        while let Some(h) = work.pop_front() {
            self.ops.at_mut(h).eligible = now;
            self.ops.touch(h);
            match self.ops.at(h).kind {
                Kind::Marker => {
                    let o = self.ops.at_mut(h);
                    o.started = now;
                    o.ended = now;
                    o.done = true;
                    self.completed.push(h);
                    let e = self.streams.complete(h, &self.ops);
                    work.extend(e);
                }
                Kind::Kernel => {
                    let o = self.ops.at_mut(h);
                    o.run_eligible = now;
                    o.ready_pending = true;
                    let own = o.overhead;
                    pol.eligible(self, h);
                    let overhead = if own.is_nan() { self.spec.kernel_overhead } else { own };
                    self.ev.push(now + overhead, READY, h, 0);
                }
                _ => {
                    let o = self.ops.at(h);
                    let lane = (crate::copies::lane_engine(o.engine), pol.copy_lane(o.client));
                    self.copies.enqueue(h, lane, now, &mut self.ops, &mut self.ev);
                    if !lanes.contains(&lane) {
                        lanes.push(lane);
                    }
                }
            }
        }
        lanes.sort();
        for lane in lanes {
            self.copies.start(lane, now, &mut self.ops, &mut self.ev);
        }
    }

    /// `h` ended now: report it and start what it held up.
    pub fn finish(&mut self, pol: &mut dyn Policy, h: u64) {
        let o = self.ops.at_mut(h);
        o.ended = self.now;
        o.done = true;
        self.ops.touch(h);
        self.completed.push(h);
        let e = self.streams.complete(h, &self.ops);
        self.settle(pol, e);
    }

    fn end_copy(&mut self, pol: &mut dyn Policy, h: u64) {
        let (ci, nbytes) = {
            let o = self.ops.at(h);
            (o.ci, o.nbytes)
        };
        let c = self.counter(ci);
        c.copies += 1;
        c.bytes_copied += nbytes as i64;
        self.copies_done += 1;
        self.finish(pol, h);
    }

    // --- events -------------------------------------------------------------------------------

    pub fn set_timer(&mut self, time: f64, token: u64) {
        self.ev.push(time, TIMER, token, 0);
    }

    fn stale(&self, pol: &dyn Policy, kind: u8, a: u64, b: u64) -> bool {
        match kind {
            GROUP_END => self.ev.list(a).iter().all(|&g| self.groups.at(g).evicted),
            SM => self.sms[a as usize].version != b,
            TIMER => pol.timer_stale(a),
            DRAM => self.dram[&a].version != b,
            COPY_END => self.copies.stale(a, b),
            _ => self.ops.at(a).run_cancelled,
        }
    }

    /// Drop a popped event nobody will handle, with what only it referred to.
    fn discard(&mut self, kind: u8, a: u64) {
        if kind == GROUP_END {
            let list = self.ev.take_list(a);
            for &g in &list {
                self.groups.free(g);
            }
            self.ev.recycle(list);
        } else if kind == READY {
            self.ops.at_mut(a).ready_pending = false;
            self.ops.release(a);
        }
    }

    /// Time of the earliest event that still matters (stale ones are dropped), or None.
    pub fn peek(&mut self, pol: &dyn Policy) -> Option<f64> {
        while let Some(&e) = self.ev.peek() {
            if !self.stale(pol, e.kind, e.a, e.b) {
                return Some(e.time);
            }
            self.ev.pop();
            self.discard(e.kind, e.a);
        }
        None
    }

    fn instant(&mut self, pol: &mut dyn Policy, t: f64) {
        while let Some(&top) = self.ev.peek() {
            if !(top.time <= t) {
                break;
            }
            let e = self.ev.pop().unwrap();
            match e.kind {
                GROUP_END => {
                    let list = self.ev.take_list(e.a);
                    self.end_fixed(pol, &list);
                    for &g in &list {
                        self.groups.free(g);
                    }
                    self.ev.recycle(list);
                }
                SM => {
                    let i = e.a as usize;
                    if self.sms[i].version != e.b {
                        continue;
                    }
                    let done = self.sms[i].pop_finished(t, &mut self.groups);
                    for g in done {
                        self.end_group(pol, g);
                        self.groups.free(g);
                    }
                    self.touch_sm(i);
                }
                READY => {
                    let o = self.ops.at_mut(e.a);
                    o.ready_pending = false;
                    if !o.run_cancelled {
                        let w = |c: i64| pol.window(c);
                        self.ready.add(e.a, &mut self.ops, &w);
                        self.dirty = true;
                    } else {
                        self.ops.release(e.a);
                    }
                }
                TIMER => {
                    if !pol.timer_stale(e.a) {
                        pol.on_timer(self, e.a);
                        self.dirty = true;
                    }
                }
                DRAM => {
                    let pool = self.dram.get_mut(&e.a).unwrap();
                    if pool.version != e.b {
                        continue;
                    }
                    let done = pool.pop_finished(&self.spec.dram, t, &mut self.groups, &self.ops);
                    for g in done {
                        self.groups.at_mut(g).pool = u64::MAX;
                        self.end_group(pol, g);
                        self.groups.free(g);
                    }
                    self.touch_pool(e.a);
                }
                _ => {
                    if !self.copies.stale(e.a, e.b) {
                        let lane = e.a as usize;
                        if let Some(op) = self.copies.fire(lane, t, &mut self.ops, &mut self.ev) {
                            self.end_copy(pol, op);
                        }
                        self.copies.start_after_fire(lane, t, &mut self.ops, &mut self.ev);
                    }
                }
            }
        }
        self.end_instant(pol);
    }

    pub fn end_instant(&mut self, pol: &mut dyn Policy) {
        if self.dirty && (!self.ready.runs.is_empty() || pol.dispatch_when_idle()) {
            self.ready.clear_full();
            let runs = std::mem::take(&mut self.ready.runs);
            pol.dispatch(self, &runs);
            // nothing adds to the ready list during a dispatch (only a preemption does, from a timer)
            debug_assert!(self.ready.runs.is_empty());
            self.ready.runs = runs;
            self.ready.prune(&self.ops);
        }
        self.dirty = false;
        if self.fit.changes >= self.next_sweep {
            let ready = &self.ready;
            self.fit.sweep(|k| ready.counted(k));
            self.next_sweep = self.fit.changes + SWEEP;
        }
        if !self.touched.is_empty() {
            let mut touched = std::mem::take(&mut self.touched);
            touched.sort_unstable();
            for &i in &touched {
                self.touched_mark[i] = false;
                if let Some(soonest) = self.sms[i].reschedule(&mut self.groups) {
                    self.ev.push(soonest, SM, i as u64, self.sms[i].version);
                }
            }
            touched.clear();
            self.touched = touched;
        }
        if !self.dram_touched.is_empty() {
            let mut keys = std::mem::take(&mut self.dram_touched);
            keys.sort_unstable();
            for &k in &keys {
                let pool = self.dram.get_mut(&k).unwrap();
                if let Some(soonest) = pool.reschedule(&self.spec.dram) {
                    let v = pool.version;
                    self.ev.push(soonest, DRAM, k, v);
                }
            }
        }
    }

    /// The completions at `now` not yet returned, in submission order (their ops are released).
    fn flush(&mut self, out: &mut Vec<u64>) {
        if self.completed.is_empty() {
            return;
        }
        let mut done = std::mem::take(&mut self.completed);
        done.sort_by_key(|&h| self.ops.at(h).seq);
        for &h in &done {
            self.ops.release(h);
        }
        out.extend(done);
    }

    // --- the API ------------------------------------------------------------------------------

    pub fn next_time(&mut self, pol: &dyn Policy) -> Option<f64> {
        if !self.completed.is_empty() {
            return Some(self.now);
        }
        self.peek(pol)
    }

    /// Process every event with time <= `until`, at most `max_instants` instants; the ops completed.
    pub fn advance(&mut self, pol: &mut dyn Policy, until: f64, max_instants: Option<u64>) -> Vec<u64> {
        let mut out = Vec::new();
        let mut instants = 0u64;
        loop {
            let Some(t) = self.peek(pol) else { break };
            if t > until {
                break;
            }
            if let Some(m) = max_instants {
                if instants >= m {
                    self.flush(&mut out);
                    return out;
                }
            }
            instants += 1;
            if t > self.now {
                self.flush(&mut out);
                self.now = t;
            }
            self.instant(pol, t);
        }
        self.flush(&mut out);
        self.now = until;
        out
    }

    pub fn run(&mut self, pol: &mut dyn Policy) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some(t) = self.peek(pol) {
            if t > self.now {
                self.flush(&mut out);
                self.now = t;
            }
            self.instant(pol, t);
        }
        self.flush(&mut out);
        out
    }

    /// Drop all of `client`'s work; the dropped (never started) ops, in submission order.
    pub fn cancel(&mut self, pol: &mut dyn Policy, client: i64) -> Vec<u64> {
        let mut dropped = Vec::new();
        let mut resolved = Vec::new();
        for h in self.streams.drop_client(client, &self.ops) {
            let kind = self.ops.at(h).kind;
            match kind {
                Kind::Kernel => {
                    let o = self.ops.at_mut(h);
                    o.has_run = false;
                    o.run_cancelled = true;
                    o.unplaced = 0;
                    let fixed = !(o.cost.shared || o.cost.dram);
                    for g in o.group_ids() {
                        self.evict(pol, g);
                        if !fixed {
                            self.groups.free(g);
                        }
                    }
                    if self.ops.at(h).started.is_nan() {
                        dropped.push(h);
                    } else {
                        resolved.push(h);
                    }
                    pol.retired(self, h);
                }
                Kind::Copy if self.copies.cancel(h, &mut self.ops) == Some(true) => resolved.push(h),
                _ => dropped.push(h),
            }
        }
        {
            let w = |c: i64| pol.window(c);
            self.ready.drop_cancelled(&mut self.ops, &w);
        }
        let mut all: Vec<u64> = dropped.iter().chain(resolved.iter()).copied().collect();
        all.sort_by_key(|&h| self.ops.at(h).seq);
        for &h in &all {
            let e = self.streams.resolve(h, &mut self.ops);
            self.settle(pol, e);
        }
        self.copies.start_all(self.now, &mut self.ops, &mut self.ev);
        self.dirty = true;
        self.end_instant(pol);
        for &h in &all {
            if !self.ops.at(h).ready_pending {
                self.ops.release(h);
            }
        }
        dropped
    }

    pub fn forget_client(&mut self, pol: &mut dyn Policy, client: i64) -> Vec<u64> {
        let dropped = self.cancel(pol, client);
        self.streams.forget_client(client);
        pol.forget(client);
        if let Some(ci) = self.client_of(client) {
            if let Some(c) = self.cl[ci].counters.take() {
                self.counter_order.retain(|&x| x != ci);
                self.departed_sm_seconds += c.sm_seconds;
            }
        }
        dropped
    }

    pub fn configure_client(&mut self, pol: &mut dyn Policy, client: i64, config: ClientConfig)
                            -> Result<(), String> {
        pol.configure(client, config)?;
        let w = |c: i64| pol.window(c);
        self.ready.forget_windows(&mut self.ops, &w);
        self.dirty = true;
        Ok(())
    }

    pub fn statistics(&self) -> Stats {
        let mut per_client: Vec<(i64, Counters)> = self.counter_order.iter()
            .map(|&ci| (self.cl[ci].id, self.cl[ci].counters.unwrap())).collect();
        let mut total = 0.0;
        for (_, c) in &per_client {
            total += c.sm_seconds;
        }
        per_client.sort_by_key(|&(id, _)| id);
        Stats { now: self.now, kernels: self.kernels, blocks: self.blocks, copies: self.copies_done, per_client,
                sm_seconds: self.departed_sm_seconds + total }
    }

    pub fn busy_sms(&self, client: Option<i64>) -> i64 {
        match client {
            None => self.sms.iter().filter(|s| s.resident != 0).count() as i64,
            Some(id) => self.client_of(id).map_or(0, |ci| self.cl[ci].occ_len),
        }
    }

    pub fn stranded_blocks(&mut self) -> i64 {
        let mut total = 0;
        for idx in 0..self.ready.runs.len() {
            let r = self.ready.runs[idx];
            let o = self.ops.at(r);
            if o.run_cancelled || o.unplaced == 0 {
                continue;
            }
            let (client, key, unplaced, cap) = (o.client, o.key, o.unplaced, o.sm_cap);
            let ci = self.client_of(client);
            let occ: &[i64] = match ci {
                Some(ci) if !self.cl[ci].occupied.is_empty() => &self.cl[ci].occupied,
                _ => &[],
            };
            let occ_len = ci.map_or(0, |ci| self.cl[ci].occ_len);
            let n = self.sms.len();
            let budget = match cap { None => n as i64, Some(c) => c - occ_len };
            let p = &self.ready.parts[key as usize];
            let (lo, hi) = (p.lo, p.hi);
            let t = self.ready.lookup(&mut self.fit, &self.sms, key);
            let room = t.room.to_vec();
            let placed = crate::spread::spread(&t.fits, unplaced.min(u32::MAX as i64) as u32,
                                               budget.max(0) as u32, |i| occ.get(i).is_some_and(|&b| b > 0),
                                               lo, hi, Some(&room));
            total += placed.iter().map(|&(_, k)| k as i64).sum::<i64>();
        }
        total
    }

    /// The DRAM pool `client`'s memory-bound blocks share (made on first use).
    pub fn dram_pool(&mut self, pol: &dyn Policy, client: i64) -> u64 {
        let (key, share) = pol.dram_share(client);
        if !self.dram.contains_key(&key) {
            let top = self.spec.dram.curve.last().map_or(0.0, |p| p.1);
            let cap = if share < 1.0 { top * share } else { f64::INFINITY };
            self.dram.insert(key, DramPool::new(key, cap, self.sms.len()));
        }
        key
    }

    /// The keys with room among the ready kernels' (a buffer: give it back with `done_keys`).
    pub fn open_keys(&mut self) -> Vec<u32> {
        let mut open = std::mem::take(&mut self.key_buf);
        open.clear();
        self.ready.open_keys(&mut self.fit, &self.sms, &mut open);
        open
    }

    pub fn done_keys(&mut self, open: Vec<u32>) {
        self.key_buf = open;
    }

    pub fn close_keys(&mut self, open: &mut Vec<u32>) {
        self.ready.close_keys(open, &self.fit)
    }
}
