//! The simulation's one test binary: `cd sim && RUSTFLAGS="--cfg madsim --cfg tokio_unstable"
//! CARGO_TARGET_DIR=../target/sim cargo test` (see docs/sim.md).
//! - `conformance`: kvx-io's conformance bodies against `SimTransport` and `SimFabric`;
//! - `scenarios`: the design's worked examples and every LMCache failure the reference
//!   describes, on the real drivers;
//! - `topologies`: 2P1D, xPyD, tensor parallelism;
//! - `swarm`: a short seed sweep, determinism, every broken variant caught, and every known
//!   kvx bug still reproducing when its workaround is off.

mod conformance;
mod scenarios;
mod swarm;
mod topologies;
