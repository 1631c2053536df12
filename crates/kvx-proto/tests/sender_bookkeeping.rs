//! What the sender's flow tells its caller about itself, on one request at a time: its
//! counts, a failing request's outcome while its writes drain, a staging slot handed back,
//! the reply deadline to the instant, what a channel learnt of its receiver, and quiescence.

use std::time::Duration;

use kvx_proto::sender::{
    ChunkSpec, Mode, RequestSpec, SendError, SendFailure, SenderEvent, SenderFlow, WriteOp,
};
use kvx_proto::wire::{AllocResponse, Message};
use kvx_proto::{Instant, PeerId, ReqId, SenderConfig};

const R: PeerId = PeerId(1);
const T0: Instant = Instant::ZERO;

fn spec(id: &ReqId, total_chunks: u32) -> RequestSpec {
    RequestSpec {
        req_id: id.clone(),
        receiver: R,
        total_chunks,
        fmt: 1,
        shape: vec![1],
        dtype: "bfloat16".into(),
        claim: None,
    }
}

/// Answers the last message sent, granting `slots`; `echo` says whether the reply carries
/// the request's `seq` back (a kvx receiver) or not (LMCache's).
fn reply(flow: &mut SenderFlow, slots: Vec<i64>, echo: bool) {
    let t = flow.poll_transmit().expect("a message went out");
    let Message::AllocRequest(req) = t.msg else {
        panic!("an AllocRequest: {t:?}");
    };
    let generations = Some(vec![1; slots.len()]);
    let seq = if echo { req.seq } else { None };
    let reply = AllocResponse::granted(slots, generations, seq);
    flow.handle_message(T0, R, Message::AllocResponse(reply));
}

/// Begins `id` with one chunk, admits it, stages and submits the chunk, grants it a slot:
/// the write is posted and returned.
fn posted(flow: &mut SenderFlow, id: &ReqId) -> WriteOp {
    flow.handle_begin(T0, spec(id, 1)).expect("begin");
    reply(flow, vec![], true);
    let chunk = ChunkSpec {
        key: "k0".into(),
        staging: flow.try_allocate(id).expect("staging"),
        tokens: 1,
        bytes: 64,
    };
    flow.handle_submit(T0, id, vec![chunk], true)
        .expect("submit");
    reply(flow, vec![0], true);
    flow.poll_write().expect("the write is posted")
}

fn events(flow: &mut SenderFlow) -> Vec<SenderEvent> {
    std::iter::from_fn(|| flow.poll_event()).collect()
}

#[test]
fn counts_a_failing_outcome_and_quiescence_follow_the_requests() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    assert!(flow.is_quiescent());
    let a = ReqId("a".into());
    let write = posted(&mut flow, &a);
    assert!(!flow.is_quiescent(), "a write is in flight");
    flow.handle_write_done(T0, write.id, Ok(()));
    assert!(
        events(&mut flow)
            .iter()
            .any(|e| matches!(e, SenderEvent::Delivered { .. })),
        "a is delivered"
    );
    while flow.poll_transmit().is_some() {}

    // b fails while its write is in flight: the outcome says so at once, before the drain.
    let b = ReqId("b".into());
    let write = posted(&mut flow, &b);
    flow.handle_cancel(T0, &b).expect("cancel");
    assert_eq!(flow.outcome(&b), Some(Err(SendFailure::Cancelled)));
    assert!(!flow.is_quiescent(), "b's write still drains");
    flow.handle_write_done(T0, write.id, Ok(()));
    events(&mut flow);
    assert_eq!(flow.outcome(&b), Some(Err(SendFailure::Cancelled)));
    assert!(
        !flow.is_quiescent(),
        "b's CancelNotif awaits its acknowledgement"
    );
    let cancel = std::iter::from_fn(|| flow.poll_transmit())
        .find_map(|t| match t.msg {
            Message::CancelNotif(c) => Some(c),
            _ => None,
        })
        .expect("b's CancelNotif");
    let ack = AllocResponse::cancel_ack(cancel.seq);
    flow.handle_message(T0, R, Message::AllocResponse(ack));

    let stats = flow.stats();
    assert_eq!(
        (stats.begun, stats.delivered, stats.failed),
        (2, 1, 1),
        "{stats:?}"
    );
    assert!(flow.is_quiescent());
    flow.check_invariants();
}

