//! The decoder's read lease on a ready request (`handle_acquire`): a cancel that arrives
//! while the decoder reads must not free the slots under it (the demo once read another
//! request's bytes that way); without a lease, the cancel frees them at once.

use kvx_proto::receiver::{Failure, Outcome, ReceiverEvent, ReceiverLedger};
use kvx_proto::wire::{AllocRequest, CancelNotif, Message};
use kvx_proto::{Instant, LegacySenders, PeerId, ReceiverConfig, ReqId, ReqKey};

const PEER: PeerId = PeerId(7);

fn ready_request(ledger: &mut ReceiverLedger, id: &str) -> ReqKey {
    let batch = AllocRequest {
        keys: vec!["k0".into(), "k1".into()],
        chunk_bytes: None,
        claim: None,
        fmt: 1,
        shape: vec![1],
        dtype: "bfloat16".into(),
        last_chunk_toks: 1,
        req_id: id.into(),
        is_last_batch: true,
        total_chunks: 2,
        seq: None, // an LMCache-style sender: ready when the proxy says so
    };
    ledger.handle_message(Instant::ZERO, PEER, Message::AllocRequest(batch));
    while ledger.poll_transmit().is_some() {}
    let key = ReqKey {
        peer: PEER,
        req_id: ReqId(id.into()),
    };
    ledger
        .handle_external_ready(Instant::ZERO, &key)
        .expect("allocated");
    let mut ready = false;
    while let Some(ev) = ledger.poll_event() {
        ready |= matches!(ev, ReceiverEvent::Ready { .. });
    }
    assert!(ready, "{id} is ready");
    key
}

fn cancel(ledger: &mut ReceiverLedger, id: &str) {
    let msg = CancelNotif {
        req_id: id.into(),
        keys: vec![],
        seq: None,
        drained: Some(true),
    };
    ledger.handle_message(Instant::ZERO, PEER, Message::CancelNotif(msg));
    while ledger.poll_transmit().is_some() {}
}

fn ended(ledger: &mut ReceiverLedger) -> Option<Outcome> {
    let mut out = None;
    while let Some(ev) = ledger.poll_event() {
        if let ReceiverEvent::Ended { outcome, .. } = ev {
            out = Some(outcome);
        }
    }
    out
}

#[test]
fn a_cancel_during_a_read_waits_for_the_consume() {
    let mut ledger = ReceiverLedger::new(ReceiverConfig {
        buffer_slots: 4,
        legacy_senders: LegacySenders::AfterProxy,
        ..ReceiverConfig::default()
    })
    .expect("config");
    let key = ready_request(&mut ledger, "r");
    let slots = ledger.handle_acquire(&key).expect("lease");
    assert_eq!(slots.len(), 2);
    cancel(&mut ledger, "r");
    ledger.check_invariants();
    assert_eq!(
        ledger.held_slots(),
        2,
        "the slots stay while the decoder reads"
    );
    assert_eq!(ended(&mut ledger), None);
    ledger.handle_consume(Instant::ZERO, &key).expect("consume");
    assert_eq!(
        ended(&mut ledger),
        Some(Outcome::Failed(Failure::Cancelled)),
        "the cancel still counts"
    );
    assert!(ledger.is_quiescent());
}

#[test]
fn a_cancel_before_the_lease_frees_at_once_and_the_lease_is_refused() {
    let mut ledger = ReceiverLedger::new(ReceiverConfig {
        buffer_slots: 4,
        legacy_senders: LegacySenders::AfterProxy,
        ..ReceiverConfig::default()
    })
    .expect("config");
    let key = ready_request(&mut ledger, "r");
    cancel(&mut ledger, "r");
    assert_eq!(
        ended(&mut ledger),
        Some(Outcome::Failed(Failure::Cancelled))
    );
    assert!(ledger.is_quiescent());
    assert!(ledger.handle_acquire(&key).is_err(), "nothing left to read");
}

/// The ledger's counts (the receiver's metrics) move with what happens: a consumed request,
/// a rolled-back one, a message a receiver never takes (refused with the bare -1); and it is
/// quiescent only when nothing is tracked.
#[test]
fn the_ledger_counts_consumed_rolled_back_and_refused() {
    let mut ledger = ReceiverLedger::new(ReceiverConfig {
        buffer_slots: 4,
        legacy_senders: LegacySenders::AfterProxy,
        ..ReceiverConfig::default()
    })
    .expect("config");
    assert!(ledger.is_quiescent());
    let a = ready_request(&mut ledger, "a");
    assert!(!ledger.is_quiescent(), "a is ready and holds its slots");
    ledger.handle_acquire(&a).expect("lease");
    ledger.handle_consume(Instant::ZERO, &a).expect("consume");
    assert_eq!(ended(&mut ledger), Some(Outcome::Consumed));
    ready_request(&mut ledger, "b");
    cancel(&mut ledger, "b");
    assert_eq!(
        ended(&mut ledger),
        Some(Outcome::Failed(Failure::Cancelled))
    );
    let notice = kvx_proto::wire::ProxyNotif { req_id: "c".into() };
    ledger.handle_message(Instant::ZERO, PEER, Message::ProxyNotif(notice));
    let (to, refusal) = ledger.poll_transmit().expect("a refusal");
    assert_eq!(to, PEER);
    assert_eq!(refusal.remote_indexes, vec![-1]);
    let stats = ledger.stats();
    assert_eq!(
        (
            stats.admitted,
            stats.consumed,
            stats.rolled_back,
            stats.refused
        ),
        (2, 1, 1, 1),
        "{stats:?}"
    );
    assert!(ledger.is_quiescent());
    ledger.check_invariants();
}
