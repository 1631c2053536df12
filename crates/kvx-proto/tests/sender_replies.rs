//! The sender's handling of replies that come too late.

use std::time::Duration;

use kvx_proto::sender::{
    ChunkSpec, Destination, RequestSpec, SendFailure, SenderEvent, SenderFlow,
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
    assert!(
        matches!(cancel, Some(t) if t.to == Destination::Receiver(R)),
        "the receiver is told"
    );
    assert_eq!(s.staging_free(), s.staging_capacity(), "staging released");
    s.check_invariants();
}
