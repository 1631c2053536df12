//! Command-line definitions.

use std::ops::RangeInclusive;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvx_embed::defaults;
use kvx_proto::{ReceiverConfig, SenderConfig};

#[derive(Debug, Parser)]
#[command(
    name = "kvx",
    version,
    about = "Move KV-cache chunks from prefill to decode workers, LMCache-compatible, without deadlocks",
    long_about = "kvx moves KV-cache chunks from the prefill workers of a disaggregated LLM-serving \
cluster into the buffers of its decode workers, speaking LMCache's PD protocol, with \
reservation-based admission control that cannot deadlock.\n\nStart with `kvx demo`. Logs go to \
stderr, filtered by RUST_LOG (e.g. RUST_LOG=kvx_node=info,kvx_transport=info)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a proxy, a receiver and senders in one process over loopback, with a synthetic
    /// chunked-prefill workload verified byte for byte by the decoder.
    Demo(DemoArgs),
    /// Run a receiver (the decode side), one per TP rank, until Ctrl-C.
    Receiver(ReceiverArgs),
    /// Run a sender as a load generator against a remote receiver (one sender per TP rank).
    Sender(SenderArgs),
    /// Run a proxy that aggregates ProxyNotif across TP ranks and logs each request's end.
    Proxy(ProxyArgs),
    /// Measure a fabric's throughput into another process's buffer, against a baseline
    /// measured in the same run.
    Bench(BenchArgs),
    /// (internal) The exposing side of `kvx bench`.
    #[command(hide = true)]
    BenchServe(BenchServeArgs),
    /// Decode or encode wire messages (msgpack ⇄ JSON).
    #[command(subcommand)]
    Wire(WireCommand),
    /// Write a CURVE key pair as ZeroMQ certificates: NAME.key (public: hand it to peers) and
    /// NAME.key_secret (mode 0600), as pyzmq's zmq.auth writes and reads them.
    Keygen(KeygenArgs),
}

#[derive(Debug, Clone, Args)]
pub struct KeygenArgs {
    /// The certificates' name: the files are NAME.key and NAME.key_secret.
    pub name: String,
    /// Directory to write them into (created if missing); existing files are never
    /// overwritten.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
}

/// CURVE (CurveZMQ) on a bound control socket: the receiver's alloc ROUTER, the proxy's
/// notice PULL. Off unless both flags are given; then only clients whose keys are allowed
/// connect, and everything they send is encrypted (docs/operations.md, "CURVE").
#[derive(Debug, Clone, Default, Args)]
pub struct CurveServerArgs {
    /// This process's CURVE key pair: a secret certificate (NAME.key_secret, from `kvx
    /// keygen` or pyzmq's zmq.auth.create_certificates).
    #[arg(long, value_name = "FILE.key_secret", requires = "curve_allow")]
    pub curve_secret_key: Option<PathBuf>,
    /// Directory of the public certificates (NAME.key) of the clients allowed to connect,
    /// read at start.
    #[arg(long, value_name = "DIR", requires = "curve_secret_key")]
    pub curve_allow: Option<PathBuf>,
}

/// CURVE (CurveZMQ) on a connecting control socket: the sender's DEALER to each receiver
/// and PUSH to the proxy. Off unless both flags are given.
#[derive(Debug, Clone, Default, Args)]
pub struct CurveClientArgs {
    /// This process's CURVE key pair: a secret certificate (NAME.key_secret); its public
    /// half must be in the receivers' and proxy's --curve-allow directories.
    #[arg(long, value_name = "FILE.key_secret", requires = "curve_server_key")]
    pub curve_secret_key: Option<PathBuf>,
    /// The public certificate (NAME.key) of the servers it connects to: the receivers and
    /// the proxy, which share that key pair.
    #[arg(long, value_name = "FILE.key", requires = "curve_secret_key")]
    pub curve_server_key: Option<PathBuf>,
}

