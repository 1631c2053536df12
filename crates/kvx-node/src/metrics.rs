//! Metric names. The drivers record through the `metrics` facade; whoever runs them installs
//! an exporter (the `kvx` binary serves Prometheus text). Without one, recording is a no-op.
//!
//! Each driver registers every series of its role when it starts (`register_receiver`,
//! `register_sender`, `register_proxy`), each label value included, so that the first scrape
//! lists them all at zero, as Prometheus exporters conventionally do: a series that appears
//! only with its first event leaves `rate()` and alerts blind until then, and a dashboard
//! cannot tell "none yet" from "not exported".

/// Gauge, per `receiver` (its alloc endpoint): first batches waiting for admission.
pub const ADMISSION_QUEUE_LEN: &str = "kvx_receiver_admission_queue_len";
/// Gauge, per `receiver`: slots reserved by admitted requests but not yet allocated to a
/// chunk.
pub const SLOTS_RESERVED: &str = "kvx_receiver_slots_reserved";
/// Gauge, per `receiver`: slots granted to live requests (written or not).
pub const SLOTS_HELD: &str = "kvx_receiver_slots_held";
/// Gauge, per `receiver`: slots no grant holds.
pub const SLOTS_FREE: &str = "kvx_receiver_slots_free";
/// Gauge, per `receiver`: slots of rolled-back requests a late write may still hit.
pub const SLOTS_QUARANTINED: &str = "kvx_receiver_slots_quarantined";
/// Counter, per `receiver`: requests admitted.
pub const ADMITTED: &str = "kvx_receiver_admitted_total";
/// Counter, per `receiver`: messages refused on arrival (`ReceiverStats::refused`).
pub const REFUSED: &str = "kvx_receiver_refused_total";
/// Counter, per `receiver`: requests that ended failed, first batches refused on arrival
/// included.
pub const ROLLED_BACK: &str = "kvx_receiver_rolled_back_total";
/// Counter, per `receiver`: requests the decoder consumed.
pub const CONSUMED: &str = "kvx_receiver_consumed_total";
/// Fabric writes refused before landing (not the grant holder's, a second write of a grant,
/// no immediate), counted by the fabric's access rules.
pub const FABRIC_WRITES_REFUSED: &str = "kvx_receiver_fabric_writes_refused_total";
/// Landing notices the ledger refused (not the grant holder's, or not the slot named).
pub const LANDINGS_REFUSED: &str = "kvx_receiver_landings_refused_total";
/// Chunks that landed empty or failed their checksum; each failed its request.
pub const CORRUPT_CHUNKS: &str = "kvx_receiver_corrupt_chunks_total";
/// Histogram, per `receiver`: each admitted request's wait in the admission queue, in
/// seconds.
pub const ADMISSION_WAIT_SECONDS: &str = "kvx_receiver_admission_wait_seconds";
/// Counter: messages no driver could decode (the receiver's per `receiver`; the senders'
/// and the proxy's without a label).
pub const DECODE_ERRORS: &str = "kvx_decode_errors_total";
/// Counter: requests a sender delivered (`ProxyNotif` sent).
pub const SENDER_DELIVERED: &str = "kvx_sender_delivered_total";
/// Counter, per `reason` (`SendFailure::kind`: cancelled, refused, reply_timeout,
/// channel_lost, write_failed, write_timeout, …): requests that failed at a sender.
pub const SENDER_FAILED: &str = "kvx_sender_failed_total";
/// Gauge: staging slots free.
pub const SENDER_STAGING_FREE: &str = "kvx_sender_staging_free";
/// Gauge: staging slots held by requests (allocated, written or in flight).
pub const SENDER_STAGING_HELD: &str = "kvx_sender_staging_held";
/// Gauge, per `state` (awaiting_admission: begun, not yet admitted; admitted: admitted and
/// not yet ended, or ending): the requests the sender tracks.
pub const SENDER_REQUESTS: &str = "kvx_sender_requests";
/// Histogram: from a request's beginning to its admission, in seconds.
pub const SENDER_ADMISSION_WAIT_SECONDS: &str = "kvx_sender_admission_wait_seconds";
/// Histogram: from a write's posting to its successful completion, in seconds.
pub const SENDER_WRITE_SECONDS: &str = "kvx_sender_write_seconds";
/// Counter: fabric writes posted; a run of chunks whose staging and remote slots are both
/// consecutive counts once where the fabric carries it as one write (`kvx_io::WriteRun`).
pub const SENDER_FABRIC_WRITES: &str = "kvx_sender_fabric_writes_total";
/// Histogram: bytes per fabric write posted.
pub const SENDER_WRITE_BYTES: &str = "kvx_sender_write_bytes";
/// Histogram: fabric writes per delivered request (its chunks, less the runs joined).
pub const SENDER_WRITES_PER_REQUEST: &str = "kvx_sender_writes_per_request";
/// Counter, per `channel` (control, fabric): connections to a receiver made again after
/// one was lost.
pub const SENDER_RECONNECTS: &str = "kvx_sender_reconnects_total";
/// Counter: receivers whose stated timeouts this sender's break (`check_sender`); writes to
/// them fail until they fit.
pub const SENDER_CONFIG_CONFLICTS: &str = "kvx_sender_config_conflicts_total";
/// Counter: requests the proxy found ready (every TP rank's ProxyNotif in).
pub const PROXY_READY: &str = "kvx_proxy_ready_total";
/// Counter, per `reason` (`ProxyFailure::kind`: reported, kv_ready_timeout): requests the
/// proxy found failed.
pub const PROXY_FAILED: &str = "kvx_proxy_failed_total";
/// Proxy outcomes no `expect` awaited that found `ProxyEvents` full (its reader behind).
pub const PROXY_EVENTS_DROPPED: &str = "kvx_proxy_events_dropped_total";
/// Counter: notices the proxy could not use (an over-long id, a message that is no notice,
/// an early notice pushed out of its full table or too large to keep), each counted once.
pub const PROXY_NOTICES_DROPPED: &str = "kvx_proxy_notices_dropped_total";
/// Counter, per `reason` (`NoticeRefusal::kind`: other_principal, rank_repeated): notices
/// the proxy refused because their sender is not one the request is bound to
/// (`docs/spec/protocol.md` §Proxy).
pub const PROXY_NOTICES_REFUSED: &str = "kvx_proxy_notices_refused_total";

