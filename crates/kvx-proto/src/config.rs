//! Configuration of each state machine. Every wait has a bound here with a sane default, and
//! every table or queue has a `*_max`; `validate` refuses settings that would break a rule of
//! the protocol (`docs/spec/protocol.md` §Timeouts) and is the only way to a `Checked`
//! configuration, which the state machines, the drivers and the bindings take without
//! checking it again: each setting is checked once, here, wherever it came from.

use std::time::Duration;

use crate::ids::WriteTag;

/// A setting that cannot work, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub String);

/// A configuration `validate` accepted. Only `validate` makes one, so whoever holds one (a
/// state machine's `from_checked`, a driver's `start`, a binding that checked its caller's
/// settings at its door) knows it is valid and never checks it again. Read it through
/// `Deref`; `into_inner` gives the plain configuration back (to change it, and check it
/// again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked<C>(C);

impl<C> Checked<C> {
    /// The plain configuration.
    pub fn into_inner(self) -> C {
        self.0
    }
}

impl<C> std::ops::Deref for Checked<C> {
    type Target = C;
    fn deref(&self) -> &C {
        &self.0
    }
}

/// A configuration, checked or not: what the drivers' `start` takes. One already `Checked`
/// (a binding's) goes through as it is; a plain one (a test's, the simulation's) is checked
/// there, once.
pub trait IntoChecked<C> {
    /// The checked configuration, or why it cannot work.
    fn into_checked(self) -> Result<Checked<C>, ConfigError>;
}

impl<C> IntoChecked<C> for Checked<C> {
    fn into_checked(self) -> Result<Checked<C>, ConfigError> {
        Ok(self)
    }
}

/// `validate` as each configuration's `IntoChecked`.
macro_rules! checked_by_validate {
    ($($config:ty),*) => {$(
        impl IntoChecked<$config> for $config {
            fn into_checked(self) -> Result<Checked<$config>, ConfigError> {
                self.validate()
            }
        }
    )*};
}
checked_by_validate!(ReceiverConfig, SenderConfig, ProxyConfig);

fn require(ok: bool, why: impl FnOnce() -> String) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(ConfigError(why()))
    }
}

/// What a receiver does with a sender that sends no `seq` (LMCache's own sender): its
/// writes travel on a channel kvx cannot see, so nothing tells the receiver when its bytes
/// are in (`docs/spec/protocol.md` §Legacy senders).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LegacySenders {
    /// Refuse its first batch, with the reason: a request kvx cannot see written must never
    /// be handed to a decoder.
    #[default]
    Refuse,
    /// Admit and allocate as usual, but never make the request ready by itself: it becomes
    /// ready only when the application says the proxy reported it complete
    /// (`ReceiverLedger::handle_external_ready`); until then its slots stay its own.
    AfterProxy,
}

/// Who chooses a request's slots (`docs/spec/protocol.md` §Caller placement).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// kvx owns the buffer: admission reserves a count of slots for each first batch (fair
    /// shares, a queue) and each batch is granted free slots.
    #[default]
    Pool,
    /// The application owns the buffer and lends kvx the slots of one request at a time
    /// (`ReceiverLedger::handle_reserve`): a vLLM decode engine, whose scheduler allocates a
    /// request's blocks. There is no admission queue; a first batch is admitted when its id
    /// is reserved (it waits up to `admission_timeout` for that), and chunk i is granted the
    /// reservation's slot i. Slots come back to the application (`ReceiverEvent::Returned`)
    /// only once no write can land in them.
    Caller,
}

