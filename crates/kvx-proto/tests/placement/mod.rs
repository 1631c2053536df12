//! What the caller-placement ledger tests share (`ledger_placement.rs`, `lost_senders.rs`):
//! a caller-placement ledger, a kvx sender's batches carrying their reservation's claim
//! secret, and readers of its replies and events.

// Each test binary that includes this module uses a part of it.
#![allow(dead_code)]

use std::time::Duration;

use kvx_proto::receiver::{ChecksumCheck, LandedWrite, Outcome, ReceiverEvent, ReceiverLedger};
use kvx_proto::wire::{AllocRequest, AllocResponse, Message};
use kvx_proto::{
    ClaimSecret, Instant, PeerId, Placement, ReceiverConfig, ReqId, ReqKey, SlotIndex, WriteTag,
};

pub const A: PeerId = PeerId(1);
pub const B: PeerId = PeerId(2);
/// A sender with no relation to the requests it claims.
pub const EVE: PeerId = PeerId(66);
pub const CHUNK: u64 = 4096;

pub fn caller_ledger(slots: u32) -> ReceiverLedger {
    ReceiverLedger::new(ReceiverConfig {
        buffer_slots: slots,
        placement: Placement::Caller,
        ..ReceiverConfig::default()
    })
    .expect("config")
}

pub fn at(secs: u64) -> Instant {
    Instant::ZERO + Duration::from_secs(secs)
}

pub fn slots(list: &[u32]) -> Vec<SlotIndex> {
    list.iter().copied().map(SlotIndex).collect()
}

pub fn key(peer: PeerId, id: &str) -> ReqKey {
    ReqKey {
        peer,
        req_id: ReqId(id.into()),
    }
}

/// The claim secret of `id`'s reservation, which its own sender knows.
pub fn secret(id: &str) -> ClaimSecret {
    let id = &id[..id.len().min(64)];
    ClaimSecret::new(format!("secret-of-{id}-0123456789")).expect("a valid secret")
}

/// A kvx sender's batch of `n` chunks of `id` (of `total`), `seq` as given, carrying the
/// reservation's secret as the sender it was made for does.
pub fn batch(id: &str, n: usize, total: u32, last: bool, seq: u64) -> AllocRequest {
    AllocRequest {
        keys: (0..n).map(|i| format!("{id}-{seq}-{i}")).collect(),
        chunk_bytes: Some(vec![CHUNK; n]),
        claim: Some(secret(id)),
        fmt: 1,
        shape: vec![1],
        dtype: "float32".into(),
        last_chunk_toks: 1,
        req_id: id.into(),
        is_last_batch: last,
        total_chunks: total,
        seq: Some(seq),
    }
}

/// Sends `msg` from `peer` and returns the replies it caused.
pub fn send(
    ledger: &mut ReceiverLedger,
    now: Instant,
    peer: PeerId,
    msg: AllocRequest,
) -> Vec<AllocResponse> {
    ledger.handle_message(now, peer, Message::AllocRequest(msg));
    replies(ledger)
}

pub fn replies(ledger: &mut ReceiverLedger) -> Vec<AllocResponse> {
    ledger.check_invariants();
    while ledger.poll_grant_change().is_some() {}
    std::iter::from_fn(|| ledger.poll_transmit().map(|(_, r)| r)).collect()
}

pub fn events(ledger: &mut ReceiverLedger) -> Vec<ReceiverEvent> {
    std::iter::from_fn(|| ledger.poll_event()).collect()
}

/// The granted write tags of a reply.
pub fn tags(reply: &AllocResponse) -> Vec<WriteTag> {
    assert!(reply.error.is_none(), "granted: {reply:?}");
    let generations = reply.generations.clone().expect("a kvx sender's reply");
    reply
        .remote_indexes
        .iter()
        .zip(generations)
        .map(|(&slot, generation)| WriteTag {
            slot: SlotIndex(slot as u32),
            generation,
        })
        .collect()
}

pub fn land(ledger: &mut ReceiverLedger, now: Instant, peer: PeerId, tag: WriteTag) {
    ledger.handle_chunk_landed(
        now,
        LandedWrite {
            peer,
            slot: tag.slot,
            tag,
            bytes: CHUNK,
            checksum: ChecksumCheck::Match,
        },
    );
    ledger.check_invariants();
}

pub fn returned(evs: &[ReceiverEvent]) -> Option<(Vec<SlotIndex>, Outcome)> {
    evs.iter().find_map(|e| match e {
        ReceiverEvent::Returned { slots, outcome, .. } => Some((slots.clone(), outcome.clone())),
        _ => None,
    })
}

pub fn ended(evs: &[ReceiverEvent]) -> Option<Outcome> {
    evs.iter().find_map(|e| match e {
        ReceiverEvent::Ended { outcome, .. } => Some(outcome.clone()),
        _ => None,
    })
}
