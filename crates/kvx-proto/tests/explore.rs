//! Exploration of every interleaving of small configurations (2 senders, one receiver):
//! deliveries on each link, write completions and failures, cancels, consumes and timeouts
//! keep every invariant, and from every state the world can heal to one where every request
//! has ended and both buffers are free (`docs/sim.md`, "exploration").
//!
//! The default tests are quick: a complete search of two one-chunk requests, bounded
//! breadth-first searches of larger plans (`KVX_EXPLORE_STATES` raises their bound), and a
//! check of the explorer's abstraction. The ignored ones are complete searches of three
//! requests, at the full 6-slot buffer and 4-slot staging and in a 2-slot buffer where they
//! contend, which CI runs in release:
//! `cargo test --release -p kvx-proto --test explore -- --ignored --nocapture`.

use kvx_proto::admission::Limits;
use kvx_proto::testing::{
    check_abstraction, explore, explore_from, explore_shares, Exploration, OpWorld, Order,
    SharesPlan,
};

fn bound(default: usize) -> usize {
    std::env::var("KVX_EXPLORE_STATES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A complete depth-first search, with its figures printed for `docs/PERFORMANCE.md`.
fn complete(what: &str, start: OpWorld, plan: &[(usize, u32)]) -> Exploration {
    let r = explore_from(start, plan, usize::MAX, Order::DepthFirst);
    eprintln!(
        "exhaustive, {what} {plan:?}: {} states, {} transitions, depth {}, {:.1} s",
        r.states,
        r.transitions,
        r.depth,
        r.elapsed.as_secs_f64()
    );
    assert!(!r.truncated, "the whole state space must be covered: {r:?}");
    r
}

#[test]
fn two_one_chunk_requests_completely() {
    let r = complete("6 slots, 4 staging,", OpWorld::new(), &[(0, 1), (1, 1)]);
    assert!(r.states > 10_000, "{r:?}");
}

#[test]
fn two_requests_from_two_senders() {
    let r = explore(&[(0, 2), (1, 3)], bound(4_000));
    eprintln!("two requests from two senders: {r:?}");
    assert!(r.states > 100, "{r:?}");
}

#[test]
fn three_requests_one_larger_than_the_buffer() {
    let r = explore(&[(0, 2), (1, 7), (0, 4)], bound(4_000));
    eprintln!("three requests, one oversized: {r:?}");
    assert!(r.states > 100, "{r:?}");
}

/// A 2-slot buffer and 1-slot staging: the 2-chunk request waits for admission behind the
/// first, the third waits behind it (FIFO), and every batch waits for staging.
#[test]
fn three_requests_contending_for_a_two_slot_buffer() {
    let start = OpWorld::with_slots(2, 1);
    let r = explore_from(
        start,
        &[(0, 1), (1, 2), (0, 1)],
        bound(4_000),
        Order::BreadthFirst,
    );
    eprintln!("three requests, a 2-slot buffer: {r:?}");
    assert!(r.states > 100, "{r:?}");
}

/// Two requests of one sender and one staging slot: whichever order their chunks are staged
/// in (the younger's through `SubmitYoungest`), a freed slot never goes to the younger while
/// the older waits for staging (S9), and a younger request holding the slot never waits
/// behind the older one.
#[test]
fn staging_goes_to_the_oldest_waiting_request() {
    let r = complete(
        "6 slots, 1 staging,",
        OpWorld::with_slots(6, 1),
        &[(0, 1), (0, 2)],
    );
    assert!(r.states > 1_000, "{r:?}");
}

/// Caller staging (§Caller staging): one sender's two requests read the same slot at once
/// (chunk 0 of each reads slot 0), nothing is allocated, and under every interleaving of
/// writes, failures, cancels and timeouts each slot is read by exactly the unwritten chunks
/// and a failed request is drained only once none of its posted writes is outstanding (S13).
#[test]
fn caller_staging_of_requests_sharing_a_slot() {
    let r = complete(
        "caller staging, 4 slots, 2 staging,",
        OpWorld::caller_staging(4, 2),
        &[(0, 2), (0, 1)],
    );
    assert!(r.states > 1_000, "{r:?}");
}

/// The explorer's abstraction against the whole state, on a plan small enough for both.
#[test]
fn the_abstraction_loses_no_state_of_one_request() {
    let c = check_abstraction(OpWorld::new(), &[(0, 2)]);
    eprintln!("abstraction check, one request: {c:?}");
    assert_eq!(c.image, c.canonical_states, "{c:?}");
}

/// Pending batches (`handle_add`): one sender interleaves two three-chunk requests on two
/// staging slots, adding chunks without submitting them; when only those chunks hold
/// staging, the core submits them (S11), or healing could not finish.
#[test]
fn pending_batches_never_hold_staging_for_ever() {
    let r = complete(
        "6 slots, 2 staging,",
        OpWorld::with_slots(6, 2),
        &[(0, 1), (0, 3)],
    );
    assert!(r.states > 1_000, "{r:?}");
}

/// `pending_batches_never_hold_staging_for_ever` with two three-chunk requests.
#[test]
#[ignore]
fn exhaustive_pending_batches_of_two_three_chunk_requests() {
    complete(
        "6 slots, 2 staging,",
        OpWorld::with_slots(6, 2),
        &[(0, 3), (0, 3)],
    );
}

/// The full size: 2 senders, 3 requests, 6 buffer slots, 4 staging slots per sender
/// (one chunk each: every chunk more multiplies the states by about four).
#[test]
#[ignore]
fn exhaustive_three_requests_from_two_senders() {
    complete(
        "6 slots, 4 staging,",
        OpWorld::new(),
        &[(0, 1), (1, 1), (0, 1)],
    );
}

/// Three requests that contend: admission queueing (FIFO across senders), staging exhausted,
/// quarantined slots holding back the queue.
#[test]
#[ignore]
fn exhaustive_three_requests_contending_for_a_two_slot_buffer() {
    complete(
        "2 slots, 1 staging,",
        OpWorld::with_slots(2, 1),
        &[(0, 1), (1, 2), (0, 1)],
    );
}

/// Multi-chunk requests: batches of one and two chunks, partial progress when one fails.
#[test]
#[ignore]
fn exhaustive_two_two_chunk_requests_from_two_senders() {
    complete("6 slots, 4 staging,", OpWorld::new(), &[(0, 2), (1, 2)]);
}

/// The abstraction check where requests wait for admission and slots are quarantined.
#[test]
#[ignore]
#[allow(clippy::disallowed_methods)] // the clock only times the check, for the figures
fn the_abstraction_loses_no_state_of_contending_requests() {
    let started = std::time::Instant::now();
    let c = check_abstraction(OpWorld::with_slots(2, 1), &[(0, 1), (1, 2)]);
    eprintln!(
        "abstraction check, 2 slots, 1 staging, [(0, 1), (1, 2)]: {c:?}, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(c.image, c.canonical_states, "{c:?}");
}

/// §Fair shares in the whole protocol: three senders, a 6-slot buffer, a share of 2 slots
/// (33 %), a request larger than the share from each, and one sender's second request past
/// its share; every message, write, timer and consume, healing checked for liveness. Its
/// state space is too large to cover (about 10,000 states a second, and millions of them),
/// so this is a bounded search; `exhaustive_shares_*` cover the admission rule completely.
#[test]
fn shares_bind_among_three_senders_in_the_whole_protocol() {
    let r = explore_from(
        OpWorld::contended(6, 1, 33),
        &[(0, 3), (1, 3), (0, 1), (2, 3)],
        bound(4_000),
        Order::BreadthFirst,
    );
    eprintln!("shares binding, three senders, whole protocol: {r:?}");
    assert!(r.states > 100, "{r:?}");
}

/// Admission alone where shares bind, completely: three senders, a 6-slot buffer, a share
/// of 2 slots; each sender's first request is larger than the share, and two send a second
/// that takes them past it. Every arrival order, end (whole or quarantined), unpin,
/// withdrawal and expiry; liveness from every state.
#[test]
fn exhaustive_shares_three_senders_six_slots() {
    let plan = SharesPlan {
        limits: Limits {
            capacity: 6,
            queue_max: 64,
            peer_cap: 2,
            peer_queue_max: 64,
        },
        requests: vec![vec![3, 1], vec![4, 2], vec![3]],
    };
    let r = explore_shares(&plan);
    eprintln!(
        "exhaustive shares, 6 slots, share 2, {:?}: {} states, {} transitions, depth {}, {:.1} s",
        plan.requests,
        r.states,
        r.transitions,
        r.depth,
        r.elapsed.as_secs_f64()
    );
    assert!(r.states > 1_000, "{r:?}");
}

/// A larger admission world, completely: three senders, an 8-slot buffer, a share of 3
/// slots, three requests each (first ones larger than the share).
#[test]
#[ignore]
fn exhaustive_shares_three_senders_eight_slots() {
    let plan = SharesPlan {
        limits: Limits {
            capacity: 8,
            queue_max: 64,
            peer_cap: 3,
            peer_queue_max: 64,
        },
        requests: vec![vec![5, 1, 2], vec![4, 2, 1], vec![6, 1, 3]],
    };
    let r = explore_shares(&plan);
    eprintln!(
        "exhaustive shares, 8 slots, share 3, {:?}: {} states, {} transitions, depth {}, {:.1} s",
        plan.requests,
        r.states,
        r.transitions,
        r.depth,
        r.elapsed.as_secs_f64()
    );
    assert!(r.states > 100_000, "{r:?}");
}

/// Caller placement (`OpWorld::placed`): the decoding application lends each request's
/// slots when it has them, withdraws reservations, and gets them back from `Returned`.
/// Every interleaving of reservations with the senders' claims (a claim before its
/// reservation waits for it), withdrawals, cancels, failed writes, lost connections and
/// timeouts keeps every invariant (R14 among them), never lands a write outside a live
/// grant of its own request or quarantine, and heals with every reservation back.
#[test]
#[ignore]
fn exhaustive_caller_placement_two_one_chunk_requests() {
    let r = complete(
        "caller placement, 2 slots, 2 staging,",
        OpWorld::placed(2, 2),
        &[(0, 1), (1, 1)],
    );
    assert!(r.states > 1_000, "{r:?}");
}

/// Caller placement where the application has too few slots for both requests at once: the
/// second waits for the first's slots to come back.
#[test]
fn caller_placement_requests_contending_for_the_applications_slots() {
    let r = explore_from(
        OpWorld::placed(2, 1),
        &[(0, 2), (1, 1)],
        bound(20_000),
        Order::BreadthFirst,
    );
    eprintln!("caller placement, 2 slots, contending: {r:?}");
    assert!(r.states > 1_000, "{r:?}");
}

/// `exhaustive_caller_placement_two_one_chunk_requests` with a two-chunk request and a
/// one-chunk request in three slots, complete.
#[test]
#[ignore]
fn exhaustive_caller_placement_two_and_one_chunk_requests() {
    complete(
        "caller placement, 3 slots, 2 staging,",
        OpWorld::placed(3, 2),
        &[(0, 2), (1, 1)],
    );
}

/// Caller placement where the application holds a request's first chunk already
/// (`OpWorld::placed_holding`, a decode engine's local prefix hit): the sender's first chunk
/// is answered as sent, the rest go to the reserved slots, and every interleaving still keeps
/// every invariant and heals with every reservation back.
#[test]
fn caller_placement_holding_a_requests_first_chunk() {
    let r = explore_from(
        OpWorld::placed_holding(2, 2),
        &[(0, 3), (1, 1)],
        bound(20_000),
        Order::BreadthFirst,
    );
    eprintln!("caller placement, holding, 2 slots: {r:?}");
    assert!(r.states > 1_000, "{r:?}");
}

/// `caller_placement_holding_a_requests_first_chunk`, complete, with a two-chunk request.
#[test]
#[ignore]
fn exhaustive_caller_placement_holding_two_and_one_chunk_requests() {
    complete(
        "caller placement, holding, 2 slots, 2 staging,",
        OpWorld::placed_holding(2, 2),
        &[(0, 2), (1, 1)],
    );
}

/// Caller placement on a fabric that stops revoked writes (`OpWorld::placed_revoking`: TCP,
/// shared memory): the fabric's grant mirror is modelled, and a failed or withdrawn request's
/// slots go back to the application as its grants are revoked, with no quarantine; a write
/// of a revoked grant fails at its sender and never lands in a slot the application holds.
#[test]
fn caller_placement_revoking_two_one_chunk_requests() {
    let r = explore_from(
        OpWorld::placed_revoking(2, 2),
        &[(0, 1), (1, 1)],
        bound(20_000),
        Order::BreadthFirst,
    );
    eprintln!("caller placement, revoking, 2 slots: {r:?}");
    assert!(r.states > 1_000, "{r:?}");
}

/// `caller_placement_revoking_two_one_chunk_requests`, complete, with a two-chunk request.
#[test]
#[ignore]
fn exhaustive_caller_placement_revoking_two_and_one_chunk_requests() {
    complete(
        "caller placement, revoking, 3 slots, 2 staging,",
        OpWorld::placed_revoking(3, 2),
        &[(0, 2), (1, 1)],
    );
}
