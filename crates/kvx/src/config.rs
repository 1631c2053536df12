//! The TOML file of `kvx receiver|sender|proxy --config FILE`. Keys are the long flag names
//! in snake_case, in a table per role; a flag given on the command line wins over the file,
//! and the file over the built-in default. Ports are laid out as LMCache lays them out: one
//! alloc port and one init (here: fabric) port per TP rank, and the proxy's host:port.
//!
//! ```toml
//! [receiver]
//! host = "127.0.0.1"
//! alloc_ports = [8400, 8401]   # one per TP rank (LMCache: pd_peer_alloc_port)
//! fabric_ports = [8300, 8301]  # one per TP rank (LMCache: pd_peer_init_port)
//! buffer_chunks = 64
//! chunk_bytes = 1048576
//! metrics = "127.0.0.1:9400"
//!
//! [proxy]
//! host = "127.0.0.1"
//! port = 8500
//! tp_ranks = 2
//! ```

use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    #[serde(default)]
    pub receiver: ReceiverSection,
    #[serde(default)]
    pub sender: SenderSection,
    #[serde(default)]
    pub proxy: ProxySection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiverSection {
    pub host: Option<String>,
    pub alloc_ports: Option<Vec<u16>>,
    pub fabric_ports: Option<Vec<u16>>,
    pub buffer_chunks: Option<u32>,
    pub chunk_bytes: Option<u64>,
    pub metrics: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SenderSection {
    pub receiver_host: Option<String>,
    pub alloc_ports: Option<Vec<u16>>,
    pub fabric_ports: Option<Vec<u16>>,
    pub proxy: Option<String>,
    pub staging_chunks: Option<u32>,
    pub chunk_bytes: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxySection {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub tp_ranks: Option<u32>,
}

/// Reads the file, or an empty one when no path is given.
pub fn load(path: Option<&Path>) -> anyhow::Result<File> {
    let Some(path) = path else {
        return Ok(File::default());
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("{}: not a valid kvx config", path.display()))
}
