//! `mpsd._core.Handle`: the record of a kernel submitted by plain values (`Simulator.launch`), made and kept
//! by the compiled engine in the op's slot instead of a Python `mpsd.sim.Kernel`. The engine writes its times
//! and flags as Rust fields, where a Kernel costs a Python attribute store apiece; Python reads them as
//! read-only attributes. It is hashed and compared by identity, as the Kernel it stands for is (a daemon keys
//! its waiters by it), and carries `tag`, the one thing its holder writes.

use pyo3::ffi;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::PyTraverseError;

#[pyclass(module = "mpsd._core")]
pub struct Handle {
    /// Tenant id.
    #[pyo3(get)]
    pub client: i64,
    /// Submission sequence number.
    #[pyo3(get)]
    pub seq: u64,
    /// Simulated times, NaN until they happen (as on an `mpsd.sim.Op`).
    #[pyo3(get)]
    pub submitted: f64,
    #[pyo3(get)]
    pub eligible: f64,
    #[pyo3(get)]
    pub started: f64,
    #[pyo3(get)]
    pub ended: f64,
    /// Reported complete.
    #[pyo3(get)]
    pub done: bool,
    /// Its client's work was torn down: it never completes.
    #[pyo3(get)]
    pub cancelled: bool,
    /// Opaque to the simulator: its holder's (None: Python's None). The collector sees it, so a tag that
    /// refers back to its handle makes no cycle that outlives them; a handle without one, as nearly all are,
    /// is left out of the collector's lists, as CPython leaves out a tuple of numbers.
    tag: Option<PyObject>,
}

impl Handle {
    /// A new handle, untracked by the collector until it is given a tag.
    pub fn create(py: Python<'_>, client: i64, seq: u64, submitted: f64) -> PyResult<Bound<'_, Handle>> {
        let handle = Bound::new(py, Handle {
            client, seq, submitted,
            eligible: f64::NAN, started: f64::NAN, ended: f64::NAN,
            done: false, cancelled: false,
            tag: None,
        })?;
        // SAFETY: a live object of a collected type (it has __traverse__), with the GIL held.
        unsafe { ffi::PyObject_GC_UnTrack(handle.as_ptr().cast()) };
        Ok(handle)
    }

    /// The engine's changes, written where a Kernel would have them set as attributes. `done` and `cancelled`
    /// only ever become true, as on a Kernel.
    pub fn update(&mut self, eligible: f64, started: f64, ended: f64, done: bool, cancelled: bool) {
        self.eligible = eligible;
        self.started = started;
        self.ended = ended;
        self.done |= done;
        self.cancelled |= cancelled;
    }
}

#[pymethods]
impl Handle {
    #[getter]
    fn tag(&self, py: Python<'_>) -> PyObject {
        self.tag.as_ref().map_or_else(|| py.None(), |t| t.clone_ref(py))
    }

    #[setter]
    fn set_tag(mut slf: PyRefMut<'_, Self>, tag: PyObject) {
        if tag.is_none(slf.py()) {
            slf.tag = None;  // tracked or not, it refers to nothing now
            return;
        }
        slf.tag = Some(tag);
        let ptr = slf.as_ptr();
        // SAFETY: as in `create`; an object may be tracked only once.
        unsafe {
            if ffi::PyObject_GC_IsTracked(ptr) == 0 {
                ffi::PyObject_GC_Track(ptr.cast());
            }
        }
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(tag) = &self.tag {
            visit.call(tag)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.tag = None;
    }

    fn __repr__(&self) -> String {
        let state = if self.cancelled { "cancelled" } else if self.done { "done" } else { "pending" };
        format!("<Handle client={} seq={} {state}>", self.client, self.seq)
    }
}
