//! Scenarios on the real drivers: the design's worked examples, every LMCache failure the
//! reference describes (`../shared/reference/lmcache-pd.md` §7), 2P1D and xPyD. Each run
//! is also checked in full by the global checker and the end-to-end verdicts; these tests
//! add what each scenario is about.

use std::time::Duration;

use kvx_proto::config::Pipelining;
use kvx_sim::config::{Fault, FaultEvent};
use kvx_sim::outcomes::ReqRecord;
use kvx_sim::{run, RequestPlan, RunOptions, RunReport, SimConfig};

const MS: Duration = Duration::from_millis(1);
const US: Duration = Duration::from_micros(1);

pub fn passes(cfg: SimConfig) -> RunReport {
    let r = run(cfg, RunOptions::default());
    assert!(r.passed(), "{:#?}\n{}", r.violations, r.tail.join("\n"));
    r
}

pub fn rec<'a>(r: &'a RunReport, id: &str) -> &'a ReqRecord {
    r.outcomes
        .get(id)
        .unwrap_or_else(|| panic!("{id} never began"))
}

pub fn delivered(r: &RunReport, id: &str) -> bool {
    let rec = rec(r, id);
    matches!(rec.proxy, Some(Ok(())))
        && rec
            .ranks
            .iter()
            .all(|k| matches!(k.sender, Some(Ok(()))) && k.verified == Some(true))
}

fn failure(r: &RunReport, id: &str) -> String {
    match &rec(r, id).ranks[0].sender {
        Some(Err(why)) => why.clone(),
        other => panic!("{id} should have failed at its sender: {other:?}"),
    }
}

pub fn plan(id: &str, p: usize, chunks: u32, batch: u32) -> RequestPlan {
    RequestPlan::new(id, p, 0, chunks, batch)
}

fn at(id: &str, p: usize, chunks: u32, batch: u32, start_at: Duration) -> RequestPlan {
    RequestPlan {
        start_at,
        ..plan(id, p, chunks, batch)
    }
}

/// The design note's example: a 10-chunk buffer, A and B need 8 each, from two senders.
/// B waits in the admission queue until the decoder consumed A; both finish.
#[test]
fn worked_example_two_senders() {
    let cfg = SimConfig::new(2, 1, 10, 8)
        .with(plan("A", 0, 8, 2))
        .with(at("B", 1, 8, 2, 20 * MS + 10 * US));
    let r = passes(cfg);
    assert!(delivered(&r, "A") && delivered(&r, "B"));
    let (a, b) = (&rec(&r, "A").ranks[0], &rec(&r, "B").ranks[0]);
    assert!(
        b.admitted_at >= a.read_at,
        "B is admitted once A is consumed: {a:?} {b:?}"
    );
}

/// The same A and B from one sender with interleaved batches (LMCache 0.5.6 deadlocks: B's
/// first batch holds the per-receiver lock while it waits for what only A can free, W1),
/// on a pipelined and on a serial (LMCache-style) channel.
#[test]
fn worked_example_one_sender_interleaved() {
    for pipelining in [Pipelining::Auto, Pipelining::Off] {
        let mut cfg = SimConfig::new(1, 1, 10, 8)
            .with(plan("A", 0, 8, 2))
            .with(at("B", 0, 8, 2, 20 * MS + 10 * US));
        cfg.prefill[0].interleave = 2;
        cfg.prefill[0].sender.pipelining = pipelining;
        let r = passes(cfg);
        assert!(delivered(&r, "A") && delivered(&r, "B"), "{pipelining:?}");
    }
}

