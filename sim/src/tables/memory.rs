//! `SimMemory`: a simulated node's registered memory, slots of bytes behind one lock.

use std::sync::Mutex;

use kvx_io::{SlotGeometry, SlotMemory};

/// Registered memory of a simulated node.
#[derive(Debug)]
pub struct SimMemory {
    slots: u32,
    slot_bytes: usize,
    bytes: Mutex<Vec<u8>>,
}

impl SimMemory {
    /// Zeroed memory of `geometry` (`SlotGeometry::new` checked it, as for every fabric).
    pub fn new(geometry: SlotGeometry) -> Self {
        let SlotGeometry { slots, slot_bytes } = geometry;
        let slot_bytes = usize::try_from(slot_bytes).expect("invariant: a checked slot size");
        Self {
            slots,
            slot_bytes,
            bytes: Mutex::new(vec![0; slots as usize * slot_bytes]),
        }
    }

    fn range(&self, slot: u32, len: usize) -> std::ops::Range<usize> {
        assert!(
            slot < self.slots && len <= self.slot_bytes,
            "invariant: slot {slot} and {len} bytes fit {} slots of {} bytes",
            self.slots,
            self.slot_bytes
        );
        let start = slot as usize * self.slot_bytes;
        start..start + len
    }
}

impl SlotMemory for SimMemory {
    fn slots(&self) -> u32 {
        self.slots
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn with_slot(&self, slot: u32, f: &mut dyn FnMut(&mut [u8])) {
        let range = self.range(slot, self.slot_bytes);
        f(&mut self.bytes.lock().unwrap_or_else(|p| p.into_inner())[range]);
    }
}
