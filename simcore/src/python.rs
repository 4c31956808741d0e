//! The Python face of the crate, `mpsd.sim._core`: thin conversions around the pure engine.

use pyo3::prelude::*;
use std::collections::HashSet;

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

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(spread, m)?)?;
    Ok(())
}
