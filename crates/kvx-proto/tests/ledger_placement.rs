//! Caller placement (`Placement::Caller`, docs/spec/protocol.md §Caller placement): the
//! application lends each request's slots, chunk i goes to the reservation's slot i, a
//! reservation is claimed once, and its slots come back (`Returned`) only once no write can
//! land in them.

use std::time::Duration;

mod placement;
use placement::*;

use kvx_proto::receiver::{Failure, Outcome, PlacementError, ReceiverEvent, ReceiverLedger};
use kvx_proto::slots::SlotState;
use kvx_proto::wire::{AllocRequest, AllocResponse, Message};
use kvx_proto::{ClaimSecret, PeerId, Placement, ReceiverConfig, SlotIndex, WriteTag};

#[test]
fn chunks_go_to_the_reserved_slots_in_order_and_come_back_after_the_consume() {
    let mut ledger = caller_ledger(8);
    ledger
        .handle_reserve(at(0), "r", slots(&[5, 2, 7]), secret("r"))
        .expect("reserve");
    let first = send(&mut ledger, at(0), A, batch("r", 2, 3, false, 1));
    let second = send(&mut ledger, at(0), A, batch("r", 1, 3, true, 2));
    let granted: Vec<WriteTag> = tags(&first[0])
        .into_iter()
        .chain(tags(&second[0]))
        .collect();
    let order: Vec<u32> = granted.iter().map(|t| t.slot.0).collect();
    assert_eq!(order, [5, 2, 7], "chunk i goes to the reservation's slot i");
    for &tag in &granted {
        land(&mut ledger, at(0), A, tag);
    }
    let evs = events(&mut ledger);
    let ready = evs.iter().find_map(|e| match e {
        ReceiverEvent::Ready { slots, .. } => Some(slots.clone()),
        _ => None,
    });
    assert_eq!(ready, Some(slots(&[5, 2, 7])));
    assert_eq!(returned(&evs), None, "lent until consumed");
    let k = key(A, "r");
    ledger.handle_acquire(&k).expect("ready");
    ledger.handle_consume(at(1), &k).expect("consume");
    ledger.check_invariants();
    let evs = events(&mut ledger);
    assert_eq!(ended(&evs), Some(Outcome::Consumed));
    assert_eq!(returned(&evs), Some((slots(&[5, 2, 7]), Outcome::Consumed)));
    for s in [5, 2, 7] {
        assert_eq!(ledger.slot_state(SlotIndex(s)), SlotState::Caller);
    }
    // The slots may be lent again, and a new grant of a slot carries a new generation.
    ledger
        .handle_reserve(at(1), "r2", slots(&[7]), secret("r2"))
        .expect("lent again");
    let again = send(&mut ledger, at(1), A, batch("r2", 1, 1, true, 3));
    let tag = tags(&again[0])[0];
    assert_eq!(tag.slot, SlotIndex(7));
    assert_ne!(tag.generation, granted[2].generation, "a fresh grant");
    // The old grant's write is stale now: it changes nothing.
    land(&mut ledger, at(1), A, granted[2]);
    assert_eq!(ledger.slot_state(SlotIndex(7)), ledger.slot_state(tag.slot));
    assert!(matches!(
        ledger.slot_state(SlotIndex(7)),
        SlotState::Granted { .. }
    ));
}

#[test]
fn a_claim_before_its_reservation_waits_for_it() {
    let mut ledger = caller_ledger(4);
    let early = send(&mut ledger, at(0), A, batch("r", 2, 2, true, 1));
    assert!(
        early.is_empty(),
        "no answer before the reservation: {early:?}"
    );
    ledger
        .handle_reserve(at(2), "r", slots(&[3, 1]), secret("r"))
        .expect("reserve");
    let granted = replies(&mut ledger);
    assert_eq!(granted.len(), 1);
    let order: Vec<u32> = tags(&granted[0]).iter().map(|t| t.slot.0).collect();
    assert_eq!(order, [3, 1]);
    let evs = events(&mut ledger);
    let waited = evs.iter().find_map(|e| match e {
        ReceiverEvent::Admitted { waited, .. } => Some(*waited),
        _ => None,
    });
    assert_eq!(waited, Some(Duration::from_secs(2)));
}

