//! kvx-io: the seams between kvx's protocol core and the world.
//!
//! What it is: the traits every driver is generic over — `Transport` (control messages:
//! LMCache's DEALER/ROUTER alloc channel and PUSH/PULL notice channel), `Fabric` (one-sided
//! writes of staged chunks into a remote registered buffer, with verbs semantics), `Env`
//! (both plus a clock and `spawn`) — with in-memory implementations and a conformance suite
//! that runs the same test bodies against every implementation, so that the simulation
//! proves things about the real system and not only about itself.
//!
//! What it is not: no transport or fabric of its own beyond the in-memory ones (ZMQ, TCP and
//! shared memory live in `kvx-transport`, RDMA in `kvx-rdma`) and no protocol logic
//! (`kvx-proto`).
//!
//! Map:
//! - `transport`: `Transport`, the channel-backed handles `ControlServer`, `ControlClient`,
//!   `NotifySink`, `NotifySource` (each `Notice` with who sent it), and `TransportError`.
//! - `fabric`: `Fabric`, `SlotMemory`, `LocalMemory`, `FabricConn`, `FabricListener`, writes
//!   and runs of writes (`WriteRun`), completions, landed notices; `fabric_error`: `FabricError`.
//! - `region`: `SlotRegion` (memory split into slots, reached in place under a lock per
//!   slot: the one place an address becomes bytes) and `ExternalRegion` (memory a caller
//!   lends kvx).
//! - `geometry`: `SlotGeometry`, a region's shape (slots × bytes), checked in one place for
//!   every fabric, the one value `Fabric::allocate_staging` and `Fabric::expose` take, and
//!   carried in the fabrics' handshakes.
//! - `access`: `FabricAccess` (the grant mirror every write is checked against) and
//!   `FabricCredential` (what ties a fabric connection to a control peer).
//! - `budget`: `ConnectionBudget`, the connections a listener holds and which one goes past
//!   its caps (the quietest, by standing first: never greeted, unauthenticated,
//!   authenticated; never a newcomer).
//! - `checksum`: the end-to-end chunk checksum (XXH3-64 folded to 32 bits), computed one-shot,
//!   during a copy, or as bytes land.
//! - `log_limit`: `LogLimiter`, one log line per interval for what peers trigger at will.
//! - `secret_label`: `SecretLabel`, how an identity or credential shows in logs (a short
//!   hash keyed per process, never the bytes).
//! - `env`: `Env` and `TokioEnv` (real time in production, virtual under madsim).
//! - `any_env`: `AnyTransport`, `AnyFabric` (over `AnyMemory`) and `AnyEnv`: a transport and
//!   a fabric chosen at run time, as trait objects at the IO edge (setup and slot access go
//!   through a vtable, posted writes and control messages do not).
//! - `mem`: `MemTransport` and `MemFabric`, in-process.
//! - `sockets` (feature): the TCP sockets beside every fabric's data path (bind with a
//!   rebind grace, bounded connect), shared by `kvx-transport`'s fabrics and `kvx-rdma`'s
//!   side channel; never built under madsim.
//! - `conformance` (feature): test bodies every implementation runs.

#![warn(missing_docs)]

pub mod access;
pub mod any_env;
pub mod budget;
pub mod checksum;
pub mod env;
pub mod fabric;
pub mod fabric_error;
pub mod geometry;
pub mod log_limit;
pub mod mem;
pub mod region;
pub mod secret_label;
pub mod transport;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "sockets")]
pub mod sockets;

pub use access::{AdmittedWrite, FabricAccess, FabricCredential, WriteRefusal};
pub use any_env::{AnyEnv, AnyFabric, AnyMemory, AnyTransport};
pub use budget::{ConnectionBudget, Evicted, Held};
pub use checksum::{chunk_checksum, copy_with_checksum, LandingChecksum};
pub use env::{Env, TokioEnv};
pub use fabric::{
    landing_channel, Completion, Fabric, FabricConn, FabricError, FabricListener, LocalMemory,
    PostWrite, SlotMemory, WriteRun,
};
pub use geometry::SlotGeometry;
pub use kvx_proto::receiver::{ChecksumCheck, LandedWrite};
pub use log_limit::LogLimiter;
pub use region::{ExternalRegion, SlotRegion};
pub use secret_label::SecretLabel;
pub use transport::{
    ClientEvent, ControlClient, ControlServer, Inbound, Notice, NotifySink, NotifySource,
    Transport, TransportError, DISCONNECT_ACK,
};
