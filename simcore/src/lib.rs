//! mpsd's GPU model, compiled: the pure engine is Rust without Python; `python.rs` binds it as
//! `mpsd._core` when the `python` feature is on (maturin builds it so).

pub mod blocks;
pub mod copies;
pub mod dram;
pub mod engine;
pub mod events;
pub mod fit;
pub mod hash;
pub mod ops;
pub mod policy;
pub mod ready;
pub mod shares;
pub mod room;
pub mod sms;
pub mod spread;
pub mod streams;
pub mod tenancy;

#[cfg(feature = "python")]
mod python;
#[cfg(feature = "python")]
mod python_handle;
