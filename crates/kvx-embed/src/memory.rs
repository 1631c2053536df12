//! Where a sender's staging or a receiver's buffer lives: kvx's own allocation, or memory
//! the caller owns (`docs/embedding.md` §1 says which fabric takes which).

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use kvx_io::{ExternalRegion, SlotMemory};

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

/// A sender's staging or a receiver's buffer, for a view the embedding program keeps
/// (`Sender::memory_view`, `Receiver::memory_view`): where it starts, its length, and what
/// keeps it mapped for as long as the view is held, even after the sender or receiver
/// stopped. Slot `i` is bytes `i × slot_bytes .. (i + 1) × slot_bytes`. Through a view, a
/// caller writes a staging slot only while it holds it (`allocate` → `add`) and reads a
/// receive slot only while it is leased: the rule every access to kvx memory follows.
pub struct MemoryView {
    /// The address of the memory's first byte (an address only: `MemoryView` never reads or
    /// writes the bytes itself).
    pub addr: usize,
    /// Its length in bytes (`slots × slot_bytes`).
    pub len: usize,
    /// Keeps the memory mapped: drop it only when no view of `addr` is left.
    pub keep: Arc<dyn Any + Send + Sync>,
}

impl fmt::Debug for MemoryView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryView")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl MemoryView {
    /// The view of `memory`, when it can be viewed (`SlotMemory::viewable`).
    pub(crate) fn of<M: SlotMemory>(memory: &Arc<M>) -> Option<Self> {
        let (ptr, len) = memory.viewable()?;
        Some(Self {
            addr: ptr.as_ptr() as usize,
            len,
            keep: memory.clone(),
        })
    }
}