/// The decode side: one receive buffer, its admission queue and request table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiverConfig {
    /// Slots (chunks) in the receive buffer.
    pub buffer_slots: u32,
    /// Longest time a first batch waits in the admission queue before it is refused.
    pub admission_timeout: Duration,
    /// Requests that may wait for admission at once; more are refused.
    pub admission_queue_max: usize,
    /// Requests tracked at once (waiting, admitted or unconsumed); more are refused.
    pub requests_max: usize,
    /// An admitted request with no batch and no landed chunk for this long is rolled back.
    pub request_idle_timeout: Duration,
    /// An admitted request of a kvx sender that lands no chunk for this long while another
    /// sender (principal) waits for admission loses its reservation (`Failure::Stalled`);
    /// alone, it keeps it until `request_idle_timeout` (which, when shorter, ends a stalled
    /// request first anyway). Keep it above the longest gap between two chunks of a healthy request (a chunked
    /// prefill's step, a write's time on the fabric).
    pub stall_timeout: Duration,
    /// A complete request the decoder has not consumed for this long is released.
    pub unconsumed_ttl: Duration,
    /// How long a slot of a rolled-back request stays out of use when a write into it may
    /// still land. Must exceed every sender's `write_timeout`.
    pub write_quarantine: Duration,
    /// How long the id of an ended request is remembered, so its late batches are refused
    /// instead of admitted afresh.
    pub tombstone_ttl: Duration,
    /// Ended request ids remembered at most; the oldest is forgotten first.
    pub tombstones_max: usize,
    /// A kvx sender's chunk must carry a checksum, checked against the landed bytes before its
    /// request is ready; one without fails its request. Every fabric carries them (RDMA in
    /// the side channel's write frame); turn off with the senders' where the CPU must not read
    /// the chunks (GPU memory registered with an RDMA NIC), or to trust the fabric's own CRC.
    pub require_checksums: bool,
    /// Senders without `seq` (LMCache's).
    pub legacy_senders: LegacySenders,
    /// The share of the buffer one sender may hold (its reservations plus its rolled-back
    /// slots in quarantine) while another sender's request waits within its own share, in
    /// percent, rounded up: 1..=100 (`docs/spec/protocol.md` §Fair shares). It decides who
    /// goes first under contention, never what is served: a sender alone uses the whole
    /// buffer, and a request larger than the share goes in when its sender holds nothing.
    pub peer_share_percent: u32,
    /// Requests of one sender waiting for admission at most.
    pub peer_queue_max: usize,
    /// The longest `req_id` accepted, in bytes; a longer one is refused and not remembered.
    pub req_id_bytes_max: usize,
    /// The longest cache key accepted, in bytes; a longer one fails its request.
    pub key_bytes_max: usize,
    /// Bytes all first batches waiting for admission may hold together (their keys and
    /// descriptions); a first batch that would go past it is refused.
    pub queued_bytes_max: usize,
    /// Bytes the remembered ids of ended requests may hold; the oldest are forgotten first.
    pub tombstones_bytes_max: usize,
    /// Who chooses a request's slots: kvx's admission (`Pool`), or the application
    /// (`Caller`).
    pub placement: Placement,
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        Self {
            buffer_slots: 64,
            admission_timeout: Duration::from_secs(30),
            admission_queue_max: 4096,
            requests_max: 8192,
            request_idle_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(5),
            unconsumed_ttl: Duration::from_secs(300),
            write_quarantine: Duration::from_secs(60),
            tombstone_ttl: Duration::from_secs(600),
            tombstones_max: 65_536,
            require_checksums: true,
            legacy_senders: LegacySenders::Refuse,
            peer_share_percent: 75,
            peer_queue_max: 256,
            req_id_bytes_max: 512,
            key_bytes_max: 1024,
            queued_bytes_max: 16 << 20,
            tombstones_bytes_max: 16 << 20,
            placement: Placement::Pool,
        }
    }
}

impl ReceiverConfig {
    /// Slots one sender may hold while others contend: `peer_share_percent` of the buffer,
    /// rounded up.
    pub fn peer_slots_max(&self) -> u32 {
        let share = u64::from(self.buffer_slots) * u64::from(self.peer_share_percent.min(100));
        (share.div_ceil(100) as u32).max(1)
    }

    /// What admission enforces.
    pub fn admission_limits(&self) -> crate::admission::Limits {
        crate::admission::Limits {
            capacity: self.buffer_slots,
            queue_max: self.admission_queue_max,
            peer_cap: self.peer_slots_max(),
            peer_queue_max: self.peer_queue_max,
        }
    }

