//! A reservation that lands nothing for `stall_timeout` while another principal waits is
//! taken back (`Failure::Stalled`, docs/spec/protocol.md §Stalls). The attack it closes: a
//! sender that took the whole buffer while alone keeps its request alive with one chunk
//! every 20 s (under the 30 s idle timeout), and a sender of another host waits out its
//! admission timeout. The rule must not touch a request alone, one whose chunks land at the
//! fabric's pace, or one whose only waiters are its own principal's.

use std::time::Duration;

use kvx_proto::receiver::{
    ChecksumCheck, Failure, LandedWrite, Outcome, ReceiverEvent, ReceiverLedger,
};
use kvx_proto::wire::{AllocRequest, AllocResponse, Message};
use kvx_proto::{Instant, PeerId, Principal, ReceiverConfig, ReqKey, SlotIndex, WriteTag};

const HOG: PeerId = PeerId(1);
const OTHER: PeerId = PeerId(2);
const CHUNK: u64 = 64;
const BUFFER: u32 = 8;

fn ledger() -> ReceiverLedger {
    ReceiverLedger::new(ReceiverConfig {
        buffer_slots: BUFFER,
        ..ReceiverConfig::default()
    })
    .expect("config")
}

fn at(ms: u64) -> Instant {
    Instant::ZERO + Duration::from_millis(ms)
}

/// A kvx sender's batch of `n` chunks of `id` (of `total`).
fn batch(id: &str, n: usize, total: u32, seq: u64) -> Message {
    Message::AllocRequest(AllocRequest {
        keys: (0..n).map(|i| format!("{id}-{seq}-{i}")).collect(),
        chunk_bytes: Some(vec![CHUNK; n]),
        claim: None,
        fmt: 1,
        shape: vec![1],
        dtype: "float32".into(),
        last_chunk_toks: 1,
        req_id: id.into(),
        is_last_batch: false,
        total_chunks: total,
        seq: Some(seq),
    })
}

/// Sends `msg` and returns the replies to `peer`.
fn send(l: &mut ReceiverLedger, now: Instant, peer: PeerId, msg: Message) -> Vec<AllocResponse> {
    l.handle_message(now, peer, msg);
    l.check_invariants();
    while l.poll_grant_change().is_some() {}
    std::iter::from_fn(|| l.poll_transmit())
        .filter(|(p, _)| *p == peer)
        .map(|(_, r)| r)
        .collect()
}

/// Lands every chunk a reply granted.
fn land_all(l: &mut ReceiverLedger, now: Instant, peer: PeerId, reply: &AllocResponse) {
    let generations = reply.generations.clone().expect("a kvx reply");
    for (&slot, generation) in reply.remote_indexes.iter().zip(generations) {
        let slot = SlotIndex(slot as u32);
        let tag = WriteTag { slot, generation };
        l.handle_chunk_landed(
            now,
            LandedWrite {
                peer,
                slot,
                tag,
                bytes: CHUNK,
                checksum: ChecksumCheck::Match,
            },
        );
        l.check_invariants();
    }
}

/// Runs the ledger's timers up to `until`, as a driver does (sleep to `poll_timeout`).
fn run_until(l: &mut ReceiverLedger, until: Instant) {
    for _ in 0..10_000 {
        match l.poll_timeout() {
            Some(t) if t <= until => {
                l.handle_timeout(t);
                l.check_invariants();
            }
            _ => return,
        }
    }
    panic!("timers fire without end");
}

fn ended(l: &mut ReceiverLedger) -> Vec<(ReqKey, Outcome)> {
    std::iter::from_fn(|| l.poll_event())
        .filter_map(|e| match e {
            ReceiverEvent::Ended { key, outcome } => Some((key, outcome)),
            _ => None,
        })
        .collect()
}

