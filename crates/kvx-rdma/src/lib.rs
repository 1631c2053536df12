//! kvx-rdma: `RdmaFabric`, kvx's one-sided writes over RDMA verbs — the fabric the protocol's
//! verbs semantics were written for (`kvx_io::fabric`).
//!
//! What it is: a receiver registers its buffer and listens on a TCP side channel (LMCache's
//! init port per TP rank); a sender registers its staging pool, and connecting exchanges queue
//! pair numbers, GIDs, the buffer's address and remote key over that channel, one
//! reliable-connected queue pair per (sender, receiver) pair. A write is an RDMA WRITE from a
//! staging slot into a remote slot, with the caller's immediate (kvx's `WriteTag`: 20-bit slot,
//! 12-bit generation) when it has one; the receiver hears of it from the receive completion
//! that immediate consumes. Ahead of each such write the sender sends, on the side channel, a
//! frame with the chunk's checksum (when it computed one); the receiver checks the landed
//! bytes against it before it announces the write. Completions are polled on a dedicated
//! thread and routed to each connection's task. A failed work request moves the queue pair to ERROR; the connection then
//! fences the receiver over the side channel and flushes every outstanding write with an
//! error, so that nothing lands after the flush; the receiver drains its queue pair's
//! completions before it answers and destroys it.
//!
//! What it is not: the verbs library. Its calls sit behind the `Verbs` seam (`verbs`); the
//! sideway backend (`IbvVerbs`, module `ibv`) is built only with the feature `rdma`, which
//! needs cmake and libclang to build and libibverbs with a device to run. Without the feature
//! the crate builds everything above the verbs calls, and its tests run it against an
//! in-process model of a NIC. Never built under madsim.
//!
//! Map:
//! - `fabric`: `RdmaFabric`, `RdmaError`.
//! - `config`: `RdmaConfig`, `PathMtu`.
//! - `verbs`: the `Verbs` / `VerbsQp` seam, work completions, `Qp` (the RC state machine).
//! - `memory`: `RdmaMemory`, registered slots and their keys (`MrKeys`) — the crate's
//!   `unsafe`, but for two calls in `ibv` that sideway does not wrap: the fork query
//!   (`ibv_is_fork_initialized`) and the event reader (`ibv_get_async_event`).
//! - `verbs_error`: `VerbsError`, a failed verbs call (a leaf under `verbs` and `memory`).
//! - `remote_access`: `RemoteAccess`, what a peer may do to a region or queue pair (a leaf
//!   under `verbs` and `memory`).
//! - `wire`: the side channel's frames (hello, welcome, fence, the write frame ahead of each
//!   write with immediate), `checked_geometry` and `within_one_write` (kvx-io's `SlotGeometry` within an RDMA write's size) and `GidKind`.
//! - `link`: the side channel's sockets (bind and bounded connect from `kvx_io::sockets`),
//!   bounded reads and writes of its frames.
//! - `route`: `wr_id` encoding and the routing of completions to connections.
//! - `device`: an opened device and its completion poller thread.
//! - `blocking`: `off_the_runtime`, where every verbs call that can block runs (a leaf).
//! - `wake`: how the poller waits when idle, and how a post wakes it.
//! - `limits`: `DeviceLimits`, the device's maxima a geometry can exceed, and their checks.
//! - `engine`: a sender connection's logic without IO (order, failure, fence, flush).
//! - `pairing`: a receiver connection's pairing of each landed write with its write frame
//!   (either may come first), without IO.
//! - `sender`, `receiver`: the connection tasks on either side.
//! - `ibv` (feature `rdma`): `IbvVerbs`, the sideway backend.
//!
//! Operations (devices, GIDs, MTU, ports, TP ranks): `docs/operations.md`.

mod blocking;
mod config;
mod device;
mod engine;
mod fabric;
mod limits;
mod link;
mod memory;
mod pairing;
mod receiver;
mod remote_access;
mod route;
mod sender;
pub mod verbs;
mod verbs_error;
mod wake;
mod wire;

#[cfg(feature = "rdma")]
mod ibv;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_checksum;
#[cfg(test)]
mod tests_cost;
#[cfg(test)]
mod tests_device;
#[cfg(test)]
mod tests_node;
#[cfg(test)]
mod tests_runs;

pub use config::{PathMtu, RdmaConfig};
pub use fabric::{RdmaError, RdmaFabric};
pub use limits::DeviceLimits;
pub use memory::RdmaMemory;
pub use wire::{checked_geometry, within_one_write, QpAddr, SLOT_BYTES_MAX};

#[cfg(feature = "rdma")]
pub use ibv::IbvVerbs;

/// The fabric over a real device (feature `rdma`).
#[cfg(feature = "rdma")]
pub type IbvFabric = RdmaFabric<IbvVerbs>;

#[cfg(feature = "rdma")]
impl RdmaFabric<IbvVerbs> {
    /// Opens the configured device (or the first one) and starts its completion poller.
    /// Without libibverbs, or without a device, this is `RdmaError::NoDevice`.
    pub fn open(config: RdmaConfig) -> Result<Self, RdmaError> {
        let verbs = IbvVerbs::open(&config)?;
        Self::with_verbs(verbs, config)
    }
}
