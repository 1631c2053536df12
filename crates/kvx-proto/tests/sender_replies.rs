//! The sender's handling of replies that come too late, or that no correct receiver sends
//! (W22): a reply that grants one slot to two chunks of a batch would have the second write
//! overwrite the first, so it fails the request as a bad reply (a hostile review found it
//! accepted).

use std::time::Duration;

use kvx_proto::sender::{
    ChunkSpec, Destination, RequestSpec, SendFailure, SenderEvent, SenderFlow, Transmit,
};
use kvx_proto::wire::{AllocResponse, Message};
use kvx_proto::{Instant, PeerId, ReqId, SenderConfig};

const R: PeerId = PeerId(1);

fn seq_of(msg: &Message) -> Option<u64> {
    match msg {
        Message::AllocRequest(m) => m.seq,
        Message::CancelNotif(m) => m.seq,
        _ => None,
    }
}

/// A grant processed after its deadline (the process stalled) is not written to: the
/// receiver may have reclaimed and re-granted those slots. The request fails with a reply
/// timeout and cancels at the receiver.
#[test]
fn a_grant_processed_after_its_deadline_is_not_written() {
    let cfg = SenderConfig {
        reply_timeout: Duration::from_secs(1),
        ..SenderConfig::default()
    };
    let mut s = SenderFlow::new(cfg).expect("config");
    let id = ReqId("r".into());
    let t0 = Instant::ZERO;
    let spec = RequestSpec {
        req_id: id.clone(),
        receiver: R,
        total_chunks: 1,
        fmt: 1,
        shape: vec![1],
        dtype: "bf16".into(),
        claim: None,
    };
    s.handle_begin(t0, spec).expect("begin");
    let probe = s.poll_transmit().expect("probe");
    s.handle_message(
        t0,
        R,
        Message::AllocResponse(AllocResponse::granted(
            vec![],
            Some(vec![]),
            seq_of(&probe.msg),
        )),
    );
    let slot = s.try_allocate(&id).expect("staging");
    let chunk = ChunkSpec {
        key: "k".into(),
        staging: slot,
        tokens: 1,
        bytes: 64,
    };
    s.handle_submit(t0, &id, vec![chunk], true).expect("submit");
    let batch = s.poll_transmit().expect("batch");
    let late = t0 + Duration::from_secs(5);
    s.handle_message(
        late,
        R,
        Message::AllocResponse(AllocResponse::granted(
            vec![3],
            Some(vec![1]),
            seq_of(&batch.msg),
        )),
    );
    assert_eq!(s.poll_write(), None, "no write into a stale grant");
    let failed = std::iter::from_fn(|| s.poll_event()).find_map(|e| match e {
        SenderEvent::Failed { failure, .. } => Some(failure),
        _ => None,
    });
    assert_eq!(failed, Some(SendFailure::ReplyTimeout));
    let cancel =
        std::iter::from_fn(|| s.poll_transmit()).find(|t| matches!(t.msg, Message::CancelNotif(_)));
    let Some(Transmit {
        to: Destination::Receiver(R),
        msg: Message::CancelNotif(cancel),
    }) = cancel
    else {
        panic!("the receiver is told: {cancel:?}");
    };
    assert_eq!(s.staging_free(), s.staging_capacity(), "staging released");
    s.check_invariants();
    // Once the cancel is acknowledged nothing of the request is left.
    let ack = AllocResponse::cancel_ack(cancel.seq);
    s.handle_message(late, R, Message::AllocResponse(ack));
    assert!(s.is_quiescent(), "nothing left");
}

fn reply_to_last(flow: &mut SenderFlow, slots: Vec<i64>) {
    let t = flow.poll_transmit().expect("a message went out");
    let Message::AllocRequest(req) = t.msg else {
        panic!("an AllocRequest: {t:?}");
    };
    let generations = Some(vec![1; slots.len()]);
    let reply = AllocResponse::granted(slots, generations, req.seq);
    flow.handle_message(Instant::ZERO, R, Message::AllocResponse(reply));
}

fn begin_and_stage(flow: &mut SenderFlow, id: &ReqId) -> Vec<ChunkSpec> {
    flow.handle_begin(
        Instant::ZERO,
        RequestSpec {
            req_id: id.clone(),
            receiver: R,
            total_chunks: 2,
            fmt: 1,
            shape: vec![1],
            dtype: "bfloat16".into(),
            claim: None,
        },
    )
    .expect("begin");
    reply_to_last(flow, vec![]);
    (0..2)
        .map(|i| ChunkSpec {
            key: format!("k{i}"),
            staging: flow.try_allocate(id).expect("staging"),
            tokens: 1,
            bytes: 64,
        })
        .collect()
}

#[test]
fn a_reply_granting_one_slot_twice_fails_the_request() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let id = ReqId("r".into());
    let chunks = begin_and_stage(&mut flow, &id);
    flow.handle_submit(Instant::ZERO, &id, chunks, true)
        .expect("submit");
    reply_to_last(&mut flow, vec![3, 3]);
    assert_eq!(flow.poll_write(), None, "nothing is written");
    let failure = std::iter::from_fn(|| flow.poll_event()).find_map(|e| match e {
        SenderEvent::Failed { failure, .. } => Some(failure),
        _ => None,
    });
    assert!(
        matches!(&failure, Some(SendFailure::BadReply(why)) if why.contains("granted twice")),
        "{failure:?}"
    );
}

#[test]
fn a_reply_granting_distinct_slots_is_written() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let id = ReqId("r".into());
    let chunks = begin_and_stage(&mut flow, &id);
    flow.handle_submit(Instant::ZERO, &id, chunks, true)
        .expect("submit");
    reply_to_last(&mut flow, vec![3, 4]);
    assert_eq!(std::iter::from_fn(|| flow.poll_write()).count(), 2);
}

/// An `already_sent` index past the batch's last chunk is a bad reply, not a chunk skipped.
#[test]
fn an_already_sent_index_out_of_range_fails_the_request() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let id = ReqId("r".into());
    let chunks = begin_and_stage(&mut flow, &id);
    flow.handle_submit(Instant::ZERO, &id, chunks, true)
        .expect("submit");
    let t = flow.poll_transmit().expect("the batch");
    let Message::AllocRequest(req) = t.msg else {
        panic!("an AllocRequest: {t:?}");
    };
    let mut reply = AllocResponse::granted(vec![3], Some(vec![1]), req.seq);
    reply.already_sent_indexes = vec![2];
    flow.handle_message(Instant::ZERO, R, Message::AllocResponse(reply));
    assert_eq!(flow.poll_write(), None, "nothing is written");
    let failure = std::iter::from_fn(|| flow.poll_event()).find_map(|e| match e {
        SenderEvent::Failed { failure, .. } => Some(failure),
        _ => None,
    });
    assert!(
        matches!(&failure, Some(SendFailure::BadReply(why)) if why.contains("out of range")),
        "{failure:?}"
    );
}
