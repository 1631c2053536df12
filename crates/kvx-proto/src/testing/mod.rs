//! A synchronous harness (feature `testing`): senders, receivers and a proxy wired together
//! with virtual time and in-memory delivery, after quinn's `Pair` and raft-rs's `Network`.
//!
//! - `workload.rs`: `ClusterSpec`, `RequestPlan`, `Timing`.
//! - `cluster/`: `Cluster`, the event loop (`mod.rs`), the applications on its nodes
//!   (`apps.rs`) and the end-of-run settling (`settle.rs`); every message goes through the
//!   wire codec, every link is FIFO, every write is a model of a one-sided write into
//!   receiver memory.
//! - `checker.rs`: the global checks run after every step and at the end.
//! - `ops/`: `OpWorld`, a byte-driven event sequence over the core (fuzzing, properties);
//!   `ops/callers.rs`, its prefill callers (begin, batches, pending batches, staging order).
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
pub use explore::{
    check_abstraction, explore, explore_from, explore_shares, AbstractionCheck, Exploration, Order,
    SharesPlan,
};
pub use ops::{Event, OpWorld};
pub use workload::{ClusterSpec, RequestPlan, Timing};

/// The message a panic carried (`panic!` with a format gives a `String`, with a literal a
/// `&str`); empty for any other payload.
pub(crate) fn panic_text(e: &Box<dyn std::any::Any + Send>) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

/// What `f` panicked with, or `None` if it returned: for tests that show a checker catches
/// the corruption it exists for.
pub fn panic_message(f: impl FnOnce()) -> Option<String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .err()
        .map(|e| panic_text(&e))
}
