//! Copy engines over PCIe and NVLink: one per direction and lane, a lane being a set of copy engines (the device's one
//! set, or a MIG partition's own). A real H200 time-slices an engine between the streams that have copies for
//! it, MPS or not: a 64-KiB copy beside another process's stream of 256-MiB copies waited for a grid of about
//! 1.05-ms slices that starts when the stream got the engine and runs on while it is alone
//! (bench/fidelity/h200_copies2.json: after sleeps of 0 to 0.5 ms the small copy's latency was 1.05 ms less
//! the sleep; after 2 and 3 ms, either almost nothing or a whole slice). A stream whose copy ends keeps the
//! engine if its next copy is eligible at that instant; otherwise the next waiting one gets it, in the order
//! they became eligible. The two directions of a lane share the PCIe link unevenly: while both run,
//! host-to-device copies were 18 to 44% slower on the H200 and device-to-host ones about 5%
//! (h200_copies.json, h200_copies3.json); `CopySpec::duplex` holds the means. Engines are kept in the order
//! they were first used, since starting them in that order decides the order of their events.
//!
//! A copy between this device and another is one of two routes, the op's engine code saying which. Between
//! peers it runs on an NVLink engine of its own (`PEER_IN` reads the peer's memory, `PEER_OUT` writes it), at
//! `CopySpec::peer_bandwidth`; NVLink is full duplex, so the two directions do not slow each other. Between
//! devices that are not peers the driver stages it through host memory: the source's device-to-host engine and
//! the destination's host-to-device one, chunk by chunk so the two legs overlap. This device's leg
//! (`STAGED_IN` on its host-to-device engine, `STAGED_OUT` on its device-to-host one) queues and shares the
//! link with its host copies; it pays both legs' latencies and one leg's bytes. The other device's leg is not
//! charged to that device: each device is its own engine, on its own clock.

use crate::events::{Events, COPY_END};
use crate::ops::Ops;
use crate::hash::Map;
use std::collections::VecDeque;

pub const D2H: u8 = 0;
pub const H2D: u8 = 1;
pub const PEER_IN: u8 = 2;
pub const PEER_OUT: u8 = 3;
pub const STAGED_IN: u8 = 4;
pub const STAGED_OUT: u8 = 5;

/// The engine an op's code runs on: staged copies take this device's PCIe engine of their direction.
pub fn lane_engine(code: u8) -> u8 {
    match code {
        STAGED_IN => H2D,
        STAGED_OUT => D2H,
        other => other,
    }
}

#[derive(Clone, Debug, Default)]
pub struct CopySpec {
    pub latency: f64,
    pub bandwidth: f64,
    pub timeslice: f64,
    /// The share of its bandwidth each direction gets while the other runs (by engine code), if given.
    pub duplex: [Option<f64>; 2],
    /// A peer copy's fixed cost and bytes/s, each direction (NVLink); 0 bandwidth: no NVLink.
    pub peer_latency: f64,
    pub peer_bandwidth: f64,
}

impl CopySpec {
    /// The time a copy of `nbytes` on engine code `code` takes alone.
    pub fn seconds(&self, code: u8, nbytes: u64) -> f64 {
        match code {
            PEER_IN | PEER_OUT => self.peer_latency + nbytes as f64 / self.peer_bandwidth,
            STAGED_IN | STAGED_OUT => 2.0 * self.latency + nbytes as f64 / self.bandwidth,
            _ => self.latency + nbytes as f64 / self.bandwidth,
        }
    }
}

pub type Lane = (u8, u32);

struct Engine {
    lane: Lane,
    waiting: VecDeque<u64>,
    running: Option<u64>,
    since: f64,
    owner: Option<u64>,
    granted: f64,
    version: u64,
    speed: f64,
}

#[derive(Default)]
pub struct CopyEngines {
    pub spec: CopySpec,
    engines: Vec<Engine>,
    index: Map<Lane, usize>,
}

impl CopyEngines {
    pub fn new(spec: CopySpec) -> Self {
        CopyEngines { spec, engines: Vec::new(), index: Map::default() }
    }

    fn engine_of(&mut self, lane: Lane) -> usize {
        if let Some(&e) = self.index.get(&lane) {
            return e;
        }
        self.engines.push(Engine { lane, waiting: VecDeque::new(), running: None, since: 0.0, owner: None,
                                   granted: 0.0, version: 0, speed: 1.0 });
        self.index.insert(lane, self.engines.len() - 1);
        self.engines.len() - 1
    }