    /// Refuses settings the ledger cannot run with: no slot or more than a write tag can
    /// name, a zero admission queue, request table, per-sender queue, id or key length, a zero
    /// admission or idle timeout, a zero unconsumed TTL (a request would be released as it
    /// becomes ready), a zero write quarantine (a late write could land in a reused slot), a
    /// zero tombstone TTL or count or byte bound (a late batch of an ended request would be
    /// admitted afresh), a zero queued-bytes bound, a share outside 1..=100.
    /// The only way to a `Checked` one.
    pub fn validate(self) -> Result<Checked<Self>, ConfigError> {
        self.problems()?;
        Ok(Checked(self))
    }

    fn problems(&self) -> Result<(), ConfigError> {
        require(self.buffer_slots > 0, || {
            "buffer_slots must be at least 1".into()
        })?;
        require(self.buffer_slots <= WriteTag::SLOTS_MAX, || {
            format!(
                "buffer_slots {} exceeds {} (the write tag's slot field)",
                self.buffer_slots,
                WriteTag::SLOTS_MAX
            )
        })?;
        require(self.admission_queue_max > 0, || {
            "admission_queue_max must be at least 1".into()
        })?;
        require(self.requests_max > 0, || {
            "requests_max must be at least 1".into()
        })?;
        require(!self.request_idle_timeout.is_zero(), || {
            "request_idle_timeout must be positive".into()
        })?;
        require(!self.stall_timeout.is_zero(), || {
            "stall_timeout must be positive".into()
        })?;
        require(!self.admission_timeout.is_zero(), || {
            "admission_timeout must be positive".into()
        })?;
        for (name, d) in [
            ("unconsumed_ttl", self.unconsumed_ttl),
            ("write_quarantine", self.write_quarantine),
            ("tombstone_ttl", self.tombstone_ttl),
        ] {
            require(!d.is_zero(), || format!("{name} must be positive"))?;
        }
        for (name, n) in [
            ("tombstones_max", self.tombstones_max),
            ("queued_bytes_max", self.queued_bytes_max),
            ("tombstones_bytes_max", self.tombstones_bytes_max),
        ] {
            require(n > 0, || format!("{name} must be at least 1"))?;
        }
        require((1..=100).contains(&self.peer_share_percent), || {
            format!(
                "peer_share_percent must be 1..=100 (percent of the buffer one sender may hold), got {}",
                self.peer_share_percent
            )
        })?;
        require(self.peer_queue_max > 0, || {
            "peer_queue_max must be at least 1".into()
        })?;
        require(self.req_id_bytes_max > 0 && self.key_bytes_max > 0, || {
            "req_id_bytes_max and key_bytes_max must be at least 1".into()
        })?;
        Ok(())
    }
}

impl ReceiverConfig {
    /// Checks the timeouts that must agree across a sender and this receiver: a live
    /// sender's write either lands or fails at the sender before the receiver's lease on the
    /// request expires, and a slot stays quarantined longer than any write can take.
    pub fn check_sender(&self, sender: &SenderConfig) -> Result<(), ConfigError> {
        require(sender.write_timeout < self.request_idle_timeout, || {
            format!(
                "sender write_timeout {:?} must be below the receiver's request_idle_timeout {:?}, \
                 or a slow write can land after its request was rolled back",
                sender.write_timeout, self.request_idle_timeout
            )
        })?;
        // A grant is acted on at most reply_timeout after its request was sent (later replies
        // are dropped), and its write lands or is flushed within write_timeout after that;
        // the receiver's lease and quarantine together must outlast both.
        require(
            sender.reply_timeout + sender.write_timeout
                < self.request_idle_timeout + self.write_quarantine,
            || {
                format!(
                    "sender reply_timeout {:?} + write_timeout {:?} must be below the receiver's \
                 request_idle_timeout {:?} + write_quarantine {:?}",
                    sender.reply_timeout,
                    sender.write_timeout,
                    self.request_idle_timeout,
                    self.write_quarantine
                )
            },
        )?;
        require(sender.write_timeout < self.write_quarantine, || {
            format!(
                "sender write_timeout {:?} must be below the receiver's write_quarantine {:?}",
                sender.write_timeout, self.write_quarantine
            )
        })
    }
}

