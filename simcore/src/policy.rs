//! What a dispatch policy is to the engine: it decides which ready kernel gets freed capacity next (by calling
//! `Core::place`) and which SMs, copy engines and DRAM a client may use; the engine does every piece of
//! accounting. The per-kernel and per-group hooks only keep the policy's own accounts: they are called in
//! the middle of the engine's bookkeeping and must not place blocks.

use crate::engine::Core;
use crate::ready::Window;

/// How a policy treats one client: priority (lower is more urgent), fair-share weight, MIG partition index,
/// and the static SM partition it is pinned to (MPS's -S: SMs first..end), which `mps` honours.
#[derive(Clone, Copy, Debug)]
pub struct ClientConfig {
    pub priority: i64,
    pub weight: f64,
    pub partition: usize,
    pub window: Window,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig { priority: 0, weight: 1.0, partition: 0, window: None }
    }
}

pub trait Policy {
    fn name(&self) -> &str;
    /// Dispatch at the end of every instant where something changed, even with no kernel ready.
    fn dispatch_when_idle(&self) -> bool {
        false
    }
    /// Offer the free capacity to the `ready` kernels (in hardware order; kernels that placed their last
    /// block this dispatch are still among them).
    fn dispatch(&mut self, core: &mut Core, ready: &[u64]);
    fn configure(&mut self, _client: i64, _config: ClientConfig) -> Result<(), String> {
        Ok(())
    }
    fn forget(&mut self, _client: i64) {}
    fn window(&self, _client: i64) -> Window {
        None
    }
    fn copy_lane(&self, _client: i64) -> u32 {
        0
    }
    fn dram_share(&self, _client: i64) -> (u64, f64) {
        (0, 1.0)
    }
    fn eligible(&mut self, _core: &Core, _run: u64) {}
    fn retired(&mut self, _core: &Core, _run: u64) {}
    /// Whether `placed` and `vacated` do anything (the engine skips the calls otherwise).
    fn group_hooks(&self) -> bool {
        false
    }
    fn placed(&mut self, _core: &Core, _group: u32) {}
    fn vacated(&mut self, _core: &Core, _group: u32) {}
    fn on_timer(&mut self, _core: &mut Core, _token: u64) {}
    fn timer_stale(&self, _token: u64) -> bool {
        false
    }
    /// Counters a policy shows (timeslice's switches); None where it has none of that name.
    fn counter(&self, _name: &str) -> Option<i64> {
        None
    }
}

/// Place every ready kernel's blocks as far as they fit, in the order given: `mps`, and `mig` within each
/// partition's window. Only kernels whose key has room are offered capacity, and the pass ends once every
/// key is full: the result of offering every kernel in turn, without walking the kernels that cannot start.
pub fn place_in_launch_order(core: &mut Core, pol: &mut dyn Policy, ready: &[u64]) {
    if ready.len() == 1 {
        let r = ready[0];
        let n = core.ops.at(r).unplaced;
        core.place(pol, r, n);
        return;
    }
    let mut open = core.open_keys();
    if open.is_empty() {
        core.done_keys(open);
        return;
    }
    // `ready` is the ready list, whose keys sit beside it (nothing changes them during a dispatch)
    let keys = std::mem::take(&mut core.ready.run_keys);
    debug_assert_eq!(keys.len(), ready.len());
    let mut mask = std::mem::take(&mut core.open_mask);
    mask.clear();
    mask.resize(core.ready.parts.len(), false);
    for &k in &open {
        mask[k as usize] = true;
    }
    for (i, &r) in ready.iter().enumerate() {
        if !mask[keys[i] as usize] {
            continue;
        }
        let n = core.ops.at(r).unplaced;
        if core.place(pol, r, n) > 0 {
            for &k in &open {
                mask[k as usize] = false;
            }
            core.close_keys(&mut open);
            if open.is_empty() {
                break;
            }
            for &k in &open {
                mask[k as usize] = true;
            }
        }
    }
    core.ready.run_keys = keys;
    core.open_mask = mask;
    core.done_keys(open);
}

/// `mps`: hardware-faithful MPS (mpsd/sim/policies/mps.py). A client given a window (a static SM
/// partition, MPS's -S) places its blocks only there, through the same window the `mig` policy uses; copy
/// engines and DRAM stay shared, as SM partitioning does not partition them.
#[derive(Default)]
pub struct Mps {
    windows: std::collections::BTreeMap<i64, (usize, usize)>,
}

impl Policy for Mps {
    fn name(&self) -> &str {
        "mps"
    }
    fn configure(&mut self, client: i64, config: ClientConfig) -> Result<(), String> {
        match config.window {
            Some(w) => self.windows.insert(client, w),
            None => self.windows.remove(&client),
        };
        Ok(())
    }
    fn forget(&mut self, client: i64) {
        self.windows.remove(&client);
    }
    fn window(&self, client: i64) -> Window {
        self.windows.get(&client).copied()
    }
    fn dispatch(&mut self, core: &mut Core, ready: &[u64]) {
        place_in_launch_order(core, self, ready);
    }
}
