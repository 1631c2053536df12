//! LMCache's PD messages as msgpack, through kvx's own codec (`kvx_proto::wire`, byte for
//! byte what LMCache's msgspec writes), for hostile and legitimate peers alike. Requests carry
//! `seq`, as a kvx sender's do: a kvx receiver refuses senders without it by default.

use kvx_proto::wire::{self, AllocRequest, AllocResponse, CancelNotif, Message, ProxyNotif};

/// The keys of chunks `range` of request `req_id`.
pub fn keys(req_id: &str, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|i| format!("{req_id}@chunk{i}")).collect()
}

/// One batch of `req_id`: chunks `range` of `total_chunks`.
pub fn alloc_request(req_id: &str, range: std::ops::Range<u32>, total_chunks: u32) -> Vec<u8> {
    let last = range.end >= total_chunks;
    wire::encode(&Message::AllocRequest(AllocRequest {
        // Each chunk's length, as a kvx sender declares it (these are never written).
        chunk_bytes: Some(vec![4096; range.len()]),
        claim: None,
        keys: keys(req_id, range),
        fmt: 1,
        shape: vec![2, 2, 16, 32],
        dtype: "bfloat16".into(),
        last_chunk_toks: 16,
        req_id: req_id.into(),
        is_last_batch: last,
        total_chunks,
        seq: Some(1),
    }))
}

/// Cancels `req_id` (its chunks `range`), saying no write to its slots is outstanding.
pub fn cancel(req_id: &str, range: std::ops::Range<u32>) -> Vec<u8> {
    wire::encode(&Message::CancelNotif(CancelNotif {
        req_id: req_id.into(),
        keys: keys(req_id, range),
        seq: Some(2),
        drained: Some(true),
    }))
}

pub fn proxy_notif(req_id: &str) -> Vec<u8> {
    wire::encode(&Message::ProxyNotif(ProxyNotif {
        req_id: req_id.into(),
    }))
}

/// The reply as an `AllocResponse`; panics on anything else.
pub fn alloc_response(bytes: &[u8]) -> AllocResponse {
    match wire::decode(bytes) {
        Ok(Message::AllocResponse(r)) => r,
        other => panic!("expected an AllocResponse, got {other:?}"),
    }
}

/// Whether the reply grants `n` slots.
pub fn granted(bytes: &[u8], n: usize) -> bool {
    let r = alloc_response(bytes);
    r.remote_indexes.len() == n && !r.is_refusal()
}