#[test]
fn a_claim_never_reserved_is_refused_at_the_admission_timeout() {
    let mut ledger = caller_ledger(4);
    assert!(send(&mut ledger, at(0), A, batch("r", 1, 1, true, 1)).is_empty());
    let deadline = ledger.poll_timeout().expect("a deadline");
    assert_eq!(
        deadline,
        at(0) + ReceiverConfig::default().admission_timeout
    );
    ledger.handle_timeout(deadline);
    let refused = replies(&mut ledger);
    assert_eq!(refused.len(), 1);
    assert!(
        refused[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("admission timed out")),
        "{refused:?}"
    );
    assert_eq!(
        ended(&events(&mut ledger)),
        Some(Outcome::Failed(Failure::AdmissionTimeout))
    );
    assert_eq!(ledger.tracked_requests(), 0);
    // A reservation made later is not claimed by the refused batch.
    ledger
        .handle_reserve(deadline, "r", slots(&[0]), secret("r"))
        .expect("reserve");
    assert!(replies(&mut ledger).is_empty());
}

#[test]
fn an_unclaimed_reservation_is_returned_at_its_deadline_or_when_withdrawn() {
    let mut ledger = caller_ledger(4);
    ledger
        .handle_reserve(at(0), "late", slots(&[0, 1]), secret("late"))
        .expect("reserve");
    ledger
        .handle_reserve(at(0), "aborted", slots(&[2]), secret("aborted"))
        .expect("reserve");
    ledger.handle_withdraw(at(1), "aborted").expect("withdraw");
    ledger.check_invariants();
    let evs = events(&mut ledger);
    assert_eq!(
        returned(&evs),
        Some((slots(&[2]), Outcome::Failed(Failure::Withdrawn)))
    );
    assert_eq!(ended(&evs), None, "no request was tracked");
    let deadline = ledger.poll_timeout().expect("the reservation's deadline");
    let admission = ReceiverConfig::default().admission_timeout;
    assert_eq!(deadline, at(0) + admission);
    ledger.handle_timeout(at(0) + (admission - Duration::from_millis(1)));
    assert_eq!(returned(&events(&mut ledger)), None);
    ledger.handle_timeout(deadline);
    ledger.check_invariants();
    assert_eq!(
        returned(&events(&mut ledger)),
        Some((slots(&[0, 1]), Outcome::Failed(Failure::Unclaimed)))
    );
    // Its sender's batch, now, waits for a reservation that will not come.
    assert!(send(&mut ledger, deadline, A, batch("late", 2, 2, true, 1)).is_empty());
}

/// A withdrawal while a write is in flight: the request fails at once, but the slot its
/// write may still reach stays out of the application's hands until that write lands or the
/// write quarantine passes.
#[test]
fn a_withdrawal_returns_the_slots_only_once_no_write_can_land() {
    for late_write in [true, false] {
        let mut ledger = caller_ledger(4);
        ledger
            .handle_reserve(at(0), "r", slots(&[2, 0, 3]), secret("r"))
            .expect("reserve");
        let granted = tags(&send(&mut ledger, at(0), A, batch("r", 2, 3, false, 1))[0]);
        land(&mut ledger, at(0), A, granted[0]);
        ledger.handle_withdraw(at(1), "r").expect("withdraw");
        ledger.check_invariants();
        let evs = events(&mut ledger);
        assert_eq!(ended(&evs), Some(Outcome::Failed(Failure::Withdrawn)));
        assert_eq!(returned(&evs), None, "slot 0's write may still land");
        // The sender's next batch is refused.
        let refused = send(&mut ledger, at(1), A, batch("r", 1, 3, true, 2));
        assert!(refused[0].error.is_some(), "{refused:?}");
        let quarantine = ReceiverConfig::default().write_quarantine;
        if late_write {
            land(&mut ledger, at(2), A, granted[1]);
        } else {
            ledger.handle_timeout(at(1) + (quarantine - Duration::from_millis(1)));
            assert_eq!(
                returned(&events(&mut ledger)),
                None,
                "not before the quarantine ends"
            );
            ledger.handle_timeout(at(1) + quarantine);
        }
        ledger.check_invariants();
        assert_eq!(
            returned(&events(&mut ledger)),
            Some((slots(&[2, 0, 3]), Outcome::Failed(Failure::Withdrawn))),
            "late write seen: {late_write}"
        );
        assert!(ledger.is_quiescent());
    }
}

