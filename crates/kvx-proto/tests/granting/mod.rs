//! A receiver stand-in for the sender's own tests: it answers every message a `SenderFlow`
//! sent so far at once, probes with an empty grant and batches with the next receiver slots,
//! one per key (shared by `staging_order.rs` and `caller_staging.rs`).

use kvx_proto::sender::SenderFlow;
use kvx_proto::wire::{AllocResponse, Message};
use kvx_proto::{Instant, PeerId};

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
