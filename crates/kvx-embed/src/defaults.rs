//! The defaults of the node-level settings that `kvx_proto`'s configs do not hold: the size of
//! a chunk and the longest wait for connecting to a receiver. Every protocol setting (shares,
//! checksums, legacy senders, timeouts, quarantine, TTLs, queue bounds, buffer and staging
//! slots) has its default in the `Default` of `ReceiverConfig`, `SenderConfig` or
//! `ProxyConfig`; these are the rest. They live here because this crate is the one every
//! front end builds on (the `kvx` binary's flags and TOML keys, the Python package and through
//! it `kvx.lmcache`), so each reads the same value instead of stating its own.

use std::time::Duration;

/// Bytes per chunk, where the deployment does not say (LMCache derives it from the model).
pub const CHUNK_BYTES: u64 = 1 << 20;

/// The longest a sender waits to connect to a receiver (its control and fabric channels).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
