//! Every protocol setting of each role, as a flag and a TOML key of the same name: the fields
//! of `kvx_proto`'s `ReceiverConfig`, `SenderConfig` and `ProxyConfig` that the other flags
//! do not already set (buffer and staging sizes, checksums). Durations are in seconds (`_s`),
//! byte bounds in bytes; each default is the core's own, read from its `Default` (a flag whose
//! default depends on another source, e.g. an LMCache file, names the core's in its help), so
//! `--help`, the TOML file and `docs/operations.md` cannot drift from it. `apply` builds the
//! config naming every field (no `..Default`), so a field added to the core without a flag
//! here is a compile error, and the core's `validate` then refuses what breaks a rule, naming
//! the field (docs/operations.md, "Settings"). Rules between processes (a sender's write
//! timeout against its receivers' quarantine, the proxy's wait against the receivers' TTL)
//! depend on the other process's settings, which this one does not know: `--help` states each.

use std::time::Duration;

use clap::{Args, ValueEnum};
use kvx_proto::config::Pipelining;
use kvx_proto::{Checked, LegacySenders, ProxyConfig, ReceiverConfig, SenderConfig};

/// Seconds as a duration, positive and finite.
fn seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1e9 => Ok(v),
        Ok(v) => Err(format!(
            "a positive number of seconds (at most 1e9), not {v}"
        )),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

/// A count or bound of at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn duration(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

const RECEIVER: &str = "Receiver protocol settings (TOML: the same names under [receiver])";
const SENDER: &str = "Protocol settings (TOML: the same names under [sender])";
const PROXY: &str = "Protocol settings (TOML: the same names under [proxy])";

/// The help of a flag whose default is an LMCache file's `pd_allocation_timeout_sec` when one
/// is given, else the core's `default`.
fn after_lmcache(what: &str, default: Duration) -> String {
    format!(
        "{what} [default: an LMCache file's pd_allocation_timeout_sec, else {}]",
        secs(default)
    )
}

