//! A synthetic chunked-prefill workload, for the demo, the load generator and end-to-end
//! tests: each chunk's bytes derive from (request, chunk), so the decoder can verify every
//! byte it reads without knowing anything else.
//!
//! Its latency figures (admission wait, first submit) read tokio's clock: a measurement for
//! whoever runs the workload (simulated under madsim all the same), never an input to a
//! driver's decisions; hence the one `allow` of `clippy.toml`'s clock rule in this crate.
#![allow(clippy::disallowed_methods)]

use std::time::Duration;

use kvx_io::{Env, SlotMemory};
use kvx_proto::sender::{ChunkSpec, RequestSpec, SendError, SendFailure};
use kvx_proto::{PeerId, ReqId};

use crate::receiver::{ChunkReader, ReadyRequest};
use crate::sender::SenderHandle;

/// The key every word of chunk `chunk` of request `req_id` is mixed with: FNV-1a of the id,
/// mixed with the chunk index. Distinct chunks differ in every word, so a chunk in the wrong
/// slot, a stale slot, or a single flipped byte all show.
fn chunk_key(req_id: &str, chunk: u32) -> u64 {
    let h = req_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (h ^ u64::from(chunk).wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9)
        | 1
}

/// Words per block: chunks are generated and checked in 4 KiB blocks, each the same
/// pseudo-random base block (L1-resident, so generating and checking run at memory speed)
/// XOR a per-block key.
const BLOCK_WORDS: usize = 512;

/// The base block (SplitMix64 from a fixed seed), computed once per process.
fn base_block() -> &'static [u64; BLOCK_WORDS] {
    static BASE: std::sync::OnceLock<[u64; BLOCK_WORDS]> = std::sync::OnceLock::new();
    BASE.get_or_init(|| {
        let mut x = 0x5EED_u64;
        std::array::from_fn(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        })
    })
}

/// The key of 4 KiB block `block` of a chunk whose key is `key`: every block of every chunk
/// has its own, so a block written at the wrong offset shows as well as a wrong chunk.
fn block_key(key: u64, block: usize) -> u64 {
    key ^ (block as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

/// Word `i` of a chunk with key `key`, as stored (little-endian).
fn word(key: u64, i: usize) -> [u8; 8] {
    (base_block()[i % BLOCK_WORDS] ^ block_key(key, i / BLOCK_WORDS)).to_le_bytes()
}

const BLOCK_BYTES: usize = BLOCK_WORDS * 8;

/// Fills `out` with the bytes of chunk `chunk` of request `req_id`.
pub fn chunk_bytes(req_id: &str, chunk: u32, out: &mut [u8]) {
    let key = chunk_key(req_id, chunk);
    let base = base_block();
    let mut blocks = out.chunks_exact_mut(BLOCK_BYTES);
    let mut block = 0;
    // Whole blocks: a fixed-length loop over the L1-resident base, which vectorises.
    for out in &mut blocks {
        let k = block_key(key, block);
        for (w, b) in out.chunks_exact_mut(8).zip(base) {
            w.copy_from_slice(&(b ^ k).to_le_bytes());
        }
        block += 1;
    }
    let i = block * BLOCK_WORDS;
    let rest = blocks.into_remainder();
    for (j, w) in rest.chunks_mut(8).enumerate() {
        let n = w.len();
        w.copy_from_slice(&word(key, i + j)[..n]);
    }
}

/// True when `got` holds exactly chunk `chunk` of request `req_id`.
pub fn chunk_matches(req_id: &str, chunk: u32, got: &[u8]) -> bool {
    let key = chunk_key(req_id, chunk);
    let base = base_block();
    let mut blocks = got.chunks_exact(BLOCK_BYTES);
    let mut block = 0;
    for got in &mut blocks {
        let k = block_key(key, block);
        // The OR of every difference in the block, with no early exit, so that the loop
        // vectorises; one test per 4 KiB.
        let diff = got.chunks_exact(8).zip(base).fold(0u64, |acc, (w, b)| {
            acc | (u64::from_le_bytes(w.try_into().expect("invariant: 8-byte chunks")) ^ b ^ k)
        });
        if diff != 0 {
            return false;
        }
        block += 1;
    }
    let i = block * BLOCK_WORDS;
    let rest = blocks.remainder();
    rest.chunks(8)
        .enumerate()
        .all(|(j, w)| w == &word(key, i + j)[..w.len()])
}

/// The claim secret of a synthetic request's caller-placement reservation: derived from its
/// id, so that a test's receiver and sender agree on it without a channel between them. Not
/// secret at all; an application draws one at random per reservation and hands it to the
/// one sender meant to claim it.
pub fn claim_secret(req_id: &ReqId) -> kvx_proto::ClaimSecret {
    let id: String = req_id
        .0
        .chars()
        .filter(char::is_ascii_graphic)
        .take(64)
        .collect();
    kvx_proto::ClaimSecret::new(format!("synthetic-claim-{id}"))
        .expect("invariant: 16..=128 printable bytes")
}

/// One request of the synthetic workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticRequest {
    /// The request's id; its bytes derive from it.
    pub req_id: ReqId,
    /// The receiver it goes to (`SenderHandle::add_receiver`'s id).
    pub receiver: PeerId,
    /// Chunks it sends (and declares).
    pub chunks: u32,
    /// Chunks per submitted batch (the last may be smaller).
    pub batch_chunks: u32,
    /// Bytes per chunk; at most a staging slot's size.
    pub chunk_bytes: usize,
}

/// What a prefill of one request measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillTiming {
    /// Time from `begin` to the receiver's admission.
    pub admission_wait: Duration,
    /// When the first batch was submitted; latency is measured from here.
    pub first_submit: tokio::time::Instant,
}

