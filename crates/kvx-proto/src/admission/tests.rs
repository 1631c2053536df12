//! `Admission`'s unit tests: its checker shown to catch what it is there for, FIFO, refusals,
//! expiry, quarantine and the fair-share rule on small cases.

use super::*;
use std::time::Duration;

const T0: Instant = Instant::ZERO;
const P: PeerId = PeerId(1);

fn later(ms: u64) -> Instant {
    T0 + Duration::from_millis(ms)
}

/// The message `check_invariants` panics with, if it does.
fn violation(adm: &Admission) -> Option<String> {
    crate::testing::panic_message(|| adm.check_invariants())
}

/// The checker catches what it is there for: footprints that do not add up, waiters
/// miscounted, a waiter left waiting though it fits, the head held back with no contender
/// (work conservation), an admission past a share while another peer contends.
#[test]
fn check_invariants_catches_miscounts_idling_and_unfair_admissions() {
    let limits = Limits {
        capacity: 10,
        queue_max: 4,
        peer_cap: 4,
        peer_queue_max: 2,
    };
    let mut adm = Admission::new(limits);
    assert_eq!(adm.request(Ticket(1), P, 4, later(100)), Decision::Admitted);
    assert_eq!(violation(&adm), None);

    let mut uneven = adm.clone();
    uneven.reserved += 1;
    let said = violation(&uneven).expect("footprints not adding up are caught");
    assert!(said.contains("add up"), "{said}");

    let mut miscounted = adm.clone();
    miscounted.share(P).waiting += 1;
    let said = violation(&miscounted).expect("a miscounted waiter is caught");
    assert!(said.contains("waiters are counted"), "{said}");

    // A waiter that fits but was never let in (the queue not re-run after a release).
    let mut full = Admission::new(Limits::fifo(10, 4));
    assert_eq!(
        full.request(Ticket(1), P, 10, later(100)),
        Decision::Admitted
    );
    assert_eq!(full.request(Ticket(2), P, 2, later(100)), Decision::Queued);
    assert_eq!(violation(&full), None);
    full.reserved -= 2;
    full.share(P).footprint -= 2;
    let said = violation(&full).expect("a waiter left waiting though it fits is caught");
    assert!(said.contains("waits only when it does not fit"), "{said}");

    // P alone, past its share: its waiter is next whenever it fits. Planted at the head
    // as if the queue's rule had skipped it, it is caught by the work-conservation check,
    // which does not go through `next_in_line` (and runs before the check that does).
    let mut idle = Admission::new(limits);
    assert_eq!(
        idle.request(Ticket(1), P, 4, later(100)),
        Decision::Admitted
    );
    idle.waiting.push_back(Waiter {
        ticket: Ticket(2),
        peer: P,
        need: 2,
        deadline: later(100),
    });
    idle.share(P).waiting += 1;
    let said = violation(&idle).expect("the head held back with no contender is caught");
    assert!(said.contains("work conservation"), "{said}");

    // P holds its share (4); Q's waiter, within its own, waits for 8. Admitting P's next
    // request now is unfair, and the independent statement of the rule says so.
    let q = PeerId(2);
    let mut unfair = Admission::new(limits);
    assert_eq!(
        unfair.request(Ticket(1), P, 4, later(100)),
        Decision::Admitted
    );
    assert_eq!(
        unfair.request(Ticket(2), q, 8, later(100)),
        Decision::Queued
    );
    assert_eq!(violation(&unfair), None);
    let forced = Waiter {
        ticket: Ticket(3),
        peer: P,
        need: 2,
        deadline: later(100),
    };
    unfair.note_fairness(&forced);
    unfair.reserve(P, 2);
    let said = violation(&unfair).expect("an admission past a share under contention is caught");
    assert!(said.contains("past its share"), "{said}");
}

#[test]
fn worked_example_b_waits_until_a_releases() {
    let mut adm = Admission::new(Limits::fifo(10, 8));
    assert_eq!(adm.request(Ticket(1), P, 8, later(100)), Decision::Admitted);
    assert_eq!(adm.request(Ticket(2), P, 8, later(100)), Decision::Queued);
    assert_eq!(adm.poll_admitted(), None);
    adm.release(P, 8);
    assert_eq!(adm.poll_admitted(), Some(Ticket(2)));
    assert_eq!(adm.reserved(), 8);
    adm.check_invariants();
}

