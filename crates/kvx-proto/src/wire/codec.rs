//! Placeholder; the real codec is written in the wire task.
use super::Message;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge { len: usize, max: usize },
    #[error("malformed message: {0}")]
    Malformed(String),
}

pub const DEFAULT_FRAME_MAX_BYTES: usize = 1 << 20;

pub fn encode(msg: &Message) -> Vec<u8> {
    rmp_serde::to_vec_named(msg).expect("invariant: messages always encode")
}

pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
    if bytes.len() > DEFAULT_FRAME_MAX_BYTES {
        return Err(DecodeError::FrameTooLarge { len: bytes.len(), max: DEFAULT_FRAME_MAX_BYTES });
    }
    rmp_serde::from_slice(bytes).map_err(|e| DecodeError::Malformed(e.to_string()))
}
