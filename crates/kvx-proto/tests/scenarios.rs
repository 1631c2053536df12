//! Scenario tests on the synchronous harness (virtual time; each runs in milliseconds).
//! Each one names the LMCache failure it guards against (reference §7).

use std::time::Duration;

use kvx_proto::config::Pipelining;
use kvx_proto::receiver::{Failure, Outcome};
use kvx_proto::testing::{Cluster, ClusterSpec, End, Report, RequestPlan};
use kvx_proto::wire::{AllocRequest, Message};

const STEPS: u64 = 1_000_000;
const TIME: Duration = Duration::from_secs(3_600);

fn run(spec: ClusterSpec) -> Report {
    match Cluster::new(spec).run(STEPS, TIME) {
        Ok(report) => report,
        Err(stuck) => panic!("{stuck}"),
    }
}

fn all_delivered(report: &Report) {
    for (i, p) in report.plans.iter().enumerate() {
        assert_eq!(p.sender_end, Some(End::Delivered), "plan {i}: {p:?}");
        assert!(matches!(p.proxy_end, Some(Ok(_))), "plan {i}: {p:?}");
        assert_eq!(p.receiver_end, Some(Outcome::Consumed), "plan {i}: {p:?}");
        assert!(p.chunks_verified > 0, "plan {i} was verified");
    }
}

fn failed(report: &Report, i: usize) -> String {
    match &report.plans[i].sender_end {
        Some(End::Failed(why)) => why.clone(),
        other => panic!("plan {i} should have failed: {other:?}"),
    }
}

/// The design note's example: a 10-chunk buffer, A and B need 8 each. B waits, both finish.
#[test]
fn worked_example_two_senders() {
    let spec = ClusterSpec::new(2, 1, 10, 8)
        .with(RequestPlan::new(0, 0, "A", 8, 2))
        .with(RequestPlan {
            start_after: Duration::from_micros(10),
            ..RequestPlan::new(1, 0, "B", 8, 2)
        });
    let report = run(spec);
    all_delivered(&report);
    let (a, b) = (&report.plans[0], &report.plans[1]);
    assert!(
        b.admitted_at >= a.consumed_at,
        "B waits for A to be consumed: {a:?} {b:?}"
    );
}

/// The same A and B from ONE sender, batches interleaved. LMCache 0.5.6 deadlocks here:
/// B's first batch holds the per-receiver lock while it waits for capacity that only A's
/// remaining batches can free (W1).
#[test]
fn worked_example_one_sender_interleaved() {
    let mut spec = ClusterSpec::new(1, 1, 10, 8)
        .with(RequestPlan::new(0, 0, "A", 8, 2))
        .with(RequestPlan::new(0, 0, "B", 8, 2));
    spec.interleave = 2;
    all_delivered(&run(spec));
}

/// The same against a receiver treated as LMCache (one message in flight, no `seq`
/// pipelining): the probe for B is held back while A still has batches to send.
#[test]
fn worked_example_one_sender_serial_channel() {
    let mut spec = ClusterSpec::new(1, 1, 10, 8)
        .with(RequestPlan::new(0, 0, "A", 8, 2))
        .with(RequestPlan::new(0, 0, "B", 8, 2));
    spec.interleave = 2;
    spec.senders[0].pipelining = Pipelining::Off;
    all_delivered(&run(spec));
}

/// 2 senders each prefilling 4 requests at once (4–16 chunks, batches of 4) into a 64-chunk
/// buffer with 64-chunk staging. LMCache wedges here with the buffer full of partial
/// requests; kvx admits whole requests only, so all complete.
#[test]
fn two_senders_four_concurrent_requests_each() {
    let sizes = [
        [16, 4, 12, 9],
        [7, 16, 5, 14],
        [16, 16, 8, 4],
        [11, 13, 6, 15],
    ];
    let mut spec = ClusterSpec::new(2, 1, 64, 64);
    spec.interleave = 4;
    for round in 0..2 {
        for s in 0..2 {
            for (k, &chunks) in sizes[round * 2 + s].iter().enumerate() {
                spec = spec.with(RequestPlan::new(
                    s,
                    0,
                    format!("s{s}-r{round}-{k}"),
                    chunks,
                    4,
                ));
            }
        }
    }
    all_delivered(&run(spec));
}

