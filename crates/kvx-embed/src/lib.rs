//! kvx-embed: kvx for programs that embed it (the `kvx` binary, the Python package).
//! kvx-node's drivers are generic over an `Env` (a transport and a fabric); this crate is
//! the one place that names the concrete ones and picks them at run time.
//!
//! Map:
//! - `choice`: `EnvChoice` (a `TransportChoice` and a `FabricChoice`), and `EnvVisitor`, the
//!   one `match` from a choice to a concrete `Env`.

pub mod choice;

pub use choice::{EnvChoice, EnvError, EnvVisitor, FabricChoice, TransportChoice};