/// Heartbeats on the control channel (`docs/spec/zmq.md` §5.1): how a stopped or hung peer
/// process is found, whose connections stay open.
#[derive(Debug, Clone, Args)]
pub struct HeartbeatArgs {
    /// Seconds between a sender's PINGs to each receiver.
    #[arg(long, default_value_t = kvx_transport::zmq::ZmqConfig::default().heartbeat_interval.as_secs_f64())]
    pub heartbeat_interval_s: f64,
    /// Seconds of silence after which a peer that announced heartbeats is given up (a
    /// receiver fails the sender's requests, a sender the receiver's); at least twice
    /// --heartbeat-interval-s.
    #[arg(long, default_value_t = kvx_transport::zmq::ZmqConfig::default().heartbeat_timeout.as_secs_f64())]
    pub heartbeat_timeout_s: f64,
}

impl HeartbeatArgs {
    /// Sets them on `choice`'s ZMQ transport, checked.
    pub fn apply(&self, choice: &mut kvx_embed::EnvChoice) -> anyhow::Result<()> {
        let positive = |name: &str, s: f64| {
            if s.is_finite() && s > 0.0 && s <= 86_400.0 {
                Ok(std::time::Duration::from_secs_f64(s))
            } else {
                Err(anyhow::anyhow!(
                    "--{name}: a positive number of seconds, at most a day, not {s}"
                ))
            }
        };
        let interval = positive("heartbeat-interval-s", self.heartbeat_interval_s)?;
        let timeout = positive("heartbeat-timeout-s", self.heartbeat_timeout_s)?;
        Ok(choice.transport.set_heartbeats(interval, timeout)?)
    }
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// How chunk bytes move.
    #[arg(long, value_enum, default_value_t = FabricKind::Tcp)]
    pub fabric: FabricKind,
    #[command(flatten)]
    pub rdma: RdmaArgs,
    /// Bytes per write (one chunk).
    #[arg(long, default_value_t = defaults::CHUNK_BYTES, value_parser = clap::value_parser!(u64).range(8..=(1 << 30)))]
    pub chunk_bytes: u64,
    /// Bytes to move in all.
    #[arg(long, default_value_t = 2 << 30, value_parser = clap::value_parser!(u64).range(8..))]
    pub total_bytes: u64,
    /// Writes in flight (and slots on each side).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub window: u32,
    /// Whether each write carries its chunk's checksum, which the receiving fabric checks
    /// (auto: on, as a kvx sender's do); `off` measures the fabric without them.
    #[arg(long, value_enum, default_value_t = ChecksumMode::Auto)]
    pub checksums: ChecksumMode,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct BenchServeArgs {
    #[arg(long, value_enum)]
    pub fabric: FabricKind,
    #[command(flatten)]
    pub rdma: RdmaArgs,
    #[arg(long)]
    pub chunk_bytes: u64,
    #[arg(long)]
    pub slots: u32,
}

#[derive(Debug, Clone, Args)]
pub struct ReceiverArgs {
    /// TOML file with a [receiver] table (keys as these flags, snake_case); flags win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// An LMCache configuration file (YAML) whose `pd_*` keys this process takes, as the
    /// LMCache process it replaces would (ports per TP rank, buffer size in bytes, proxy,
    /// allocation timeout; docs/operations.md). Below --config and flags.
    #[arg(long, value_name = "FILE.yaml")]
    pub lmcache_config: Option<PathBuf>,
    /// Address to bind [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Alloc-channel port per TP rank, comma-separated (LMCache: pd_peer_alloc_port) [default: 8400].
    #[arg(long, value_delimiter = ',')]
    pub alloc_ports: Option<Vec<u16>>,
    /// Fabric port per TP rank, comma-separated (LMCache: pd_peer_init_port) [default: 8300].
    #[arg(long, value_delimiter = ',')]
    pub fabric_ports: Option<Vec<u16>>,
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000), help = format!(
        "Buffer size per rank, in chunks [default: an LMCache file's pd_buffer_size in chunks, else {}]",
        ReceiverConfig::default().buffer_slots
    ))]
    pub buffer_chunks: Option<u32>,
    #[arg(long, value_parser = clap::value_parser!(u64).range(8..=(1 << 30)), help = format!(
        "Bytes per chunk [default: {}]",
        defaults::CHUNK_BYTES
    ))]
    pub chunk_bytes: Option<u64>,
    /// How chunk bytes move.
    #[arg(long, value_enum, default_value_t = FabricKind::Tcp)]
    pub fabric: FabricKind,
    /// End-to-end chunk checksums: auto (on, over every fabric), on, or off. A receiver with
    /// them on fails a kvx sender's chunk that carries none.
    #[arg(long, value_enum, default_value_t = ChecksumMode::Auto)]
    pub checksums: ChecksumMode,
    #[command(flatten)]
    pub rdma: RdmaArgs,
    /// Serve Prometheus metrics at this address (e.g. 127.0.0.1:9400), with /ready beside them.
    #[arg(long)]
    pub metrics: Option<String>,
    /// Do not check the synthetic workload's bytes (for real KV data).
    #[arg(long)]
    pub no_verify: bool,
    /// Exit after this many seconds (for tests); default: run until Ctrl-C.
    #[arg(long)]
    pub exit_after_s: Option<u64>,
    #[command(flatten)]
    pub protocol: crate::knobs::ReceiverKnobs,
    #[command(flatten)]
    pub curve: CurveServerArgs,
    #[command(flatten)]
    pub heartbeats: HeartbeatArgs,
}