impl ReceiverConfig {
    /// Checks the proxy's wait against this receiver's TTL: a rank that finished first keeps
    /// its KV at least as long as the proxy may still wait for the other ranks; otherwise the
    /// proxy could report ready a request whose first rank's KV was already reclaimed (found
    /// by the simulation).
    pub fn check_proxy(&self, proxy: &ProxyConfig) -> Result<(), ConfigError> {
        require(self.unconsumed_ttl > proxy.kv_ready_timeout, || {
            format!(
                "receiver unconsumed_ttl {:?} must exceed the proxy's kv_ready_timeout {:?}",
                self.unconsumed_ttl, proxy.kv_ready_timeout
            )
        })
    }
}

/// How the sender uses one receiver's control channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pipelining {
    /// Send one message first; pipeline if the reply echoes `seq` (a kvx receiver), else
    /// keep one message in flight as LMCache does.
    #[default]
    Auto,
    /// Always one message in flight (an LMCache receiver known in advance).
    Off,
}

/// The prefill side: one staging pool and a control channel per receiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SenderConfig {
    /// Slots (chunks) in the staging pool. The default 4 covers what is in flight on one link
    /// (its bandwidth-delay product: 4 chunks of 1 MiB cover 25 GB/s × 160 µs); more staging
    /// adds queueing and cache misses, not throughput (`docs/PERFORMANCE.md`).
    pub staging_slots: u32,
    /// Longest wait for the reply to an admission probe (it may wait in the receiver's queue).
    pub admission_reply_timeout: Duration,
    /// Longest wait for the reply to a batch or a cancel.
    pub reply_timeout: Duration,
    /// Longest time a posted write may take; then the request fails and the driver resets
    /// the connection so the fabric flushes it.
    pub write_timeout: Duration,
    /// Longest time a prefill thread waits in a blocking staging allocate (used by drivers).
    pub staging_timeout: Duration,
    /// Messages in flight on one pipelined channel at most, per window: up to this many
    /// probes and, separately, this many batches and cancels; more wait in order.
    pub inflight_max: usize,
    /// Requests tracked at once; more are refused.
    pub requests_max: usize,
    /// Outcomes of ended requests remembered (`SenderFlow::outcome`); the oldest is
    /// forgotten first.
    pub outcomes_kept: usize,
    /// Messages queued on one channel at most; more are refused.
    pub channel_queue_max: usize,
    /// Whether replies may be matched by `seq` with several messages in flight.
    pub pipelining: Pipelining,
    /// Send `FailNotif` to the proxy when a request fails, so it reports the failure at once
    /// instead of at its `kv_ready_timeout`. Turn off for a proxy that knows only LMCache's
    /// messages (LMCache's example proxy decodes every frame as a `ProxyNotif`).
    pub notify_proxy_on_failure: bool,
    /// Whose staging memory the chunks are read from (`docs/spec/protocol.md` §Caller
    /// staging). `Pool`: kvx's staging pool of `staging_slots`, which the caller allocates
    /// from. `Caller`: the application's own memory of `staging_slots` slots (a vLLM prefill
    /// engine's paged KV), where the bytes already are: a batch names the slots its chunks
    /// are read from, nothing is allocated, and a request's reads of them end when it is
    /// delivered or, failed, when its last write has completed (`SenderEvent::Drained`).
    pub staging_placement: Placement,
    /// Compute each chunk's checksum (`kvx_io::chunk_checksum`) when it is staged and send it with
    /// the write, so the receiver checks the bytes that landed (drivers; `docs/spec/fabrics.md`
    /// §5b; over RDMA in the side channel's write frame). Off where the CPU must not read the
    /// chunks (GPU memory registered with an RDMA NIC), or to trust the fabric's own CRC alone.
    pub checksums: bool,
}