#[test]
fn fifo_holds_small_requests_behind_a_large_head() {
    let mut adm = Admission::new(Limits::fifo(10, 8));
    assert_eq!(adm.request(Ticket(1), P, 6, later(100)), Decision::Admitted);
    assert_eq!(adm.request(Ticket(2), P, 8, later(100)), Decision::Queued);
    // 4 slots are free, but the 8-chunk head came first.
    assert_eq!(adm.request(Ticket(3), P, 2, later(100)), Decision::Queued);
    adm.release(P, 6);
    assert_eq!(adm.poll_admitted(), Some(Ticket(2)));
    assert_eq!(adm.poll_admitted(), Some(Ticket(3)));
    adm.check_invariants();
}

#[test]
fn refusals_are_immediate() {
    let mut adm = Admission::new(Limits::fifo(10, 1));
    assert_eq!(
        adm.request(Ticket(1), P, 0, later(1)),
        Decision::Refused(Refusal::ZeroChunks)
    );
    assert_eq!(
        adm.request(Ticket(2), P, 11, later(1)),
        Decision::Refused(Refusal::LargerThanBuffer {
            need: 11,
            capacity: 10
        })
    );
    assert_eq!(adm.request(Ticket(3), P, 10, later(1)), Decision::Admitted);
    assert_eq!(adm.request(Ticket(4), P, 1, later(1)), Decision::Queued);
    assert_eq!(
        adm.request(Ticket(5), P, 1, later(1)),
        Decision::Refused(Refusal::QueueFull { max: 1 })
    );
}

#[test]
fn expiry_and_withdraw_unblock_the_queue() {
    let mut adm = Admission::new(Limits::fifo(10, 8));
    adm.request(Ticket(1), P, 5, later(10));
    adm.request(Ticket(2), P, 9, later(10));
    adm.request(Ticket(3), P, 4, later(20));
    assert_eq!(adm.poll_expired(later(5)), None);
    assert_eq!(adm.poll_expired(later(10)), Some(Ticket(2)));
    assert_eq!(adm.poll_admitted(), Some(Ticket(3)));
    adm.request(Ticket(4), P, 9, later(30));
    assert!(adm.withdraw(Ticket(4)));
    assert!(!adm.withdraw(Ticket(4)));
    adm.check_invariants();
}

#[test]
fn pinned_slots_are_not_available() {
    let mut adm = Admission::new(Limits::fifo(4, 8));
    adm.request(Ticket(1), P, 4, later(10));
    adm.pin_from_reservation(2);
    adm.release(P, 2);
    assert_eq!(adm.available(), 2);
    assert_eq!(adm.request(Ticket(2), P, 3, later(10)), Decision::Queued);
    adm.unpin(P, 2);
    assert_eq!(adm.poll_admitted(), Some(Ticket(2)));
}

#[test]
fn a_peer_at_its_share_waits_without_blocking_others() {
    let limits = Limits {
        capacity: 8,
        queue_max: 8,
        peer_cap: 6,
        peer_queue_max: 2,
    };
    let (a, b) = (PeerId(1), PeerId(2));
    let mut adm = Admission::new(limits);
    assert_eq!(adm.request(Ticket(2), a, 6, later(100)), Decision::Admitted);
    // B waits for 4: within its share, it is next in line.
    assert_eq!(adm.request(Ticket(4), b, 4, later(100)), Decision::Queued);
    // A, at its share, is passed over in favour of B's waiter, though 1 slot would fit.
    assert_eq!(adm.request(Ticket(3), a, 1, later(100)), Decision::Queued);
    assert_eq!(adm.request(Ticket(5), a, 1, later(100)), Decision::Queued);
    assert_eq!(
        adm.request(Ticket(6), a, 1, later(100)),
        Decision::Refused(Refusal::PeerQueueFull { max: 2 })
    );
    adm.check_invariants();
    // A's release lets B in first, then A's waiters (B is not waiting any more).
    adm.release(a, 6);
    assert_eq!(adm.poll_admitted(), Some(Ticket(4)));
    assert_eq!(adm.poll_admitted(), Some(Ticket(3)));
    assert_eq!(adm.poll_admitted(), Some(Ticket(5)));
    adm.check_invariants();
}