/// The `reason` values of `SENDER_FAILED`: every `SendFailure::kind`.
pub const SENDER_FAILED_REASONS: &[&str] = &[
    "cancelled",
    "refused",
    "bad_reply",
    "reply_timeout",
    "channel_lost",
    "write_failed",
    "write_timeout",
    "misuse",
];
/// The `state` values of `SENDER_REQUESTS`.
pub const SENDER_REQUEST_STATES: &[&str] = &["awaiting_admission", "admitted"];
/// The `channel` values of `SENDER_RECONNECTS`.
pub const SENDER_RECONNECT_CHANNELS: &[&str] = &["control", "fabric"];
/// The `reason` values of `PROXY_FAILED`: the `ProxyFailure::kind`s the proxy's tracker
/// reports (`proxy_gone` is a handle's, never counted).
pub const PROXY_FAILED_REASONS: &[&str] = &["reported", "kv_ready_timeout"];

/// Registers every series of a receiver whose `receiver` label is `label`, at zero but for
/// its `free` slots.
pub fn register_receiver(label: &str, free: u32) {
    let counters = [
        ADMITTED,
        REFUSED,
        ROLLED_BACK,
        CONSUMED,
        FABRIC_WRITES_REFUSED,
        LANDINGS_REFUSED,
        CORRUPT_CHUNKS,
        DECODE_ERRORS,
    ];
    for name in counters {
        metrics::counter!(name, "receiver" => label.to_owned()).increment(0);
    }
    let gauges = [
        ADMISSION_QUEUE_LEN,
        SLOTS_RESERVED,
        SLOTS_HELD,
        SLOTS_FREE,
        SLOTS_QUARANTINED,
    ];
    for name in gauges {
        metrics::gauge!(name, "receiver" => label.to_owned()).increment(0.0);
    }
    metrics::gauge!(SLOTS_FREE, "receiver" => label.to_owned()).set(f64::from(free));
    let _ = metrics::histogram!(ADMISSION_WAIT_SECONDS, "receiver" => label.to_owned());
}