/// Head-of-line wait behind admission (W1): while B's probe waits at the receiver, A's
/// batches from the same sender keep flowing, so A finishes as fast as it would alone.
#[test]
fn head_of_line_wait_behind_admission() {
    let alone = passes(SimConfig::new(1, 1, 10, 8).with(plan("A", 0, 8, 1)));
    let mut cfg = SimConfig::new(1, 1, 10, 8)
        .with(plan("A", 0, 8, 1))
        .with(at("B", 0, 8, 1, 20 * MS + 150 * US));
    cfg.prefill[0].interleave = 2;
    let both = passes(cfg);
    let span = |r: &RunReport| {
        let a = rec(r, "A");
        a.proxy_at.unwrap_or_default() - a.begun_at
    };
    assert!(
        span(&both) < span(&alone).mul_f64(1.5),
        "A alone {:?}, A with B waiting {:?}",
        span(&alone),
        span(&both)
    );
    assert!(delivered(&both, "B"));
}

/// Two senders each prefilling 4 requests at once into a 64-chunk buffer (LMCache wedges
/// with the buffer full of partial requests); kvx admits whole requests, so all complete.
#[test]
fn two_senders_four_concurrent_requests_each() {
    let sizes = [
        [16, 4, 12, 9],
        [7, 16, 5, 14],
        [16, 16, 8, 4],
        [11, 13, 6, 15],
    ];
    let mut cfg = SimConfig::new(2, 1, 64, 64);
    for p in &mut cfg.prefill {
        p.interleave = 4;
    }
    for round in 0..2 {
        for s in 0..2 {
            for (k, &chunks) in sizes[round * 2 + s].iter().enumerate() {
                cfg = cfg.with(plan(&format!("s{s}-r{round}-{k}"), s, chunks, 4));
            }
        }
    }
    let r = passes(cfg);
    assert!(r.outcomes.keys().all(|id| delivered(&r, id)));
}

/// The same, decoded as a Python program decodes: every ready request leased as it comes
/// through `ReadyLeases` (what `kvx.Receiver.next_ready` runs on), in takes the decoder's
/// other work cuts short, each lease held until the proxy's verdict; all complete, every
/// byte checked, nothing left held (the final checks).
#[test]
fn two_senders_four_concurrent_requests_each_decoded_through_ready_leases() {
    let mut cfg = SimConfig::new(2, 1, 64, 64);
    cfg.decoder_takes_leases = true;
    for p in &mut cfg.prefill {
        p.interleave = 4;
    }
    for s in 0..2 {
        for (k, chunks) in [16, 4, 12, 9, 7, 16, 5, 14].into_iter().enumerate() {
            cfg = cfg.with(plan(&format!("s{s}-{k}"), s, chunks, 4));
        }
    }
    let r = passes(cfg);
    assert_eq!(r.outcomes.len(), 16);
    assert!(r.outcomes.keys().all(|id| delivered(&r, id)));
}

/// Cancel at every moment of a request's life, the first batch in flight included (LMCache
/// sends no CancelNotif then and leaks the reservation, W6): the whole buffer is usable
/// again afterwards, and nothing leaks anywhere (the final checks).
#[test]
fn cancel_at_any_moment_releases_everything() {
    for leases in [false, true] {
        cancel_at_any_moment(leases);
    }
}

/// The cancel scenario with the decoder hearing notices (`leases` false) or taking every
/// ready request as a lease as it comes, as Python's `next_ready` does (true).
fn cancel_at_any_moment(leases: bool) {
    let mut cancelled = 0;
    for us in (0..15_000).step_by(500) {
        let mut c = plan("C", 0, 8, 4);
        c.cancel_after = Some(Duration::from_micros(us));
        c.fault_free = false;
        let mut cfg = SimConfig::new(1, 1, 10, 8)
            .with(c)
            .with(at("after", 0, 10, 4, 50 * MS));
        cfg.decoder_takes_leases = leases;
        let r = passes(cfg);
        assert!(delivered(&r, "after"), "cancel at {us}us");
        if failure_or_none(&r, "C").is_some_and(|w| w.contains("cancelled")) {
            cancelled += 1;
            assert!(
                matches!(rec(&r, "C").proxy, Some(Err(_))),
                "the proxy is told"
            );
            assert_eq!(
                r.proxy_notifs.get("C"),
                None,
                "no ProxyNotif for an aborted request"
            );
        }
    }
    assert!(
        cancelled > 5,
        "many cancels hit the request while it ran: {cancelled}"
    );
}