#[test]
fn a_staging_slot_handed_back_is_free_again_and_only_once() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let id = ReqId("r".into());
    flow.handle_begin(T0, spec(&id, 2)).expect("begin");
    reply(&mut flow, vec![], true);
    let free = flow.staging_free();
    let slot = flow.try_allocate(&id).expect("staging");
    assert_eq!(flow.staging_free(), free - 1);
    flow.release_staging(&id, slot).expect("handed back");
    assert_eq!(flow.staging_free(), free);
    assert!(
        flow.release_staging(&id, slot).is_err(),
        "a slot not held is refused"
    );
    flow.check_invariants();
}

/// A request whose reply does not come fails at `reply_timeout` exactly, not before.
#[test]
fn a_missing_reply_fails_the_request_at_its_deadline_and_not_before() {
    let cfg = SenderConfig {
        reply_timeout: Duration::from_secs(2),
        ..SenderConfig::default()
    };
    let mut flow = SenderFlow::new(cfg).expect("config");
    let id = ReqId("r".into());
    flow.handle_begin(T0, spec(&id, 1)).expect("begin");
    reply(&mut flow, vec![], true);
    let chunk = ChunkSpec {
        key: "k0".into(),
        staging: flow.try_allocate(&id).expect("staging"),
        tokens: 1,
        bytes: 64,
    };
    let sent = T0 + Duration::from_secs(10);
    flow.handle_submit(sent, &id, vec![chunk], true)
        .expect("submit");
    flow.poll_transmit().expect("the batch");
    let deadline = sent + Duration::from_secs(2);
    assert_eq!(flow.poll_timeout(), Some(deadline));
    flow.handle_timeout(sent + Duration::from_millis(1999));
    assert_eq!(flow.outcome(&id), None, "still waiting");
    flow.handle_timeout(deadline);
    assert_eq!(flow.outcome(&id), Some(Err(SendFailure::ReplyTimeout)));
    flow.check_invariants();
}

/// A channel learns from the first reply whether its receiver echoes `seq`.
#[test]
fn a_channel_learns_its_receivers_mode_from_the_first_reply() {
    for (echo, mode) in [(true, Mode::Pipelined), (false, Mode::Serial)] {
        let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
        assert_eq!(flow.channel_mode(R), None, "no request yet");
        flow.handle_begin(T0, spec(&ReqId("r".into()), 1))
            .expect("begin");
        assert_eq!(flow.channel_mode(R), Some(Mode::Probing));
        reply(&mut flow, vec![], echo);
        assert_eq!(flow.channel_mode(R), Some(mode), "echo: {echo}");
    }
}

/// On a channel whose receiver echoes `seq`, a reply without one answers nothing: it is
/// counted stale, and the batch in flight is written once its own reply comes.
#[test]
fn a_reply_without_seq_on_a_pipelined_channel_answers_nothing() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let id = ReqId("r".into());
    flow.handle_begin(T0, spec(&id, 1)).expect("begin");
    reply(&mut flow, vec![], true);
    assert_eq!(flow.channel_mode(R), Some(Mode::Pipelined));
    let chunk = ChunkSpec {
        key: "k0".into(),
        staging: flow.try_allocate(&id).expect("staging"),
        tokens: 1,
        bytes: 64,
    };
    flow.handle_submit(T0, &id, vec![chunk], true)
        .expect("submit");
    let stale = flow.stats().stale_replies;
    let unnumbered = AllocResponse::granted(vec![0], Some(vec![1]), None);
    flow.handle_message(T0, R, Message::AllocResponse(unnumbered));
    assert_eq!(flow.stats().stale_replies, stale + 1);
    assert_eq!(flow.poll_write(), None, "nothing was granted");
    reply(&mut flow, vec![0], true);
    assert!(flow.poll_write().is_some(), "its own reply grants the slot");
    flow.check_invariants();
}

/// A message other than a reply on the control channel answers nothing and is counted stale.
#[test]
fn a_message_that_is_not_a_reply_is_counted_stale() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    flow.handle_begin(T0, spec(&ReqId("r".into()), 1))
        .expect("begin");
    let notice = kvx_proto::wire::ProxyNotif { req_id: "r".into() };
    flow.handle_message(T0, R, Message::ProxyNotif(notice));
    assert_eq!(flow.stats().stale_replies, 1);
    assert_eq!(
        flow.channel_mode(R),
        Some(Mode::Probing),
        "the probe still waits"
    );
}

