//! The wire: LMCache-compatible msgpack messages and their byte-exact codec
//! (`docs/spec/wire.md`).
//!
//! Both directions are written by hand instead of going through serde:
//!
//! - **Encoding** writes what `msgspec.msgpack.encode` writes: a map, `"type"` first, then
//!   every field in declaration order with defaults included, integers in their smallest
//!   form. kvx extension fields that are `None` are left out (spec §1.6).
//! - **Decoding** follows `msgspec.msgpack.decode(bytes, type=PDMsg)` (spec §3.1): the tag may
//!   sit anywhere in the map, unknown fields are skipped, any integer width is accepted, and
//!   typing is strict (an int is not a bool, bin is not str). It never panics, never
//!   recurses on input, and never allocates more than a small multiple of the frame, because
//!   every length is checked against the bytes that are actually left.
//!
//! serde's internally tagged enums buffer the whole map into `Content` before choosing a
//! variant, and `String`'s visitor accepts bin as str, so the derived `Deserialize` is both
//! slower and laxer than msgspec (spec §5); it is kept for convenience only.
//!
//! - `messages`: the message structs and the tagged `Message` enum.
//! - `encode`: `encode` / `encode_into`.
//! - `decode`: `decode` / `decode_with_limit`, with a frame-size limit.
//! - `error`: `DecodeError`.

mod decode;
mod encode;
mod error;
mod messages;

pub use decode::{decode, decode_with_limit, DEFAULT_FRAME_MAX_BYTES, LIST_ENTRIES_MAX};
pub use encode::{encode, encode_into};
pub use error::DecodeError;
pub use messages::*;