/// `ReceiverConfig`'s admission policy, bounds and timeouts (`kvx receiver` and `kvx demo`).
#[derive(Debug, Clone, Args)]
pub struct ReceiverKnobs {
    #[arg(long, value_parser = seconds, help_heading = RECEIVER, help = after_lmcache(
        "Longest time a request's first batch waits in the admission queue before it is \
         refused, in seconds",
        ReceiverConfig::default().admission_timeout,
    ))]
    pub admission_timeout_s: Option<f64>,
    /// The share of each rank's buffer one sender may hold while another sender's request
    /// waits within its own, in percent (1-100): its reservations plus its rolled-back slots
    /// in quarantine. A sender past its share is passed over in favour of such a request; a
    /// sender alone uses the whole buffer, and no request that fits is refused for its size.
    #[arg(long, default_value_t = ReceiverConfig::default().peer_share_percent, value_parser = clap::value_parser!(u32).range(1..=100), help_heading = RECEIVER)]
    pub peer_share_percent: u32,
    /// Senders without kvx's `seq` (LMCache's own sender): refuse them (nothing tells this
    /// receiver when their bytes are in), or allocate for them and never hand them to the
    /// decoder until an application marks them ready (`after-proxy`).
    #[arg(long, value_enum, default_value_t = LegacyMode::from(ReceiverConfig::default().legacy_senders), help_heading = RECEIVER)]
    pub legacy_senders: LegacyMode,
    /// Requests that may wait for admission at once; more are refused.
    #[arg(long, default_value_t = ReceiverConfig::default().admission_queue_max, value_parser = at_least_one, help_heading = RECEIVER)]
    pub admission_queue_max: usize,
    /// Requests of one sender waiting for admission at most.
    #[arg(long, default_value_t = ReceiverConfig::default().peer_queue_max, value_parser = at_least_one, help_heading = RECEIVER)]
    pub peer_queue_max: usize,
    /// Requests tracked at once (waiting, admitted or unconsumed); more are refused.
    #[arg(long, default_value_t = ReceiverConfig::default().requests_max, value_parser = at_least_one, help_heading = RECEIVER)]
    pub requests_max: usize,
    /// An admitted request with no batch and no landed chunk for this long is rolled back,
    /// in seconds. Must exceed every sender's --write-timeout-s.
    #[arg(long, default_value_t = secs(ReceiverConfig::default().request_idle_timeout), value_parser = seconds, help_heading = RECEIVER)]
    pub request_idle_timeout_s: f64,
    /// An admitted request that lands no chunk for this long while another sender waits
    /// for the buffer loses its reservation (its sender is told why: stall_timeout), in
    /// seconds; alone, it keeps it. Keep it above the longest gap between two chunks of a
    /// healthy request.
    #[arg(long, default_value_t = secs(ReceiverConfig::default().stall_timeout), value_parser = seconds, help_heading = RECEIVER)]
    pub stall_timeout_s: f64,
    /// A complete request the decoder has not consumed for this long is released, in
    /// seconds. Must exceed the proxy's --kv-ready-timeout-s.
    #[arg(long, default_value_t = secs(ReceiverConfig::default().unconsumed_ttl), value_parser = seconds, help_heading = RECEIVER)]
    pub unconsumed_ttl_s: f64,
    /// How long a slot of a rolled-back request stays out of use while a late write may
    /// still land, in seconds. Must exceed every sender's --write-timeout-s.
    #[arg(long, default_value_t = secs(ReceiverConfig::default().write_quarantine), value_parser = seconds, help_heading = RECEIVER)]
    pub write_quarantine_s: f64,
    /// How long the id of an ended request is remembered, so that its late batches are
    /// refused rather than admitted afresh, in seconds.
    #[arg(long, default_value_t = secs(ReceiverConfig::default().tombstone_ttl), value_parser = seconds, help_heading = RECEIVER)]
    pub tombstone_ttl_s: f64,
    /// Ended request ids remembered at most; the oldest is forgotten first.
    #[arg(long, default_value_t = ReceiverConfig::default().tombstones_max, value_parser = at_least_one, help_heading = RECEIVER)]
    pub tombstones_max: usize,
    /// Bytes the remembered ids of ended requests may hold together.
    #[arg(long, default_value_t = ReceiverConfig::default().tombstones_bytes_max, value_parser = at_least_one, help_heading = RECEIVER)]
    pub tombstones_bytes_max: usize,
    /// The longest request id accepted, in bytes.
    #[arg(long, default_value_t = ReceiverConfig::default().req_id_bytes_max, value_parser = at_least_one, help_heading = RECEIVER)]
    pub req_id_bytes_max: usize,
    /// The longest cache key accepted, in bytes; a longer one fails its request.
    #[arg(long, default_value_t = ReceiverConfig::default().key_bytes_max, value_parser = at_least_one, help_heading = RECEIVER)]
    pub key_bytes_max: usize,
    /// Bytes the first batches waiting for admission may hold together (their keys and
    /// descriptions).
    #[arg(long, default_value_t = ReceiverConfig::default().queued_bytes_max, value_parser = at_least_one, help_heading = RECEIVER)]
    pub queued_bytes_max: usize,
}

/// What the receiver's other flags decide.
pub struct ReceiverFlags {
    pub buffer_slots: u32,
    pub require_checksums: bool,
    /// From an LMCache file, below the flag.
    pub lmcache_allocation_timeout: Option<Duration>,
}