fn failure_or_none(r: &RunReport, id: &str) -> Option<String> {
    match &rec(r, id).ranks[0].sender {
        Some(Err(why)) => Some(why.clone()),
        _ => None,
    }
}

/// A request larger than the whole buffer fails at once (LMCache waits the full timeout,
/// W3), once, and the proxy is told.
#[test]
fn oversized_request_fails_fast_once() {
    let mut big = plan("big", 0, 12, 2);
    big.oversized = true;
    let r = passes(SimConfig::new(1, 1, 10, 8).with(big));
    let why = failure(&r, "big");
    assert!(
        why.contains("needs 12 chunks") && why.contains("only 10 slots"),
        "{why}"
    );
    let big = rec(&r, "big");
    let took = big.proxy_at.unwrap_or_default() - big.begun_at;
    assert!(
        took < 20 * MS,
        "refused in {took:?} (a few hops, not admission_timeout): {big:?}"
    );
    assert!(big.ranks[0]
        .receiver_end
        .as_deref()
        .is_some_and(|e| e.contains("12 chunks")));
}

/// Zombie batches after a failure (W7): the sender hangs mid-request past the receiver's
/// lease. When it wakes, its replies are overdue, so it fails the request instead of
/// sending more batches; any batch that still reaches the receiver is refused, never
/// admitted afresh (the checker's W7 rule). The buffer then serves the next request.
#[test]
fn zombie_batches_after_a_failure_are_refused() {
    let mut z = plan("Z", 0, 8, 1);
    z.fault_free = false;
    let mut cfg = SimConfig::new(1, 1, 10, 8)
        .with(z)
        .with(at("next", 0, 10, 2, 6_000 * MS));
    cfg.prefill_chunk_time = MS;
    let pause = Fault::Pause {
        node: "p0r0".into(),
        lasts: 3_000 * MS,
    };
    cfg.faults = vec![FaultEvent {
        at: 27 * MS,
        fault: pause,
    }];
    cfg.heal_at = 3_100 * MS;
    let r = passes(cfg);
    let why = failure(&r, "Z");
    assert!(
        why.contains("already ended") || why.contains("did not reply in time"),
        "{why}"
    );
    assert!(rec(&r, "Z").ranks[0]
        .receiver_end
        .as_deref()
        .is_some_and(|e| e.contains("request_idle_timeout")));
    assert!(delivered(&r, "next"));
}

/// No ProxyNotif after an abort or a failed write (LMCache U sends one for data never
/// written, W8/W22): a partition mid-transfer flushes the writes; the request fails, the
/// proxy hears a failure, and the checker saw no ProxyNotif for it (S5).
#[test]
fn no_proxy_notif_after_a_failed_transfer() {
    let mut x = plan("X", 0, 16, 2);
    x.fault_free = false;
    let mut cfg = SimConfig::new(1, 1, 16, 4)
        .with(x)
        .with(at("next", 0, 16, 4, 8_000 * MS));
    cfg.prefill_chunk_time = MS;
    let cut = Fault::Partition {
        a: "p0r0".into(),
        b: "d0r0".into(),
        lasts: 50 * MS,
    };
    cfg.faults = vec![FaultEvent {
        at: 30 * MS,
        fault: cut,
    }];
    cfg.heal_at = 100 * MS;
    let r = passes(cfg);
    failure(&r, "X");
    assert!(matches!(rec(&r, "X").proxy, Some(Err(_))));
    assert_eq!(r.proxy_notifs.get("X"), None);
    assert!(
        delivered(&r, "next"),
        "the sender reconnects its fabric after the partition"
    );
}

