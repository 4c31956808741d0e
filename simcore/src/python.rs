//! The Python face of the crate, `mpsd._core`: thin conversions around the pure engine. The engine keeps
//! ops by handle; this keeps the Python op objects beside them (by slot, and by address for the `after`
//! lookups of later submits) and writes the engine's times onto them at the end of every call, so that the
//! objects the caller holds read as the Python engine left them. A kernel submitted by plain values has no
//! Python op: its object is a `Handle` (python_handle.rs) made here, whose fields are written natively.

use crate::engine::{Core, KernelArgs};
use crate::ops::{slot, Cost, Need};
use crate::policy::{ClientConfig, Mps, Policy};
use crate::python_handle::Handle;
use crate::shares::{Fair, Priority, RoundRobin};
use crate::tenancy::{Exclusive, Mig, Timeslice};
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

/// The Python op objects by slot (and the address each was kept under), shared with a policy written in
/// Python, which hands its dispatch the kernels themselves.
type Objects = Rc<RefCell<Vec<Option<(PyObject, usize)>>>>;
/// An exception a Python policy raised inside the engine, raised again when the engine returns.
type Raised = Rc<RefCell<Option<PyErr>>>;

/// `mpsd.sim.policies.base.spread`, compiled: (SM index, block count) pairs by SM index.
#[pyfunction]
#[pyo3(signature = (fits, left, budget, occupied, lo=0, hi=None, room=None))]
fn spread(
    fits: Vec<u32>,
    left: u32,
    budget: u32,
    occupied: HashSet<usize>,
    lo: usize,
    hi: Option<usize>,
    room: Option<Vec<usize>>,
) -> Vec<(usize, u32)> {
    let hi = hi.unwrap_or(fits.len());
    crate::spread::spread(&fits, left, budget, |i| occupied.contains(&i), lo, hi, room.as_deref())
}

/// The compiled policy `name`, from the settings the Python policy object checked (`args`: what the policy
/// needs of them, its `engine_args()`); "python": `args` is a policy written in Python.
fn make_policy(name: &str, args: &Bound<'_, PyAny>, objs: &Objects, raised: &Raised) -> PyResult<Box<dyn Policy>> {
    Ok(match name {
        "python" => Box::new(PyPolicy {
            obj: args.clone().unbind(),
            name: args.getattr("name")?.extract()?,
            when_idle: args.getattr("dispatch_when_idle")?.is_truthy()?,
            objs: objs.clone(),
            raised: raised.clone(),
        }),
        "mps" => Box::new(Mps::default()),
        "round-robin" => Box::new(RoundRobin::default()),
        "fair" => Box::new(Fair::default()),
        "exclusive" => Box::new(Exclusive::default()),
        "priority" => Box::new(Priority::new(args.extract()?)),
        "mig" => Box::new(Mig::new(args.extract()?)),
        "timeslice" => {
            let (slice, switch, state, warp_slots): (f64, f64, Vec<(f64, f64, f64)>, i64) = args.extract()?;
            Box::new(Timeslice::new(slice, switch, state, warp_slots))
        }
        _ => return Err(PyValueError::new_err(format!("policy {name:?} is not compiled"))),
    })
}

/// A policy written in Python (mpsd.sim.Policy): the engine calls its `_dispatch` at every dispatch with the
/// ready kernels and a `Placer`, and its `window` once per client until clients are configured again.
struct PyPolicy {
    obj: PyObject,
    name: String,
    when_idle: bool,
    objs: Objects,
    raised: Raised,
}

impl PyPolicy {
    fn keep_error(&self, e: PyErr) {
        let mut r = self.raised.borrow_mut();
        if r.is_none() {
            *r = Some(e);
        }
    }
}