impl ReceiverKnobs {
    /// The receiver's configuration, checked.
    pub fn apply(&self, f: ReceiverFlags) -> anyhow::Result<Checked<ReceiverConfig>> {
        let defaults = ReceiverConfig::default();
        let cfg = ReceiverConfig {
            buffer_slots: f.buffer_slots,
            admission_timeout: self
                .admission_timeout_s
                .map(duration)
                .or(f.lmcache_allocation_timeout)
                .unwrap_or(defaults.admission_timeout),
            admission_queue_max: self.admission_queue_max,
            requests_max: self.requests_max,
            request_idle_timeout: duration(self.request_idle_timeout_s),
            stall_timeout: duration(self.stall_timeout_s),
            unconsumed_ttl: duration(self.unconsumed_ttl_s),
            write_quarantine: duration(self.write_quarantine_s),
            tombstone_ttl: duration(self.tombstone_ttl_s),
            tombstones_max: self.tombstones_max,
            require_checksums: f.require_checksums,
            legacy_senders: self.legacy_senders.into(),
            peer_share_percent: self.peer_share_percent,
            peer_queue_max: self.peer_queue_max,
            req_id_bytes_max: self.req_id_bytes_max,
            key_bytes_max: self.key_bytes_max,
            queued_bytes_max: self.queued_bytes_max,
            tombstones_bytes_max: self.tombstones_bytes_max,
            // The binary's receiver places requests itself; the application-lent kind is
            // the vLLM connector's.
            placement: kvx_proto::Placement::Pool,
        };
        Ok(cfg.validate()?)
    }
}

/// `--legacy-senders`: what a receiver does with senders that send no `seq`
/// (docs/spec/protocol.md §Legacy senders).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LegacyMode {
    Refuse,
    AfterProxy,
}

impl From<LegacyMode> for LegacySenders {
    fn from(m: LegacyMode) -> Self {
        match m {
            LegacyMode::Refuse => LegacySenders::Refuse,
            LegacyMode::AfterProxy => LegacySenders::AfterProxy,
        }
    }
}

impl From<LegacySenders> for LegacyMode {
    fn from(l: LegacySenders) -> Self {
        match l {
            LegacySenders::Refuse => LegacyMode::Refuse,
            LegacySenders::AfterProxy => LegacyMode::AfterProxy,
        }
    }
}

/// `--pipelining`: how a sender uses one receiver's control channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PipeliningMode {
    /// Pipeline when the receiver echoes `seq` (a kvx receiver); else one message at a time.
    Auto,
    /// One message in flight at a time, always (an LMCache receiver known in advance).
    Off,
}

impl From<Pipelining> for PipeliningMode {
    fn from(p: Pipelining) -> Self {
        match p {
            Pipelining::Auto => PipeliningMode::Auto,
            Pipelining::Off => PipeliningMode::Off,
        }
    }
}