/// A receiver that already holds a chunk (LMCache's dedup, `already_sent_indexes`) has it
/// counted written without a write: the request is delivered once the other chunk lands.
#[test]
fn a_chunk_the_receiver_already_holds_counts_as_written() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let id = ReqId("r".into());
    flow.handle_begin(T0, spec(&id, 2)).expect("begin");
    reply(&mut flow, vec![], true);
    let chunks = (0..2)
        .map(|i| ChunkSpec {
            key: format!("k{i}"),
            staging: flow.try_allocate(&id).expect("staging"),
            tokens: 1,
            bytes: 64,
        })
        .collect();
    flow.handle_submit(T0, &id, chunks, true).expect("submit");
    let t = flow.poll_transmit().expect("the batch");
    let Message::AllocRequest(batch) = t.msg else {
        panic!("an AllocRequest: {t:?}");
    };
    let mut grant = AllocResponse::granted(vec![5], Some(vec![1]), batch.seq);
    grant.already_sent_indexes = vec![1];
    flow.handle_message(T0, R, Message::AllocResponse(grant));
    let write = flow.poll_write().expect("chunk 0 is written");
    assert_eq!(flow.poll_write(), None, "chunk 1 is not");
    flow.handle_write_done(T0, write.id, Ok(()));
    assert!(
        events(&mut flow)
            .iter()
            .any(|e| matches!(e, SenderEvent::Delivered { .. })),
        "delivered"
    );
    assert_eq!(flow.staging_free(), flow.staging_capacity());
    flow.check_invariants();
}

/// A reply from a receiver this sender has no channel to answers nothing: counted stale.
#[test]
fn a_reply_from_an_unknown_receiver_is_counted_stale() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let reply = AllocResponse::granted(vec![0], Some(vec![1]), Some(1));
    flow.handle_message(T0, PeerId(9), Message::AllocResponse(reply));
    assert_eq!(flow.stats().stale_replies, 1);
    assert!(flow.is_quiescent());
}

/// With one message in flight per channel, a batch of another request queued behind it
/// does not shift the answered batch's chunk numbers: the write is of chunk 0.
#[test]
fn a_queued_batch_of_another_request_leaves_the_answered_chunks_numbers_alone() {
    let cfg = SenderConfig {
        inflight_max: 1,
        ..SenderConfig::default()
    };
    let mut flow = SenderFlow::new(cfg).expect("config");
    let (a, b) = (ReqId("a".into()), ReqId("b".into()));
    for id in [&a, &b] {
        flow.handle_begin(T0, spec(id, 1)).expect("begin");
        reply(&mut flow, vec![], true);
    }
    for id in [&a, &b] {
        let chunk = ChunkSpec {
            key: "k0".into(),
            staging: flow.try_allocate(id).expect("staging"),
            tokens: 1,
            bytes: 64,
        };
        flow.handle_submit(T0, id, vec![chunk], true)
            .expect("submit");
    }
    // a's batch is in flight, b's waits behind it.
    reply(&mut flow, vec![0], true);
    let write = flow.poll_write().expect("a's write");
    assert_eq!((write.req_id, write.chunk), (a, 0));
    flow.check_invariants();
}

/// A request takes at most one staging slot per declared chunk, and none after its last
/// batch: more is the caller's mistake, refused as misuse.
#[test]
fn staging_beyond_the_declared_chunks_is_misuse() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let id = ReqId("r".into());
    flow.handle_begin(T0, spec(&id, 2)).expect("begin");
    reply(&mut flow, vec![], true);
    let first = flow.try_allocate(&id).expect("chunk 0's staging");
    let chunk = ChunkSpec {
        key: "k0".into(),
        staging: first,
        tokens: 1,
        bytes: 64,
    };
    flow.handle_submit(T0, &id, vec![chunk], true)
        .expect("a last batch of one chunk");
    assert!(
        matches!(flow.try_allocate(&id), Err(SendError::Misuse { .. })),
        "nothing after the last batch"
    );

    let other = ReqId("s".into());
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    flow.handle_begin(T0, spec(&other, 1)).expect("begin");
    reply(&mut flow, vec![], true);
    flow.try_allocate(&other).expect("its one chunk");
    assert!(
        matches!(flow.try_allocate(&other), Err(SendError::Misuse { .. })),
        "one chunk declared, one slot"
    );
}

/// Requests have their place in the staging order while they run, in the order begun.
#[test]
fn a_request_has_its_age_while_it_runs() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let (a, b) = (ReqId("a".into()), ReqId("b".into()));
    flow.handle_begin(T0, spec(&a, 1)).expect("begin");
    flow.handle_begin(T0, spec(&b, 1)).expect("begin");
    let (age_a, age_b) = (flow.age(&a).expect("a runs"), flow.age(&b).expect("b runs"));
    assert!(age_a < age_b);
    assert!(flow.knows(&a) && !flow.knows(&ReqId("never".into())));
    flow.handle_cancel(T0, &a).expect("cancel");
    assert_eq!(flow.age(&a), None, "a ended");
    assert!(flow.knows(&a), "its outcome is remembered");
}