impl Policy for PyPolicy {
    fn name(&self) -> &str {
        &self.name
    }
    fn dispatch_when_idle(&self) -> bool {
        self.when_idle
    }
    fn dispatch(&mut self, core: &mut Core, ready: &[u64]) {
        if self.raised.borrow().is_some() {
            return;
        }
        Python::with_gil(|py| {
            let result = (|| -> PyResult<()> {
                let entries = {
                    let objs = self.objs.borrow();
                    let mut entries = Vec::with_capacity(ready.len());
                    for &r in ready {
                        let o = core.ops.at(r);
                        if o.unplaced == 0 {
                            continue;
                        }
                        let k = objs[slot(r)].as_ref().expect("a live kernel").0.clone_ref(py);
                        entries.push((k, o.unplaced, o.run_eligible, r));
                    }
                    entries
                };
                let obj = self.obj.clone_ref(py);
                // The placer reaches the engine through raw pointers, valid only while this call lasts (it is
                // switched off after): the engine and this policy are not otherwise touched meanwhile.
                let placer = Py::new(py, Placer { core: core as *mut Core, policy: self as *mut PyPolicy, live: true })?;
                let out = obj.call_method1(py, intern!(py, "_dispatch"), (entries, placer.clone_ref(py)));
                placer.borrow_mut(py).live = false;
                out.map(|_| ())
            })();
            if let Err(e) = result {
                self.keep_error(e);
            }
        });
    }
    fn window(&self, client: i64) -> crate::ready::Window {
        Python::with_gil(|py| {
            match self.obj.call_method1(py, intern!(py, "window"), (client,))
                .and_then(|w| w.extract::<Option<(usize, usize)>>(py)) {
                Ok(w) => w,
                Err(e) => {
                    self.keep_error(e);
                    None
                }
            }
        })
    }
}

/// What a Python policy's dispatch places blocks through (mpsd.sim.ReadyKernel.place calls it).
#[pyclass(module = "mpsd._core")]
struct Placer {
    core: *mut Core,
    policy: *mut PyPolicy,
    live: bool,
}

// SAFETY (both): the module is built for CPython with the GIL (abi3, not free-threaded), and every access to
// an Engine or a Placer, and so to the Rc, RefCell and raw pointers they hold, happens in a call holding it,
// one at a time, checked by PyO3's borrow flag. They may be created on one thread and used or dropped on
// another (a daemon's simulator is made in one thread and may be collected in another); they are never used
// by two at once.
unsafe impl Send for Engine {}
unsafe impl Sync for Engine {}
unsafe impl Send for Placer {}
unsafe impl Sync for Placer {}

#[pymethods]
impl Placer {
    /// Place up to `limit` blocks of the ready kernel `handle`; the blocks placed.
    fn place(&self, handle: u64, limit: i64) -> PyResult<i64> {
        if !self.live {
            return Err(pyo3::exceptions::PyRuntimeError::new_err("blocks can be placed only during a dispatch"));
        }
        // SAFETY: live only inside PyPolicy::dispatch, which holds the engine and the policy and uses neither
        // while Python runs.
        let core = unsafe { &mut *self.core };
        let policy = unsafe { &mut *self.policy };
        if core.ops.get(handle).is_none_or(|o| !o.has_run || o.run_cancelled || o.key == u32::MAX) {
            return Err(PyValueError::new_err("not a ready kernel of this dispatch"));
        }
        Ok(core.place(policy, handle, limit))
    }
}

/// The compiled engine (mpsd.sim.Simulator wraps it; it is not an API of its own).
#[pyclass(module = "mpsd._core")]
struct Engine {
    core: Core,
    policy: Box<dyn Policy>,
    objs: Objects,
    raised: Raised,
    by_addr: HashMap<usize, u64>,
    trace: Trace,
    /// Whether a kernel may be submitted without a Python op (a `Handle` made for it): not while a trace is
    /// recorded (its block groups name the Kernel objects) nor under a policy written in Python (its dispatch
    /// is handed them).
    handles: bool,
}

