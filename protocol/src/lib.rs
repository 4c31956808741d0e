//! mpsd's wire codec, compiled: `wire.rs` reads and writes msgpack frame bodies in pure Rust; `python_wire.rs`
//! binds it as `mpsd_protocol._wire` when the `python` feature is on (maturin builds it so).

pub mod wire;

#[cfg(feature = "python")]
mod python_wire;

#[cfg(feature = "python")]
#[pyo3::pymodule]
fn _wire(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
    python_wire::register(m)
}
