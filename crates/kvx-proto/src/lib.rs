//! kvx-proto: the sans-IO core of kvx. No sockets, no async, no clocks, no threads: every
//! state machine takes inputs through `handle_*(now, …)` and hands outputs out through
//! `poll_*`, so the same code runs under the madsim simulation, the harness in `testing`,
//! and the production drivers.
//!
//! Map:
//! - `wire`: LMCache-compatible msgpack messages and their codec.
//! - `ids`, `time`, `config`: newtype ids, virtual time, configuration with bounds.
//! - `admission`: FIFO reservation of a request's whole `total_chunks`.
//! - `slots`: the receiver's buffer slots, generations and quarantine.
//! - `receiver`: `ReceiverLedger`, the decode side (admission + ledger + leases).
//! - `sender`: `SenderFlow`, the prefill side (staging, pipelined channels, ProxyNotif).
//! - `proxy`: `ProxyTracker`, aggregation of ProxyNotif across TP ranks.
//! - `testing` (feature): `Cluster`, a synchronous harness with virtual time.

pub mod admission;
pub mod config;
pub mod ids;
pub mod proxy;
pub mod receiver;
pub mod sender;
pub mod slots;
pub mod time;
pub mod wire;

pub use config::{ConfigError, ProxyConfig, ReceiverConfig, SenderConfig};
pub use ids::{PeerId, ReqId, ReqKey, SlotIndex, StagingSlot, Ticket, WriteId, WriteTag};
pub use time::Instant;

#[cfg(feature = "testing")]
pub mod testing;
