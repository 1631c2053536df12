//! kvx-proto: the sans-IO core of kvx. No sockets, no async, no clocks, no threads: every
//! state machine takes inputs through `handle_*(now, …)` and hands outputs out through
//! `poll_*`, so the same code runs under the madsim simulation, the harness in `testing`,
//! and the production drivers.
//!
//! Map:
//! - `wire`: LMCache-compatible msgpack messages and their codec.
//! - `ids`, `time`, `config`: newtype ids, virtual time, configuration with bounds.
//! - `claim`: `ClaimSecret`, what a claim of a caller-placement reservation must prove.
//! - `admission`: FIFO reservation of a request's whole `total_chunks`.
//! - `slots`: the receiver's buffer slots, generations and quarantine.
//! - `receiver`: `ReceiverLedger`, the decode side (admission + ledger + leases).
//! - `sender`: `SenderFlow`, the prefill side (staging, pipelined channels, ProxyNotif).
//! - `proxy`: `ProxyTracker`, aggregation of ProxyNotif across TP ranks, each request's
//!   notices counted only from the senders it is bound to (`NoticeFrom`).
//! - `rng`: `SeededRng`, the deterministic generator of whatever kvx draws from a seed (the
//!   harness, the simulation, the demo's workload); the core itself draws nothing.
//! - `testing` (feature): `Cluster`, a synchronous harness with virtual time.
//! - `canon` (feature `testing`): `Canon`, the explorer's canonical encoding of a state, which
//!   each core type above writes its own fields into.
//! - `broken_variants` (feature, simulation only): deliberately broken behaviours.

#![warn(missing_docs)]

/// Whether the deliberately broken variant `Variant::$v` is selected: always `false` unless
/// the `broken-variants` feature (enabled only by `sim/`) is on.
macro_rules! broken_variant {
    ($v:ident) => {{
        #[cfg(feature = "broken-variants")]
        let on = $crate::broken_variants::active($crate::broken_variants::Variant::$v);
        #[cfg(not(feature = "broken-variants"))]
        let on = false;
        on
    }};
}

pub mod admission;
#[cfg(feature = "testing")]
mod canon;
pub mod claim;
pub mod config;
pub mod ids;
pub mod proxy;
pub mod receiver;
pub mod rng;
pub mod sender;
pub mod slots;
pub mod time;
pub mod wire;

pub use claim::ClaimSecret;
pub use config::{
    Checked, ConfigError, IntoChecked, LegacySenders, Placement, ProxyConfig, ReceiverConfig,
    SenderConfig,
};
pub use ids::{
    PeerId, Principal, ReqId, ReqKey, SlotIndex, StagingSlot, Ticket, WriteId, WriteTag,
};
pub use time::Instant;

#[cfg(feature = "testing")]
pub mod testing;

#[cfg(feature = "broken-variants")]
pub mod broken_variants;