/// The recorded block groups as columns (a run has millions; an object each cost a third of a stress run's
/// time and most of its memory): group i ran `count[i]` blocks of `kernels[kernel[i]]` on SM `sm[i]` over
/// [start[i], end[i]). `kernels` holds each kernel once (while it is live; `index` finds it by handle).
#[derive(Default)]
struct Trace {
    kernels: Vec<PyObject>,
    index: HashMap<u64, u32>,
    kernel: Vec<u32>,
    sm: Vec<u32>,
    count: Vec<i64>,
    start: Vec<f64>,
    end: Vec<f64>,
}

/// A column from `from` on as the bytes of its native-endian values (numpy.frombuffer reads them).
fn column_bytes<'py, T: Copy, const N: usize>(py: Python<'py>, column: &[T], from: usize,
                                              bytes: fn(T) -> [u8; N]) -> Bound<'py, PyBytes> {
    let tail = &column[from.min(column.len())..];
    let mut out = Vec::with_capacity(tail.len() * N);
    for &x in tail {
        out.extend_from_slice(&bytes(x));
    }
    PyBytes::new(py, &out)
}

#[pyfunction]
fn compiled_policies() -> Vec<&'static str> {
    vec!["mps", "round-robin", "priority", "fair", "exclusive", "mig", "timeslice"]
}

impl Engine {
    fn keep(&mut self, h: u64, obj: &Bound<'_, PyAny>) {
        let i = slot(h);
        let mut objs = self.objs.borrow_mut();
        if objs.len() <= i {
            objs.resize_with(i + 1, || None);
        }
        let addr = obj.as_ptr() as usize;
        objs[i] = Some((obj.clone().unbind(), addr));
        self.by_addr.insert(addr, h);
    }