/// Registers every series of a sender, at zero but for its `staging_slots` free ones (last:
/// once it is there, every series is).
pub fn register_sender(staging_slots: u32) {
    for name in [
        SENDER_DELIVERED,
        SENDER_CONFIG_CONFLICTS,
        SENDER_FABRIC_WRITES,
        DECODE_ERRORS,
    ] {
        metrics::counter!(name).increment(0);
    }
    for &reason in SENDER_FAILED_REASONS {
        metrics::counter!(SENDER_FAILED, "reason" => reason).increment(0);
    }
    for &channel in SENDER_RECONNECT_CHANNELS {
        metrics::counter!(SENDER_RECONNECTS, "channel" => channel).increment(0);
    }
    metrics::gauge!(SENDER_STAGING_HELD).increment(0.0);
    for &state in SENDER_REQUEST_STATES {
        metrics::gauge!(SENDER_REQUESTS, "state" => state).increment(0.0);
    }
    for name in [
        SENDER_ADMISSION_WAIT_SECONDS,
        SENDER_WRITE_SECONDS,
        SENDER_WRITE_BYTES,
        SENDER_WRITES_PER_REQUEST,
    ] {
        let _ = metrics::histogram!(name);
    }
    metrics::gauge!(SENDER_STAGING_FREE).set(f64::from(staging_slots));
}

/// Registers every series of a proxy, at zero.
pub fn register_proxy() {
    let counters = [
        PROXY_READY,
        PROXY_EVENTS_DROPPED,
        PROXY_NOTICES_DROPPED,
        DECODE_ERRORS,
    ];
    for name in counters {
        metrics::counter!(name).increment(0);
    }
    for &reason in PROXY_FAILED_REASONS {
        metrics::counter!(PROXY_FAILED, "reason" => reason).increment(0);
    }
    for why in kvx_proto::proxy::NoticeRefusal::ALL {
        metrics::counter!(PROXY_NOTICES_REFUSED, "reason" => why.kind()).increment(0);
    }
}

#[cfg(test)]
mod tests {
    /// The label values registered at start are every value the drivers record.
    #[test]
    fn registered_reasons_are_every_kind() {
        use kvx_proto::proxy::ProxyFailure;
        use kvx_proto::sender::SendFailure as F;
        let every = [
            F::Cancelled,
            F::Refused(String::new()),
            F::BadReply(String::new()),
            F::ReplyTimeout,
            F::ChannelLost,
            F::WriteFailed(String::new()),
            F::WriteTimeout,
            F::Misuse(String::new()),
        ];
        let kinds: Vec<&str> = every.iter().map(F::kind).collect();
        assert_eq!(kinds, super::SENDER_FAILED_REASONS);
        let tracked = [
            ProxyFailure::Reported(String::new()),
            ProxyFailure::TimedOut { seen: 0, ranks: 1 },
        ];
        let kinds: Vec<&str> = tracked.iter().map(ProxyFailure::kind).collect();
        assert_eq!(kinds, super::PROXY_FAILED_REASONS);
    }

    /// Every name defined here is in the operators' table (`docs/operations.md`, "Metrics and
    /// readiness"), in full or as its suffix after the role (`_slots_held` in the receiver's
    /// row): a metric added without a row fails here.
    #[test]
    fn every_metric_is_in_the_operations_table() {
        let source = include_str!("metrics.rs")
            .split("#[cfg(test)]")
            .next()
            .expect("the definitions");
        let docs = include_str!("../../../docs/operations.md");
        let table = docs
            .split("# Metrics and readiness")
            .nth(1)
            .expect("docs/operations.md has its metrics section");
        let names: Vec<&str> = source
            .split('"')
            .skip(1)
            .step_by(2)
            .filter(|s| s.starts_with("kvx_") && !s.contains(' '))
            .collect();
        assert!(names.len() >= 20, "the names were found: {names:?}");
        for name in names {
            let suffix = ["kvx_receiver", "kvx_sender", "kvx_proxy"]
                .iter()
                .find_map(|role| name.strip_prefix(role))
                .unwrap_or(name);
            assert!(
                table.contains(&format!("`{name}`")) || table.contains(&format!("`{suffix}`")),
                "{name} is not in docs/operations.md's metrics table"
            );
        }
    }
}
