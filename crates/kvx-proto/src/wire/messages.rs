//! The four LMCache PD messages, plus kvx's opt-in extensions.
//!
//! Field names, order, types and defaults follow LMCache's `msgspec` structs
//! (`docs/spec/wire.md`, reference §2.1). kvx's own fields are `Option`s that are left out of
//! the bytes when unset, so an LMCache peer sees exactly its own format; fields we do not
//! know are ignored on decode.

use serde::{Deserialize, Serialize};

use crate::claim::ClaimSecret;

/// Sender → receiver: one batch of chunk keys for one request (or, with no keys, an
/// admission probe: kvx asks for the reservation before any chunk takes staging).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocRequest {
    /// Stringified cache keys, one per chunk in this batch. Opaque to the protocol.
    pub keys: Vec<String>,
    /// LMCache `MemoryFormat` value (`KV_2LTD` = 1).
    pub fmt: u32,
    /// Shape of one full chunk, e.g. `[2, layers, tokens, dim]`.
    pub shape: Vec<u64>,
    /// torch dtype name, e.g. `"bfloat16"`.
    pub dtype: String,
    /// Token count of the last key of this batch.
    pub last_chunk_toks: u64,
    /// The proxy's request id. Empty means LMCache's legacy path, which kvx refuses.
    #[serde(default)]
    pub req_id: String,
    /// This is the request's final batch.
    #[serde(default)]
    pub is_last_batch: bool,
    /// Chunks the whole request will send; reserved on the first batch.
    #[serde(default)]
    pub total_chunks: u32,
    /// kvx extension: correlates the reply; its presence marks a kvx sender.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// kvx extension: each chunk's length in bytes, parallel to `keys` (the last one of a
    /// partial chunk shorter). A kvx sender must send it: a write into a chunk's slot lands
    /// only if it brings exactly this many bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_bytes: Option<Vec<u64>>,
    /// kvx extension: the claim secret of the caller-placement reservation this request
    /// claims (`crate::claim`); a first batch without the reservation's secret claims
    /// nothing. Never printed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<ClaimSecret>,
}

/// Receiver → sender: the slots to write, or `[-1]` entries on failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocResponse {
    /// One receiver slot per key that must be written; −1 means failure.
    pub remote_indexes: Vec<i64>,
    /// Indexes into the batch's `keys` the receiver already holds (LMCache dedup): nothing
    /// is written for them. A kvx receiver names them only under caller placement, for the
    /// leading chunks a reservation says the application holds (`handle_reserve_held`).
    #[serde(default)]
    pub already_sent_indexes: Vec<i64>,
    /// kvx extension: echoes the request's `seq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// kvx extension: why the request was refused, in words a person can act on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// kvx extension: the generation of each granted slot, parallel to `remote_indexes`;
    /// the sender puts it into the write's immediate so a late write is recognisable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generations: Option<Vec<u32>>,
    /// kvx extension: the credential the sender presents when it attaches its fabric
    /// connection, which ties that connection to this control peer so that its writes land
    /// only in slots granted to this peer (`docs/spec/fabrics.md` §Access). Opaque to the
    /// sender; at most `FABRIC_CREDENTIAL_MAX` bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric_credential: Option<String>,
    /// kvx extension: the receiver's `request_idle_timeout`, in milliseconds, so that a kvx
    /// sender can check its own timeouts against it (`ReceiverConfig::check_sender`: the
    /// rule spans two processes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_idle_timeout_ms: Option<u64>,
    /// kvx extension: the receiver's `write_quarantine`, in milliseconds, for the same check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_quarantine_ms: Option<u64>,
}

/// The longest `AllocResponse::fabric_credential` a sender accepts.
pub const FABRIC_CREDENTIAL_MAX: usize = 128;

/// Sender → proxy (PUSH → PULL): every chunk of `req_id` is written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyNotif {
    /// The proxy's request id, as the sender's batches carried it.
    pub req_id: String,
}

/// Sender → receiver: abort `req_id` and release `keys` and its reservation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelNotif {
    /// The request to abort.
    pub req_id: String,
    /// The chunk keys sent so far (LMCache's per-key bookkeeping); a kvx receiver releases
    /// the whole request whatever this names.
    pub keys: Vec<String>,
    /// kvx extension: correlates the (empty) reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// kvx extension: the sender has no write to this request's slots outstanding, so the
    /// receiver may reuse them at once instead of quarantining them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained: Option<bool>,
}

/// kvx extension, sender → proxy (opt-in): `req_id` failed and will never be ready.
/// An LMCache proxy does not know this message, so senders send it only when configured to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailNotif {
    /// The request that failed.
    pub req_id: String,
    /// Why, in words a person can act on; the proxy cuts it to `reason_bytes_max`.
    pub reason: String,
}

/// Every message on kvx's wire, tagged by `"type"` with the class name as LMCache does.
///
/// The derived `Serialize` (with `rmp_serde::to_vec_named`) writes the same bytes as
/// [`super::encode`]; decode with [`super::decode`], not serde: the derived `Deserialize`
/// accepts bin for str, which msgspec rejects, and is about 3× slower (`docs/spec/wire.md` §5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Message {
    /// Sender → receiver: a batch or an admission probe.
    AllocRequest(AllocRequest),
    /// Receiver → sender: the reply to an `AllocRequest` or a `CancelNotif`.
    AllocResponse(AllocResponse),
    /// Sender → proxy: the request's chunks are all written.
    ProxyNotif(ProxyNotif),
    /// Sender → receiver: abort a request.
    CancelNotif(CancelNotif),
    /// Sender → proxy (kvx only): the request failed.
    FailNotif(FailNotif),
}

impl AllocResponse {
    /// A successful reply granting `slots`.
    pub fn granted(slots: Vec<i64>, generations: Option<Vec<u32>>, seq: Option<u64>) -> Self {
        Self {
            remote_indexes: slots,
            already_sent_indexes: Vec::new(),
            seq,
            error: None,
            generations,
            fabric_credential: None,
            request_idle_timeout_ms: None,
            write_quarantine_ms: None,
        }
    }

    /// LMCache's error shape: `max(n_keys, 1)` entries of −1, plus kvx's reason for a kvx
    /// peer. A peer that sent no `seq` (LMCache) gets exactly LMCache's bytes; the receiver
    /// logs the reason instead.
    pub fn refused(n_keys: usize, reason: String, seq: Option<u64>) -> Self {
        Self {
            remote_indexes: vec![-1; n_keys.max(1)],
            already_sent_indexes: Vec::new(),
            seq,
            error: seq.map(|_| reason),
            generations: None,
            fabric_credential: None,
            request_idle_timeout_ms: None,
            write_quarantine_ms: None,
        }
    }

    /// The empty acknowledgement of a `CancelNotif`.
    pub fn cancel_ack(seq: Option<u64>) -> Self {
        Self::granted(Vec::new(), None, seq)
    }

    /// True when LMCache would read this as a failure (any −1 entry).
    pub fn is_refusal(&self) -> bool {
        self.error.is_some() || self.remote_indexes.iter().any(|&i| i < 0)
    }
}