impl Default for SenderConfig {
    fn default() -> Self {
        Self {
            staging_slots: 4,
            admission_reply_timeout: Duration::from_secs(45),
            reply_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(10),
            staging_timeout: Duration::from_secs(30),
            inflight_max: 64,
            requests_max: 8192,
            outcomes_kept: 65_536,
            channel_queue_max: 65_536,
            pipelining: Pipelining::Auto,
            notify_proxy_on_failure: true,
            staging_placement: Placement::Pool,
            checksums: true,
        }
    }
}

impl SenderConfig {
    /// Whether memory its owner may reuse while a write still reads it (a vLLM prefill
    /// engine's KV blocks, given to another request when the engine preempts one) may be
    /// staged in place (`Placement::Caller`): only with checksums, which let the receiver
    /// tell a chunk that changed under its write (the request then fails; wrong bytes never
    /// reach a decoder). Without them such memory is copied into kvx's pool as it is ready.
    /// The one place this data-path rule is decided (the vLLM connector asks it through
    /// `kvx.may_stage_in_place`).
    pub fn may_stage_reused_memory_in_place(&self) -> bool {
        self.checksums
    }

    /// Refuses settings the flow cannot run with: no staging slot, a zero `inflight_max`,
    /// `requests_max` or `outcomes_kept`, a zero reply or write timeout. The only way to a
    /// `Checked` one.
    pub fn validate(self) -> Result<Checked<Self>, ConfigError> {
        self.problems()?;
        Ok(Checked(self))
    }

    fn problems(&self) -> Result<(), ConfigError> {
        require(self.staging_slots > 0, || {
            "staging_slots must be at least 1".into()
        })?;
        require(self.inflight_max > 0, || {
            "inflight_max must be at least 1".into()
        })?;
        require(self.requests_max > 0, || {
            "requests_max must be at least 1".into()
        })?;
        require(self.outcomes_kept > 0, || {
            "outcomes_kept must be at least 1".into()
        })?;
        require(!self.reply_timeout.is_zero(), || {
            "reply_timeout must be positive".into()
        })?;
        require(!self.write_timeout.is_zero(), || {
            "write_timeout must be positive".into()
        })?;
        Ok(())
    }
}

/// The proxy's aggregation of completion notices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyConfig {
    /// Longest wait for every TP rank's `ProxyNotif` of a request (LMCache waits forever).
    pub kv_ready_timeout: Duration,
    /// Requests awaited at once.
    pub requests_max: usize,
    /// Notices for requests not (yet) awaited that are kept; older ones are dropped.
    pub early_notices_max: usize,
    /// How long an early notice is kept.
    pub early_notice_ttl: Duration,
    /// Bytes the kept early notices may hold together (ids and failure reasons).
    pub early_notices_bytes_max: usize,
    /// The longest request id a notice may carry; longer ones are dropped and counted.
    pub req_id_bytes_max: usize,
    /// A failure's reason is cut to this many bytes.
    pub reason_bytes_max: usize,
    /// `Some(tp_ranks)`: a proxy nobody tells of requests (`kvx proxy` on its own) awaits
    /// each id from its first notice, from `tp_ranks` senders. `None` (the default): only
    /// ids given to `handle_expect` are awaited.
    pub await_on_first_notice: Option<u32>,
    /// Ranks of one request one notice connection may speak for (`docs/spec/protocol.md`
    /// §Proxy): a connection's notices past it for a request are refused, not counted as
    /// further ranks. Default 1, one sender process per TP rank, each with its own connection
    /// (LMCache's, `kvx sender`'s); raise it only for a sender that pushes several ranks'
    /// notices over one connection.
    pub ranks_per_connection: u32,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            kv_ready_timeout: Duration::from_secs(120),
            requests_max: 65_536,
            early_notices_max: 65_536,
            early_notice_ttl: Duration::from_secs(60),
            early_notices_bytes_max: 16 << 20,
            req_id_bytes_max: 512,
            reason_bytes_max: 1024,
            await_on_first_notice: None,
            ranks_per_connection: 1,
        }
    }
}

