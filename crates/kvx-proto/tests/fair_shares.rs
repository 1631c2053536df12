//! Per-sender shares (`admission.rs`, `docs/spec/protocol.md` §Fair shares), on the harness.
//! The promise first: a lone sender uses the whole buffer with the default share, and a
//! request larger than the share is served. Then the starvation cases a hostile review found,
//! each run twice — with the default share, where the legitimate sender completes, and with
//! shares off (one sender may hold the whole buffer and queue without limit), where it does
//! not. The second run is what shows each test can fail. Last, the bound a hog that struck
//! while alone holds a latecomer to: its request's lifetime.

use std::time::Duration;

use kvx_proto::receiver::Outcome;
use kvx_proto::testing::{Cluster, ClusterSpec, End, Report, RequestPlan};
use kvx_proto::wire::{AllocRequest, Message};

const STEPS: u64 = 5_000_000;
const TIME: Duration = Duration::from_secs(3_600);
/// A 10-slot buffer; at the default 75 % one sender holds at most 8 slots.
const BUFFER: u32 = 10;
const DEFAULT_SHARE: u32 = 75;

fn batch(req: &str, keys: usize, total: u32, last: bool, seq: u64) -> Message {
    Message::AllocRequest(AllocRequest {
        keys: (0..keys).map(|k| format!("{req}@{k}")).collect(),
        chunk_bytes: Some(vec![64; keys]),
        claim: None,
        fmt: 1,
        shape: vec![2, 2, 256, 64],
        dtype: "bfloat16".into(),
        last_chunk_toks: 256,
        req_id: req.into(),
        is_last_batch: last,
        total_chunks: total,
        seq: Some(seq),
    })
}

/// 1P1D with the defaults: one sender, a 24-slot buffer, the default 75 % share. A request
/// of the whole buffer is served, and so are requests that together hold all of it.
#[test]
fn a_lone_sender_uses_the_whole_buffer_with_the_default_share() {
    let spec = ClusterSpec::new(1, 1, 24, 8)
        .with_peer_share(DEFAULT_SHARE)
        .with(RequestPlan::new(0, 0, "whole", 24, 4))
        .with(RequestPlan::new(0, 0, "a", 12, 4))
        .with(RequestPlan::new(0, 0, "b", 12, 4));
    let mut spec = spec;
    spec.interleave = 3;
    let report = run(Cluster::new(spec));
    for (i, p) in report.plans.iter().enumerate() {
        assert_eq!(p.sender_end, Some(End::Delivered), "request {i}: {p:?}");
        assert_eq!(
            p.receiver_end,
            Some(Outcome::Consumed),
            "request {i}: {p:?}"
        );
    }
    assert_eq!(
        ReceiverDefault::share(),
        DEFAULT_SHARE,
        "the test uses the default"
    );
}

/// The default share, read from the core's one place for defaults.
struct ReceiverDefault;

impl ReceiverDefault {
    fn share() -> u32 {
        kvx_proto::ReceiverConfig::default().peer_share_percent
    }
}

/// One legitimate sender with a 2-chunk request that begins after the hog has struck. The
/// stall rule (§Stalls) is off (a stall time of an hour): these tests show
/// what shares and queue bounds do on their own; `stalled_reservations.rs` shows the rule.
fn spec(share: u32) -> ClusterSpec {
    let mut spec = ClusterSpec::new(1, 1, BUFFER, 2)
        .with_peer_share(share)
        .with(RequestPlan {
            start_after: Duration::from_secs(1),
            ..RequestPlan::new(0, 0, "legit", 2, 2)
        });
    for r in &mut spec.receivers {
        r.stall_timeout = Duration::from_secs(3600);
    }
    spec
}

fn legit_delivered(report: &Report) -> bool {
    let p = &report.plans[0];
    p.sender_end == Some(End::Delivered) && p.receiver_end == Some(Outcome::Consumed)
}

fn run(cluster: Cluster) -> Report {
    cluster.run(STEPS, TIME).unwrap_or_else(|s| panic!("{s}"))
}

/// A hog reserves all it may, then keeps its request alive with a one-key batch every 20 s
/// (under the 30 s idle timeout), never finishing.
fn hog_renewing(share: u32) -> Report {
    let mut cluster = Cluster::new(spec(share));
    let hold = (u64::from(BUFFER) * u64::from(share)).div_ceil(100) as u32;
    cluster.inject(Duration::ZERO, 0, 0, &batch("hog", 0, hold, false, 1));
    // Seven one-key batches, 20 s apart: it holds its reservation for 140 s.
    for i in 0..7u64 {
        let at = Duration::from_secs(1 + 20 * i);
        cluster.inject(at, 0, 0, &batch("hog", 1, hold, false, 2 + i));
    }
    run(cluster)
}

#[test]
fn a_sender_renewing_a_whole_buffer_reservation_does_not_starve_others() {
    assert!(
        legit_delivered(&hog_renewing(DEFAULT_SHARE)),
        "with shares the legitimate sender completes"
    );
    assert!(
        !legit_delivered(&hog_renewing(100)),
        "without shares it is starved (this test can fail)"
    );
}