/// A peer alone is never held to its share: a request larger than the share is
/// admitted, and so are more requests past it while nobody else waits.
#[test]
fn a_lone_peer_uses_the_whole_buffer() {
    let limits = Limits {
        capacity: 8,
        queue_max: 8,
        peer_cap: 6,
        peer_queue_max: 8,
    };
    let (a, b) = (PeerId(1), PeerId(2));
    let mut adm = Admission::new(limits);
    assert_eq!(adm.request(Ticket(1), a, 7, later(100)), Decision::Admitted);
    assert_eq!(adm.request(Ticket(2), a, 1, later(100)), Decision::Admitted);
    // Full: the next waits at the head, alone, and is admitted as soon as it fits.
    assert_eq!(adm.request(Ticket(3), a, 8, later(100)), Decision::Queued);
    adm.check_invariants();
    adm.release(a, 7);
    assert_eq!(adm.poll_admitted(), None, "8 do not fit in 7");
    adm.release(a, 1);
    assert_eq!(adm.poll_admitted(), Some(Ticket(3)));
    // Another peer arriving now waits only for what A holds to come back.
    assert_eq!(adm.request(Ticket(4), b, 2, later(100)), Decision::Queued);
    assert_eq!(adm.request(Ticket(5), a, 2, later(100)), Decision::Queued);
    adm.release(a, 8);
    assert_eq!(adm.poll_admitted(), Some(Ticket(4)));
    assert_eq!(adm.poll_admitted(), Some(Ticket(5)));
    adm.check_invariants();
}

/// A request larger than the share, of a peer that holds something, waits until its peer
/// holds nothing, whatever fits meanwhile for others; its peer's later requests wait
/// behind it.
#[test]
fn a_request_larger_than_the_share_goes_in_when_its_peer_holds_nothing() {
    let limits = Limits {
        capacity: 10,
        queue_max: 8,
        peer_cap: 4,
        peer_queue_max: 8,
    };
    let (a, b) = (PeerId(1), PeerId(2));
    let mut adm = Admission::new(limits);
    assert_eq!(adm.request(Ticket(1), a, 2, later(100)), Decision::Admitted);
    assert_eq!(adm.request(Ticket(2), b, 3, later(100)), Decision::Admitted);
    // A holds 2; 6 would take it past 4, and B may still contend: next in line anyway
    // while nobody within a share waits, it waits only because 6 do not fit in 5.
    assert_eq!(adm.request(Ticket(3), a, 6, later(100)), Decision::Queued);
    assert_eq!(adm.request(Ticket(4), a, 1, later(100)), Decision::Queued);
    // B's waiter is within its share: it passes A's.
    assert_eq!(adm.request(Ticket(5), b, 1, later(100)), Decision::Admitted);
    adm.check_invariants();
    adm.release(a, 2);
    assert_eq!(adm.poll_admitted(), Some(Ticket(3)));
    assert_eq!(
        adm.poll_admitted(),
        None,
        "A's 1 waits behind its 6 and for room"
    );
    adm.check_invariants();
}

#[test]
fn quarantined_slots_count_against_the_peer_that_rolled_back() {
    let limits = Limits {
        capacity: 8,
        queue_max: 8,
        peer_cap: 4,
        peer_queue_max: 8,
    };
    let (a, b) = (PeerId(1), PeerId(2));
    let mut adm = Admission::new(limits);
    assert_eq!(adm.request(Ticket(1), a, 4, later(100)), Decision::Admitted);
    // A rolls back: its 4 slots are quarantined, still A's.
    adm.pin_from_reservation(4);
    assert_eq!(adm.footprint(a), 4);
    // B waits for 6 of the 4 free; A, at its share, is passed over in B's favour.
    assert_eq!(adm.request(Ticket(2), b, 6, later(100)), Decision::Queued);
    assert_eq!(adm.request(Ticket(3), a, 1, later(100)), Decision::Queued);
    adm.check_invariants();
    adm.unpin(a, 4);
    assert_eq!(adm.poll_admitted(), Some(Ticket(2)));
    assert_eq!(adm.poll_admitted(), Some(Ticket(3)));
    adm.check_invariants();
}