#[test]
fn a_reservation_is_claimed_once() {
    let mut ledger = caller_ledger(4);
    ledger
        .handle_reserve(at(0), "r", slots(&[0]), secret("r"))
        .expect("reserve");
    assert!(tags(&send(&mut ledger, at(0), A, batch("r", 1, 1, true, 1))[0]).len() == 1);
    let second = send(&mut ledger, at(0), B, batch("r", 1, 1, true, 1));
    assert!(
        second[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("already claimed")),
        "{second:?}"
    );
    assert_eq!(
        ended(&events(&mut ledger)),
        Some(Outcome::Failed(Failure::AlreadyClaimed))
    );
    // Also when both claims came before the reservation (a duplicate prefill that knows
    // the secret too): both wait, since which of them proves the secret is known only once
    // the reservation comes; then the first is admitted and the second refused.
    assert!(send(&mut ledger, at(0), A, batch("w", 1, 1, true, 2)).is_empty());
    assert!(send(&mut ledger, at(0), B, batch("w", 1, 1, true, 2)).is_empty());
    ledger
        .handle_reserve(at(0), "w", slots(&[1]), secret("w"))
        .expect("reserve");
    let answers: Vec<_> = std::iter::from_fn(|| ledger.poll_transmit()).collect();
    ledger.check_invariants();
    assert_eq!(answers.len(), 2, "{answers:?}");
    let rival = answers
        .iter()
        .find(|(peer, _)| *peer == B)
        .expect("B answered");
    assert!(
        rival
            .1
            .error
            .as_deref()
            .is_some_and(|e| e.contains("already claimed")),
        "{rival:?}"
    );
    let granted: Vec<_> = answers
        .into_iter()
        .filter(|(peer, _)| *peer == A)
        .map(|(_, r)| r)
        .collect();
    assert_eq!(granted.len(), 1, "the first claimer's batch is answered");
    // B's write into A's grant is refused.
    let tag = tags(&granted[0])[0];
    land(&mut ledger, at(0), B, tag);
    assert!(matches!(
        ledger.slot_state(tag.slot),
        SlotState::Granted { .. }
    ));
}

#[test]
fn a_claim_larger_than_its_reservation_is_refused_and_the_slots_returned() {
    let mut ledger = caller_ledger(4);
    ledger
        .handle_reserve(at(0), "r", slots(&[0, 1]), secret("r"))
        .expect("reserve");
    let refused = send(&mut ledger, at(0), A, batch("r", 1, 3, false, 1));
    assert!(
        refused[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("lends 2 slots")),
        "{refused:?}"
    );
    let evs = events(&mut ledger);
    let failure = Failure::LargerThanReservation {
        need: 3,
        reserved: 2,
    };
    assert_eq!(ended(&evs), Some(Outcome::Failed(failure.clone())));
    assert_eq!(
        returned(&evs),
        Some((slots(&[0, 1]), Outcome::Failed(failure)))
    );
    assert!(ledger.is_quiescent());
}

#[test]
fn a_reservation_that_cannot_be_lent_is_refused_with_nothing_changed() {
    let mut pool = ReceiverLedger::new(ReceiverConfig::default()).expect("config");
    assert_eq!(
        pool.handle_reserve(at(0), "r", slots(&[0]), secret("r")),
        Err(PlacementError::NotCaller)
    );
    assert_eq!(
        pool.handle_withdraw(at(0), "r"),
        Err(PlacementError::NotCaller)
    );
    let mut ledger = caller_ledger(4);
    ledger
        .handle_reserve(at(0), "held", slots(&[1]), secret("held"))
        .expect("reserve");
    let long = "x".repeat(ReceiverConfig::default().req_id_bytes_max + 1);
    for (id, list, want) in [
        ("", vec![0], "request id of 0 bytes"),
        (long.as_str(), vec![0], "must be 1..="),
        ("r", vec![], "at least one slot"),
        ("r", vec![4], "outside the buffer's 4 slots"),
        ("r", vec![0, 0], "slot 0 is already reserved"),
        (
            "r",
            vec![0, 1],
            "slot 1 is already reserved (for request held)",
        ),
        ("held", vec![2], "request held is already reserved"),
    ] {
        let err = ledger
            .handle_reserve(at(0), id, slots(&list), secret(id))
            .expect_err(want);
        assert!(err.to_string().contains(want), "{err} lacks {want:?}");
        ledger.check_invariants();
    }
    assert!(matches!(
        ledger.handle_withdraw(at(0), "r"),
        Err(PlacementError::Unknown(_))
    ));
    assert!(events(&mut ledger).is_empty(), "nothing changed");
    assert_eq!(ledger.slot_state(SlotIndex(0)), SlotState::Caller);
}

