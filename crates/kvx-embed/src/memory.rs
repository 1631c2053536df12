//! Where a sender's staging or a receiver's buffer lives: kvx's own allocation, or memory
//! the caller owns (`docs/embedding.md` §1 says which fabric takes which).

use kvx_io::ExternalRegion;

/// Where a sender's staging or a receiver's buffer lives.
#[derive(Debug)]
pub enum Memory {
    /// kvx allocates `slots` slots of `slot_bytes` (the configuration's count): the only
    /// choice a fabric that needs a shared mapping (shm) accepts.
    Allocate {
        /// Bytes per slot: one chunk.
        slot_bytes: usize,
    },
    /// Memory the caller owns (a framework's pinned buffer, a Python object's memory),
    /// kept alive by the region's owner until kvx lets go of it.
    External(ExternalRegion),
}