#[derive(Debug, Clone, Args)]
pub struct SenderArgs {
    /// TOML file with a [sender] table (keys as these flags, snake_case); flags win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// An LMCache configuration file (YAML) whose `pd_*` keys this process takes, as the
    /// LMCache process it replaces would (ports per TP rank, buffer size in bytes, proxy,
    /// allocation timeout; docs/operations.md). Below --config and flags.
    #[arg(long, value_name = "FILE.yaml")]
    pub lmcache_config: Option<PathBuf>,
    /// The receiver's host [default: 127.0.0.1].
    #[arg(long)]
    pub receiver_host: Option<String>,
    /// The receiver's alloc port per TP rank, comma-separated [default: 8400].
    #[arg(long, value_delimiter = ',')]
    pub alloc_ports: Option<Vec<u16>>,
    /// The receiver's fabric port per TP rank, comma-separated [default: 8300].
    #[arg(long, value_delimiter = ',')]
    pub fabric_ports: Option<Vec<u16>>,
    /// The proxy's notice endpoint, host:port [default: 127.0.0.1:8500].
    #[arg(long)]
    pub proxy: Option<String>,
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000), help = format!(
        "Staging pool per rank, in chunks [default: an LMCache file's pd_buffer_size in chunks, \
         else {}]. As in `kvx demo`: staging only needs to cover what is in flight on the link \
         (its bandwidth-delay product; 4 chunks of 1 MiB cover 25 GB/s × 160 µs); more adds \
         queueing and cache misses, not throughput (docs/PERFORMANCE.md measures 4 against 8 \
         and 64). Raise it for a longer or faster link.",
        SenderConfig::default().staging_slots
    ))]
    pub staging_chunks: Option<u32>,
    #[arg(long, value_parser = clap::value_parser!(u64).range(8..=(1 << 30)), help = format!(
        "Bytes per chunk; must match the receiver's [default: {}]",
        defaults::CHUNK_BYTES
    ))]
    pub chunk_bytes: Option<u64>,
    /// How chunk bytes move.
    #[arg(long, value_enum, default_value_t = FabricKind::Tcp)]
    pub fabric: FabricKind,
    /// End-to-end chunk checksums: auto (on, over every fabric), on, or off. A receiver with
    /// them on fails a kvx sender's chunk that carries none.
    #[arg(long, value_enum, default_value_t = ChecksumMode::Auto)]
    pub checksums: ChecksumMode,
    #[command(flatten)]
    pub rdma: RdmaArgs,
    /// Serve Prometheus metrics at this address (e.g. 127.0.0.1:9401), with /ready beside them.
    #[arg(long)]
    pub metrics: Option<String>,
    /// This sender's number, used in request ids so several senders never collide.
    #[arg(long, default_value_t = 0)]
    pub sender_index: u32,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub protocol: crate::knobs::SenderKnobs,
    #[command(flatten)]
    pub curve: CurveClientArgs,
    #[command(flatten)]
    pub heartbeats: HeartbeatArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// TOML file with a [proxy] table; flags win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// An LMCache configuration file (YAML) whose `pd_*` keys this process takes, as the
    /// LMCache process it replaces would (ports per TP rank, buffer size in bytes, proxy,
    /// allocation timeout; docs/operations.md). Below --config and flags.
    #[arg(long, value_name = "FILE.yaml")]
    pub lmcache_config: Option<PathBuf>,
    /// Address to bind [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Notice port (LMCache: proxy_port) [default: 8500].
    #[arg(long)]
    pub port: Option<u16>,
    /// Serve Prometheus metrics at this address (e.g. 127.0.0.1:9402), with /ready beside them.
    #[arg(long)]
    pub metrics: Option<String>,
    /// Notices that make a request ready: one per decoder TP rank [default: 1].
    #[arg(long)]
    pub tp_ranks: Option<u32>,
    /// Exit after this many seconds (for tests); default: run until Ctrl-C.
    #[arg(long)]
    pub exit_after_s: Option<u64>,
    #[command(flatten)]
    pub protocol: crate::knobs::ProxyKnobs,
    #[command(flatten)]
    pub curve: CurveServerArgs,
}

