//! mpsd's GPU model, compiled: the pure engine is Rust without Python; `python.rs` binds it as
//! `mpsd.sim._core` when the `python` feature is on (maturin builds it so).

pub mod spread;

#[cfg(feature = "python")]
mod python;
