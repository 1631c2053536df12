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
//!   add a chunk to its request's pending batch, submit, cancel, await the outcome or read
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
//! - `proxy`: `ProxyNode` / `ProxyHandle` — await every TP rank's notice of a request; notices
//!   from a sender the request is not bound to are refused, counted and logged once per sender.
//! - `metrics`: names of the metrics the drivers record (exported by the binary).
//! - `synthetic`: a workload whose bytes the decoder can verify (demo, load generator,
//!   end-to-end tests).
//! - here: `StartError`, and the one place a node's memory shape is made from its
//!   configuration (`configured_geometry`) or a lent region is held to it (`lent_fits`).

#![warn(missing_docs)]

pub mod lease;
pub mod metrics;
pub mod placement;
pub mod proxy;
pub mod receiver;
pub mod sender;
pub mod synthetic;

pub use lease::{ReadLease, ReadyLeases, RequestEnds};
pub use proxy::{ProxyHandle, ProxyNode, ProxyOutcome};
pub use receiver::{
    BufferSnapshot, ChunkReader, ReadyRequest, ReceiverHandle, ReceiverNode, ReceiverNotice,
    Returned, Returns,
};
pub use sender::{ReceiverAddr, RequestEnd, SenderHandle, SenderNode, WriteCounts, NOTICE_LINGER};

/// Sleeps until the core's next deadline, or forever when it has none (the drivers'
/// `select!` arm for timers).
pub(crate) async fn sleep_until_deadline<E: kvx_io::Env>(
    env: &E,
    deadline: Option<kvx_proto::Instant>,
) {
    match deadline {
        Some(at) => env.sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Why a driver could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration cannot work (the state machine's `validate` says why): fix it.
    #[error(transparent)]
    Config(#[from] kvx_proto::ConfigError),
    // Not `#[from]`: that would make the inner error a `source` as well, and error chains
    // (`{:#}`) would print it twice.
    /// Binding or connecting the control channel failed.
    #[error("transport: {0}")]
    Transport(kvx_io::TransportError),
    /// Exposing the receive buffer or allocating staging failed.
    #[error("fabric: {0}")]
    Fabric(kvx_io::FabricError),
    /// Memory the caller lent does not fit the configuration (its slot count or size).
    #[error("memory: {0}")]
    Memory(String),
    /// The sender's driver has ended (shut down, closed, or its runtime went away), so it
    /// can connect to no receiver (`SenderHandle::add_receiver`): make a new sender.
    #[error(
        "this sender has stopped (shut down, closed, or its runtime ended): make a new sender"
    )]
    Stopped,
}

impl From<kvx_io::TransportError> for StartError {
    fn from(e: kvx_io::TransportError) -> Self {
        Self::Transport(e)
    }
}

impl From<kvx_io::FabricError> for StartError {
    fn from(e: kvx_io::FabricError) -> Self {
        Self::Fabric(e)
    }
}

/// The shape of a node's own memory (a sender's staging, a receiver's buffer): the slot count
/// its configuration names (`SenderConfig::staging_slots`, `ReceiverConfig::buffer_slots`),
/// of `slot_bytes` each, checked by `SlotGeometry::new`.
///
/// Derived here, in one place, rather than taken from the caller beside the configuration:
/// the core's state machines count the configuration's slots, so a second slot count passed
/// with the memory's shape could disagree with them; derived from the configuration, it
/// cannot. Memory a caller lends (`start_in`) brings its own shape, which `lent_fits` holds
/// to the configuration.
pub(crate) fn configured_geometry(
    config_slots: u32,
    slot_bytes: usize,
) -> Result<kvx_io::SlotGeometry, StartError> {
    Ok(kvx_io::SlotGeometry::new(config_slots, slot_bytes)?)
}

/// The one check that lent memory (`start_in`) has the slot count the configuration names:
/// refused, naming both, rather than a state machine counting slots the memory lacks (or
/// never using some it has).
pub(crate) fn lent_fits(
    what: &str,
    region: &kvx_io::ExternalRegion,
    config_slots: u32,
) -> Result<(), StartError> {
    if region.slots() == config_slots {
        return Ok(());
    }
    Err(StartError::Memory(format!(
        "the {what} region holds {} slots of {} bytes, the configuration {config_slots} {what} \
         slots",
        region.slots(),
        region.slot_bytes(),
    )))
}