/// Prefills one request: `admit`, then `transfer`.
pub async fn prefill<E: Env>(
    sender: &SenderHandle<E>,
    req: &SyntheticRequest,
) -> Result<PrefillTiming, SendFailure> {
    let admission_wait = admit(sender, req).await?;
    transfer(sender, req, admission_wait).await
}

/// Begins a request and awaits its admission; returns how long that took. With TP > 1,
/// admit a request's ranks one after another in rank order before transferring any of them
/// (`docs/spec/protocol.md` §Tensor parallelism): ranks admitted in different orders by
/// different requests would each hold one rank and wait for the other.
pub async fn admit<E: Env>(
    sender: &SenderHandle<E>,
    req: &SyntheticRequest,
) -> Result<Duration, SendFailure> {
    let spec = RequestSpec {
        req_id: req.req_id.clone(),
        receiver: req.receiver,
        total_chunks: req.chunks,
        fmt: 1,
        shape: vec![2, 1, 256, (req.chunk_bytes / 1024).max(1) as u64],
        dtype: "bfloat16".into(),
        claim: Some(claim_secret(&req.req_id)),
    };
    let started = tokio::time::Instant::now();
    sender
        .begin(spec)
        .map_err(|e| SendFailure::Misuse(e.to_string()))?;
    sender.admitted(&req.req_id).await?;
    Ok(started.elapsed())
}

/// Stages and submits every chunk of an admitted request in batches, and awaits its outcome
/// (delivered or failed). A call that cannot go on (no staging in time, a refused submit)
/// cancels the request, so its outcome comes at once rather than at a timeout.
pub async fn transfer<E: Env>(
    sender: &SenderHandle<E>,
    req: &SyntheticRequest,
    admission_wait: Duration,
) -> Result<PrefillTiming, SendFailure> {
    let mut first_submit = None;
    let mut stopped = None;
    // Each chunk is added to the request's pending batch in the core, which submits pending
    // batches itself when only they hold staging (S11): the batching Python's callers use.
    let mut pending = 0;
    for chunk in 0..req.chunks {
        let allocated = sender.allocate(&req.req_id, &mut Vec::new()).await;
        if pending > 0 && sender.added_count(&req.req_id) == 0 {
            // The core submitted our pending chunks while we waited for staging.
            first_submit.get_or_insert_with(tokio::time::Instant::now);
        }
        let slot = match allocated {
            Ok(slot) => slot,
            Err(e) => {
                stopped = Some(e);
                break;
            }
        };
        // The chunk is produced straight into its staging slot.
        sender.stage_with(slot, req.chunk_bytes, &mut |out| {
            chunk_bytes(&req.req_id.0, chunk, out)
        });
        let added = ChunkSpec {
            key: format!("{}@{chunk}", req.req_id),
            staging: slot,
            tokens: 256,
            bytes: req.chunk_bytes as u64,
        };
        if let Err(e) = sender.add(&req.req_id, added) {
            stopped = Some(e);
            break;
        }
        pending = sender.added_count(&req.req_id);
        let is_last = chunk + 1 == req.chunks;
        if pending as u32 == req.batch_chunks || is_last {
            first_submit.get_or_insert_with(tokio::time::Instant::now);
            if let Err(e) = sender.submit_added(&req.req_id, is_last) {
                stopped = Some(e);
                break;
            }
            pending = 0;
        }
    }
    if let Some(e) = stopped {
        // A request that failed has its outcome already; any other error (a full channel,
        // a timeout) leaves it running with nothing more to come: end it.
        if !matches!(e, SendError::Failed(..)) {
            let _ = sender.cancel(&req.req_id);
        }
        let outcome = sender.outcome(&req.req_id).await;
        return outcome.and(Err(SendFailure::Misuse(e.to_string())));
    }
    let first_submit = first_submit.unwrap_or_else(tokio::time::Instant::now);
    let outcome = sender.outcome(&req.req_id).await;
    outcome.map(|()| PrefillTiming {
        admission_wait,
        first_submit,
    })
}

