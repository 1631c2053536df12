//! Why bytes are not a valid message.

/// Why bytes are not a valid kvx / LMCache PD message (spec §3.3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The frame is longer than the configured `frame_max_bytes`.
    #[error(
        "frame of {len} bytes exceeds the limit of {max} bytes; \
         raise frame_max_bytes if the peer legitimately sends batches this large"
    )]
    FrameTooLarge {
        /// The frame's length.
        len: usize,
        /// The limit it was decoded with.
        max: usize,
    },
    /// The input ends inside a value, or a length prefix claims more than the frame holds.
    #[error(
        "truncated message: the value at byte {offset} needs more bytes than the frame holds \
         (was the frame cut short, or is it not msgpack?)"
    )]
    Truncated {
        /// Where the value that runs past the end starts.
        offset: usize,
    },
    /// The top-level value is not a msgpack map.
    #[error("a message must be a msgpack map, found {found}: is the peer speaking LMCache PD?")]
    NotAMap {
        /// The msgpack type found instead.
        found: &'static str,
    },
    /// The map has no `"type"` key.
    #[error("the message map has no \"type\" key, so its message type is unknown")]
    MissingType,
    /// The `"type"` names no message kvx knows.
    #[error(
        "unknown message type {0:?}; kvx knows AllocRequest, AllocResponse, ProxyNotif, \
         CancelNotif and FailNotif (is the peer a newer or different protocol?)"
    )]
    UnknownType(String),
    /// A required field is absent.
    #[error("{message} lacks its required field `{field}`")]
    MissingField {
        /// The message type.
        message: &'static str,
        /// The absent field.
        field: &'static str,
    },
    /// A value has the wrong msgpack type (msgspec is strict: int is not bool, bin is not str).
    #[error("`{path}`: expected {expected}, found {found}")]
    WrongType {
        /// The field, e.g. `AllocRequest.keys[3]`.
        path: String,
        /// The msgpack type the field needs.
        expected: &'static str,
        /// The msgpack type found.
        found: &'static str,
    },
    /// An integer does not fit the field's Rust type (e.g. a negative `total_chunks`).
    #[error("`{path}`: {value} is out of range for {expected}")]
    IntOutOfRange {
        /// The field.
        path: String,
        /// The integer found.
        value: i128,
        /// The Rust type it must fit.
        expected: &'static str,
    },
    /// A msgpack str holds bytes that are not UTF-8.
    #[error("`{path}`: string is not valid UTF-8")]
    InvalidUtf8 {
        /// The field.
        path: String,
    },
    /// Bytes follow the end of the message.
    #[error("{len} unexpected bytes after the end of the message at byte {offset}")]
    TrailingBytes {
        /// Where the message ends.
        offset: usize,
        /// How many bytes follow it.
        len: usize,
    },
    /// Anything else that is not msgpack or not a consistent message.
    #[error("malformed message: {0}")]
    Malformed(String),
}
