//! A request waiting for admission is refused when its `admission_timeout` passes, by a
//! driver that does what every kvx driver does: sleep until `ReceiverLedger::poll_timeout`,
//! then call `handle_timeout`. So the head of the admission queue's deadline must be among
//! the ledger's timers, even when every other timer (here the holder's idle lease) is later;
//! without it the waiter would wait until some other timer happened to fire, or forever.

use std::time::Duration;

use kvx_proto::receiver::{Failure, Outcome, ReceiverEvent, ReceiverLedger};
use kvx_proto::wire::{AllocRequest, Message};
use kvx_proto::{Instant, PeerId, ReceiverConfig, ReqId, ReqKey};

const HOLDER: PeerId = PeerId(1);
const WAITER: PeerId = PeerId(2);

/// A kvx sender's first batch (one chunk of `total`).
fn first_batch(req: &str, total: u32) -> Message {
    Message::AllocRequest(AllocRequest {
        keys: vec![format!("{req}@0")],
        chunk_bytes: Some(vec![64]),
        claim: None,
        fmt: 1,
        shape: vec![2, 2, 256, 64],
        dtype: "bfloat16".into(),
        last_chunk_toks: 256,
        req_id: req.into(),
        is_last_batch: total == 1,
        total_chunks: total,
        seq: Some(1),
    })
}

#[test]
fn a_waiting_request_is_refused_at_its_admission_deadline() {
    let admission_timeout = Duration::from_secs(5);
    let cfg = ReceiverConfig {
        buffer_slots: 4,
        peer_share_percent: 100,
        admission_timeout,
        // The holder lands nothing: here it keeps its reservation for its idle lease, so that
        // the waiter's own deadline is what ends the wait (`stalled_reservations.rs` covers
        // the stall rule).
        stall_timeout: ReceiverConfig::default().request_idle_timeout,
        ..ReceiverConfig::default()
    };
    assert!(
        admission_timeout + Duration::from_secs(1) < cfg.request_idle_timeout,
        "the holder's idle lease must end after the waiter's deadline"
    );
    let mut ledger = ReceiverLedger::new(cfg).expect("valid config");

    // The holder reserves the whole buffer; the waiter arrives a second later and queues.
    ledger.handle_message(Instant::ZERO, HOLDER, first_batch("holder", 4));
    let arrival = Instant::ZERO + Duration::from_secs(1);
    ledger.handle_message(arrival, WAITER, first_batch("waiter", 1));
    let replies: Vec<PeerId> = std::iter::from_fn(|| ledger.poll_transmit())
        .map(|(peer, _)| peer)
        .collect();
    assert_eq!(replies, [HOLDER], "only the holder is answered");
    while ledger.poll_event().is_some() {}
    assert_eq!(ledger.admission_queue_len(), 1);
    ledger.check_invariants();

    let deadline = arrival + admission_timeout;
    assert_eq!(
        ledger.poll_timeout(),
        Some(deadline),
        "the waiter's admission deadline is the ledger's next timer"
    );
    // The driver's loop: wake at the next timer, handle it.
    let now = ledger.poll_timeout().expect("a timer");
    ledger.handle_timeout(now);
    ledger.check_invariants();

    let ended: Vec<(ReqKey, Outcome)> = std::iter::from_fn(|| ledger.poll_event())
        .filter_map(|ev| match ev {
            ReceiverEvent::Ended { key, outcome } => Some((key, outcome)),
            _ => None,
        })
        .collect();
    let waiter = ReqKey {
        peer: WAITER,
        req_id: ReqId("waiter".into()),
    };
    assert_eq!(
        ended,
        [(waiter, Outcome::Failed(Failure::AdmissionTimeout))],
        "at {now:?}, the waiter and only it ends"
    );
    let (peer, reply) = ledger.poll_transmit().expect("the waiter is answered");
    assert_eq!(peer, WAITER);
    assert!(
        reply.is_refusal()
            && reply
                .error
                .as_deref()
                .is_some_and(|e| e.contains("admission timed out")),
        "{reply:?}"
    );
    assert_eq!(ledger.admission_queue_len(), 0);
    assert_eq!(ledger.tracked_requests(), 1, "the holder is untouched");
}