/// The hog reserves the whole buffer at 0 and trickles one chunk every 20 s; the other
/// principal's one-chunk request comes at 1 s. With `stall` as the stall time: when the
/// other request was admitted (ms), and how the hog's request ended.
fn trickling_hog(stall: Duration, same_principal: bool) -> (Option<u64>, Vec<(ReqKey, Outcome)>) {
    let mut l = ReceiverLedger::new(ReceiverConfig {
        buffer_slots: BUFFER,
        stall_timeout: stall,
        ..ReceiverConfig::default()
    })
    .expect("config");
    if same_principal {
        l.bind_principal(HOG, Principal::new(7));
        l.bind_principal(OTHER, Principal::new(7));
    }
    let first = send(&mut l, at(0), HOG, batch("hog", 1, BUFFER, 1));
    land_all(&mut l, at(100), HOG, &first[0]);
    assert!(
        send(&mut l, at(1_000), OTHER, batch("other", 1, 1, 1)).is_empty(),
        "it waits"
    );
    let mut admitted_at = None;
    let mut ends = Vec::new();
    for (i, t) in (20_000..=100_000).step_by(20_000).enumerate() {
        let before = t - 1;
        run_until(&mut l, at(before));
        let evs: Vec<_> = std::iter::from_fn(|| l.poll_event()).collect();
        for e in evs {
            match e {
                ReceiverEvent::Admitted { key, waited, .. } if key.req_id.0 == "other" => {
                    admitted_at.get_or_insert(1_000 + waited.as_millis() as u64);
                }
                ReceiverEvent::Ended { key, outcome } => ends.push((key, outcome)),
                _ => {}
            }
        }
        // The hog's next trickled chunk (refused once its reservation was taken back).
        let replies = send(&mut l, at(t), HOG, batch("hog", 1, BUFFER, 2 + i as u64));
        if let Some(r) = replies.first().filter(|r| r.error.is_none()) {
            land_all(&mut l, at(t + 10), HOG, r);
        }
    }
    ends.extend(ended(&mut l));
    (admitted_at, ends)
}

#[test]
fn a_trickling_hog_holds_another_principal_back_for_the_stall_time_only() {
    let stall = ReceiverConfig::default().stall_timeout;
    let (admitted_at, ends) = trickling_hog(stall, false);
    // Its last chunk landed at 0.1 s: stalled at 0.1 s + the stall time, and the other
    // request goes in at once.
    let bound = 100 + stall.as_millis() as u64;
    assert_eq!(
        admitted_at,
        Some(bound),
        "admitted when the hog stalled: {ends:?}"
    );
    let hog = ends
        .iter()
        .find(|(k, _)| k.req_id.0 == "hog")
        .expect("the hog ended");
    assert_eq!(hog.1, Outcome::Failed(Failure::Stalled { after: stall }));
    // Without the rule (a stall time past the idle lease) the other request waits out its
    // admission timeout (30 s) and is refused.
    let (without, ends) = trickling_hog(Duration::from_secs(3600), false);
    assert_eq!(without, None, "{ends:?}");
    assert!(ends
        .iter()
        .any(|(k, o)| k.req_id.0 == "other" && *o == Outcome::Failed(Failure::AdmissionTimeout)));
}

#[test]
fn the_sender_of_a_stalled_request_is_told_why() {
    let mut l = ledger();
    let first = send(&mut l, at(0), HOG, batch("hog", 1, BUFFER, 1));
    land_all(&mut l, at(0), HOG, &first[0]);
    assert!(send(&mut l, at(1_000), OTHER, batch("other", 1, 1, 1)).is_empty());
    run_until(&mut l, at(10_000));
    let refused = send(&mut l, at(10_000), HOG, batch("hog", 1, BUFFER, 2));
    let why = refused[0].error.clone().expect("refused");
    assert!(why.contains("stall_timeout"), "{why}");
}

#[test]
fn a_request_alone_or_among_its_own_principals_requests_is_never_stalled() {
    // Alone: no one waits, so the hog keeps its reservation past any stall time (until its
    // idle lease, which its trickle renews).
    let mut l = ledger();
    let first = send(&mut l, at(0), HOG, batch("hog", 1, BUFFER, 1));
    land_all(&mut l, at(0), HOG, &first[0]);
    run_until(&mut l, at(25_000));
    assert!(ended(&mut l).is_empty(), "nothing ended while it was alone");
    // Its own principal waiting does not stall it either.
    let (admitted_at, ends) = trickling_hog(ReceiverConfig::default().stall_timeout, true);
    assert!(
        !ends
            .iter()
            .any(|(_, o)| matches!(o, Outcome::Failed(Failure::Stalled { .. }))),
        "{ends:?}"
    );
    assert_eq!(admitted_at, None, "its own waiter waits behind it");
}

#[test]
fn a_request_whose_chunks_land_at_the_fabrics_pace_is_never_stalled() {
    // One chunk every second, a stall time of five, another principal waiting all along.
    let mut l = ledger();
    let total = BUFFER;
    let first = send(&mut l, at(0), HOG, batch("steady", 1, total, 1));
    land_all(&mut l, at(0), HOG, &first[0]);
    assert!(send(&mut l, at(10), OTHER, batch("other", 1, 1, 1)).is_empty());
    for i in 1..total as u64 {
        let t = i * 1_000;
        run_until(&mut l, at(t));
        let reply = send(&mut l, at(t), HOG, batch("steady", 1, total, 1 + i));
        assert!(reply[0].error.is_none(), "chunk {i}: {reply:?}");
        land_all(&mut l, at(t + 5), HOG, &reply[0]);
    }
    assert!(ended(&mut l).is_empty(), "nothing ended");
    assert_eq!(l.stats().stalled, 0, "never stalled");
}
