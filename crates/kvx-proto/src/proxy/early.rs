//! A notice kept for an id the proxy does not await yet (its `early` table): what it stands
//! for, and about how much memory it holds (the table is bounded in bytes as in entries).

use super::binding::Binding;
use crate::ids::ReqId;
use crate::time::Instant;

#[derive(Debug, Clone, Default)]
pub(super) struct Early {
    pub(super) notices: u32,
    pub(super) failed: bool,
    /// Its key in `early_order`: when it was last kept, and a sequence number that orders
    /// entries kept at the same instant.
    pub(super) order: (Instant, u64),
    pub(super) binding: Binding,
}

impl Early {
    /// The messages this entry stands for (each notice, and the failure if any): what is
    /// lost when it is pushed out.
    pub(super) fn messages(&self) -> u64 {
        u64::from(self.notices) + u64::from(self.failed)
    }
}

/// What one kept early notice holds, about: its id twice (map and order), its failure reason,
/// the connections it is bound to, and the overhead of both entries.
pub(super) fn early_bytes(req_id: &ReqId, early: &Early, reason: Option<&String>) -> usize {
    2 * req_id.0.len()
        + reason.map_or(0, String::len)
        + early.binding.connections.len() * std::mem::size_of::<(u64, u32)>()
        + 128
}