/// Cancel while the first batch is in flight (LMCache sends no CancelNotif then and leaks
/// the reservation, W6): everything is released on both sides.
#[test]
fn cancel_while_first_batch_in_flight() {
    let cancel = RequestPlan {
        cancel_after: Some(Duration::from_micros(70)),
        ..RequestPlan::new(0, 0, "C", 8, 4)
    };
    let spec = ClusterSpec::new(1, 1, 10, 8)
        .with(cancel)
        .with(RequestPlan {
            start_after: Duration::from_millis(5),
            ..RequestPlan::new(0, 0, "after", 10, 4)
        });
    let report = run(spec);
    assert_eq!(failed(&report, 0), "cancelled");
    assert!(
        matches!(report.plans[0].proxy_end, Some(Err(_))),
        "the proxy is told"
    );
    assert_eq!(
        report.plans[0].receiver_end,
        Some(Outcome::Failed(Failure::Cancelled))
    );
    // The whole buffer is usable again: a 10-chunk request fits.
    assert_eq!(report.plans[1].sender_end, Some(End::Delivered));
}

/// Cancel at every moment of a request's life: nothing leaks, whatever the timing.
#[test]
fn cancel_at_any_moment_leaks_nothing() {
    for us in (0..1_500).step_by(37) {
        let plan = RequestPlan {
            cancel_after: Some(Duration::from_micros(us)),
            ..RequestPlan::new(0, 0, "C", 8, 2)
        };
        let report = run(ClusterSpec::new(1, 1, 10, 4).with(plan));
        let p = &report.plans[0];
        assert!(
            p.sender_end.is_some() && p.proxy_end.is_some(),
            "cancel at {us}us: {p:?}"
        );
    }
}

/// A request larger than the whole buffer fails at once (LMCache U waits the full timeout,
/// W3), once, and the proxy is told.
#[test]
fn oversized_request_fails_fast_once() {
    let spec = ClusterSpec::new(1, 1, 10, 8).with(RequestPlan::new(0, 0, "big", 12, 2));
    let report = run(spec);
    let why = failed(&report, 0);
    assert!(
        why.contains("needs 12 chunks") && why.contains("only 10 slots"),
        "{why}"
    );
    let p = &report.plans[0];
    assert!(p.ended_at.expect("ended") - p.begun_at.expect("begun") < Duration::from_millis(1));
    assert!(matches!(&p.proxy_end, Some(Err(reason)) if reason.contains("12 chunks")));
    assert_eq!(
        p.receiver_end,
        Some(Outcome::Failed(Failure::LargerThanBuffer {
            need: 12,
            capacity: 10
        }))
    );
}