    pub fn enqueue(&mut self, op: u64, lane: Lane, now: f64, ops: &mut Ops, ev: &mut Events) {
        let e = self.engine_of(lane);
        ops.at_mut(op).copy_lane = Some(e);
        self.engines[e].waiting.push_back(op);
        if self.engines[e].running.is_some() {
            self.plan(e, now, ops, ev);
        }
    }

    pub fn start(&mut self, lane: Lane, now: f64, ops: &mut Ops, ev: &mut Events) {
        let e = self.index[&lane];
        self.start_engine(e, now, ops, ev);
    }

    fn start_engine(&mut self, e: usize, now: f64, ops: &mut Ops, ev: &mut Events) {
        let eng = &mut self.engines[e];
        if eng.running.is_some() {
            return;
        }
        if eng.waiting.is_empty() {
            eng.owner = None;
            let p = self.partner(e);
            self.pace(p, now, ops, ev);
            return;
        }
        let owner = eng.owner;
        let pos = eng.waiting.iter().position(|&o| Some(ops.at(o).stream) == owner);
        let pos = match pos {
            Some(p) => p,
            None => {
                let o = eng.waiting[0];
                eng.owner = Some(ops.at(o).stream);
                eng.granted = now;
                0
            }
        };
        let op = eng.waiting.remove(pos).unwrap();
        self.run(e, op, now, ops, ev);
    }

    pub fn start_all(&mut self, now: f64, ops: &mut Ops, ev: &mut Events) {
        for e in 0..self.engines.len() {
            self.start_engine(e, now, ops, ev);
        }
    }

    pub fn stale(&self, lane: u64, version: u64) -> bool {
        self.engines[lane as usize].version != version
    }

    /// The engine's event is due: its copy ended (returned; the caller reports it, then calls
    /// `start_engine`), or its slice did and another stream's copy took over (None).
    pub fn fire(&mut self, e: usize, now: f64, ops: &mut Ops, ev: &mut Events) -> Option<u64> {
        let eng = &mut self.engines[e];
        let op = eng.running.expect("a running copy");
        let left = ops.at(op).copy_left.unwrap() - (now - eng.since) * eng.speed;
        let scale = if now > 1.0 { now } else { 1.0 };
        if left <= 1e-12 * scale {
            let o = ops.at_mut(op);
            o.copy_left = None;
            o.copy_lane = None;
            eng.running = None;
            eng.version += 1;
            return Some(op);
        }
        ops.at_mut(op).copy_left = Some(left);
        eng.waiting.push_back(op);
        let nxt = eng.waiting.pop_front().unwrap();
        eng.owner = Some(ops.at(nxt).stream);
        eng.granted = now;
        self.run(e, nxt, now, ops, ev);
        None
    }

    pub fn start_after_fire(&mut self, e: usize, now: f64, ops: &mut Ops, ev: &mut Events) {
        self.start_engine(e, now, ops, ev);
    }

    /// Stop `op` in flight (Some(true): the caller calls `start_all`) or take it off its queue (Some(false));
    /// None if it is not here.
    pub fn cancel(&mut self, op: u64, ops: &mut Ops) -> Option<bool> {
        let o = ops.at_mut(op);
        let e = o.copy_lane.take()?;
        o.copy_left = None;
        let eng = &mut self.engines[e];
        if eng.running == Some(op) {
            eng.running = None;
            eng.owner = None;
            eng.version += 1;
            return Some(true);
        }
        if let Some(p) = eng.waiting.iter().position(|&w| w == op) {
            eng.waiting.remove(p);
        }
        Some(false)
    }

    fn run(&mut self, e: usize, op: u64, now: f64, ops: &mut Ops, ev: &mut Events) {
        let o = ops.at_mut(op);
        if o.copy_left.is_none() {
            o.started = now;
            o.copy_left = Some(self.spec.seconds(o.engine, o.nbytes));
            ops.touch(op);
        }
        let speed = self.speed(e);
        let eng = &mut self.engines[e];
        eng.running = Some(op);
        eng.since = now;
        eng.speed = speed;
        self.plan(e, now, ops, ev);
        let p = self.partner(e);
        self.pace(p, now, ops, ev);
    }

    /// The other direction's engine on the same PCIe link (NVLink's directions are independent).
    fn partner(&self, e: usize) -> Option<usize> {
        let (dir, lane) = self.engines[e].lane;
        let other = match dir {
            H2D => D2H,
            D2H => H2D,
            _ => return None,
        };
        self.index.get(&(other, lane)).copied()
    }

    fn speed(&self, e: usize) -> f64 {
        match self.partner(e) {
            Some(p) if self.engines[p].running.is_some() => {
                self.spec.duplex[self.engines[e].lane.0 as usize].unwrap_or(1.0)
            }
            _ => 1.0,
        }
    }