/// A receiver's channel lost fails every request on it at once, as channel lost.
#[test]
fn a_lost_receiver_fails_its_requests_at_once() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let id = ReqId("r".into());
    flow.handle_begin(T0, spec(&id, 1)).expect("begin");
    assert_eq!(flow.tracked_requests(), 1);
    flow.handle_receiver_lost(T0, R);
    assert_eq!(flow.outcome(&id), Some(Err(SendFailure::ChannelLost)));
    assert_eq!(flow.tracked_requests(), 0);
    flow.check_invariants();
}

/// An id begun again after it ended has its new outcome remembered, even when the old
/// entry is the one forgotten to keep `outcomes_kept`.
#[test]
fn a_reused_ids_new_outcome_outlives_its_old_entry() {
    let cfg = SenderConfig {
        outcomes_kept: 2,
        ..SenderConfig::default()
    };
    let mut flow = SenderFlow::new(cfg).expect("config");
    let (a, b) = (ReqId("a".into()), ReqId("b".into()));
    for id in [&a, &b, &a] {
        flow.handle_begin(T0, spec(id, 1)).expect("begin");
        flow.handle_cancel(T0, id).expect("cancel");
    }
    assert_eq!(flow.outcome(&a), Some(Err(SendFailure::Cancelled)));
    assert_eq!(flow.outcome(&b), Some(Err(SendFailure::Cancelled)));
    flow.check_invariants();
}

/// With two batches of one request in flight and a third queued, the first batch's reply
/// writes chunk 0: the batches after it, sent or not, do not shift its numbers.
#[test]
fn batches_in_flight_and_queued_behind_leave_the_answered_chunks_numbers_alone() {
    let cfg = SenderConfig {
        inflight_max: 2,
        ..SenderConfig::default()
    };
    let mut flow = SenderFlow::new(cfg).expect("config");
    let id = ReqId("r".into());
    flow.handle_begin(T0, spec(&id, 3)).expect("begin");
    reply(&mut flow, vec![], true);
    let mut sent = Vec::new();
    for i in 0..3 {
        let chunk = ChunkSpec {
            key: format!("k{i}"),
            staging: flow.try_allocate(&id).expect("staging"),
            tokens: 1,
            bytes: 64,
        };
        flow.handle_submit(T0, &id, vec![chunk], i == 2)
            .expect("submit");
        sent.extend(std::iter::from_fn(|| flow.poll_transmit()));
    }
    assert_eq!(sent.len(), 2, "two batches in flight, the third queued");
    let Message::AllocRequest(first) = &sent[0].msg else {
        panic!("an AllocRequest: {:?}", sent[0]);
    };
    let grant = AllocResponse::granted(vec![0], Some(vec![1]), first.seq);
    flow.handle_message(T0, R, Message::AllocResponse(grant));
    let write = flow.poll_write().expect("the first batch's write");
    assert_eq!(write.chunk, 0);
    flow.check_invariants();
}

/// A batch may name only staging slots its request holds, each once: another request's
/// slot, or its own twice, is misuse (which fails the request); its own slot once is taken.
#[test]
fn a_batch_naming_a_slot_its_request_does_not_hold_is_misuse() {
    let (a, b) = (ReqId("a".into()), ReqId("b".into()));
    let chunk = |staging| ChunkSpec {
        key: "k".into(),
        staging,
        tokens: 1,
        bytes: 64,
    };
    for case in [
        "another request's slot",
        "its own slot twice",
        "its own slot once",
    ] {
        let cfg = SenderConfig {
            staging_slots: 3,
            ..SenderConfig::default()
        };
        let mut flow = SenderFlow::new(cfg).expect("config");
        assert_eq!(flow.config().staging_slots, 3, "the flow keeps its config");
        flow.handle_begin(T0, spec(&a, 2)).expect("begin");
        reply(&mut flow, vec![], true);
        flow.handle_begin(T0, spec(&b, 1)).expect("begin");
        reply(&mut flow, vec![], true);
        let mine = flow.try_allocate(&a).expect("a's staging");
        let theirs = flow.try_allocate(&b).expect("b's staging");
        let batch = match case {
            "another request's slot" => vec![chunk(theirs)],
            "its own slot twice" => vec![chunk(mine), chunk(mine)],
            _ => vec![chunk(mine)],
        };
        let result = flow.handle_submit(T0, &a, batch, false);
        if case == "its own slot once" {
            assert!(result.is_ok(), "{result:?}");
        } else {
            assert!(
                matches!(&result, Err(SendError::Misuse { why, .. }) if why.contains("not held by this request")),
                "{case}: {result:?}"
            );
        }
    }
}

