//! Every size a sender controls is bounded before the receiver keeps it (the memory
//! amplification a hostile review found: 40 first batches of 1 MiB waiting for admission took a
//! receiver from 7 MB to 1 GB; tombstones kept 1 MiB ids twice for ten minutes). Each test
//! floods the ledger and checks what it holds stays under its bound; the same flood with the
//! bound lifted shows the test can fail.

use kvx_proto::receiver::{Failure, Outcome, ReceiverEvent, ReceiverLedger};
use kvx_proto::wire::{AllocRequest, CancelNotif, Message};
use kvx_proto::{Instant, PeerId, ReceiverConfig};

fn batch(id: String, keys: Vec<String>, total: u32) -> Message {
    Message::AllocRequest(AllocRequest {
        chunk_bytes: Some(vec![64; keys.len()]),
        claim: None,
        keys,
        fmt: 1,
        shape: vec![2, 2, 256, 64],
        dtype: "bfloat16".into(),
        last_chunk_toks: 1,
        req_id: id,
        is_last_batch: false,
        total_chunks: total,
        seq: Some(1),
    })
}

fn ledger(cfg: ReceiverConfig) -> ReceiverLedger {
    ReceiverLedger::new(cfg).expect("config")
}

fn failures(l: &mut ReceiverLedger) -> Vec<Failure> {
    std::iter::from_fn(|| l.poll_event())
        .filter_map(|e| match e {
            ReceiverEvent::Ended {
                outcome: Outcome::Failed(f),
                ..
            } => Some(f),
            _ => None,
        })
        .collect()
}

#[test]
fn a_huge_req_id_is_refused_briefly_and_not_remembered() {
    let mut l = ledger(ReceiverConfig::default());
    let id = "x".repeat(1 << 20);
    l.handle_message(Instant::ZERO, PeerId(1), batch(id.clone(), vec![], 1));
    let (_, reply) = l.poll_transmit().expect("a refusal");
    let why = reply.error.expect("a reason");
    assert!(why.contains("req_id_bytes_max"), "{why}");
    assert!(
        why.len() < 1024,
        "the reply does not echo the id: {} bytes",
        why.len()
    );
    assert_eq!(l.tracked_requests(), 0);
    // A cancel of it is acknowledged and not remembered either; a normal id still works.
    let cancel = CancelNotif {
        req_id: id,
        keys: vec![],
        seq: Some(2),
        drained: None,
    };
    l.handle_message(Instant::ZERO, PeerId(1), Message::CancelNotif(cancel));
    assert!(l.poll_transmit().is_some());
    l.handle_message(Instant::ZERO, PeerId(1), batch("ok".into(), vec![], 1));
    let (_, reply) = l.poll_transmit().expect("a reply");
    assert!(!reply.is_refusal());
    l.check_invariants();
}

#[test]
fn huge_keys_and_more_keys_than_declared_are_refused_before_queueing() {
    let mut l = ledger(ReceiverConfig {
        buffer_slots: 4,
        peer_share_percent: 100,
        ..ReceiverConfig::default()
    });
    // Fill the buffer so that every later first batch would wait.
    l.handle_message(Instant::ZERO, PeerId(1), batch("full".into(), vec![], 4));
    let huge = vec!["k".repeat(64 << 10)];
    l.handle_message(Instant::ZERO, PeerId(2), batch("a".into(), huge, 1));
    let many: Vec<String> = (0..1000).map(|i| format!("k{i}")).collect();
    l.handle_message(Instant::ZERO, PeerId(2), batch("b".into(), many, 2));
    assert_eq!(l.admission_queue_len(), 0, "nothing was queued");
    let f = failures(&mut l);
    assert!(
        matches!(&f[..], [Failure::TooLarge(a), Failure::ProtocolViolation(b)]
            if a.contains("key_bytes_max") && b.contains("1000 keys")),
        "{f:?}"
    );
    l.check_invariants();
}

