//! kvx-embed: kvx for programs that embed it (the `kvx` binary, the Python package).
//! kvx-node's drivers are generic over an `Env` (a transport and a fabric); this crate is
//! the one place that names the concrete ones and picks them at run time, owns the tokio
//! runtime they run on, and offers blocking calls (each bounded) beside async ones.
//!
//! Map:
//! - `choice`: `EnvChoice` (a `TransportChoice` and a `FabricChoice`), and `EnvVisitor`, the
//!   one `match` from a choice to a concrete `Env`.
//! - `runtime`: `Runtime`, the shared multi-threaded runtime.
//! - `proxy`: `Proxy`, awaiting each request's notices from every TP rank.
//! - `error`: `EmbedError`.

pub mod choice;
pub mod error;
pub mod proxy;
pub mod runtime;

pub use choice::{EnvChoice, EnvError, EnvVisitor, FabricChoice, TransportChoice};
pub use error::EmbedError;
pub use proxy::{Proxy, ProxyWait};
pub use runtime::Runtime;