/// A posted write is overdue at `write_timeout` exactly, not before: a timer that fires
/// earlier for anything else leaves it alone; then its request fails once and the stall is
/// reported once, however often the timer fires after.
#[test]
fn a_write_is_overdue_at_its_timeout_and_reported_once() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let timeout = flow.config().write_timeout;
    let id = ReqId("r".into());
    posted(&mut flow, &id);
    events(&mut flow);
    flow.handle_timeout(T0 + (timeout - Duration::from_millis(1)));
    assert_eq!(flow.outcome(&id), None, "not overdue yet");
    assert!(events(&mut flow).is_empty());
    flow.handle_timeout(T0 + timeout);
    assert_eq!(flow.outcome(&id), Some(Err(SendFailure::WriteTimeout)));
    let stalls = |evs: Vec<SenderEvent>| {
        evs.iter()
            .filter(|e| matches!(e, SenderEvent::FabricStalled { .. }))
            .count()
    };
    assert_eq!(stalls(events(&mut flow)), 1);
    flow.handle_timeout(T0 + timeout * 2);
    assert_eq!(stalls(events(&mut flow)), 0, "reported once");
    flow.check_invariants();
}

/// Staging is held by callers only when every slot is taken by an unsubmitted chunk: with
/// one slot's write in flight it is not, and a caller holding the other slot waits for that
/// write instead of being told to submit.
#[test]
fn staging_is_held_by_callers_only_with_nothing_in_flight() {
    let cfg = SenderConfig {
        staging_slots: 2,
        ..SenderConfig::default()
    };
    let mut flow = SenderFlow::new(cfg).expect("config");
    let (a, b) = (ReqId("a".into()), ReqId("b".into()));
    posted(&mut flow, &a);
    flow.handle_begin(T0, spec(&b, 2)).expect("begin");
    reply(&mut flow, vec![], true);
    flow.try_allocate(&b).expect("the other slot");
    assert!(!flow.staging_held_by_callers(), "a's write holds a slot");
    assert_eq!(flow.try_allocate(&b), Err(SendError::WouldBlock));
}

/// S12: a slot the caller of a cancelled request still holds (taken, not added) is not
/// handed to the next request while that caller may still be writing it; it returns to the
/// pool when the caller hands it back — by releasing it, or by an add or a submit the
/// cancelled request refuses. Chunks already added are free at once.
#[test]
fn a_cancelled_requests_slots_its_caller_holds_stay_out_of_the_pool_until_handed_back() {
    let cfg = SenderConfig {
        staging_slots: 3,
        ..SenderConfig::default()
    };
    let mut flow = SenderFlow::new(cfg).expect("config");
    let (a, b) = (ReqId("a".into()), ReqId("b".into()));
    for id in [&a, &b] {
        flow.handle_begin(T0, spec(id, 4)).expect("begin");
        reply(&mut flow, vec![], true);
    }
    let chunk = |slot, key: &str| ChunkSpec {
        key: key.into(),
        staging: slot,
        tokens: 1,
        bytes: 64,
    };
    let added = flow.try_allocate(&a).expect("a slot");
    flow.handle_add(T0, &a, chunk(added, "a0")).expect("added");
    let writing = flow.try_allocate(&a).expect("a slot");
    let also_writing = flow.try_allocate(&a).expect("a slot");
    flow.handle_cancel(T0, &a).expect("cancel");
    flow.check_invariants();
    // Only the added chunk's slot is free: the other two are still in a's caller's hands.
    assert_eq!(flow.staging_free(), 1);
    assert_eq!(flow.try_allocate(&b), Ok(added));
    assert_eq!(flow.try_allocate(&b), Err(SendError::WouldBlock));
    // The caller hands them back: a release, and an add the cancelled request refuses.
    assert_eq!(flow.release_staging(&a, writing), Ok(()));
    assert!(matches!(
        flow.handle_add(T0, &a, chunk(also_writing, "a2")),
        Err(SendError::Failed(_, SendFailure::Cancelled))
    ));
    flow.check_invariants();
    assert_eq!(flow.staging_free(), 2);
    assert!(flow.try_allocate(&b).is_ok());
}