/// On a fabric that stops a revoked grant's write (TCP, shared memory), the withdrawal
/// revokes the grants (the driver mirrors the change before the application hears of the
/// return) and the slots come back at once; a late write of the old grant changes nothing.
#[test]
fn on_a_fabric_that_stops_revoked_writes_a_withdrawal_returns_the_slots_at_once() {
    let mut ledger = caller_ledger(4).with_revocation_stopping_writes();
    ledger
        .handle_reserve(at(0), "r", slots(&[2, 0, 3]), secret("r"))
        .expect("reserve");
    ledger.handle_message(at(0), A, Message::AllocRequest(batch("r", 2, 3, false, 1)));
    let granted = {
        while ledger.poll_grant_change().is_some() {}
        tags(&ledger.poll_transmit().expect("granted").1)
    };
    land(&mut ledger, at(0), A, granted[0]);
    ledger.handle_withdraw(at(1), "r").expect("withdraw");
    ledger.check_invariants();
    let revoked: Vec<_> = std::iter::from_fn(|| ledger.poll_grant_change())
        .filter(|c| c.grant.is_none())
        .map(|c| c.slot.0)
        .collect();
    assert_eq!(
        revoked,
        [2, 0],
        "both grants revoked, the landed one and the one in flight"
    );
    let evs = events(&mut ledger);
    assert_eq!(
        returned(&evs),
        Some((slots(&[2, 0, 3]), Outcome::Failed(Failure::Withdrawn))),
        "returned with the revocation, no quarantine"
    );
    assert!(ledger.is_quiescent());
    land(&mut ledger, at(2), A, granted[1]);
    assert_eq!(ledger.slot_state(SlotIndex(0)), SlotState::Caller);
    assert!(events(&mut ledger).is_empty());
}

/// The first `held` chunks of a reservation are the application's already (a decode engine's
/// local prefix hit): the sender, which sends every chunk, is told they are sent, and only the
/// rest take the reserved slots and must land before the request is ready.
#[test]
fn chunks_the_application_holds_are_answered_as_sent_and_take_no_slot() {
    let mut ledger = caller_ledger(8);
    ledger
        .handle_reserve_held(at(0), "r", 3, slots(&[6, 1]), secret("r"))
        .expect("reserve");
    // A probe, then a batch of chunks 0..2 (all held), then 2..5 (one held, two written).
    assert!(tags(&send(&mut ledger, at(0), A, batch("r", 0, 5, false, 1))[0]).is_empty());
    let first = send(&mut ledger, at(0), A, batch("r", 2, 5, false, 2));
    assert_eq!(first[0].already_sent_indexes, [0, 1]);
    assert!(tags(&first[0]).is_empty(), "held chunks take no slot");
    let second = send(&mut ledger, at(0), A, batch("r", 3, 5, true, 3));
    assert_eq!(
        second[0].already_sent_indexes,
        [0],
        "chunk 2 is the last one held"
    );
    let granted = tags(&second[0]);
    let order: Vec<u32> = granted.iter().map(|t| t.slot.0).collect();
    assert_eq!(
        order,
        [6, 1],
        "chunk held + i goes to the reservation's slot i"
    );
    land(&mut ledger, at(0), A, granted[0]);
    assert!(
        !events(&mut ledger)
            .iter()
            .any(|e| matches!(e, ReceiverEvent::Ready { .. })),
        "not ready before every written chunk landed"
    );
    land(&mut ledger, at(0), A, granted[1]);
    let ready = events(&mut ledger).into_iter().find_map(|e| match e {
        ReceiverEvent::Ready { slots, .. } => Some(slots),
        _ => None,
    });
    assert_eq!(ready, Some(slots(&[6, 1])));
    let k = key(A, "r");
    ledger.handle_acquire(&k).expect("ready");
    ledger.handle_consume(at(1), &k).expect("consume");
    let evs = events(&mut ledger);
    assert_eq!(returned(&evs), Some((slots(&[6, 1]), Outcome::Consumed)));
}

