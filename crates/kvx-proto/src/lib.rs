//! kvx-proto: the sans-IO core of kvx.
pub mod wire;