/// A sender dies mid-request: its control connection closes, and the receiver fails its
/// request at once (`Failure::SenderLost`; LMCache leaks it forever, W4), so the sender that
/// waits gets the buffer long before the stall time.
#[test]
fn dead_sender_reservation_is_reclaimed_at_once() {
    let (cfg, stall, idle) = one_dies_one_waits(Fault::Crash {
        node: "p0r0".into(),
        lasts: 30_000 * MS,
    });
    let r = passes(cfg);
    let end = rec(&r, "dies").ranks[0].receiver_end.clone();
    assert!(
        end.as_deref()
            .is_some_and(|e| e.contains("control connection closed")),
        "{end:?}"
    );
    assert!(
        matches!(rec(&r, "dies").proxy, Some(Err(_))),
        "the proxy times out, not hangs"
    );
    assert!(delivered(&r, "waits"));
    let waited = rec(&r, "waits").ranks[0].admitted_at.unwrap_or_default();
    assert!(
        waited < stall.min(idle),
        "admitted once the dead sender's connection closed: {waited:?}"
    );
}

/// A sender hangs mid-request (its connections stay up): its reservation is reclaimed at
/// the stall time since another sender waits, and that sender's request then gets the
/// buffer.
#[test]
fn hung_sender_reservation_is_reclaimed_at_the_stall_time() {
    let (cfg, stall, idle) = one_dies_one_waits(Fault::Pause {
        node: "p0r0".into(),
        lasts: 30_000 * MS,
    });
    let r = passes(cfg);
    // Another sender waits: the hung sender's reservation, landing nothing, is taken back
    // at the stall time (docs/spec/protocol.md §Stalls), before its idle lease ends.
    let end = rec(&r, "dies").ranks[0].receiver_end.clone();
    assert!(
        end.as_deref().is_some_and(|e| e.contains("stall_timeout")),
        "{end:?}"
    );
    assert!(delivered(&r, "waits"));
    let waited = rec(&r, "waits").ranks[0].admitted_at.unwrap_or_default();
    assert!(
        waited >= stall && waited < idle,
        "admitted once the hung sender's request stalled: {waited:?}"
    );
}

/// Sender "dies" (8 chunks into a buffer of 10) meets `fault` at 25 ms; "waits" (8 chunks)
/// comes at 21 ms from another sender. The configuration, the stall time and the idle lease.
fn one_dies_one_waits(fault: Fault) -> (SimConfig, Duration, Duration) {
    let mut dies = plan("dies", 0, 8, 2);
    dies.fault_free = false;
    let mut cfg = SimConfig::new(2, 1, 10, 8)
        .with(dies)
        .with(at("waits", 1, 8, 2, 21 * MS));
    cfg.prefill_chunk_time = MS;
    cfg.faults = vec![FaultEvent { at: 25 * MS, fault }];
    cfg.heal_at = 30_100 * MS;
    let receiver = &cfg.decode[0].receiver;
    let (idle, stall) = (receiver.request_idle_timeout, receiver.stall_timeout);
    assert!(
        stall < idle,
        "the stall rule acts first while another sender waits"
    );
    (cfg, stall, idle)
}

/// Requests the decoder never consumes are released after their TTL (LMCache counts their
/// slots free while they still hold memory, W12); the second is admitted only then.
#[test]
fn unconsumed_requests_expire() {
    let mut cfg = SimConfig::new(1, 1, 10, 8)
        .with(plan("u1", 0, 6, 2))
        .with(at("u2", 0, 6, 2, 21 * MS));
    cfg.decoder_consumes = false;
    cfg.prefill[0].interleave = 2;
    // u2 waits out u1's TTL in the admission queue.
    cfg.decode[0].receiver.admission_timeout = Duration::from_secs(40);
    cfg.prefill[0].sender.admission_reply_timeout = Duration::from_secs(45);
    cfg.proxy.kv_ready_timeout = Duration::from_secs(40);
    let ttl = cfg.decode[0].receiver.unconsumed_ttl;
    let r = passes(cfg);
    for id in ["u1", "u2"] {
        assert!(
            rec(&r, id).ranks[0]
                .receiver_end
                .as_deref()
                .is_some_and(|e| e.contains("unconsumed_ttl")),
            "{id}"
        );
    }
    assert!(rec(&r, "u2").ranks[0].admitted_at.unwrap_or_default() >= ttl);
}