/// A claim that declares more chunks than held + reserved is refused; one that would write
/// nothing past the held ones is a protocol violation; and a later batch still declares the
/// sender's own total, not the written count.
#[test]
fn held_chunks_are_counted_against_the_declared_total() {
    let mut ledger = caller_ledger(8);
    ledger
        .handle_reserve_held(at(0), "big", 1, slots(&[0, 1]), secret("big"))
        .expect("reserve");
    let refused = send(&mut ledger, at(0), A, batch("big", 1, 4, false, 1));
    assert!(
        refused[0].error.is_some(),
        "4 chunks need more than 1 held + 2 slots"
    );
    let evs = events(&mut ledger);
    assert!(matches!(
        ended(&evs),
        Some(Outcome::Failed(Failure::LargerThanReservation {
            need: 3,
            reserved: 2
        }))
    ));

    ledger
        .handle_reserve_held(at(0), "none", 2, slots(&[2]), secret("none"))
        .expect("reserve");
    let refused = send(&mut ledger, at(0), A, batch("none", 1, 2, false, 2));
    assert!(
        refused[0].error.is_some(),
        "nothing past the held chunks to write"
    );

    ledger
        .handle_reserve_held(at(0), "ok", 1, slots(&[3, 4]), secret("ok"))
        .expect("reserve");
    let first = send(&mut ledger, at(0), A, batch("ok", 1, 3, false, 3));
    assert_eq!(first[0].already_sent_indexes, [0]);
    let second = send(&mut ledger, at(0), A, batch("ok", 2, 3, true, 4));
    assert!(second[0].already_sent_indexes.is_empty());
    assert_eq!(
        tags(&second[0]).len(),
        2,
        "the declared total (3) is the sender's"
    );
}

/// Claims for ids nobody reserved (ghosts) have budgets: a principal waits for at most its
/// share of the buffer's slots (`peer_cap`), all senders together for the buffer's slots;
/// past them a ghost is refused at once, naming the bound. A claim whose reservation is out
/// is never refused for them: 9,000 ghosts from 40 identities of one principal, and 300
/// from another, leave the real claim admitted at once.
#[test]
fn ghost_claims_have_budgets_and_never_crowd_out_a_reserved_claim() {
    use kvx_proto::Principal;
    let mut ledger = caller_ledger(16);
    let attacker = Principal::new(7);
    // Sends a ghost claim; which budget refused it, if one did.
    let ghost = |ledger: &mut ReceiverLedger, peer: PeerId, n: u32| -> Option<bool> {
        let id = format!("ghost-{}-{n}", peer.0);
        let answers = send(ledger, at(0), peer, batch(&id, 1, 1, true, 1));
        let why = answers.into_iter().next()?.error.unwrap_or_default();
        match () {
            () if why.contains("this sender's share") => Some(true),
            () if why.contains("all senders together") => Some(false),
            () => panic!("a ghost refused for another reason: {why}"),
        }
    };
    let (mut refused_own, mut refused_all) = (0, 0);
    for n in 0..9_000u32 {
        let peer = PeerId(100 + u64::from(n % 40));
        ledger.bind_principal(peer, attacker);
        match ghost(&mut ledger, peer, n) {
            Some(true) => refused_own += 1,
            Some(false) => refused_all += 1,
            None => {}
        }
    }
    // The default share is 75 %: 12 of 16 slots.
    assert_eq!(
        ledger.tracked_requests(),
        12,
        "one principal waits for its share at most"
    );
    assert_eq!(refused_own, 9_000 - 12);
    // Another principal fills the rest of the buffer's budget, and is refused past it.
    for n in 0..300u32 {
        match ghost(&mut ledger, PeerId(500), n) {
            Some(true) => refused_own += 1,
            Some(false) => refused_all += 1,
            None => {}
        }
    }
    assert_eq!(
        ledger.tracked_requests(),
        16,
        "all together wait for the buffer's slots at most"
    );
    assert_eq!(refused_all, 300 - 4);
    assert_eq!(
        refused_own,
        9_000 - 12,
        "the other principal is within its share"
    );
    // The real request: reserved, then claimed (and the other order for a second one).
    ledger
        .handle_reserve(at(1), "real", slots(&[0, 1]), secret("real"))
        .expect("reserve");
    let granted = send(&mut ledger, at(1), A, batch("real", 2, 2, true, 1));
    assert_eq!(granted.len(), 1, "{granted:?}");
    assert!(granted[0].error.is_none(), "{granted:?}");
    assert_eq!(
        tags(&granted[0]).len(),
        2,
        "admitted at once, its chunks granted"
    );
    let early = send(&mut ledger, at(1), B, batch("second", 1, 1, true, 1));
    assert!(
        early.iter().all(|r| r
            .error
            .as_deref()
            .is_some_and(|e| e.contains("all senders together"))),
        "a claim before its reservation counts against the budget: {early:?}"
    );
}