    fn obj<'py>(&self, py: Python<'py>, h: u64) -> Bound<'py, PyAny> {
        self.record(py, h).expect("a live op")
    }

    /// The Python object of op `h`: None for a kernel of a run that has none (submit_kernel's `count`).
    fn record<'py>(&self, py: Python<'py>, h: u64) -> Option<Bound<'py, PyAny>> {
        self.objs.borrow().get(slot(h))?.as_ref().map(|(o, _)| o.bind(py).clone())
    }

    /// Raise what a Python policy raised during the last call into the engine.
    fn raise(&self) -> PyResult<()> {
        match self.raised.borrow_mut().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Handles of `after`'s ops: live ones as they are; done or cancelled ones are left out (they hold
    /// nothing up); others (not submitted yet) get a placeholder their submit fills.
    fn deps(&mut self, after: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let mut out = Vec::new();
        for dep in after.try_iter()? {
            let dep = dep?;
            if let Some(&h) = self.by_addr.get(&(dep.as_ptr() as usize)) {
                out.push(h);
                continue;
            }
            let py = dep.py();
            if dep.getattr(intern!(py, "done"))?.is_truthy()? || dep.getattr(intern!(py, "cancelled"))?.is_truthy()? {
                continue;
            }
            let h = self.core.placeholder();
            self.keep(h, &dep);
            out.push(h);
        }
        Ok(out)
    }

    fn slot_for(&mut self, op: &Bound<'_, PyAny>) -> Option<u64> {
        self.by_addr.get(&(op.as_ptr() as usize)).copied()
    }

    fn entered(&mut self, h: u64, op: &Bound<'_, PyAny>) -> PyResult<()> {
        self.keep(h, op);
        let py = op.py();
        let o = self.core.ops.at(h);
        op.setattr(intern!(py, "seq"), o.seq)?;
        op.setattr(intern!(py, "submitted"), o.submitted)?;
        Ok(())
    }

    /// Write the engine's times and flags onto the objects of the ops `dirty` names.
    fn write_ops(&mut self, py: Python<'_>, dirty: &[u64]) -> PyResult<()> {
        for &h in dirty {
            let o = self.core.ops.at_mut(h);
            o.dirty = false;
            let (e, s, t, d, c) = (o.eligible, o.started, o.ended, o.done, o.cancelled);
            let Some(obj) = self.record(py, h) else { continue }; // one of a run's kernels without one
            if let Ok(handle) = obj.downcast::<Handle>() {
                handle.borrow_mut().update(e, s, t, d, c);
                continue;
            }
            obj.setattr(intern!(py, "eligible"), e)?;
            obj.setattr(intern!(py, "started"), s)?;
            obj.setattr(intern!(py, "ended"), t)?;
            if d {
                obj.setattr(intern!(py, "done"), true)?;
            }
            if c {
                obj.setattr(intern!(py, "cancelled"), true)?;
            }
        }
        Ok(())
    }

    /// Write the engine's changes onto the Python objects, extend the trace, and let go of finished ops.
    fn sync(&mut self, py: Python<'_>) -> PyResult<()> {
        // The list goes back emptied, not dropped: nearly every call dirties an op or two, and one grown
        // afresh would be an allocation per call.
        let mut dirty = std::mem::take(&mut self.core.ops.dirty);
        let written = self.write_ops(py, &dirty);
        dirty.clear();
        self.core.ops.dirty = dirty;
        written?;
        for (h, sm, count, start, end) in std::mem::take(&mut self.core.trace) {
            let next = self.trace.kernels.len() as u32;
            let k = *self.trace.index.entry(h).or_insert(next);
            if k == next {
                let obj = self.obj(py, h).unbind();
                self.trace.kernels.push(obj);
            }
            self.trace.kernel.push(k);
            self.trace.sm.push(sm);
            self.trace.count.push(count);
            self.trace.start.push(start);
            self.trace.end.push(end);
        }
        for &h in &self.core.ops.released {
            self.trace.index.remove(&h); // its handle may come back for another op
            let i = slot(h);
            if self.core.ops.get(h).is_some() {
                let taken = self.objs.borrow_mut()[i].take();
                if let Some((_, addr)) = taken {
                    self.by_addr.remove(&addr);
                }
            }
        }
        self.core.ops.reclaim();
        self.raise()
    }

    fn objects<'py>(&self, py: Python<'py>, handles: &[u64]) -> PyResult<Bound<'py, PyList>> {
        let records: Vec<_> = handles.iter().filter_map(|&h| self.record(py, h)).collect();
        PyList::new(py, records)
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(spec: &Bound<'_, PyTuple>, policy: &str, policy_args: &Bound<'_, PyAny>, record: bool)
           -> PyResult<Self> {
        let (sm_count, warps_per_sm, blocks_per_sm, regs_per_sm, smem_per_sm, min_block_time, kernel_overhead,
             dram, copy): (usize, i64, i64, i64, i64, f64, f64, (Vec<(f64, f64)>, i64, f64),
                           (f64, f64, f64, Option<f64>, Option<f64>, f64, f64)) = spec.extract()?;
        let spec = crate::engine::Spec {
            sm_count, warps_per_sm, blocks_per_sm, regs_per_sm, smem_per_sm, min_block_time, kernel_overhead,
            dram: crate::dram::DramSpec { curve: dram.0, knee: dram.1, beyond: dram.2 },
            copy: crate::copies::CopySpec { latency: copy.0, bandwidth: copy.1, timeslice: copy.2,
                                           duplex: [copy.3, copy.4], peer_latency: copy.5,
                                           peer_bandwidth: copy.6 },
        };
        let objs: Objects = Rc::new(RefCell::new(Vec::new()));
        let raised: Raised = Rc::new(RefCell::new(None));
        let handles = !record && policy != "python";
        let policy = make_policy(policy, policy_args, &objs, &raised)?;
        Ok(Engine { core: Core::new(spec, record), policy, objs, raised, by_addr: HashMap::new(),
                    trace: Trace::default(), handles })
    }

    #[getter]
    fn now(&self) -> f64 {
        self.core.now
    }

    #[getter]
    fn handles(&self) -> bool {
        self.handles
    }

    /// Submit a kernel: `op`, the caller's Kernel, which gets the engine's times written on it; or, with `op`
    /// None, a kernel of these values alone, whose `Handle` this returns (None otherwise). With `op` None,
    /// `count` such kernels go one after another on the stream (after `after`, the first): only the last has
    /// a handle, the others no record at all (nothing returns them; the stream's order says when they end).
    /// `overhead`: its launch overhead where it is not the spec's kernel_overhead (a graph's node).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (op, client, stream, after, blocks, threads, priority, sm_cap, cost, shape, seconds, count=1,
                        overhead=None))]
    fn submit_kernel(&mut self, py: Python<'_>, op: Option<&Bound<'_, PyAny>>, client: i64, stream: u64,
                     after: &Bound<'_, PyAny>, blocks: i64, threads: u32, priority: i64, sm_cap: Option<i64>,
                     cost: (f64, bool, bool, bool, f64), shape: (u32, i64, i64, i64, f64, f64), seconds: f64,
                     count: u64, overhead: Option<f64>) -> PyResult<PyObject> {
        if op.is_none() && !self.handles {
            return Err(PyValueError::new_err(
                "a recorded run and a policy written in Python need Kernel objects: submit a Kernel"));
        }
        if count == 0 || (count > 1 && op.is_some()) {
            return Err(PyValueError::new_err("count must be at least 1, and 1 for a Kernel"));
        }
        let mut after = self.deps(after)?;
        let into = op.and_then(|op| self.slot_for(op));
        let args = KernelArgs {
            client, stream, after: Vec::new(), threads, priority, sm_cap,
            cost: Cost { seconds: cost.0, shared: cost.1, clocked: cost.2, dram: cost.3, weight: cost.4 },
            need: Need { warps: shape.1, regs: shape.2, smem: shape.3 },
            shape: shape.0, seconds, demand: shape.4, sm_share: shape.5, blocks,
            overhead: overhead.unwrap_or(f64::NAN),
        };
        for _ in 1..count {
            self.core.submit_kernel(&mut *self.policy, None, KernelArgs { after, ..args.clone() });
            after = Vec::new();
        }
        let h = self.core.submit_kernel(&mut *self.policy, into, KernelArgs { after, ..args });
        let out = match op {
            Some(op) => {
                self.entered(h, op)?;
                py.None()
            }
            None => {
                let o = self.core.ops.at(h);
                let handle = Handle::create(py, client, o.seq, o.submitted)?.into_any();
                self.keep(h, &handle);
                handle.unbind()
            }
        };
        self.sync(py)?;
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn submit_copy(&mut self, py: Python<'_>, op: &Bound<'_, PyAny>, client: i64, stream: u64,
                   after: &Bound<'_, PyAny>, engine: u8, nbytes: u64) -> PyResult<()> {
        let after = self.deps(after)?;
        let into = self.slot_for(op);
        let h = self.core.submit_copy(&mut *self.policy, into, client, stream, after, engine, nbytes);
        self.entered(h, op)?;
        self.sync(py)
    }

    fn submit_marker(&mut self, py: Python<'_>, op: &Bound<'_, PyAny>, client: i64, stream: u64,
                     after: &Bound<'_, PyAny>) -> PyResult<()> {
        let after = self.deps(after)?;
        let into = self.slot_for(op);
        let h = self.core.submit_marker(&mut *self.policy, into, client, stream, after);
        self.entered(h, op)?;
        self.sync(py)
    }

    #[pyo3(signature = (until, max_instants=None))]
    fn advance<'py>(&mut self, py: Python<'py>, until: f64, max_instants: Option<u64>)
                    -> PyResult<Bound<'py, PyList>> {
        let done = self.core.advance(&mut *self.policy, until, max_instants);
        let out = self.objects(py, &done)?;
        self.sync(py)?;
        Ok(out)
    }

    fn run<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let done = self.core.run(&mut *self.policy);
        let out = self.objects(py, &done)?;
        self.sync(py)?;
        Ok(out)
    }

    /// The recorded block groups from the `from`-th on, as columns: (kernels, kernel, sm, count, start, end),
    /// `kernels` a list of every kernel recorded so far and the rest bytes of uint32, uint32, int64, float64
    /// and float64 values, `kernel` indexing `kernels`.
    #[allow(clippy::type_complexity)]
    fn trace_columns<'py>(&self, py: Python<'py>, from: usize)
                          -> PyResult<(Bound<'py, PyList>, Bound<'py, PyBytes>, Bound<'py, PyBytes>,
                                       Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let t = &self.trace;
        Ok((PyList::new(py, t.kernels.iter().map(|k| k.bind(py)))?, column_bytes(py, &t.kernel, from, u32::to_ne_bytes),
            column_bytes(py, &t.sm, from, u32::to_ne_bytes), column_bytes(py, &t.count, from, i64::to_ne_bytes),
            column_bytes(py, &t.start, from, f64::to_ne_bytes), column_bytes(py, &t.end, from, f64::to_ne_bytes)))
    }

    /// How many block groups are recorded.
    fn trace_len(&self) -> usize {
        self.trace.kernel.len()
    }

    fn next_time(&mut self) -> Option<f64> {
        self.core.next_time(&*self.policy)
    }

    fn cancel<'py>(&mut self, py: Python<'py>, client: i64) -> PyResult<Bound<'py, PyList>> {
        let dropped = self.core.cancel(&mut *self.policy, client);
        let out = self.objects(py, &dropped)?;
        self.sync(py)?;
        Ok(out)
    }

    /// Alias stream number `stream` of `client` onto hardware work queue `queue` (any integer naming it), for
    /// the kernels and markers submitted to it from now on: see streams.rs.
    fn stream_queue(&mut self, stream: u64, client: i64, queue: u64) {
        self.core.streams.set_queue(stream, client, queue);
    }

    fn forget_client(&mut self, py: Python<'_>, client: i64) -> PyResult<()> {
        self.core.forget_client(&mut *self.policy, client);
        self.sync(py)
    }

    #[pyo3(signature = (client, priority, weight, partition, window=None))]
    fn configure_client(&mut self, client: i64, priority: i64, weight: f64, partition: usize,
                        window: Option<(usize, usize)>) -> PyResult<()> {
        if let Some((first, end)) = window {
            if first >= end || end > self.core.sms.len() {
                return Err(PyValueError::new_err(format!("SM window {first}..{end} is not within the device's {} SMs",
                                                         self.core.sms.len())));
            }
        }
        self.core
            .configure_client(&mut *self.policy, client, ClientConfig { priority, weight, partition, window })
            .map_err(PyValueError::new_err)?;
        self.raise()
    }

    /// (now, kernels, blocks, copies, [(client, kernels, blocks, block_seconds, sm_seconds, copies,
    /// bytes_copied, max_sms)], sm_seconds)
    #[allow(clippy::type_complexity)]
    fn statistics(&self) -> (f64, i64, i64, i64, Vec<(i64, i64, i64, f64, f64, i64, i64, i64)>, f64) {
        let s = self.core.statistics();
        let per = s.per_client.iter()
            .map(|(id, c)| (*id, c.kernels, c.blocks, c.block_seconds, c.sm_seconds, c.copies, c.bytes_copied,
                            c.max_sms))
            .collect();
        (s.now, s.kernels, s.blocks, s.copies, per, s.sm_seconds)
    }

    #[pyo3(signature = (client=None))]
    fn busy_sms(&self, client: Option<i64>) -> i64 {
        self.core.busy_sms(client)
    }

    fn stranded_blocks(&mut self) -> i64 {
        self.core.stranded_blocks()
    }

    fn policy_counter(&self, name: &str) -> Option<i64> {
        self.policy.counter(name)
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(spread, m)?)?;
    m.add_function(wrap_pyfunction!(compiled_policies, m)?)?;
    m.add_class::<Engine>()?;
    m.add_class::<Handle>()?;
    Ok(())
}
