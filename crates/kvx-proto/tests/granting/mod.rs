//! What the sender's own tests share (`staging_order.rs`, `caller_staging.rs`): one receiver,
//! its requests' description, and a stand-in for it that answers every message a
//! `SenderFlow` sent so far at once, probes with an empty grant and batches with the next
//! receiver slots, one per key.

use kvx_proto::sender::{RequestSpec, SenderFlow};
use kvx_proto::wire::{AllocResponse, Message};
use kvx_proto::{Instant, PeerId, ReqId};

/// The receiver every request goes to.
pub const R: PeerId = PeerId(1);
/// The tests' clock: nothing here waits on time.
pub const T0: Instant = Instant::ZERO;

/// Request `id` of `total` chunks to `R`.
pub fn spec(id: &str, total: u32) -> RequestSpec {
    RequestSpec {
        req_id: ReqId(id.into()),
        receiver: R,
        total_chunks: total,
        fmt: 1,
        shape: vec![1],
        dtype: "bf16".into(),
        claim: None,
    }
}

/// Answers everything `flow` sent, as receiver `from`, granting slots `next_slot`, … in
/// turn.
pub fn answer(flow: &mut SenderFlow, from: PeerId, next_slot: &mut i64) {
    while let Some(t) = flow.poll_transmit() {
        let Message::AllocRequest(req) = &t.msg else {
            continue;
        };
        let n = req.keys.len();
        let slots: Vec<i64> = (*next_slot..*next_slot + n as i64).collect();
        *next_slot += n as i64;
        let reply = AllocResponse::granted(slots, Some(vec![1; n]), req.seq);
        flow.handle_message(Instant::ZERO, from, Message::AllocResponse(reply));
    }
}
