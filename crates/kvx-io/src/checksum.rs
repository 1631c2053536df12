//! The end-to-end chunk checksum (`docs/spec/fabrics.md` §Checksums): CRC32C (Castagnoli), the
//! checksum of iSCSI, ext4 and NVMe-oF data digests, computed with the CPU's CRC32 instruction
//! (the `crc32c` crate; about 20 GB/s per core on the project's VM, `docs/PERFORMANCE.md`).
//!
//! A sender computes it over a chunk's bytes in its staging slot; the receiving fabric
//! computes it over the bytes that landed in the slot, piece by piece as they arrive, and the
//! ledger fails the request when the two differ. It guards against bytes changing anywhere
//! between the two memories: a staging slot rewritten too early, a fabric or kernel bug, a
//! NIC or memory fault past the link's own CRC.

/// The checksum of a whole chunk.
pub fn chunk_checksum(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// A checksum computed piece by piece, as a chunk's bytes arrive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChecksumState(u32);

impl ChecksumState {
    pub fn update(&mut self, piece: &[u8]) {
        self.0 = crc32c::crc32c_append(self.0, piece);
    }

    pub fn value(self) -> u32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_give_the_whole_and_the_standard_value() {
        // The CRC-32C check value (RFC 3720, "123456789").
        assert_eq!(chunk_checksum(b"123456789"), 0xe306_9283);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut s = ChecksumState::default();
        for piece in data.chunks(777) {
            s.update(piece);
        }
        assert_eq!(s.value(), chunk_checksum(&data));
        let mut flipped = data.clone();
        flipped[5000] ^= 0x10;
        assert_ne!(chunk_checksum(&flipped), chunk_checksum(&data));
    }
}