    fn pace(&mut self, e: Option<usize>, now: f64, ops: &mut Ops, ev: &mut Events) {
        let Some(e) = e else { return };
        let Some(running) = self.engines[e].running else { return };
        let speed = self.speed(e);
        let eng = &mut self.engines[e];
        if speed != eng.speed {
            let o = ops.at_mut(running);
            o.copy_left = Some(o.copy_left.unwrap() - (now - eng.since) * eng.speed);
            eng.since = now;
            eng.speed = speed;
            self.plan(e, now, ops, ev);
        }
    }

    fn plan(&mut self, e: usize, now: f64, ops: &Ops, ev: &mut Events) {
        let eng = &mut self.engines[e];
        let running = eng.running.expect("a running copy");
        let mut at = eng.since + ops.at(running).copy_left.unwrap() / eng.speed;
        let quantum = self.spec.timeslice;
        if !eng.waiting.is_empty() && quantum > 0.0 {
            let s = ((now - eng.granted) / quantum - 1e-9).ceil();
            let slices = if s > 1.0 { s } else { 1.0 };
            let end = eng.granted + slices * quantum;
            if end < at {
                at = end;
            }
        }
        eng.version += 1;
        ev.push(at, COPY_END, e as u64, eng.version);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Core, Spec};
    use crate::policy::Mps;

    const LATENCY: f64 = 2e-6;
    const PCIE: f64 = 55e9;
    const NVLINK: f64 = 450e9;

    fn core() -> Core {
        let copy = CopySpec { latency: LATENCY, bandwidth: PCIE, timeslice: 0.0, duplex: [Some(0.9), Some(0.7)],
                              peer_latency: LATENCY, peer_bandwidth: NVLINK };
        Core::new(Spec { sm_count: 4, warps_per_sm: 64, blocks_per_sm: 32, regs_per_sm: 65536,
                         smem_per_sm: 233472, min_block_time: 1e-7, kernel_overhead: 2e-6,
                         copy, ..Spec::default() }, false)
    }

    /// Each copy's (start, end) after running `copies` ((client, stream, code, bytes)) submitted at time 0.
    fn run(copies: &[(i64, u64, u8, u64)]) -> Vec<(f64, f64)> {
        let mut c = core();
        let mut pol = Mps::default();
        let hs: Vec<u64> = copies.iter()
            .map(|&(client, stream, code, n)| c.submit_copy(&mut pol, None, client, stream, vec![], code, n))
            .collect();
        c.run(&mut pol);
        hs.iter().map(|&h| (c.ops.at(h).started, c.ops.at(h).ended)).collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn a_peer_copy_runs_at_nvlink_bandwidth_and_a_staged_one_at_pcie() {
        let n = 256u64 << 20;
        let [(_, peer)] = run(&[(1, 1, PEER_IN, n)])[..] else { panic!() };
        assert!(close(peer, LATENCY + n as f64 / NVLINK));
        let [(_, staged)] = run(&[(1, 1, STAGED_IN, n)])[..] else { panic!() };
        assert!(close(staged, 2.0 * LATENCY + n as f64 / PCIE));
        let [(_, host)] = run(&[(1, 1, H2D, n)])[..] else { panic!() };
        assert!(close(host, LATENCY + n as f64 / PCIE));
    }

    #[test]
    fn nvlink_directions_and_pcie_do_not_slow_each_other() {
        let n = 64u64 << 20;
        let ends = run(&[(1, 1, PEER_IN, n), (2, 2, PEER_OUT, n), (3, 3, H2D, n)]);
        assert!(close(ends[0].1, LATENCY + n as f64 / NVLINK));
        assert!(close(ends[1].1, LATENCY + n as f64 / NVLINK));
        assert!(close(ends[2].1, LATENCY + n as f64 / PCIE));
    }

    #[test]
    fn a_staged_copy_queues_behind_host_copies_on_its_pcie_engine() {
        let n = 64u64 << 20;
        let ends = run(&[(1, 1, H2D, n), (2, 2, STAGED_IN, n)]);
        let first = LATENCY + n as f64 / PCIE;
        assert!(close(ends[0].1, first));
        assert!(close(ends[1].0, first));
        assert!(close(ends[1].1, first + 2.0 * LATENCY + n as f64 / PCIE));
        // The outgoing leg shares the link with the other direction, as a device-to-host copy does.
        let both = run(&[(1, 1, H2D, n), (2, 2, STAGED_OUT, n)]);
        assert!(both[0].1 > first * 1.3 && both[1].1 > (2.0 * LATENCY + n as f64 / PCIE) * 1.05);
    }
}