/// The bounds are inclusive: an id of exactly `req_id_bytes_max` bytes and a key of exactly
/// `key_bytes_max` are served (and the id's cancel releases it), one byte more is refused.
#[test]
fn an_id_and_a_key_at_their_bounds_are_served() {
    let cfg = ReceiverConfig {
        buffer_slots: 4,
        peer_share_percent: 100,
        req_id_bytes_max: 32,
        key_bytes_max: 16,
        ..ReceiverConfig::default()
    };
    let mut l = ledger(cfg.clone());
    assert_eq!(l.config(), &cfg, "the ledger keeps its config");
    let id = "i".repeat(32);
    l.handle_message(
        Instant::ZERO,
        PeerId(1),
        batch(id.clone(), vec!["k".repeat(16)], 2),
    );
    assert!(failures(&mut l).is_empty(), "both at their bounds");
    assert_eq!(l.reserved_total(), 2, "admitted");
    let cancel = CancelNotif {
        req_id: id,
        keys: vec![],
        seq: Some(2),
        drained: None,
    };
    l.handle_message(Instant::ZERO, PeerId(1), Message::CancelNotif(cancel));
    assert_eq!(l.reserved_total(), 0, "its cancel released it");
    assert!(matches!(&failures(&mut l)[..], [Failure::Cancelled]));
    l.handle_message(Instant::ZERO, PeerId(1), batch("j".repeat(33), vec![], 1));
    l.handle_message(
        Instant::ZERO,
        PeerId(1),
        batch("k".into(), vec!["k".repeat(17)], 1),
    );
    let f = failures(&mut l);
    assert_eq!(f.len(), 1, "the key one byte over is refused: {f:?}");
    assert!(matches!(&f[0], Failure::TooLarge(w) if w.contains("key_bytes_max")));
    assert_eq!(
        l.tracked_requests(),
        0,
        "the id one byte over is not kept either"
    );
    l.check_invariants();
}

/// 40 first batches of about 1 MiB of keys each wait for a full buffer.
fn flood_the_queue(queued_bytes_max: usize) -> (usize, Vec<Failure>) {
    let mut l = ledger(ReceiverConfig {
        buffer_slots: 4096,
        peer_share_percent: 100,
        queued_bytes_max,
        ..ReceiverConfig::default()
    });
    l.handle_message(Instant::ZERO, PeerId(1), batch("full".into(), vec![], 4096));
    for i in 0..40 {
        let keys: Vec<String> = (0..1024)
            .map(|k| format!("{i}-{k}-{}", "k".repeat(1000)))
            .collect();
        l.handle_message(Instant::ZERO, PeerId(2), batch(format!("r{i}"), keys, 1024));
    }
    l.check_invariants();
    let waiting = l.admission_queue_len();
    (waiting, failures(&mut l))
}

#[test]
fn first_batches_waiting_for_admission_hold_at_most_queued_bytes_max() {
    let (waiting, refused) = flood_the_queue(16 << 20);
    assert!(
        waiting <= 16,
        "{waiting} batches of 1 MiB wait within 16 MiB"
    );
    assert_eq!(waiting + refused.len(), 40);
    assert!(refused
        .iter()
        .all(|f| matches!(f, Failure::TooLarge(w) if w.contains("queued_bytes_max"))));
    let (waiting, _) = flood_the_queue(usize::MAX);
    assert_eq!(
        waiting, 40,
        "without the bound all 40 MiB wait (this test can fail)"
    );
}

#[test]
fn tombstones_hold_at_most_tombstones_bytes_max() {
    let bytes_max = 1 << 20;
    let mut l = ledger(ReceiverConfig {
        tombstones_bytes_max: bytes_max,
        ..ReceiverConfig::default()
    });
    // 10 000 cancels of unknown 500-byte ids: each is remembered, about 1 KiB apiece.
    for i in 0..10_000 {
        let cancel = CancelNotif {
            req_id: format!("{i:0>500}"),
            keys: vec![],
            seq: Some(i),
            drained: None,
        };
        l.handle_message(Instant::ZERO, PeerId(1), Message::CancelNotif(cancel));
        while l.poll_transmit().is_some() {}
    }
    assert!(
        l.tombstone_bytes() <= bytes_max,
        "{} bytes of tombstones",
        l.tombstone_bytes()
    );
    assert!(l.tombstone_bytes() > bytes_max / 2, "and they are used");
}
