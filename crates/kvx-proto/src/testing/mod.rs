//! A synchronous harness (feature `testing`): senders, receivers and a proxy wired together
//! with virtual time and in-memory delivery, after quinn's `Pair` and raft-rs's `Network`.
//!
//! - `workload.rs`: `ClusterSpec`, `RequestPlan`, `Timing`.
//! - `cluster/`: `Cluster`, the event loop (`mod.rs`), the applications on its nodes
//!   (`apps.rs`) and the end-of-run settling (`settle.rs`); every message goes through the
//!   wire codec, every link is FIFO, every write is a model of a one-sided write into
//!   receiver memory.
//! - `checker.rs`: the global checks run after every step and at the end.
//! - `ops.rs`: `OpWorld`, a byte-driven event sequence over the core (fuzzing, properties).
//! - `explore/`: exhaustive exploration of every interleaving for small configurations.
//!
//! `Cluster::run` is bounded in steps and in virtual time and returns `Stuck` with a dump
//! of what is outstanding instead of hanging.

mod checker;
mod cluster;
// The explorer's visited sets are hash sets probed for membership only (never iterated, so
// their order decides nothing), and it reads a clock only to time its own run.
#[allow(clippy::disallowed_types, clippy::disallowed_methods)]
mod explore;
mod ops;
mod workload;

pub use checker::Violation;
pub use cluster::{Cluster, End, PlanReport, Report, Stuck};
pub(crate) use explore::Canon;
pub use explore::{check_abstraction, explore, explore_from, AbstractionCheck, Exploration, Order};
pub use ops::{Event, OpWorld};
pub use workload::{ClusterSpec, RequestPlan, Timing};