fn raw_batch(req: &str, keys: usize, total: u32, last: bool, seq: u64) -> Message {
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

fn refusal(msg: &Message) -> Option<String> {
    match msg {
        Message::AllocResponse(r) if r.is_refusal() => Some(r.error.clone().unwrap_or_default()),
        _ => None,
    }
}

/// A sender that sends more chunks than it declared: the batch is refused with a reason,
/// every earlier batch is rolled back, and a later batch of the same id is refused too
/// (never admitted afresh, W7).
#[test]
fn protocol_violation_rolls_back_everything() {
    let mut cluster = Cluster::new(ClusterSpec::new(0, 1, 10, 1));
    cluster.inject(
        Duration::from_micros(0),
        0,
        0,
        &raw_batch("v", 2, 3, false, 1),
    );
    cluster.inject(
        Duration::from_micros(10),
        0,
        0,
        &raw_batch("v", 2, 3, false, 2),
    );
    cluster.inject(
        Duration::from_micros(20),
        0,
        0,
        &raw_batch("v", 1, 3, true, 3),
    );
    let report = cluster.run(STEPS, TIME).unwrap_or_else(|s| panic!("{s}"));
    let replies: Vec<Option<String>> = report.raw_replies.iter().map(|(_, m)| refusal(m)).collect();
    assert_eq!(replies[0], None);
    let why = replies[1].clone().expect("second batch refused");
    assert!(
        why.contains("declared total_chunks=3") && why.contains("rolled back"),
        "{why}"
    );
    let why = replies[2].clone().expect("late batch refused");
    assert!(why.contains("already ended"), "{why}");
}

/// total_chunks == 0 and a missing req_id are refused with a reason and leave no state.
#[test]
fn zero_chunks_and_legacy_requests_are_refused() {
    let mut cluster = Cluster::new(ClusterSpec::new(0, 1, 10, 1));
    cluster.inject(Duration::ZERO, 0, 0, &raw_batch("z", 1, 0, false, 1));
    cluster.inject(Duration::ZERO, 1, 0, &raw_batch("", 1, 4, false, 1));
    let report = cluster.run(STEPS, TIME).unwrap_or_else(|s| panic!("{s}"));
    let reasons: Vec<String> = report
        .raw_replies
        .iter()
        .filter_map(|(_, m)| refusal(m))
        .collect();
    assert_eq!(reasons.len(), 2);
    assert!(
        reasons.iter().any(|r| r.contains("total_chunks is 0")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("no req_id")),
        "{reasons:?}"
    );
}

/// A write fails: the request fails (no ProxyNotif for unwritten data, LMCache U's W8), the
/// receiver rolls back every batch, the proxy is told, and the next request uses the buffer.
#[test]
fn failed_write_rolls_back_the_whole_request() {
    let bad = RequestPlan {
        fail_write_of_chunk: Some(5),
        ..RequestPlan::new(0, 0, "bad", 8, 2)
    };
    let next = RequestPlan {
        start_after: Duration::from_millis(10),
        ..RequestPlan::new(0, 0, "next", 10, 2)
    };
    let report = run(ClusterSpec::new(1, 1, 10, 4).with(bad).with(next));
    assert!(failed(&report, 0).contains("write failed"));
    assert!(
        !report.proxy_notifs.contains_key("bad"),
        "no ProxyNotif for a failed request"
    );
    assert!(matches!(report.plans[0].proxy_end, Some(Err(_))));
    assert_eq!(
        report.plans[0].receiver_end,
        Some(Outcome::Failed(Failure::Cancelled))
    );
    assert_eq!(report.plans[1].sender_end, Some(End::Delivered));
}

/// A sender dies mid-request: its reservation is reclaimed after the idle timeout (LMCache
/// leaks it forever, W4), and a request from another sender then gets the whole buffer.
#[test]
fn dead_sender_reservation_is_reclaimed() {
    let mut spec = ClusterSpec::new(2, 1, 10, 8)
        .with(RequestPlan {
            ..RequestPlan::new(0, 0, "dies", 8, 2)
        })
        .with(RequestPlan {
            start_after: Duration::from_millis(1),
            ..RequestPlan::new(1, 0, "waits", 8, 2)
        });
    spec.timing.prefill_chunk_time = Duration::from_millis(1);
    spec.kill_sender_after = vec![(0, Duration::from_micros(500))];
    spec.receivers[0].request_idle_timeout = Duration::from_secs(2);
    for s in &mut spec.senders {
        s.write_timeout = Duration::from_secs(1);
    }
    spec.receivers[0].write_quarantine = Duration::from_secs(20);
    let report = run(spec);
    assert_eq!(
        report.plans[0].receiver_end,
        Some(Outcome::Failed(Failure::IdleTimeout))
    );
    assert!(
        matches!(report.plans[0].proxy_end, Some(Err(_))),
        "the proxy times out, not hangs"
    );
    assert_eq!(report.plans[1].sender_end, Some(End::Delivered));
    let waited = report.plans[1].admitted_at.expect("admitted") - Instant0::ZERO;
    assert!(
        waited >= Duration::from_secs(2),
        "admitted only after the lease expired: {waited:?}"
    );
}

use kvx_proto::Instant as Instant0;

/// Complete requests the decoder never consumes are released after their TTL (LMCache
/// counts their slots as free while they still hold memory, W12).
#[test]
fn unconsumed_requests_expire() {
    let mut spec = ClusterSpec::new(1, 1, 10, 8)
        .with(RequestPlan::new(0, 0, "u1", 6, 2))
        .with(RequestPlan {
            start_after: Duration::from_micros(1),
            ..RequestPlan::new(0, 0, "u2", 6, 2)
        });
    spec.decoder_consumes = false;
    spec.receivers[0].unconsumed_ttl = Duration::from_secs(5);
    spec.proxy.kv_ready_timeout = Duration::from_secs(4);
    let report = run(spec);
    for p in &report.plans {
        assert_eq!(p.sender_end, Some(End::Delivered));
        assert_eq!(p.receiver_end, Some(Outcome::Failed(Failure::Unconsumed)));
    }
    // u2 was admitted only once u1's slots were released, though u1 had finished sending.
    assert!(
        report.plans[1].admitted_at.expect("admitted") - Instant0::ZERO >= Duration::from_secs(5)
    );
}

/// 2P1D: two senders each send one request to one receiver; the transfers overlap, so the
/// makespan is close to the longer one, not the sum.
#[test]
fn two_senders_transfer_concurrently() {
    let alone = |chunks| {
        run(ClusterSpec::new(1, 1, 64, 16).with(RequestPlan::new(0, 0, "x", chunks, 4))).makespan()
    };
    let (long, short) = (alone(32), alone(24));
    let both = run(ClusterSpec::new(2, 1, 64, 16)
        .with(RequestPlan::new(0, 0, "a", 32, 4))
        .with(RequestPlan::new(1, 0, "b", 24, 4)));
    all_delivered(&both);
    let span = both.makespan();
    assert!(
        span < (long + short).mul_f64(0.75),
        "makespan {span:?} vs {long:?} + {short:?}"
    );
    assert!(
        span < long.mul_f64(1.2),
        "makespan {span:?} close to the longer {long:?}"
    );
}

/// A request that sends fewer chunks than it declared (LMCache drops a partial last chunk in
/// some configurations, W13) still completes, and the unused reservation is returned.
#[test]
fn fewer_chunks_than_declared_completes() {
    let plan = RequestPlan {
        declared: 9,
        ..RequestPlan::new(0, 0, "short", 7, 3)
    };
    all_delivered(&run(ClusterSpec::new(1, 1, 10, 8).with(plan)));
}

/// Many requests from several senders to several receivers with jittered links.
#[test]
fn xpyd_with_jitter_completes() {
    for seed in 0..20 {
        let mut spec = ClusterSpec::new(3, 2, 24, 12);
        spec.seed = seed;
        spec.interleave = 3;
        spec.timing.jitter = Duration::from_micros(200);
        for k in 0..18u32 {
            let chunks = 1 + (k * 7 + seed as u32) % 20;
            let plan = RequestPlan::new(
                (k % 3) as usize,
                (k % 2) as usize,
                format!("q{k}"),
                chunks,
                1 + k % 4,
            );
            spec = spec.with(plan);
        }
        all_delivered(&run(spec));
    }
}

/// Found by the property test (kept as a regression): on a serial (LMCache-style) channel a
/// cancel queued behind another request's admission probe could not pass it, so the probe
/// waited at the receiver for capacity that only the cancel would free. Cancels and batches
/// now always go before probes.
#[test]
fn serial_channel_cancel_passes_a_waiting_probe() {
    let mut spec = ClusterSpec::new(1, 1, 5, 9)
        .with(RequestPlan {
            start_after: Duration::from_micros(284),
            ..RequestPlan::new(0, 0, "p0", 3, 1)
        })
        .with(RequestPlan {
            start_after: Duration::from_micros(319),
            cancel_after: Some(Duration::from_micros(1_948)),
            ..RequestPlan::new(0, 0, "p1", 3, 1)
        })
        .with(RequestPlan {
            start_after: Duration::from_micros(319),
            ..RequestPlan::new(0, 0, "p2", 3, 1)
        });
    spec.interleave = 3;
    spec.seed = 12_257_266_579_060_608_737;
    spec.timing.jitter = Duration::from_micros(10);
    spec.senders[0].pipelining = Pipelining::Off;
    let report = run(spec);
    assert_eq!(
        report.plans[2].sender_end,
        Some(End::Delivered),
        "{:?}",
        report.plans[2]
    );
    assert!(
        report.makespan() < Duration::from_secs(1),
        "no admission timeout on the way"
    );
}

/// Found by the property test: a batch larger than the whole staging pool. The engine
/// submits what it has staged when allocation would block, and the core refuses to let a
/// caller wait on staging that only its own unsubmitted chunks hold.
#[test]
fn batch_larger_than_staging_completes() {
    let spec = ClusterSpec::new(1, 1, 4, 1).with(RequestPlan {
        start_after: Duration::from_micros(128),
        ..RequestPlan::new(0, 0, "p0", 2, 2)
    });
    all_delivered(&run(spec));
}

/// Found by the property test: on a serial channel, a request cancelled after its last batch
/// was answered, with writes still in flight, let another request's probe go out before its
/// CancelNotif, and the probe then waited for the capacity the cancel would free. On a
/// serial channel a probe now waits until no other request is admitted or failing.
#[test]
fn serial_channel_probe_waits_for_a_pending_cancel() {
    let mut spec = ClusterSpec::new(1, 1, 4, 3)
        .with(RequestPlan {
            start_after: Duration::from_micros(1_373),
            cancel_after: Some(Duration::from_micros(835)),
            ..RequestPlan::new(0, 0, "p0", 4, 3)
        })
        .with(RequestPlan {
            start_after: Duration::from_micros(1_373),
            ..RequestPlan::new(0, 0, "p1", 1, 1)
        });
    spec.interleave = 3;
    spec.seed = 7_756_152_892_049_454_264;
    spec.timing.jitter = Duration::from_micros(170);
    spec.senders[0].pipelining = Pipelining::Off;
    spec.receivers[0].request_idle_timeout = Duration::from_secs(1);
    spec.receivers[0].write_quarantine = Duration::from_secs(5);
    spec.senders[0].write_timeout = Duration::from_millis(800);
    spec.senders[0].reply_timeout = Duration::from_secs(1);
    let report = run(spec);
    assert_eq!(
        report.plans[1].sender_end,
        Some(End::Delivered),
        "{:?}",
        report.plans[1]
    );
}

/// A sender hangs with writes already posted: its NIC keeps writing while the receiver's
/// lease on the request expires. The rolled-back slots go to quarantine, so the late writes
/// land there and never in a slot already granted to the next request (whose bytes they
/// would corrupt); the next request is admitted once the quarantine clears.
#[test]
fn late_write_after_a_lease_expiry_lands_in_quarantine() {
    let mut spec = ClusterSpec::new(2, 1, 2, 2)
        .with(RequestPlan {
            write_time: Some(Duration::from_millis(1_200)),
            ..RequestPlan::new(0, 0, "hung", 2, 2)
        })
        .with(RequestPlan {
            start_after: Duration::from_millis(1),
            ..RequestPlan::new(1, 0, "next", 2, 2)
        });
    for s in &mut spec.senders {
        s.write_timeout = Duration::from_millis(800);
        s.reply_timeout = Duration::from_secs(1);
    }
    spec.kill_sender_after = vec![(0, Duration::from_millis(500))];
    spec.receivers[0].request_idle_timeout = Duration::from_secs(1);
    spec.receivers[0].write_quarantine = Duration::from_secs(5);
    let report = run(spec);
    assert_eq!(
        report.plans[0].receiver_end,
        Some(Outcome::Failed(Failure::IdleTimeout))
    );
    assert_eq!(report.plans[1].sender_end, Some(End::Delivered));
    assert_eq!(report.plans[1].chunks_verified, 2);
    let admitted = report.plans[1].admitted_at.expect("admitted") - Instant0::ZERO;
    assert!(
        admitted >= Duration::from_millis(2_400),
        "admitted after both late writes: {admitted:?}"
    );
}

/// Found by the simulation: on a pipelined channel, probes waiting at the receiver filled
/// the whole in-flight window, and an admitted request's batches queued behind them — the
/// capacity the probes waited for could never be freed (W1, back through the window).
/// Probes now have their own window.
#[test]
fn probes_waiting_at_the_receiver_never_block_batches() {
    let mut spec = ClusterSpec::new(1, 1, 10, 8);
    spec.interleave = 4;
    spec.senders[0].inflight_max = 2;
    for k in 0..4 {
        spec = spec.with(RequestPlan::new(0, 0, format!("w{k}"), 6, 1));
    }
    let report = run(spec);
    all_delivered(&report);
    assert!(
        report.makespan() < Duration::from_secs(1),
        "no admission timeout on the way: {:?}",
        report.makespan()
    );
}
