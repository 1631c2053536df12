//! `kvx receiver|sender|proxy --lmcache-config FILE.yaml`: the `pd_*` keys of an LMCache
//! configuration file, read as LMCache 0.5.6 reads them (`lmcache/v1/config.py`), so that a kvx
//! process takes the place of the LMCache process that file configures: the receiver binds
//! `pd_peer_host` with an alloc and a fabric port per TP rank (`pd_peer_alloc_port`,
//! `pd_peer_init_port`) and sizes its buffer from `pd_buffer_size`; a sender sizes its staging
//! from `pd_buffer_size` and notifies `pd_proxy_host:pd_proxy_port`; the proxy listens there.
//! `pd_allocation_timeout_sec` bounds the receiver's admission wait and the sender's staging
//! wait (LMCache's default, no bound, keeps kvx's own bounds).
//!
//! The file is the lowest layer: a kvx TOML file (`--config`) and flags override it. A `pd_*`
//! key LMCache does not know is an error (a typo would otherwise be a silent default); keys
//! kvx does not use (the model's, the cache's, `pd_*` keys that only tune LMCache's own
//! backend) are listed once, as a warning, so that an operator sees what did not take effect.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use yaml_serde::Value;

/// Which process reads the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Receiver,
    Sender,
    Proxy,
}

impl Role {
    fn lmcache_name(self) -> &'static str {
        match self {
            Role::Receiver => "receiver",
            Role::Sender => "sender",
            Role::Proxy => "proxy",
        }
    }
}

/// What kvx takes from an LMCache file; `None` where the file does not say.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct LmcachePd {
    pub peer_host: Option<String>,
    /// `pd_peer_init_port`: kvx's fabric port per TP rank.
    pub init_ports: Option<Vec<u16>>,
    /// `pd_peer_alloc_port`: kvx's alloc (control) port per TP rank.
    pub alloc_ports: Option<Vec<u16>>,
    /// `pd_buffer_size`, in bytes: the receive buffer (receiver) or staging (sender).
    pub buffer_bytes: Option<u64>,
    pub proxy_host: Option<String>,
    pub proxy_port: Option<u16>,
    /// `pd_allocation_timeout_sec`, when finite.
    pub allocation_timeout: Option<Duration>,
    /// Keys of the file kvx does not use, sorted.
    pub unused: Vec<String>,
}

impl LmcachePd {
    /// `pd_buffer_size` in whole chunks of `chunk_bytes` (`kvx_embed::lmcache`, the mapping
    /// `kvx.lmcache` uses too); an error naming the key when it holds none or too many.
    pub fn buffer_chunks(&self, chunk_bytes: u64) -> anyhow::Result<Option<u32>> {
        let Some(bytes) = self.buffer_bytes else {
            return Ok(None);
        };
        let slots = kvx_embed::lmcache::pd_buffer_slots(bytes, chunk_bytes)
            .map_err(|e| anyhow::anyhow!("{e} (chunks of --chunk-bytes)"))?;
        Ok(Some(slots))
    }

    /// The proxy's notice endpoint as `host:port`, when the file names both.
    pub fn proxy(&self) -> Option<String> {
        Some(format!(
            "{}:{}",
            self.proxy_host.as_ref()?,
            self.proxy_port?
        ))
    }

    /// Lists the unused keys once, as a warning.
    pub fn warn_unused(&self, path: &Path) {
        if !self.unused.is_empty() {
            tracing::warn!(
                file = %path.display(),
                keys = %self.unused.join(", "),
                "LMCache settings kvx does not use (they take no effect here)"
            );
        }
    }
}

/// The `pd_*` keys kvx reads.
const USED: &[&str] = &[
    "pd_role",
    "pd_buffer_size",
    "pd_buffer_device",
    "pd_peer_host",
    "pd_peer_init_port",
    "pd_peer_alloc_port",
    "pd_proxy_host",
    "pd_proxy_port",
    "pd_allocation_timeout_sec",
    "pd_backend_mode",
    "pd_bidirectional",
    "pd_skip_proxy_notification",
];

/// The `pd_*` keys LMCache 0.5.6 knows that tune only its own backend.
const LMCACHE_ONLY: &[&str] = &[
    "pd_peer_query_port",
    "pd_shutdown_timeout_sec",
    "pd_condition_poll_interval_sec",
    "pd_max_prefill_len",
];

/// LMCache's older names for `pd_*` keys, which it still accepts.
const ALIASES: &[(&str, &str)] = &[
    ("nixl_peer_host", "pd_peer_host"),
    ("nixl_peer_init_port", "pd_peer_init_port"),
    ("nixl_peer_alloc_port", "pd_peer_alloc_port"),
    ("nixl_proxy_host", "pd_proxy_host"),
    ("nixl_proxy_port", "pd_proxy_port"),
    ("nixl_buffer_size", "pd_buffer_size"),
    ("nixl_role", "pd_role"),
];

