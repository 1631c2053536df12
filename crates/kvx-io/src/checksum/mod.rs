//! The end-to-end chunk checksum (`docs/spec/fabrics.md` §5b): XXH3-64 (the `twox-hash`
//! crate, which picks AVX2 or NEON at run time), folded to the 32 bits the write header
//! carries.
//!
//! A sender computes it over a chunk's bytes in its staging slot; the receiving fabric
//! computes it over the bytes that landed in the slot — while copying them
//! (`copy_with_checksum`, shared memory and in-process) or piece by piece as they arrive
//! (`LandingChecksum`, TCP) — and the ledger fails the request when the two differ. It guards against bytes changing anywhere
//! between the two memories: a staging slot rewritten too early, a fabric or kernel bug, a
//! NIC or memory fault past the link's own CRC, a write into the wrong slot.
//!
//! Why XXH3 and not CRC32C: every byte of a chunk passes through it twice (sender and
//! receiver), and `kvx demo` on two cores is CPU-bound. On the project's VM XXH3 runs at
//! 40–46 GB/s per core and CRC32C (the `crc32c` crate, the CPU's CRC32 instruction) at
//! 21–23 GB/s (`cargo bench -p kvx-benches --bench checksum`, docs/PERFORMANCE.md). What CRC
//! adds — certain detection of short bursts — matters on a wire that flips bits, which TCP
//! and the NIC already check; what kvx guards against (misplaced or stale writes, memory
//! corruption) is random with respect to the checksum, and any 32-bit checksum misses it with
//! probability 2⁻³².
//!
//! Map: this file is the API (`chunk_checksum` through `twox-hash`, the reference);
//! `xxh3_long.rs` is XXH3's long-input path written to run during a copy or as bytes land,
//! checked against `twox-hash` over many lengths and cuts.

mod xxh3_long;

use twox_hash::XxHash3_64;
use xxh3_long::{Kernel, LongState, LONG_MIN};

/// The checksum of a whole chunk.
pub fn chunk_checksum(bytes: &[u8]) -> u32 {
    fold(XxHash3_64::oneshot(bytes))
}

fn fold(h: u64) -> u32 {
    (h ^ (h >> 32)) as u32
}

/// Copies `src` into `dst` (the same length) and returns the checksum of the copy, in one
/// pass over the bytes: as fast as the copy alone where the CPU has AVX2
/// (`xxh3_long.rs`; docs/PERFORMANCE.md, "Integrity").
pub fn copy_with_checksum(dst: &mut [u8], src: &[u8]) -> u32 {
    assert_eq!(dst.len(), src.len(), "copy_with_checksum: lengths differ");
    // SAFETY: `src` is a live slice of `dst.len()` bytes; a `&mut` and a `&` never overlap.
    #[allow(unsafe_code)]
    unsafe {
        copy_shared_with_checksum(dst, src.as_ptr())
    }
}

/// `copy_with_checksum` from memory that is not a Rust slice: another process's shared
/// mapping, which that process may write while the copy runs. The checksum is of the bytes
/// `dst` received.
///
/// # Safety
/// `src` must be valid for reads of `dst.len()` bytes for the whole call, and must not
/// overlap `dst`.
#[allow(unsafe_code)]
pub unsafe fn copy_shared_with_checksum(dst: &mut [u8], src: *const u8) -> u32 {
    if dst.len() < LONG_MIN {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        return chunk_checksum(dst);
    }
    let mut state = LongState::new(dst.len(), Kernel::best());
    // SAFETY: the caller's contract; `dst` is writable for its length.
    unsafe { state.copy(src, dst.as_mut_ptr()) };
    fold(state.finish(dst))
}

/// The checksum of a chunk whose bytes land in place, piece by piece (a TCP receive into
/// its slot): each `advance` folds in what has landed since the last one, while it is still
/// in the CPU's caches, and `value` finishes over the whole chunk. The chunk's length is
/// known from the start (its write header declares it).
#[derive(Debug, Clone)]
pub struct LandingChecksum(Landing);

#[derive(Debug, Clone)]
enum Landing {
    /// Too short for the long path: hashed whole at the end.
    Short,
    Long(LongState),
}

impl LandingChecksum {
    /// The checksum of a chunk of `len` bytes, none landed yet.
    pub fn new(len: usize) -> LandingChecksum {
        LandingChecksum(if len < LONG_MIN {
            Landing::Short
        } else {
            Landing::Long(LongState::new(len, Kernel::best()))
        })
    }

    /// `landed` is the chunk's first bytes, as many as have landed (each call's at least as
    /// long as the last's, and no longer than the chunk).
    pub fn advance(&mut self, landed: &[u8]) {
        if let Landing::Long(s) = &mut self.0 {
            s.advance(landed);
        }
    }

    /// The checksum of `whole`, the chunk's bytes once all have landed (as
    /// `chunk_checksum(whole)` gives).
    pub fn value(&self, whole: &[u8]) -> u32 {
        match &self.0 {
            Landing::Short => chunk_checksum(whole),
            Landing::Long(s) => fold(s.finish(whole)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_way_gives_the_whole_and_a_flip_changes_it() {
        for len in [0, 1, 240, 241, 10_000] {
            let data: Vec<u8> = (0..len as u32).map(|i| (i * 7) as u8).collect();
            let whole = chunk_checksum(&data);
            let mut s = LandingChecksum::new(len);
            for end in (777..len).step_by(777).chain([len]) {
                s.advance(&data[..end]);
            }
            assert_eq!(s.value(&data), whole, "len {len}");
            let mut copy = vec![0u8; len];
            assert_eq!(copy_with_checksum(&mut copy, &data), whole, "len {len}");
            assert_eq!(copy, data);
            if len > 0 {
                let mut flipped = data.clone();
                flipped[len / 2] ^= 0x10;
                assert_ne!(chunk_checksum(&flipped), whole);
            }
        }
        // XXH3-64's own test vector: the empty input.
        assert_eq!(XxHash3_64::oneshot(b""), 0x2D06_8005_38D3_94C2);
    }
}
