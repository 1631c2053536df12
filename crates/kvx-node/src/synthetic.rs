//! A synthetic chunked-prefill workload, for the demo, the load generator and end-to-end
//! tests: each chunk's bytes derive from (request, chunk), so the decoder can verify every
//! byte it reads without knowing anything else.

use std::time::Duration;

use kvx_io::{Env, SlotMemory};
use kvx_proto::sender::{ChunkSpec, RequestSpec, SendFailure};
use kvx_proto::{PeerId, ReqId};

use crate::receiver::{ReadyRequest, ReceiverHandle};
use crate::sender::SenderHandle;

/// Fills `out` with the bytes of chunk `chunk` of request `req_id`.
pub fn chunk_bytes(req_id: &str, chunk: u32, out: &mut [u8]) {
    // FNV-1a of the request id, mixed with the chunk index, seeds a xorshift stream.
    let mut x = req_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    x ^= u64::from(chunk).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for word in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        word.copy_from_slice(&x.to_le_bytes()[..word.len()]);
    }
}

/// One request of the synthetic workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticRequest {
    pub req_id: ReqId,
    pub receiver: PeerId,
    pub chunks: u32,
    pub batch_chunks: u32,
    pub chunk_bytes: usize,
}

/// What a prefill of one request measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillTiming {
    /// Time from `begin` to the receiver's admission.
    pub admission_wait: Duration,
}

/// Prefills one request: begin, await admission, stage and submit every chunk in batches,
/// and await the outcome (delivered or failed).
pub async fn prefill<E: Env>(
    sender: &SenderHandle<E>,
    req: &SyntheticRequest,
) -> Result<PrefillTiming, SendFailure> {
    let spec = RequestSpec {
        req_id: req.req_id.clone(),
        receiver: req.receiver,
        total_chunks: req.chunks,
        fmt: 1,
        shape: vec![2, 1, 256, (req.chunk_bytes / 1024).max(1) as u64],
        dtype: "bfloat16".into(),
    };
    let started = tokio::time::Instant::now();
    sender
        .begin(spec)
        .map_err(|e| SendFailure::Misuse(e.to_string()))?;
    sender.admitted(&req.req_id).await?;
    let admission_wait = started.elapsed();
    let mut buf = vec![0u8; req.chunk_bytes];
    let mut batch = Vec::new();
    for chunk in 0..req.chunks {
        let slot = match sender.allocate(&req.req_id).await {
            Ok(slot) => slot,
            Err(e) => {
                let _ = sender.cancel(&req.req_id);
                return sender
                    .outcome(&req.req_id)
                    .await
                    .and(Err(SendFailure::Misuse(e.to_string())));
            }
        };
        chunk_bytes(&req.req_id.0, chunk, &mut buf);
        sender.stage(slot, &buf);
        batch.push(ChunkSpec {
            key: format!("{}@{chunk}", req.req_id),
            staging: slot,
            tokens: 256,
        });
        let is_last = chunk + 1 == req.chunks;
        let full = batch.len() as u32 == req.batch_chunks || is_last;
        // An error means the request ended meanwhile; its outcome says how.
        if full
            && sender
                .submit(&req.req_id, std::mem::take(&mut batch), is_last)
                .is_err()
        {
            break;
        }
    }
    sender
        .outcome(&req.req_id)
        .await
        .map(|()| PrefillTiming { admission_wait })
}

/// Reads every chunk of a ready request and checks its bytes. Returns the bytes verified,
/// or the first chunk that differs.
pub fn verify<M: SlotMemory>(
    receiver: &ReceiverHandle<M>,
    ready: &ReadyRequest,
    chunk_len: usize,
) -> Result<u64, u32> {
    let mut got = vec![0u8; chunk_len];
    let mut want = vec![0u8; chunk_len];
    for (chunk, slot) in ready.slots.iter().enumerate() {
        receiver.read_chunk(*slot, &mut got);
        chunk_bytes(&ready.key.req_id.0, chunk as u32, &mut want);
        if got != want {
            return Err(chunk as u32);
        }
    }
    Ok((ready.slots.len() * chunk_len) as u64)
}
