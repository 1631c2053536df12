//! kvx-node: the async drivers. Each one runs a kvx-proto state machine in a task of its
//! own, feeds it the `Env`'s messages, completions and timers, and carries out what it asks
//! for. The receiver's and the proxy's machines belong to their task alone (handles talk to
//! it over channels); the sender's sits behind a mutex shared with its handles, so prefill
//! threads stage and submit without a round trip through the task (`sender/mod.rs`). They
//! contain no protocol logic and no simulation switches: the same code runs in production and in
//! the simulation.
//!
//! The handles are the one client layer: the `kvx` binary, the simulation and, through
//! kvx-embed, the Python package all drive them, so a client feature belongs here (or, when
//! it is a rule, in the core) and never in one front end only. Pending batches, for one, are
//! the core's (`SenderHandle::add`), which the demo's workload, the simulation's engine and
//! Python's `Sender.add` all use.
//!
//! Map:
//! - `sender`: `SenderNode` / `SenderHandle` — begin (staging of kvx's or the caller's
//!   memory: `start` / `start_in`), a staging allocate that blocks (for prefill threads) or
//!   awaits and submits the caller's held batch when only it stands in the way, stage bytes,
//!   add a chunk to its request's pending batch, submit (with caller staging, batches of
//!   the caller's own slots: `submit_slots`, `SlotChunk`), cancel, await the outcome or read
//!   every request's end (`completions`). Inside:
//!   `sender/staging_turn` (an allocate call's wait for staging; the order is the core's),
//!   `sender/sleepers` (blocked prefill threads, woken by turn) and
//!   `sender/driver/fabric_link` (fabric connections, writes parked across a reconnect).
//! - `receiver`: `ReceiverNode` / `ReceiverHandle` — the decoder's side (a buffer of kvx's
//!   or the caller's memory): await ready requests; its clonable `ChunkReader` leases them,
//!   takes snapshots and can stop the receiver.
//! - `placement`: caller placement's calls (`ChunkReader::reserve`, `withdraw`) and the
//!   stream of returned reservations (`ReceiverHandle::take_returns`), for an application
//!   that owns the receive buffer (a vLLM decode engine).
//! - `lease`: `ReadLease` — a ready request held for reading until consumed, released when
//!   dropped (from any thread, never blocking); `ReadyLeases` — ready requests handed out as
//!   leases to callers on many tasks or threads, none lost to a cancelled wait (what
//!   Python's `Receiver.next_ready` runs on).
//! - `handover`: the one cancel-safe hand-over of what must reach a caller or go back
//!   (leases, returned reservations, request ends, admissions): `GivenBack` (taken, not
//!   passed on, handed out again first), `Handover` (a task's result on its way to its
//!   caller) and `SharedStream` (a driver's channel for many callers).
//! - `proxy`: `ProxyNode` / `ProxyHandle` — await every TP rank's notice of a request; notices
//!   from a sender the request is not bound to are refused, counted and logged once per sender.
//! - `metrics`: names of the metrics the drivers record (exported by the binary).
//! - `synthetic`: a workload whose bytes the decoder can verify (demo, load generator,
//!   end-to-end tests).
//! - `start`: `StartError`, and the one place a node's memory shape is made from its
//!   configuration (`configured_geometry`) or a lent region is held to it (`lent_fits`).
//! - `deadline`: the drivers' timer (sleep until the core's next deadline).
//!
//! `lib.rs` is only this map and the re-exports: no module reaches into it for helpers.

#![warn(missing_docs)]

mod deadline;
pub mod handover;
pub mod lease;
pub mod metrics;
pub mod placement;
pub mod proxy;
pub mod receiver;
pub mod sender;
mod start;
pub mod synthetic;

pub use handover::{GivenBack, SharedStream};
pub use lease::{ReadLease, ReadyLeases, RequestEnds};
pub use proxy::{ProxyHandle, ProxyNode, ProxyOutcome};
pub use receiver::{
    BufferSnapshot, ChunkReader, ReadyRequest, ReceiverHandle, ReceiverNode, ReceiverNotice,
    Returned, Returns,
};
pub use sender::{
    ReceiverAddr, RequestEnd, SenderHandle, SenderNode, SlotChunk, WriteCounts, NOTICE_LINGER,
};
pub use start::StartError;
