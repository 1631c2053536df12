//! The shape of a slot region (a receive buffer, a staging area): how many slots of how many
//! bytes. One type for every fabric (TCP, shared memory, RDMA, in-process, the simulation's),
//! checked in one place (`SlotGeometry::new`) and carried as is in their handshakes; a fabric
//! with a tighter limit of its own (RDMA's largest write) checks it on top.

use kvx_proto::WriteTag;

use crate::fabric_error::FabricError;

/// `slots` slots of `slot_bytes` bytes each; slot `i` is bytes
/// `i × slot_bytes .. (i + 1) × slot_bytes` of the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotGeometry {
    /// Slots in the region.
    pub slots: u32,
    /// Bytes in each slot.
    pub slot_bytes: u64,
}

impl SlotGeometry {
    /// Checks a requested shape and returns it: at least one slot of at least one byte, no
    /// more slots than a write's immediate can name (`WriteTag::SLOTS_MAX`), and a total an
    /// address can span. Refused up front, naming the shape, rather than failing later in an
    /// allocator, a mapping or a NIC.
    pub fn new(slots: u32, slot_bytes: usize) -> Result<Self, FabricError> {
        let total = (slots as usize).checked_mul(slot_bytes);
        let ok = slots > 0
            && slots <= WriteTag::SLOTS_MAX
            && slot_bytes > 0
            && total.is_some_and(|t| t <= isize::MAX as usize);
        if !ok {
            return Err(FabricError::Allocation(format!(
                "{slots} slots of {slot_bytes} bytes (1..={} slots of at least 1 byte, at most \
                 {} bytes in all)",
                WriteTag::SLOTS_MAX,
                isize::MAX
            )));
        }
        Ok(Self {
            slots,
            slot_bytes: slot_bytes as u64,
        })
    }

    /// Whether `len` bytes into `slot` stay inside the region.
    pub fn holds(&self, slot: u32, len: u64) -> bool {
        slot < self.slots && len <= self.slot_bytes
    }

    /// Byte offset of `slot` from the region's start.
    pub fn offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_bytes
    }

    /// Bytes in the whole region.
    pub fn total_bytes(&self) -> u64 {
        u64::from(self.slots) * self.slot_bytes
    }

    /// The whole region's length in this address space, for code that maps or allocates it;
    /// `None` for an empty shape or one too large to address. Not a second policy check
    /// (`new` is the one): the fields are public, so a shape built by hand (a handshake's,
    /// before it is checked) could be either, and memory must not be sized from it then.
    pub fn region_len(&self) -> Option<usize> {
        u64::from(self.slots)
            .checked_mul(self.slot_bytes)
            .and_then(|len| usize::try_from(len).ok())
            .filter(|&len| len > 0 && len <= isize::MAX as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_overflowing_and_unaddressable_shapes_are_refused() {
        assert!(SlotGeometry::new(0, 4096).is_err());
        assert!(SlotGeometry::new(4, 0).is_err());
        assert!(SlotGeometry::new(WriteTag::SLOTS_MAX + 1, 1).is_err());
        assert!(SlotGeometry::new(u32::MAX, usize::MAX / 2).is_err());
        let g = SlotGeometry::new(4, 4096).expect("a shape");
        assert_eq!((g.total_bytes(), g.offset(3)), (16_384, 12_288));
        assert!(g.holds(3, 4096) && !g.holds(4, 1) && !g.holds(0, 4097));
        assert_eq!(g.region_len(), Some(16_384));
        let by_hand = |slots, slot_bytes| SlotGeometry { slots, slot_bytes };
        assert_eq!(by_hand(0, 64).region_len(), None);
        assert_eq!(by_hand(u32::MAX, u64::MAX / 2).region_len(), None);
    }
}
