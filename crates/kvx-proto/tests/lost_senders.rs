//! A sender whose last control connection closed (`ReceiverLedger::handle_peer_lost`): its
//! requests that are not ready fail at once with `Failure::SenderLost`, under either
//! placement, instead of holding their slots for `request_idle_timeout` or
//! `admission_timeout`; a ready request keeps its bytes for the decoder; another sender's
//! requests are untouched; a write of the lost sender that lands afterwards lands nowhere.

mod placement;
use placement::*;

use kvx_proto::receiver::{Failure, Outcome, ReceiverEvent, ReceiverLedger};
use kvx_proto::{ReceiverConfig, SlotIndex};

fn ended_by(evs: &[ReceiverEvent], id: &str) -> Option<Outcome> {
    evs.iter().find_map(|e| match e {
        ReceiverEvent::Ended { key, outcome } if key.req_id.0 == id => Some(outcome.clone()),
        ReceiverEvent::Returned {
            req_id, outcome, ..
        } if req_id.0 == id => Some(outcome.clone()),
        _ => None,
    })
}

#[test]
fn under_pool_placement_a_lost_senders_open_requests_fail_at_once_and_its_ready_one_stays() {
    let mut l = ReceiverLedger::new(ReceiverConfig {
        buffer_slots: 6,
        ..ReceiverConfig::default()
    })
    .expect("config");
    // A: "half" (2 of 4 chunks granted, 1 landed), "done" (1 of 1, ready), "queued" (waits: no room);
    // B: "other" (receiving).
    let half = send(&mut l, at(0), A, batch("half", 2, 4, false, 1));
    land(&mut l, at(0), A, tags(&half[0])[0]);
    let done = send(&mut l, at(0), A, batch("done", 1, 1, true, 2));
    land(&mut l, at(0), A, tags(&done[0])[0]);
    let other = send(&mut l, at(0), B, batch("other", 1, 1, false, 1));
    assert!(
        send(&mut l, at(0), A, batch("queued", 2, 6, false, 3)).is_empty(),
        "it waits"
    );
    let before = events(&mut l);
    assert!(before
        .iter()
        .any(|e| matches!(e, ReceiverEvent::Ready { key, .. } if key.req_id.0 == "done")));

    l.handle_peer_lost(at(1), A);
    l.check_invariants();
    let after = events(&mut l);
    assert_eq!(
        ended_by(&after, "half"),
        Some(Outcome::Failed(Failure::SenderLost))
    );
    assert_eq!(
        ended_by(&after, "queued"),
        Some(Outcome::Failed(Failure::SenderLost))
    );
    assert_eq!(
        ended_by(&after, "done"),
        None,
        "a ready request keeps its bytes"
    );
    assert_eq!(
        ended_by(&after, "other"),
        None,
        "another sender's request is untouched"
    );
    // The ready one is still consumed as ever.
    let done_key = key(A, "done");
    assert_eq!(l.handle_acquire(&done_key).expect("ready").len(), 1);
    l.handle_consume(at(1), &done_key).expect("consumed");
    // The lost sender's granted slots are not handed out while a write may still land:
    // the rest of the buffer is free, they are not.
    // Of "half", the slot whose write landed is free again; the other, whose write may
    // still come, is quarantined. The rest of the buffer is free, but for B's.
    let _ = other;
    assert_eq!(l.quarantined_slots(), 1);
    assert_eq!(l.free_slots(), 6 - 1 - 1);
    l.check_invariants();
}

#[test]
fn under_caller_placement_a_lost_claimant_returns_the_reservation_at_once() {
    // On a fabric whose revocations stop writes (TCP, shared memory), as the vLLM connector
    // runs: the slots go back as the grants are revoked, without quarantine.
    let mut l = caller_ledger(8).with_revocation_stopping_writes();
    l.handle_reserve(at(0), "r", slots(&[5, 2, 7]), secret("r"))
        .expect("reserved");
    let granted = send(&mut l, at(0), A, batch("r", 3, 3, false, 1));
    land(&mut l, at(0), A, tags(&granted[0])[0]);
    // A claim of A that waits for a reservation nobody made yet, and B's claimed one.
    assert!(
        send(&mut l, at(0), A, batch("later", 1, 1, true, 2)).is_empty(),
        "it waits"
    );
    l.handle_reserve(at(0), "b", slots(&[1]), secret("b"))
        .expect("reserved");
    send(&mut l, at(0), B, batch("b", 1, 1, false, 1));
    events(&mut l);

    l.handle_peer_lost(at(1), A);
    // The waiting claim's refusal goes out to A's id (lost with it, as any reply to a gone
    // peer), with the reason.
    let refused = replies(&mut l);
    assert!(
        refused.iter().all(|r| r
            .error
            .as_deref()
            .is_some_and(|e| e.contains("control connection closed"))),
        "{refused:?}"
    );
    let evs = events(&mut l);
    let (back, outcome) = returned(&evs).expect("the reservation came back");
    assert_eq!(back, slots(&[5, 2, 7]));
    assert_eq!(outcome, Outcome::Failed(Failure::SenderLost));
    assert!(
        evs.iter()
            .all(|e| !matches!(e, ReceiverEvent::Returned { req_id, .. } if req_id.0 == "b")),
        "B's reservation is untouched: {evs:?}"
    );
    // A's waiting claim is gone: B, with the secret, claims "later" once it is reserved.
    l.handle_reserve(at(2), "later", slots(&[0]), secret("later"))
        .expect("reserved");
    let claimed = send(&mut l, at(2), B, batch("later", 1, 1, true, 2));
    assert_eq!(tags(&claimed[0]).len(), 1, "claimed by B");
    // A late write of the lost sender lands nowhere.
    let stale = tags(&granted[0])[1];
    land(&mut l, at(3), A, stale);
    assert!(
        events(&mut l)
            .iter()
            .all(|e| !matches!(e, ReceiverEvent::Ready { .. })),
        "nothing became ready from a lost sender's write"
    );
    assert_eq!(
        l.slot_state(SlotIndex(2)),
        l.slot_state(SlotIndex(6)),
        "slot 2 is the application's again"
    );
}

#[test]
fn a_peer_with_nothing_open_changes_nothing() {
    let mut l = caller_ledger(4);
    l.handle_peer_lost(at(0), A);
    l.check_invariants();
    assert!(events(&mut l).is_empty());
    assert!(l.is_quiescent());
}