/// `requests_max` bounds what waits, never a claim whose reservation is out: with the table
/// full of ghosts, the reserved request is admitted.
#[test]
fn a_reserved_claim_is_admitted_with_the_request_table_full() {
    let mut ledger = ReceiverLedger::new(ReceiverConfig {
        buffer_slots: 16,
        placement: Placement::Caller,
        requests_max: 4,
        ..ReceiverConfig::default()
    })
    .expect("config");
    for n in 0..4u64 {
        let ghost = batch(&format!("ghost-{n}"), 1, 1, true, 1);
        assert!(send(&mut ledger, at(0), PeerId(10 + n), ghost).is_empty());
    }
    let refused = send(
        &mut ledger,
        at(0),
        PeerId(20),
        batch("ghost-5", 1, 1, true, 1),
    );
    assert!(
        refused[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("requests_max")),
        "{refused:?}"
    );
    ledger
        .handle_reserve(at(1), "real", slots(&[0]), secret("real"))
        .expect("reserve");
    let granted = send(&mut ledger, at(1), A, batch("real", 1, 1, true, 1));
    assert!(granted[0].error.is_none(), "{granted:?}");
    assert_eq!(ledger.tracked_requests(), 5);
}

/// `batch` carrying `claim` in place of the reservation's own secret (an attacker who knows
/// the request id only).
fn forged(id: &str, claim: Option<&str>) -> AllocRequest {
    AllocRequest {
        claim: claim.map(|c| ClaimSecret::new(c).expect("a valid secret")),
        ..batch(id, 1, 1, true, 9)
    }
}

/// Eve's claim of `id` with a guessed secret, before the reservation: it waits, since what
/// it proves is known only once the reservation comes.
fn forged_claim_waits(ledger: &mut ReceiverLedger, id: &str) {
    let answers = send(ledger, at(0), EVE, forged(id, Some("guessed-0123456789")));
    assert!(answers.is_empty(), "{answers:?}");
}

/// Asserts the real claim's batch was granted its `n` chunks.
fn assert_granted(answers: &[AllocResponse], n: usize) {
    assert_eq!(
        tags(&answers[0]).len(),
        n,
        "the real claim is admitted: {answers:?}"
    );
}

fn refusal(answers: &[AllocResponse]) -> String {
    assert_eq!(answers.len(), 1, "{answers:?}");
    answers[0].error.clone().expect("refused")
}

