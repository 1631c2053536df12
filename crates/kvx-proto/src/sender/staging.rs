//! The sender's staging pool: a fixed number of chunk slots, each owned by at most one
//! request. Only admitted requests may take a slot (`docs/spec/protocol.md` §Sender), so
//! staging is only ever held by requests whose receiver slots are guaranteed, and finite
//! staging cannot close a wait cycle.

use crate::ids::{ReqId, StagingSlot};

#[derive(Debug, Clone)]
pub struct StagingPool {
    owner: Vec<Option<ReqId>>,
    free: Vec<StagingSlot>,
}

impl StagingPool {
    pub fn new(slots: u32) -> Self {
        // Reversed so that `pop` hands out slot 0 first.
        Self {
            owner: vec![None; slots as usize],
            free: (0..slots).rev().map(StagingSlot).collect(),
        }
    }

    pub fn capacity(&self) -> u32 {
        self.owner.len() as u32
    }

    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn take(&mut self, req: &ReqId) -> Option<StagingSlot> {
        let slot = self.free.pop()?;
        self.owner[slot.0 as usize] = Some(req.clone());
        Some(slot)
    }

    pub fn owner(&self, slot: StagingSlot) -> Option<&ReqId> {
        self.owner.get(slot.0 as usize).and_then(Option::as_ref)
    }

    pub fn give_back(&mut self, slot: StagingSlot) {
        let owner = self
            .owner
            .get_mut(slot.0 as usize)
            .expect("invariant: staging slot in range");
        assert!(
            owner.is_some(),
            "invariant: staging slot {} freed twice",
            slot.0
        );
        *owner = None;
        self.free.push(slot);
    }

    /// Slots each request owns, for the sender's invariant check.
    pub fn owned_by(&self, req: &ReqId) -> usize {
        self.owner
            .iter()
            .filter(|o| o.as_ref() == Some(req))
            .count()
    }

    /// The free stack in order (the explorer's canonical encoding, feature `testing`).
    #[cfg(feature = "testing")]
    pub(crate) fn canon_free(&self, enc: &mut crate::testing::Canon) {
        enc.len(self.free.len());
        self.free.iter().for_each(|&s| enc.staging(s));
    }

    pub fn check_invariants(&self) {
        let owned = self.owner.iter().filter(|o| o.is_some()).count();
        assert_eq!(
            owned + self.free.len(),
            self.owner.len(),
            "invariant: staging slots are owned or free"
        );
    }
}
