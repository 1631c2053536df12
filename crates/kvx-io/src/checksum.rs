//! The end-to-end chunk checksum (`docs/spec/fabrics.md` §5b): XXH3-64 (the `twox-hash`
//! crate, which picks AVX2 or NEON at run time), folded to the 32 bits the write header
//! carries.
//!
//! A sender computes it over a chunk's bytes in its staging slot; the receiving fabric
//! computes it over the bytes that landed in the slot, piece by piece as they arrive, and the
//! ledger fails the request when the two differ. It guards against bytes changing anywhere
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

use std::hash::Hasher;

use twox_hash::XxHash3_64;

/// The checksum of a whole chunk.
pub fn chunk_checksum(bytes: &[u8]) -> u32 {
    fold(XxHash3_64::oneshot(bytes))
}

fn fold(h: u64) -> u32 {
    (h ^ (h >> 32)) as u32
}

/// A checksum computed piece by piece, as a chunk's bytes arrive.
#[derive(Clone, Default)]
pub struct ChecksumState(XxHash3_64);

impl std::fmt::Debug for ChecksumState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChecksumState")
    }
}

impl ChecksumState {
    /// Adds the next piece; pieces in order give the whole's checksum however they are cut.
    pub fn update(&mut self, piece: &[u8]) {
        self.0.write(piece);
    }

    /// The checksum of every piece so far, as `chunk_checksum` gives for their concatenation.
    pub fn value(&self) -> u32 {
        fold(self.0.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_give_the_whole_and_a_flip_changes_it() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut s = ChecksumState::default();
        for piece in data.chunks(777) {
            s.update(piece);
        }
        assert_eq!(s.value(), chunk_checksum(&data));
        let mut flipped = data.clone();
        flipped[5000] ^= 0x10;
        assert_ne!(chunk_checksum(&flipped), chunk_checksum(&data));
        // XXH3-64's own test vector: the empty input.
        assert_eq!(XxHash3_64::oneshot(b""), 0x2D06_8005_38D3_94C2);
    }
}