/// Reads `path` for `role`; `Ok(None)` without a path.
pub fn load(path: Option<&Path>, role: Role) -> anyhow::Result<Option<LmcachePd>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let pd = parse(&text, role).with_context(|| format!("{}", path.display()))?;
    pd.warn_unused(path);
    Ok(Some(pd))
}

/// Reads the text of an LMCache file for `role`.
pub fn parse(text: &str, role: Role) -> anyhow::Result<LmcachePd> {
    let doc: Option<BTreeMap<String, Value>> =
        yaml_serde::from_str(text).context("not an LMCache configuration (a YAML mapping)")?;
    let mut keys: BTreeMap<String, Value> = BTreeMap::new();
    let mut unused = Vec::new();
    for (key, value) in doc.unwrap_or_default() {
        let name = ALIASES
            .iter()
            .find(|(old, _)| *old == key)
            .map_or(key.as_str(), |(_, new)| *new)
            .to_owned();
        if USED.contains(&name.as_str()) {
            if keys.insert(name.clone(), value).is_some() {
                bail!("{name} is given twice (once under an older name)");
            }
        } else if name.starts_with("pd_") && !LMCACHE_ONLY.contains(&name.as_str()) {
            let mut known: Vec<&str> = USED.iter().chain(LMCACHE_ONLY).copied().collect();
            known.sort_unstable();
            bail!(
                "{key}: not a key of LMCache 0.5.6's PD backend (known: {})",
                known.join(", ")
            );
        } else {
            unused.push(key);
        }
    }
    let pd_role = string(&keys, "pd_role")?;
    match (role, pd_role.as_deref()) {
        (Role::Proxy, _) => {}
        (_, None) => bail!(
            "pd_role is missing: this file must configure a {} (pd_role: {})",
            role.lmcache_name(),
            role.lmcache_name()
        ),
        (_, Some(r)) if r == role.lmcache_name() => {}
        (_, Some(r)) => bail!(
            "pd_role: {r}: this file configures a {r}, not a {} (run `kvx {r}` with it)",
            role.lmcache_name()
        ),
    }
    if let Some(mode) = string(&keys, "pd_backend_mode")? {
        if mode != "async" {
            bail!("pd_backend_mode: {mode}: kvx speaks the protocol of LMCache's async PD backend; set pd_backend_mode: async");
        }
    }
    for key in ["pd_bidirectional", "pd_skip_proxy_notification"] {
        if boolean(&keys, key)? == Some(true) {
            bail!("{key}: true is not supported by kvx; remove it or set it to false");
        }
    }
    if role != Role::Proxy {
        if let Some(device) = string(&keys, "pd_buffer_device")? {
            if device != "cpu" {
                bail!(
                    "pd_buffer_device: {device}: the kvx process's buffers are host memory \
                     (its TCP and shared-memory fabrics reach nothing else); set \
                     pd_buffer_device: cpu"
                );
            }
        }
    }
    let allocation_timeout = match number(&keys, "pd_allocation_timeout_sec")? {
        None => None,
        Some(s) if s.is_infinite() && s > 0.0 => None,
        Some(s) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s)),
        Some(s) => bail!("pd_allocation_timeout_sec: {s}: a positive number of seconds"),
    };
    let buffer_bytes = match number(&keys, "pd_buffer_size")? {
        None => None,
        Some(b) if b >= 1.0 && b.fract() == 0.0 && b <= u64::MAX as f64 => Some(b as u64),
        Some(b) => bail!("pd_buffer_size: {b}: a positive whole number of bytes"),
    };
    let proxy_port = match number(&keys, "pd_proxy_port")? {
        None => None,
        Some(p) => Some(port(p, "pd_proxy_port")?),
    };
    Ok(LmcachePd {
        peer_host: string(&keys, "pd_peer_host")?,
        init_ports: ports(&keys, "pd_peer_init_port")?,
        alloc_ports: ports(&keys, "pd_peer_alloc_port")?,
        buffer_bytes,
        proxy_host: string(&keys, "pd_proxy_host")?,
        proxy_port,
        allocation_timeout,
        unused,
    })
}

fn string(keys: &BTreeMap<String, Value>, key: &str) -> anyhow::Result<Option<String>> {
    match keys.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => bail!("{key}: {other:?} is not a string"),
    }
}

fn boolean(keys: &BTreeMap<String, Value>, key: &str) -> anyhow::Result<Option<bool>> {
    match keys.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => bail!("{key}: {other:?} is not true or false"),
    }
}

fn number(keys: &BTreeMap<String, Value>, key: &str) -> anyhow::Result<Option<f64>> {
    match keys.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_f64()
            .map(Some)
            .with_context(|| format!("{key}: {n} is not a number kvx can read")),
        Some(other) => bail!("{key}: {other:?} is not a number"),
    }
}

fn port(p: f64, key: &str) -> anyhow::Result<u16> {
    if p.fract() == 0.0 && (1.0..=65535.0).contains(&p) {
        Ok(p as u16)
    } else {
        bail!("{key}: {p} is not a port (1-65535)")
    }
}

