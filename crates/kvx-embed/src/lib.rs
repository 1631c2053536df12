//! kvx-embed: kvx for programs that embed it (the `kvx` binary, the Python package).
//! kvx-node's drivers are generic over an `Env` (a transport and a fabric); this crate is
//! the one place that names the concrete ones and picks them at run time (handed to the
//! drivers as kvx-io's `AnyEnv`, trait objects at the IO edge), owns the tokio runtime they
//! run on, and offers the blocking calls a Python thread makes (each bounded). It adds a
//! language's conveniences, not a second implementation: rules live in the core and client
//! calls in kvx-node's handles (`Sender::handle`, `Receiver::reader` hand them out), which
//! the `kvx` binary and the simulation drive too; what is here is the choice, guards that
//! hand back what a dropped caller held, and the waits.
//!
//! Map:
//! - `choice`: `EnvChoice` (a `TransportChoice` and a `FabricChoice`) and `into_env`, the
//!   one `match` from a choice to the concrete transport and fabric (an `AnyEnv`), and
//!   `TransportChoice::set_heartbeats`, the one place the ZeroMQ heartbeats are set (the
//!   binary's flags, Python's keywords).
//! - `named`: transports and fabrics by the names users write (`EnvChoice::named`,
//!   `InProcess` for the "mem" ones), the one mapping the binary and Python share.
//! - `lmcache`: LMCache's `pd_buffer_size` as kvx's slot count, for the binary and Python.
//! - `defaults`: the defaults of node-level settings the core's configs do not hold (chunk
//!   size, connect timeout).
//! - `runtime`: `Runtime`, the shared multi-threaded runtime.
//! - `proxy`: `Proxy`, awaiting each request's notices from every TP rank.
//! - `receiver`: `Receiver` (ready requests as `ReadLease`s, consumed or released on drop;
//!   never lost to a caller that stops waiting), the blocking form of kvx-node's
//!   `ReadyLeases`; caller placement's returned reservations, a kvx-node `SharedStream`.
//! - `sender`: `Sender` (its `SenderHandle<AnyEnv>`, staging guards, admissions reported
//!   as events, request ends shared by every caller), and `unique_local_id`, a sender
//!   identity of its own for each sender.
//! - `memory`: `Memory`, where staging or a receive buffer lives (kvx's or the caller's).
//! - `error`: `EmbedError`.
//!
//! `lib.rs` is only this map and the re-exports: no module reaches into it for helpers.

#![warn(missing_docs)]

pub mod choice;
pub mod defaults;
pub mod error;
pub mod lmcache;
pub mod memory;
pub mod named;
pub mod proxy;
pub mod receiver;
pub mod runtime;
pub mod sender;

pub use choice::{EnvChoice, EnvError, FabricChoice, HeartbeatError, TransportChoice};
pub use error::EmbedError;
pub use memory::{Memory, MemoryView};
pub use named::{InProcess, NameError, FABRIC_NAMES, TRANSPORT_NAMES};
pub use proxy::{Proxy, ProxyWait};
pub use receiver::{ReadLease, Receiver, ReceiverSettings};
pub use runtime::Runtime;
pub use sender::{unique_local_id, Admission, Sender, SenderSettings, StagingGuard};
