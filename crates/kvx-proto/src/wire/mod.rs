//! The wire: LMCache-compatible msgpack messages and their codec.
//!
//! - `messages`: the message structs and the tagged `Message` enum.
//! - `codec`: `encode` / `decode` with a frame-size limit and typed errors.

mod codec;
mod messages;

pub use codec::*;
pub use messages::*;