/// `SenderConfig`'s bounds and timeouts.
#[derive(Debug, Clone, Args)]
pub struct SenderKnobs {
    /// Longest wait for the reply to an admission probe (it may wait in the receiver's
    /// queue), in seconds.
    #[arg(long, default_value_t = secs(SenderConfig::default().admission_reply_timeout), value_parser = seconds, help_heading = SENDER)]
    pub admission_reply_timeout_s: f64,
    /// Longest wait for the reply to a batch or a cancel, in seconds.
    #[arg(long, default_value_t = secs(SenderConfig::default().reply_timeout), value_parser = seconds, help_heading = SENDER)]
    pub reply_timeout_s: f64,
    /// Longest time a posted write may take, in seconds; then its request fails and the
    /// connection is reset so the fabric flushes it. Must be below the receivers'
    /// --write-quarantine-s and --request-idle-timeout-s.
    #[arg(long, default_value_t = secs(SenderConfig::default().write_timeout), value_parser = seconds, help_heading = SENDER)]
    pub write_timeout_s: f64,
    #[arg(long, value_parser = seconds, help_heading = SENDER, help = after_lmcache(
        "Longest wait for a staging slot, in seconds",
        SenderConfig::default().staging_timeout,
    ))]
    pub staging_timeout_s: Option<f64>,
    /// Messages in flight on one pipelined channel at most, per window.
    #[arg(long, default_value_t = SenderConfig::default().inflight_max, value_parser = at_least_one, help_heading = SENDER)]
    pub inflight_max: usize,
    /// Requests tracked at once; more are refused.
    #[arg(long, default_value_t = SenderConfig::default().requests_max, value_parser = at_least_one, help_heading = SENDER)]
    pub requests_max: usize,
    /// Outcomes of ended requests remembered; the oldest is forgotten first.
    #[arg(long, default_value_t = SenderConfig::default().outcomes_kept, value_parser = at_least_one, help_heading = SENDER)]
    pub outcomes_kept: usize,
    /// Messages queued on one channel at most; more are refused.
    #[arg(long, default_value_t = SenderConfig::default().channel_queue_max, value_parser = at_least_one, help_heading = SENDER)]
    pub channel_queue_max: usize,
    /// Whether several messages may be in flight on a channel, matched by `seq`.
    #[arg(long, value_enum, default_value_t = PipeliningMode::from(SenderConfig::default().pipelining), help_heading = SENDER)]
    pub pipelining: PipeliningMode,
    /// Tell the proxy when a request fails (kvx's FailNotif); set false for a proxy that
    /// knows only LMCache's messages.
    #[arg(long, default_value_t = SenderConfig::default().notify_proxy_on_failure, action = clap::ArgAction::Set, help_heading = SENDER)]
    pub notify_proxy_on_failure: bool,
}

/// What the sender's other flags decide.
pub struct SenderFlags {
    pub staging_slots: u32,
    pub checksums: bool,
    /// From an LMCache file, below the flag.
    pub lmcache_allocation_timeout: Option<Duration>,
}

impl SenderKnobs {
    /// The sender's configuration, checked.
    pub fn apply(&self, f: SenderFlags) -> anyhow::Result<Checked<SenderConfig>> {
        let defaults = SenderConfig::default();
        let cfg = SenderConfig {
            staging_slots: f.staging_slots,
            admission_reply_timeout: duration(self.admission_reply_timeout_s),
            reply_timeout: duration(self.reply_timeout_s),
            write_timeout: duration(self.write_timeout_s),
            staging_timeout: self
                .staging_timeout_s
                .map(duration)
                .or(f.lmcache_allocation_timeout)
                .unwrap_or(defaults.staging_timeout),
            inflight_max: self.inflight_max,
            requests_max: self.requests_max,
            outcomes_kept: self.outcomes_kept,
            channel_queue_max: self.channel_queue_max,
            pipelining: match self.pipelining {
                PipeliningMode::Auto => Pipelining::Auto,
                PipeliningMode::Off => Pipelining::Off,
            },
            notify_proxy_on_failure: self.notify_proxy_on_failure,
            // The binary's senders stage in kvx's pool; caller staging is for embedders that
            // lend their own memory (a vLLM prefill engine's KV).
            staging_placement: defaults.staging_placement,
            checksums: f.checksums,
        };
        Ok(cfg.validate()?)
    }
}