/// A hog takes grants for all it may, writes nothing, then over-declares: the rollback
/// quarantines every slot it held for `write_quarantine` (60 s).
fn hog_quarantining(share: u32) -> Report {
    let mut cluster = Cluster::new(spec(share));
    let hold = (u64::from(BUFFER) * u64::from(share)).div_ceil(100) as u32;
    cluster.inject(Duration::ZERO, 0, 0, &batch("hog", 0, hold, false, 1));
    let at = Duration::from_millis(10);
    cluster.inject(at, 0, 0, &batch("hog", hold as usize, hold, false, 2));
    let at = Duration::from_millis(20);
    cluster.inject(at, 0, 0, &batch("hog", 1, hold, false, 3));
    run(cluster)
}

#[test]
fn a_sender_quarantining_what_it_held_does_not_starve_others() {
    assert!(legit_delivered(&hog_quarantining(DEFAULT_SHARE)));
    assert!(
        !legit_delivered(&hog_quarantining(100)),
        "without shares the whole buffer is quarantined past the legitimate sender's \
         admission timeout (this test can fail)"
    );
}

/// A hog holds its share and floods the admission queue with probes that can only wait.
fn hog_flooding_the_queue(share: u32, peer_queue_max: usize) -> Report {
    let mut s = spec(share);
    for r in &mut s.receivers {
        r.admission_queue_max = 1024;
        r.peer_queue_max = peer_queue_max;
    }
    let mut cluster = Cluster::new(s);
    let hold = (u64::from(BUFFER) * u64::from(share)).div_ceil(100) as u32;
    cluster.inject(Duration::ZERO, 0, 0, &batch("hog", 0, hold, false, 1));
    for i in 0..1024u64 {
        let at = Duration::from_millis(10);
        let req = format!("probe{i}");
        cluster.inject(at, 0, 0, &batch(&req, 0, hold, false, 2 + i));
    }
    run(cluster)
}

#[test]
fn a_sender_flooding_the_admission_queue_does_not_lock_others_out() {
    assert!(legit_delivered(&hog_flooding_the_queue(DEFAULT_SHARE, 256)));
    assert!(
        !legit_delivered(&hog_flooding_the_queue(100, 1024)),
        "without per-sender limits the queue is full (this test can fail)"
    );
}

/// A hog holds 8 of the 10 slots, then asks for 8 more: a waiter over its sender's share.
/// The legitimate request (2 chunks, which fit in what is free) arrives behind it.
fn hog_waiting_over_its_share(share: u32) -> Report {
    let mut cluster = Cluster::new(spec(share));
    cluster.inject(Duration::ZERO, 0, 0, &batch("hog", 0, 8, false, 1));
    let at = Duration::from_millis(10);
    cluster.inject(at, 0, 0, &batch("over", 0, 8, false, 2));
    run(cluster)
}

fn legit_admission_wait(report: &Report) -> Duration {
    let p = &report.plans[0];
    p.admitted_at.expect("admitted") - p.begun_at.expect("begun")
}

#[test]
fn a_waiter_over_its_senders_share_does_not_hold_others_behind_it() {
    let with_shares = hog_waiting_over_its_share(DEFAULT_SHARE);
    assert!(legit_delivered(&with_shares));
    assert!(
        legit_admission_wait(&with_shares) < Duration::from_millis(100),
        "with shares the over-share waiter is passed over: {:?}",
        legit_admission_wait(&with_shares)
    );
    let without = hog_waiting_over_its_share(100);
    assert!(
        !legit_delivered(&without) || legit_admission_wait(&without) >= Duration::from_secs(1),
        "without shares the waiter at the head of the queue holds it until it expires \
         (this test can fail)"
    );
}

/// A hog alone reserves the whole buffer (a request larger than its share goes in when its
/// sender holds nothing) and then sends nothing. The latecomer, within its share, is next in
/// line and is admitted when the hog's request ends: at the hog's idle timeout, the lifetime
/// §Fair shares bounds it by; a second hog request queued meanwhile is passed over.
#[test]
fn a_hog_alone_holds_a_latecomer_back_only_for_its_requests_lifetime() {
    let mut cluster = Cluster::new(spec(DEFAULT_SHARE));
    cluster.inject(Duration::ZERO, 0, 0, &batch("hog", 0, BUFFER, false, 1));
    cluster.inject(Duration::from_secs(2), 0, 0, &batch("more", 0, 1, false, 2));
    let report = run(cluster);
    assert!(legit_delivered(&report), "{:?}", report.plans[0]);
    let idle = kvx_proto::ReceiverConfig::default().request_idle_timeout;
    let waited = legit_admission_wait(&report);
    // Begun at 1 s, admitted when the hog's request is rolled back at its idle timeout
    // (30 s after its admission at 0 s).
    assert!(
        waited <= idle && waited >= idle - Duration::from_secs(2),
        "the latecomer waits for the hog's lifetime, no more: {waited:?}"
    );
}