impl ProxyConfig {
    /// Refuses a zero `requests_max`, a zero `kv_ready_timeout`, `await_on_first_notice` of 0
    /// ranks or a zero `ranks_per_connection`. The only way to a `Checked`
    /// one.
    pub fn validate(self) -> Result<Checked<Self>, ConfigError> {
        self.problems()?;
        Ok(Checked(self))
    }

    fn problems(&self) -> Result<(), ConfigError> {
        require(self.requests_max > 0, || {
            "requests_max must be at least 1".into()
        })?;
        require(self.await_on_first_notice != Some(0), || {
            "await_on_first_notice must be at least 1 TP rank".into()
        })?;
        require(self.ranks_per_connection > 0, || {
            "ranks_per_connection must be at least 1".into()
        })?;
        require(!self.kv_ready_timeout.is_zero(), || {
            "kv_ready_timeout must be positive".into()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_make_a_valid_deployment() {
        let r = ReceiverConfig::default();
        r.check_sender(&SenderConfig::default())
            .expect("defaults agree");
        r.check_proxy(&ProxyConfig::default())
            .expect("defaults agree");
    }

    #[test]
    fn zero_durations_and_bounds_are_refused_naming_the_field() {
        type Zero = fn(&mut ReceiverConfig);
        let cases: [(&str, Zero); 6] = [
            ("unconsumed_ttl", |c| c.unconsumed_ttl = Duration::ZERO),
            ("write_quarantine", |c| c.write_quarantine = Duration::ZERO),
            ("tombstone_ttl", |c| c.tombstone_ttl = Duration::ZERO),
            ("tombstones_max", |c| c.tombstones_max = 0),
            ("queued_bytes_max", |c| c.queued_bytes_max = 0),
            ("tombstones_bytes_max", |c| c.tombstones_bytes_max = 0),
        ];
        for (name, zero) in cases {
            let mut c = ReceiverConfig::default();
            zero(&mut c);
            let err = c.validate().expect_err(name);
            assert!(err.to_string().contains(name), "{name}: {err}");
        }
        ReceiverConfig::default()
            .validate()
            .expect("the defaults are valid");
    }

    #[test]
    fn reused_memory_is_staged_in_place_only_with_checksums() {
        let with = SenderConfig::default();
        assert!(with.checksums && with.may_stage_reused_memory_in_place());
        let without = SenderConfig {
            checksums: false,
            ..SenderConfig::default()
        };
        assert!(!without.may_stage_reused_memory_in_place());
    }

    #[test]
    fn only_validate_makes_a_checked_configuration_and_it_is_not_checked_again() {
        let bad = SenderConfig {
            staging_slots: 0,
            ..SenderConfig::default()
        };
        assert!(
            bad.clone().into_checked().is_err(),
            "a plain one is checked"
        );
        let good = SenderConfig::default()
            .validate()
            .expect("the defaults are valid");
        let same = good
            .clone()
            .into_checked()
            .expect("a checked one goes through");
        assert_eq!(same, good);
        assert_eq!(same.into_inner(), SenderConfig::default());
    }

    #[test]
    fn disagreeing_timeouts_are_refused_with_a_reason() {
        let r = ReceiverConfig {
            request_idle_timeout: Duration::from_secs(5),
            ..ReceiverConfig::default()
        };
        let err = r
            .check_sender(&SenderConfig::default())
            .expect_err("write_timeout 10 s ≥ lease 5 s");
        assert!(err.to_string().contains("request_idle_timeout"), "{err}");
        let r = ReceiverConfig {
            unconsumed_ttl: Duration::from_secs(60),
            ..ReceiverConfig::default()
        };
        assert!(r.check_proxy(&ProxyConfig::default()).is_err());
    }
}