/// A claim is bound to the sender the reservation was made for: the request id alone (a
/// batch without the secret, or with another one) claims nothing, in either order, and
/// costs the reservation nothing: its own sender's claim then succeeds. The secret is never
/// printed.
#[test]
fn only_the_reservations_secret_claims_it_in_either_order() {
    // Reserved first, then the forged claims, then the real one.
    let mut ledger = caller_ledger(4);
    ledger
        .handle_reserve(at(0), "r", slots(&[0, 1]), secret("r"))
        .expect("reserve");
    let none = refusal(&send(&mut ledger, at(0), EVE, forged("r", None)));
    assert!(none.contains("no claim secret"), "{none}");
    let wrong = refusal(&send(
        &mut ledger,
        at(0),
        PeerId(68),
        forged("r", Some("guessed-0123456789")),
    ));
    assert!(wrong.contains("not its reservation's"), "{wrong}");
    assert_eq!(
        ended(&events(&mut ledger)),
        Some(Outcome::Failed(Failure::ClaimNotProven {
            secret_sent: false
        }))
    );
    assert_granted(&send(&mut ledger, at(0), A, batch("r", 2, 2, true, 1)), 2);

    // The forged claim came first and waits; one without any secret is refused at once.
    let mut ledger = caller_ledger(4);
    forged_claim_waits(&mut ledger, "w");
    let none = refusal(&send(&mut ledger, at(0), PeerId(67), forged("w", None)));
    assert!(none.contains("no claim secret"), "{none}");
    ledger
        .handle_reserve(at(1), "w", slots(&[2]), secret("w"))
        .expect("reserve");
    let wrong = refusal(&replies(&mut ledger));
    assert!(wrong.contains("not its reservation's"), "{wrong}");
    assert_granted(&send(&mut ledger, at(1), A, batch("w", 1, 1, true, 1)), 1);

    // Both came first: the forged one first, the real one after; the real one is admitted.
    let mut ledger = caller_ledger(4);
    forged_claim_waits(&mut ledger, "b");
    assert!(send(&mut ledger, at(0), A, batch("b", 1, 1, true, 1)).is_empty());
    ledger
        .handle_reserve(at(1), "b", slots(&[3]), secret("b"))
        .expect("reserve");
    let answers: Vec<_> = std::iter::from_fn(|| ledger.poll_transmit()).collect();
    ledger.check_invariants();
    for (peer, answer) in &answers {
        let printed = format!("{answer:?}");
        assert!(
            !printed.contains("secret-of-"),
            "the secret is never printed: {printed}"
        );
        match *peer {
            EVE => assert!(answer.error.is_some(), "{answer:?}"),
            A => assert!(answer.error.is_none(), "{answer:?}"),
            other => panic!("{other:?} answered"),
        }
    }
    assert_eq!(answers.len(), 2);
    assert!(!format!("{:?}", batch("b", 1, 1, true, 1)).contains("secret-of-"));
}

/// A sender whose chunks are longer than the receiver's slots (two vLLM engines started with
/// different block sizes: the prefill engine's larger) fails at its first batch of chunks,
/// naming both sizes, before any write; its reservation comes back with that reason, so
/// the decode side can say it too.
#[test]
fn chunks_longer_than_the_slots_fail_the_request_naming_both_sizes() {
    let mut ledger = caller_ledger(4).with_slot_bytes(CHUNK);
    ledger
        .handle_reserve(at(0), "r", slots(&[0, 1]), secret("r"))
        .expect("reserve");
    let probe = AllocRequest {
        keys: Vec::new(),
        chunk_bytes: Some(Vec::new()),
        ..batch("r", 0, 1, false, 1)
    };
    assert!(
        send(&mut ledger, at(0), A, probe)[0].error.is_none(),
        "claimed"
    );
    let long = AllocRequest {
        chunk_bytes: Some(vec![2 * CHUNK]),
        ..batch("r", 1, 1, true, 2)
    };
    let refused = send(&mut ledger, at(0), A, long);
    let why = refused[0].error.clone().expect("refused");
    assert!(
        why.contains("chunks are 8192 bytes but the receiver's slots are 4096 bytes"),
        "{why}"
    );
    let evs = events(&mut ledger);
    let failure = Failure::ChunkSizeMismatch {
        chunk: 2 * CHUNK,
        slot: CHUNK,
    };
    assert_eq!(ended(&evs), Some(Outcome::Failed(failure.clone())));
    assert_eq!(
        returned(&evs),
        Some((slots(&[0, 1]), Outcome::Failed(failure)))
    );
}
