//! LMCache's PD settings as kvx reads them, in one place for the `kvx` binary's
//! `--lmcache-config` and the Python package's `kvx.lmcache` (which calls it through the
//! native module): `pd_buffer_size`, LMCache's buffer (receiver) or staging (sender) in
//! bytes, becomes kvx's count of whole chunk slots.

use kvx_proto::WriteTag;

/// Why `pd_buffer_size` makes no buffer; each says what to set instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PdBufferError {
    /// The chunk size is 0.
    #[error("a chunk of 0 bytes: chunks are at least 1 byte")]
    ZeroChunk,
    /// Not one whole chunk fits.
    #[error(
        "pd_buffer_size={bytes} holds no chunk of {chunk_bytes} bytes: give at least \
         {chunk_bytes}"
    )]
    NoChunk {
        /// `pd_buffer_size`.
        bytes: u64,
        /// The chunk size.
        chunk_bytes: u64,
    },
    /// More chunks than a receiver's slots can be named (`WriteTag::SLOTS_MAX`).
    #[error(
        "pd_buffer_size={bytes} is {chunks} chunks of {chunk_bytes} bytes, over the {max} \
         slots a buffer may have: give at most {}",
        u64::from(*max) * chunk_bytes
    )]
    TooManyChunks {
        /// `pd_buffer_size`.
        bytes: u64,
        /// The chunk size.
        chunk_bytes: u64,
        /// Chunks it would hold.
        chunks: u64,
        /// The most a buffer may hold.
        max: u32,
    },
}

/// `pd_buffer_size` in whole slots of `chunk_bytes` (the rest of the bytes go unused).
pub fn pd_buffer_slots(bytes: u64, chunk_bytes: u64) -> Result<u32, PdBufferError> {
    if chunk_bytes == 0 {
        return Err(PdBufferError::ZeroChunk);
    }
    let chunks = bytes / chunk_bytes;
    if chunks == 0 {
        return Err(PdBufferError::NoChunk { bytes, chunk_bytes });
    }
    u32::try_from(chunks)
        .ok()
        .filter(|&c| c <= WriteTag::SLOTS_MAX)
        .ok_or(PdBufferError::TooManyChunks {
            bytes,
            chunk_bytes,
            chunks,
            max: WriteTag::SLOTS_MAX,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_chunks_within_the_slot_limit() {
        assert_eq!(pd_buffer_slots(64 << 20, 1 << 20), Ok(64));
        assert_eq!(pd_buffer_slots((1 << 20) + 5, 1 << 20), Ok(1));
        let max = u64::from(WriteTag::SLOTS_MAX);
        assert_eq!(pd_buffer_slots(max * 4, 4), Ok(WriteTag::SLOTS_MAX));
        assert!(matches!(
            pd_buffer_slots(max * 4 + 4, 4),
            Err(PdBufferError::TooManyChunks { .. })
        ));
        let e = pd_buffer_slots(100, 4096).expect_err("no whole chunk");
        assert!(e.to_string().contains("pd_buffer_size=100"), "{e}");
        assert_eq!(pd_buffer_slots(1, 0), Err(PdBufferError::ZeroChunk));
    }
}