/// What the decoder made of one ready request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded {
    /// Every byte matched; this many bytes were read.
    Verified(u64),
    /// This chunk held other bytes.
    Corrupt(u32),
    /// The request ended between its Ready notice and the lease (cancelled): nothing to read.
    Gone,
}

/// The decoder's whole job for one ready request: lease it, check every chunk in place
/// (unless `check` is false: real KV data), and consume it.
pub async fn decode<M: SlotMemory>(
    receiver: &ChunkReader<M>,
    ready: ReadyRequest,
    chunk_len: usize,
    check: bool,
) -> Decoded {
    let Ok(lease) = receiver.lease(ready).await else {
        return Decoded::Gone;
    };
    let mut result = Decoded::Verified((lease.slots().len() * chunk_len) as u64);
    if check {
        let req_id = &lease.key().req_id.0;
        for chunk in 0..lease.slots().len() {
            let mut ok = false;
            lease.inspect_chunk(chunk, chunk_len, &mut |got| {
                ok = chunk_matches(req_id, chunk as u32, got)
            });
            if !ok {
                result = Decoded::Corrupt(chunk as u32);
                break;
            }
        }
        if matches!(result, Decoded::Verified(_)) {
            // Said only once every chunk was read and matched: what a test waits for to know
            // the decoder did read (the twin of "decoder read corrupt bytes" never showing).
            tracing::debug!(key = %lease.key(), chunks = lease.slots().len(), "decoder verified a request");
        }
    }
    let key = lease.key().clone();
    if let Err(e) = lease.consume().await {
        tracing::error!(%key, error = %e, "consume of a leased request failed");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_verify_and_any_difference_shows() {
        for len in [1usize, 7, 8, 13, 4096, 4099, 3 * 4096 + 5, 1 << 20] {
            let mut a = vec![0u8; len];
            chunk_bytes("s0-r001", 3, &mut a);
            assert!(chunk_matches("s0-r001", 3, &a));
            assert!(!chunk_matches("s0-r001", 4, &a), "another chunk's bytes");
            assert!(!chunk_matches("s0-r002", 3, &a), "another request's bytes");
            a[len / 2] ^= 0x10;
            assert!(!chunk_matches("s0-r001", 3, &a), "a flipped bit");
            a[len / 2] ^= 0x10;
            a[len - 1] ^= 0x01;
            assert!(!chunk_matches("s0-r001", 3, &a), "the last byte flipped");
        }
    }

    #[test]
    fn blocks_at_the_wrong_offset_show() {
        let mut a = vec![0u8; 4 * BLOCK_BYTES];
        chunk_bytes("s0-r001", 0, &mut a);
        let (first, rest) = a.split_at_mut(BLOCK_BYTES);
        first.swap_with_slice(&mut rest[..BLOCK_BYTES]);
        assert!(!chunk_matches("s0-r001", 0, &a), "two 4 KiB blocks swapped");
    }
}