/// A port or a list of ports (one per TP rank), as LMCache takes them.
fn ports(keys: &BTreeMap<String, Value>, key: &str) -> anyhow::Result<Option<Vec<u16>>> {
    let one = |v: &Value| match v {
        Value::Number(n) => n
            .as_f64()
            .with_context(|| format!("{key}: {n} is not a port"))
            .and_then(|p| port(p, key)),
        other => bail!("{key}: {other:?} is not a port"),
    };
    match keys.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Sequence(list)) if !list.is_empty() => {
            list.iter().map(one).collect::<Result<_, _>>().map(Some)
        }
        Some(Value::Sequence(_)) => bail!("{key}: an empty list (one port per TP rank)"),
        Some(v) => one(v).map(|p| Some(vec![p])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DECODE: &str = "
chunk_size: 256
local_cpu: false
enable_pd: true
pd_backend_mode: async
pd_role: receiver
pd_buffer_size: 67108864
pd_buffer_device: cpu
pd_peer_host: 10.0.0.2
pd_peer_init_port: [8300, 8301]
pd_peer_alloc_port: [8400, 8401]
pd_allocation_timeout_sec: 30
pd_proxy_host: 10.0.0.9
pd_proxy_port: 8500
pd_max_prefill_len: 8192
";

    #[test]
    fn a_decoders_file_gives_the_receiver_its_ports_buffer_and_timeout() {
        let pd = parse(DECODE, Role::Receiver).expect("a receiver's file");
        assert_eq!(pd.peer_host.as_deref(), Some("10.0.0.2"));
        assert_eq!(pd.init_ports, Some(vec![8300, 8301]));
        assert_eq!(pd.alloc_ports, Some(vec![8400, 8401]));
        assert_eq!(pd.buffer_chunks(1 << 20).expect("fits"), Some(64));
        assert_eq!(pd.allocation_timeout, Some(Duration::from_secs(30)));
        assert_eq!(pd.proxy().as_deref(), Some("10.0.0.9:8500"));
        assert_eq!(
            pd.unused,
            ["chunk_size", "enable_pd", "local_cpu", "pd_max_prefill_len"]
        );
        // The proxy reads the same file for its own address.
        let proxy = parse(DECODE, Role::Proxy).expect("any role's file");
        assert_eq!(proxy.proxy().as_deref(), Some("10.0.0.9:8500"));
    }

    #[test]
    fn single_ports_older_names_and_no_bound_read_as_lmcache_reads_them() {
        let pd = parse(
            "nixl_role: sender\nnixl_buffer_size: 4194304\npd_peer_init_port: 8300\n\
             pd_allocation_timeout_sec: .inf\n",
            Role::Sender,
        )
        .expect("a sender's file");
        assert_eq!(pd.init_ports, Some(vec![8300]));
        assert_eq!(pd.buffer_chunks(1 << 20).expect("fits"), Some(4));
        assert_eq!(pd.allocation_timeout, None);
    }

    #[test]
    fn what_kvx_cannot_honour_is_refused_naming_the_key() {
        for (text, role, names) in [
            (
                "pd_role: receiver\npd_bufer_size: 1\n",
                Role::Receiver,
                "pd_bufer_size",
            ),
            ("pd_role: sender\n", Role::Receiver, "pd_role: sender"),
            ("pd_buffer_size: 1\n", Role::Sender, "pd_role is missing"),
            (
                "pd_role: receiver\npd_buffer_device: cuda\n",
                Role::Receiver,
                "pd_buffer_device",
            ),
            (
                "pd_role: receiver\npd_backend_mode: sync\n",
                Role::Receiver,
                "pd_backend_mode",
            ),
            (
                "pd_role: sender\npd_bidirectional: true\n",
                Role::Sender,
                "pd_bidirectional",
            ),
            (
                "pd_role: receiver\npd_peer_alloc_port: [8400, 70000]\n",
                Role::Receiver,
                "pd_peer_alloc_port",
            ),
            (
                "pd_role: receiver\npd_allocation_timeout_sec: -1\n",
                Role::Receiver,
                "pd_allocation_timeout_sec",
            ),
            (
                "pd_role: receiver\npd_buffer_size: lots\n",
                Role::Receiver,
                "pd_buffer_size",
            ),
            (
                "pd_role: receiver\npd_peer_host: x\nnixl_peer_host: y\n",
                Role::Receiver,
                "pd_peer_host is given twice",
            ),
            ("- a list\n", Role::Receiver, "YAML mapping"),
        ] {
            let err = format!("{:#}", parse(text, role).expect_err(text));
            assert!(err.contains(names), "{text:?}: {err}");
        }
        let small =
            parse("pd_role: receiver\npd_buffer_size: 1000\n", Role::Receiver).expect("parses");
        let err = small.buffer_chunks(1 << 20).expect_err("no whole chunk");
        assert!(err.to_string().contains("pd_buffer_size"), "{err}");
    }
}