/// `ProxyConfig`'s bounds and timeouts.
#[derive(Debug, Clone, Args)]
pub struct ProxyKnobs {
    /// Longest wait for every TP rank's ProxyNotif of a request, in seconds (LMCache waits
    /// forever). Must be below the receivers' --unconsumed-ttl-s.
    #[arg(long, default_value_t = secs(ProxyConfig::default().kv_ready_timeout), value_parser = seconds, help_heading = PROXY)]
    pub kv_ready_timeout_s: f64,
    /// Requests awaited at once.
    #[arg(long, default_value_t = ProxyConfig::default().requests_max, value_parser = at_least_one, help_heading = PROXY)]
    pub requests_max: usize,
    /// Notices for requests not (yet) awaited that are kept; older ones are dropped.
    #[arg(long, default_value_t = ProxyConfig::default().early_notices_max, value_parser = at_least_one, help_heading = PROXY)]
    pub early_notices_max: usize,
    /// How long an early notice is kept, in seconds.
    #[arg(long, default_value_t = secs(ProxyConfig::default().early_notice_ttl), value_parser = seconds, help_heading = PROXY)]
    pub early_notice_ttl_s: f64,
    /// Bytes the kept early notices may hold together.
    #[arg(long, default_value_t = ProxyConfig::default().early_notices_bytes_max, value_parser = at_least_one, help_heading = PROXY)]
    pub early_notices_bytes_max: usize,
    /// The longest request id a notice may carry, in bytes.
    #[arg(long, default_value_t = ProxyConfig::default().req_id_bytes_max, value_parser = at_least_one, help_heading = PROXY)]
    pub req_id_bytes_max: usize,
    /// A failure's reason is cut to this many bytes.
    #[arg(long, default_value_t = ProxyConfig::default().reason_bytes_max, value_parser = at_least_one, help_heading = PROXY)]
    pub reason_bytes_max: usize,
    /// TP ranks of one request that one notice connection may speak for: a connection's further notices for the request are refused (counted in kvx_proxy_notices_refused_total, logged once), not counted as more ranks. Keep 1 where each TP rank's sender has its own connection (LMCache's senders, kvx sender); set it to the TP size for one process that pushes every rank's notices over one connection.
    #[arg(long, default_value_t = ProxyConfig::default().ranks_per_connection, value_parser = clap::value_parser!(u32).range(1..), help_heading = PROXY)]
    pub ranks_per_connection: u32,
}