/// Whether chunks carry an end-to-end checksum (XXH3, 32 bits) that the receiver checks before a
/// request is ready (docs/spec/fabrics.md §5b). Every fabric carries them (RDMA in the write
/// frame its side channel sends ahead of each write), so the mode does not depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum ChecksumMode {
    /// The core's defaults: on (`SenderConfig::checksums`, `ReceiverConfig::require_checksums`).
    #[default]
    Auto,
    /// Senders compute them and receivers require them.
    On,
    /// Senders send none and receivers require none (memory the CPU must not read, such as
    /// GPU memory registered with an RDMA NIC: docs/embedding.md).
    Off,
}

impl ChecksumMode {
    /// Whether a receiver requires them: `auto` is the core's default
    /// (`ReceiverConfig::require_checksums`).
    pub fn required(self) -> bool {
        self.enabled(ReceiverConfig::default().require_checksums)
    }

    /// Whether a sender computes them: `auto` is the core's default
    /// (`SenderConfig::checksums`).
    pub fn computed(self) -> bool {
        self.enabled(SenderConfig::default().checksums)
    }

    fn enabled(self, core_default: bool) -> bool {
        match self {
            ChecksumMode::Auto => core_default,
            ChecksumMode::On => true,
            ChecksumMode::Off => false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FabricKind {
    /// One-sided writes carried over TCP.
    Tcp,
    /// Writes through shared memory (one host): the receiver copies each admitted write out
    /// of the sender's staging.
    Shm,
    /// In-process copies (no sockets at all).
    Mem,
    /// One-sided RDMA writes over verbs (RoCE or InfiniBand; needs a kvx built with
    /// `--features rdma` and an RDMA NIC; see docs/operations.md).
    Rdma,
}

const RDMA: &str = "RDMA (with --fabric rdma)";

/// Which RDMA device, port and GID `--fabric rdma` uses (docs/operations.md).
#[derive(Debug, Clone, Args)]
pub struct RdmaArgs {
    /// RDMA device name (`ibv_devices`, e.g. mlx5_0) [default: the first device].
    #[arg(long, help_heading = RDMA)]
    pub rdma_device: Option<String>,
    /// Physical port of the device.
    #[arg(long, help_heading = RDMA, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..))]
    pub rdma_port: u8,
    /// GID index (`show_gids`) [default: on RoCE the first RoCE v2 GID with an IPv4 address; on InfiniBand 0].
    #[arg(long, help_heading = RDMA)]
    pub rdma_gid_index: Option<u32>,
    /// Caps the path MTU: 256, 512, 1024, 2048 or 4096 [default: both ports' active MTU].
    #[arg(long, help_heading = RDMA, value_parser = parse_mtu)]
    pub rdma_mtu: Option<u32>,
}

impl RdmaArgs {
    /// The same settings as flags, for a child process (`kvx bench-serve`).
    pub fn to_flags(&self) -> Vec<String> {
        let mut f = vec!["--rdma-port".to_owned(), self.rdma_port.to_string()];
        if let Some(d) = &self.rdma_device {
            f.extend(["--rdma-device".to_owned(), d.clone()]);
        }
        if let Some(g) = self.rdma_gid_index {
            f.extend(["--rdma-gid-index".to_owned(), g.to_string()]);
        }
        if let Some(m) = self.rdma_mtu {
            f.extend(["--rdma-mtu".to_owned(), m.to_string()]);
        }
        f
    }
}

fn parse_mtu(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(m @ (256 | 512 | 1024 | 2048 | 4096)) => Ok(m),
        _ => Err(format!(
            "an RDMA MTU is 256, 512, 1024, 2048 or 4096, not {s:?}"
        )),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportKind {
    /// ZeroMQ DEALER/ROUTER and PUSH/PULL, LMCache's sockets and framing.
    Zmq,
    /// In-process channels.
    Mem,
}

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Prefill workers (senders).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub senders: u32,
    /// Receiver buffer size, in chunks.
    #[arg(long, default_value_t = ReceiverConfig::default().buffer_slots, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub buffer_chunks: u32,
    /// Staging pool size per sender, in chunks. Staging only needs to cover what is in
    /// flight on the link (its bandwidth-delay product): more adds queueing and cache
    /// misses, not throughput (docs/PERFORMANCE.md measures 4 against 8 and 64).
    #[arg(long, default_value_t = SenderConfig::default().staging_slots, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub staging_chunks: u32,
    /// Bytes per chunk.
    #[arg(long, default_value_t = defaults::CHUNK_BYTES, value_parser = clap::value_parser!(u64).range(8..=(1 << 30)))]
    pub chunk_bytes: u64,
    /// How chunk bytes move.
    #[arg(long, value_enum, default_value_t = FabricKind::Tcp)]
    pub fabric: FabricKind,
    /// End-to-end chunk checksums: auto (on, over every fabric), on, or off. A receiver with
    /// them on fails a kvx sender's chunk that carries none.
    #[arg(long, value_enum, default_value_t = ChecksumMode::Auto)]
    pub checksums: ChecksumMode,
    #[command(flatten)]
    pub rdma: RdmaArgs,
    #[arg(long, value_enum, default_value_t = TransportKind::Zmq)]
    pub transport: TransportKind,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// The receiver's protocol settings, as `kvx receiver` takes them, so that the demo can
    /// reproduce a deployment's receiver.
    #[command(flatten)]
    pub receiver: crate::knobs::ReceiverKnobs,
}

/// The synthetic workload, shared by `kvx demo` and `kvx sender`.
#[derive(Debug, Clone, Args)]
pub struct WorkloadArgs {
    /// Requests per sender.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub requests: u32,
    /// Chunks per request, drawn uniformly from MIN..MAX (inclusive).
    #[arg(long, default_value = "4..16", value_parser = parse_range)]
    pub chunks: RangeInclusive<u32>,
    /// Requests each sender prefills concurrently.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub interleave: u32,
    /// Chunks per batch (one AllocRequest).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub batch_chunks: u32,
    /// Fraction of requests cancelled at a random moment of their prefill.
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub cancel_fraction: f64,
    /// Seed of the workload (sizes, cancels).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Give up (and exit non-zero) after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
    /// Print one JSON object instead of the table and progress bar. Latencies, of completed
    /// requests: `request_latency_ms_p50/p99` from a request's beginning (before its
    /// admission probe) to its ProxyNotif at the proxy (demo) or its delivery on every rank
    /// (sender), what a user waits; `transfer_ms_p50/p99` from its first batch submitted to
    /// the same end, the transfer alone.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum WireCommand {
    /// Read one msgpack message on stdin (raw, or hex with --hex) and print it as JSON.
    Decode {
        /// The input is hex text (whitespace ignored), as in shared/golden/*.hex.
        #[arg(long)]
        hex: bool,
        /// Read from this file instead of stdin.
        #[arg(long)]
        file: Option<PathBuf>,
    },
    /// Read one message as JSON on stdin and write its msgpack bytes to stdout.
    Encode {
        /// Write hex text instead of raw bytes.
        #[arg(long)]
        hex: bool,
        #[arg(long)]
        file: Option<PathBuf>,
    },
}

fn parse_range(s: &str) -> Result<RangeInclusive<u32>, String> {
    let (lo, hi) = s
        .split_once("..")
        .ok_or_else(|| format!("expected MIN..MAX, got {s:?}"))?;
    let lo: u32 = lo.trim().parse().map_err(|e| format!("MIN {lo:?}: {e}"))?;
    let hi: u32 = hi
        .trim_start_matches('=')
        .trim()
        .parse()
        .map_err(|e| format!("MAX {hi:?}: {e}"))?;
    if lo == 0 || lo > hi {
        return Err(format!("need 1 <= MIN <= MAX, got {lo}..{hi}"));
    }
    Ok(lo..=hi)
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if (0.0..=1.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("a fraction is between 0 and 1, got {f}"))
    }
}

impl CurveServerArgs {
    /// The CURVE settings the flags give, the files read and checked now; `None` when off.
    pub fn load(&self) -> anyhow::Result<Option<kvx_transport::zmq::CurveConfig>> {
        use kvx_transport::zmq::{AllowList, CurveConfig, CurveKeyPair};
        let (Some(secret), Some(allow)) = (&self.curve_secret_key, &self.curve_allow) else {
            return Ok(None);
        };
        let keys = CurveKeyPair::load(secret)?;
        let allowed = AllowList::load_dir(allow)?;
        tracing::info!(
            public_key = %kvx_transport::zmq::fingerprint(&keys.public()),
            allowed_clients = allowed.len(),
            "CURVE on: only allowed clients connect"
        );
        Ok(Some(CurveConfig {
            keys,
            allowed_clients: Some(allowed),
            server_key: None,
        }))
    }
}

impl CurveClientArgs {
    /// The CURVE settings the flags give, the files read and checked now; `None` when off.
    pub fn load(&self) -> anyhow::Result<Option<kvx_transport::zmq::CurveConfig>> {
        use kvx_transport::zmq::{load_public_key, CurveConfig, CurveKeyPair};
        let (Some(secret), Some(server)) = (&self.curve_secret_key, &self.curve_server_key) else {
            return Ok(None);
        };
        let keys = CurveKeyPair::load(secret)?;
        let server_key = load_public_key(server)?;
        tracing::info!(
            public_key = %kvx_transport::zmq::fingerprint(&keys.public()),
            server_key = %kvx_transport::zmq::fingerprint(&server_key),
            "CURVE on"
        );
        Ok(Some(CurveConfig {
            keys,
            allowed_clients: None,
            server_key: Some(server_key),
        }))
    }
}