impl ProxyKnobs {
    /// The proxy's configuration, awaiting each request from its first notice from
    /// `tp_ranks` senders, checked.
    pub fn apply(&self, tp_ranks: u32) -> anyhow::Result<Checked<ProxyConfig>> {
        let cfg = ProxyConfig {
            kv_ready_timeout: duration(self.kv_ready_timeout_s),
            requests_max: self.requests_max,
            early_notices_max: self.early_notices_max,
            early_notice_ttl: duration(self.early_notice_ttl_s),
            early_notices_bytes_max: self.early_notices_bytes_max,
            req_id_bytes_max: self.req_id_bytes_max,
            reason_bytes_max: self.reason_bytes_max,
            await_on_first_notice: Some(tp_ranks),
            ranks_per_connection: self.ranks_per_connection,
        };
        Ok(cfg.validate()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn parse(args: &[&str]) -> Command {
        Cli::try_parse_from(args).expect("valid flags").command
    }

    /// Each flag lands in its own field: distinct values everywhere, so a swapped or
    /// forgotten field shows.
    #[test]
    fn every_receiver_flag_sets_its_field() {
        let Command::Receiver(r) = parse(&[
            "kvx",
            "receiver",
            "--admission-timeout-s",
            "1.5",
            "--admission-queue-max",
            "2",
            "--peer-queue-max",
            "3",
            "--requests-max",
            "4",
            "--request-idle-timeout-s",
            "5",
            "--unconsumed-ttl-s",
            "6",
            "--write-quarantine-s",
            "7",
            "--tombstone-ttl-s",
            "8",
            "--tombstones-max",
            "9",
            "--tombstones-bytes-max",
            "10",
            "--req-id-bytes-max",
            "11",
            "--key-bytes-max",
            "12",
            "--queued-bytes-max",
            "13",
            "--peer-share-percent",
            "15",
            "--legacy-senders",
            "after-proxy",
        ]) else {
            panic!("a receiver")
        };
        let c = r
            .protocol
            .apply(ReceiverFlags {
                buffer_slots: 14,
                require_checksums: false,
                lmcache_allocation_timeout: Some(Duration::from_secs(99)),
            })
            .expect("valid");
        let s = Duration::from_secs;
        assert_eq!(
            c.admission_timeout,
            Duration::from_millis(1500),
            "the flag over LMCache's"
        );
        assert_eq!(
            (c.admission_queue_max, c.peer_queue_max, c.requests_max),
            (2, 3, 4)
        );
        assert_eq!(
            (
                c.request_idle_timeout,
                c.unconsumed_ttl,
                c.write_quarantine,
                c.tombstone_ttl
            ),
            (s(5), s(6), s(7), s(8))
        );
        assert_eq!(
            (
                c.tombstones_max,
                c.tombstones_bytes_max,
                c.req_id_bytes_max,
                c.key_bytes_max
            ),
            (9, 10, 11, 12)
        );
        assert_eq!(
            (c.queued_bytes_max, c.buffer_slots, c.peer_share_percent),
            (13, 14, 15)
        );
        assert!(!c.require_checksums);
        assert_eq!(c.legacy_senders, kvx_proto::LegacySenders::AfterProxy);
    }

    #[test]
    fn every_sender_and_proxy_flag_sets_its_field() {
        let Command::Sender(a) = parse(&[
            "kvx",
            "sender",
            "--admission-reply-timeout-s",
            "1",
            "--reply-timeout-s",
            "2",
            "--write-timeout-s",
            "3",
            "--staging-timeout-s",
            "4",
            "--inflight-max",
            "5",
            "--requests-max",
            "6",
            "--outcomes-kept",
            "7",
            "--channel-queue-max",
            "8",
            "--pipelining",
            "off",
            "--notify-proxy-on-failure",
            "false",
        ]) else {
            panic!("a sender")
        };
        let c = a
            .protocol
            .apply(SenderFlags {
                staging_slots: 9,
                checksums: false,
                lmcache_allocation_timeout: None,
            })
            .expect("valid");
        let s = Duration::from_secs;
        assert_eq!(
            (
                c.admission_reply_timeout,
                c.reply_timeout,
                c.write_timeout,
                c.staging_timeout
            ),
            (s(1), s(2), s(3), s(4))
        );
        assert_eq!(
            (
                c.inflight_max,
                c.requests_max,
                c.outcomes_kept,
                c.channel_queue_max
            ),
            (5, 6, 7, 8)
        );
        assert_eq!(c.pipelining, Pipelining::Off);
        assert!(!c.notify_proxy_on_failure && !c.checksums);
        assert_eq!(c.staging_slots, 9);
        let Command::Proxy(p) = parse(&[
            "kvx",
            "proxy",
            "--kv-ready-timeout-s",
            "1",
            "--requests-max",
            "2",
            "--early-notices-max",
            "3",
            "--early-notice-ttl-s",
            "4",
            "--early-notices-bytes-max",
            "5",
            "--req-id-bytes-max",
            "6",
            "--reason-bytes-max",
            "7",
            "--ranks-per-connection",
            "9",
        ]) else {
            panic!("a proxy")
        };
        let c = p.protocol.apply(8).expect("valid");
        assert_eq!((c.kv_ready_timeout, c.early_notice_ttl), (s(1), s(4)));
        assert_eq!(
            (
                c.requests_max,
                c.early_notices_max,
                c.early_notices_bytes_max
            ),
            (2, 3, 5)
        );
        assert_eq!((c.req_id_bytes_max, c.reason_bytes_max), (6, 7));
        assert_eq!(c.await_on_first_notice, Some(8));
        assert_eq!(c.ranks_per_connection, 9);
    }

    /// With no flag, no TOML key and no LMCache file, each role runs with exactly the core's
    /// `Default` (the flags of the role's sizes and checksums included), and `kvx demo`'s
    /// receiver too.
    #[test]
    fn defaults_are_the_cores() {
        let Command::Receiver(r) = parse(&["kvx", "receiver"]) else {
            panic!("a receiver")
        };
        let c = r
            .protocol
            .apply(ReceiverFlags {
                buffer_slots: r
                    .buffer_chunks
                    .unwrap_or(ReceiverConfig::default().buffer_slots),
                require_checksums: r.checksums.required(),
                lmcache_allocation_timeout: None,
            })
            .expect("valid");
        assert_eq!(*c, ReceiverConfig::default());
        let Command::Demo(d) = parse(&["kvx", "demo"]) else {
            panic!("a demo")
        };
        let c = d
            .receiver
            .apply(ReceiverFlags {
                buffer_slots: d.buffer_chunks,
                require_checksums: d.checksums.required(),
                lmcache_allocation_timeout: None,
            })
            .expect("valid");
        assert_eq!(*c, ReceiverConfig::default(), "kvx demo's receiver");
        assert_eq!(d.staging_chunks, SenderConfig::default().staging_slots);
        assert_eq!(d.chunk_bytes, kvx_embed::defaults::CHUNK_BYTES);

        let Command::Sender(a) = parse(&["kvx", "sender"]) else {
            panic!("a sender")
        };
        let c = a
            .protocol
            .apply(SenderFlags {
                staging_slots: a
                    .staging_chunks
                    .unwrap_or(SenderConfig::default().staging_slots),
                checksums: a.checksums.computed(),
                lmcache_allocation_timeout: None,
            })
            .expect("valid");
        assert_eq!(*c, SenderConfig::default());

        let Command::Proxy(p) = parse(&["kvx", "proxy"]) else {
            panic!("a proxy")
        };
        let c = p.protocol.apply(1).expect("valid");
        assert_eq!(
            *c,
            ProxyConfig {
                await_on_first_notice: Some(1),
                ..ProxyConfig::default()
            }
        );
    }

    /// A TOML file that sets nothing leaves every flag at the core's default: the file adds
    /// only the keys it has.
    #[test]
    fn an_empty_toml_table_keeps_the_cores_defaults() {
        let path =
            std::env::temp_dir().join(format!("kvx-knobs-empty-{}.toml", std::process::id()));
        std::fs::write(&path, "[receiver]\n[sender]\n[proxy]\n").expect("write");
        let argv = |role: &str| -> Vec<std::ffi::OsString> {
            vec![
                "kvx".into(),
                role.into(),
                "--config".into(),
                path.clone().into(),
            ]
        };
        let from_file = |role: &str| -> Command {
            let args = crate::config::command_line(argv(role)).expect("a valid file");
            Cli::try_parse_from(args).expect("valid").command
        };
        let (rx, tx) = (from_file("receiver"), from_file("sender"));
        let _ = std::fs::remove_file(&path);
        let (Command::Receiver(r), Command::Sender(s)) = (rx, tx) else {
            panic!("a receiver and a sender")
        };
        let c = r
            .protocol
            .apply(ReceiverFlags {
                buffer_slots: ReceiverConfig::default().buffer_slots,
                require_checksums: r.checksums.required(),
                lmcache_allocation_timeout: None,
            })
            .expect("valid");
        assert_eq!(*c, ReceiverConfig::default());
        let c = s
            .protocol
            .apply(SenderFlags {
                staging_slots: SenderConfig::default().staging_slots,
                checksums: s.checksums.computed(),
                lmcache_allocation_timeout: None,
            })
            .expect("valid");
        assert_eq!(*c, SenderConfig::default());
    }

    #[test]
    fn bad_values_are_refused_naming_the_flag() {
        for (flag, value) in [
            ("--unconsumed-ttl-s", "0"),
            ("--write-quarantine-s", "-3"),
            ("--tombstones-max", "0"),
            ("--request-idle-timeout-s", "inf"),
            ("--peer-share-percent", "0"),
            ("--peer-share-percent", "101"),
        ] {
            let err = Cli::try_parse_from(["kvx", "receiver", &format!("{flag}={value}")])
                .expect_err(flag)
                .to_string();
            assert!(err.contains(flag), "{flag} {value}: {err}");
        }
    }
}
