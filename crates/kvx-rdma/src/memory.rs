//! Registered memory: the crate's only `unsafe` code. Three operations, each behind a bounds
//! check with its reasoning beside it: `RdmaMemory::with_slot`'s slice, and (feature `rdma`)
//! the two verbs calls that hand the mapping's raw addresses to the NIC — registration
//! (`ibv_reg_mr`) and a write's scatter/gather entry.
//!
//! `RdmaMemory` is an anonymous mapping (page-aligned, never moved) split into slots. In-process
//! access goes through one lock per slot, like `HeapMemory`. What no lock covers is the NIC:
//! it reads a staging slot while a write is outstanding, and writes a receive slot when a
//! sender's write lands. That is sound under the protocol's ownership rule — a staging slot is
//! not refilled before its write completes, a receive slot is written only by the sender it is
//! granted to and read only after that write's `Landed` notice (whose receive completion verbs
//! orders after the data) — the same contract as `ShmFabric`'s mappings.
//!
//! Lifetimes: the registration is dropped before the mapping (field order), and every queue
//! pair that may still access the memory holds an `Arc` to it and is destroyed before letting
//! go of it (`sender`, `receiver`), so the NIC never touches unmapped memory.
#![allow(unsafe_code)]

use std::any::Any;
use std::fmt;
use std::io;
use std::sync::{Mutex, OnceLock};

use kvx_io::SlotMemory;
use memmap2::{MmapOptions, MmapRaw};

use crate::verbs_error::VerbsError;
use crate::wire::Geometry;

/// What a registered region tells a peer and a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrKeys {
    pub lkey: u32,
    pub rkey: u32,
    /// The region's start, as the NIC addresses it.
    pub addr: u64,
    /// The device (`Verbs::device_id`) whose protection domain holds the registration.
    pub device_id: u64,
}

struct Registration {
    keys: MrKeys,
    /// Whatever keeps the registration alive (sideway's `MemoryRegion`); dropped first.
    _keep: Box<dyn Any + Send + Sync>,
}

/// Memory registered with an RDMA device: a sender's staging or a receiver's exposed buffer.
pub struct RdmaMemory {
    // Declared before `map`: deregistered before it is unmapped.
    registration: OnceLock<Registration>,
    map: MmapRaw,
    geometry: Geometry,
    locks: Box<[Mutex<()>]>,
}

impl fmt::Debug for RdmaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaMemory")
            .field("slots", &self.geometry.slots)
            .field("slot_bytes", &self.geometry.slot_bytes)
            .field("keys", &self.keys())
            .finish()
    }
}

impl RdmaMemory {
    /// `slots × slot_bytes` zeroed bytes, not yet registered. The caller has checked the
    /// geometry (`Geometry::checked`).
    pub(crate) fn anonymous(slots: u32, slot_bytes: usize) -> io::Result<Self> {
        let geometry = Geometry {
            slots,
            slot_bytes: slot_bytes as u64,
        };
        let map = MmapOptions::new()
            .len(geometry.total_bytes() as usize)
            .map_anon()?;
        Ok(RdmaMemory {
            registration: OnceLock::new(),
            map: map.into(),
            geometry,
            locks: (0..slots).map(|_| Mutex::new(())).collect(),
        })
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The keys of its registration; None before `Verbs::register`.
    pub fn keys(&self) -> Option<MrKeys> {
        self.registration.get().map(|r| r.keys)
    }

    /// The mapping's start address and length, for a `Verbs` implementation's registration.
    pub fn region(&self) -> (u64, usize) {
        (self.map.as_ptr() as u64, self.map.len())
    }

    /// Records the registration (for `Verbs::register`); `keep` is dropped, before the memory
    /// is unmapped, when the memory is. A memory is registered once.
    pub fn set_registration(
        &self,
        keys: MrKeys,
        keep: Box<dyn Any + Send + Sync>,
    ) -> Result<(), VerbsError> {
        self.registration
            .set(Registration { keys, _keep: keep })
            .map_err(|_| VerbsError::new("reg_mr", "the memory is already registered"))
    }

    /// Runs `f` on the slot's bytes in place, under the slot's lock. Panics when `slot` is out
    /// of bounds (a caller bug, as for `SlotMemory`).
    pub fn with_slot<R>(&self, slot: u32, f: impl FnOnce(&mut [u8]) -> R) -> R {
        assert!(
            slot < self.geometry.slots,
            "invariant: slot {slot} < {} slots",
            self.geometry.slots
        );
        let _guard = self.locks[slot as usize]
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let offset = self.geometry.offset(slot) as usize;
        let len = self.geometry.slot_bytes as usize;
        // SAFETY: `slot < slots`, so `offset + len <= slots × slot_bytes`, the length of the
        // live mapping `self.map` (kept alive by `&self`): the range is valid and writable.
        // Within this process the slot's lock, held until `f` returns, makes the `&mut`
        // exclusive. The NIC touches the slot only while the protocol hands it to a write
        // (module doc), never while this process reads or fills it.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(offset), len) };
        f(bytes)
    }
}

impl SlotMemory for RdmaMemory {
    fn slots(&self) -> u32 {
        self.geometry.slots
    }

    fn slot_bytes(&self) -> usize {
        self.geometry.slot_bytes as usize
    }

    fn write_slot(&self, slot: u32, data: &[u8]) {
        assert!(
            data.len() as u64 <= self.geometry.slot_bytes,
            "invariant: {} bytes fit a {}-byte slot",
            data.len(),
            self.geometry.slot_bytes
        );
        self.with_slot(slot, |s| s[..data.len()].copy_from_slice(data));
    }

    fn read_slot(&self, slot: u32, out: &mut [u8]) {
        self.with_slot(slot, |s| out.copy_from_slice(&s[..out.len()]));
    }

    fn fill_slot(&self, slot: u32, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        self.with_slot(slot, |s| f(&mut s[..len]));
    }

    fn inspect_slot(&self, slot: u32, len: usize, f: &mut dyn FnMut(&[u8])) {
        self.with_slot(slot, |s| f(&s[..len]));
    }
}

#[cfg(feature = "rdma")]
mod ibv {
    use std::sync::Arc;

    use sideway::ibverbs::protection_domain::ProtectionDomain;
    use sideway::ibverbs::queue_pair::SetScatterGatherEntry;
    use sideway::ibverbs::AccessFlags;

    use super::{MrKeys, RdmaMemory};
    use crate::verbs_error::VerbsError;

    impl RdmaMemory {
        /// Registers the whole mapping with `pd` for local and remote writes.
        pub(crate) fn register_ibv(
            &self,
            pd: &Arc<ProtectionDomain>,
            device_id: u64,
        ) -> Result<(), VerbsError> {
            let (addr, len) = self.region();
            let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite;
            // SAFETY: `addr..addr + len` is exactly the live mapping `self.map`. The returned
            // `MemoryRegion` is stored in `self.registration`, which is dropped (deregistered)
            // before the mapping is unmapped (field order), so the NIC's view never outlives
            // the memory.
            let mr = unsafe { pd.reg_mr(addr as usize, len, access) }
                .map_err(|e| VerbsError::new("ibv_reg_mr", format!("{len} bytes: {e:?}")))?;
            let keys = MrKeys {
                lkey: mr.lkey(),
                rkey: mr.rkey(),
                addr,
                device_id,
            };
            self.set_registration(keys, Box::new(mr))
        }

        /// Points a write's scatter/gather entry at the first `len` bytes of staging `slot`.
        pub(crate) fn set_write_sge<H: SetScatterGatherEntry>(
            &self,
            handle: H,
            slot: u32,
            len: u32,
        ) -> Result<(), VerbsError> {
            let keys = self
                .keys()
                .ok_or_else(|| VerbsError::new("post_send", "staging memory is not registered"))?;
            if !self.geometry.holds(slot, u64::from(len)) {
                return Err(VerbsError::new(
                    "post_send",
                    format!("{len} bytes of staging slot {slot} are out of bounds"),
                ));
            }
            let addr = keys.addr + self.geometry.offset(slot);
            // SAFETY: the range `addr..addr + len` lies inside this registered mapping (checked
            // just above) under its own lkey. The NIC reads it until the write completes; the
            // connection that posts it holds an `Arc` to this memory and destroys its queue
            // pair (which ends every access) before letting go of it.
            unsafe { handle.setup_sge(keys.lkey, addr, len) };
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_separate_and_zeroed() {
        let m = RdmaMemory::anonymous(3, 16).expect("map");
        assert_eq!(m.slots(), 3);
        assert_eq!(m.slot_bytes(), 16);
        m.write_slot(1, &[7; 16]);
        let mut out = [1u8; 16];
        m.read_slot(0, &mut out);
        assert_eq!(out, [0; 16]);
        m.read_slot(1, &mut out);
        assert_eq!(out, [7; 16]);
        m.fill_slot(2, 4, &mut |b| b.copy_from_slice(&[1, 2, 3, 4]));
        m.inspect_slot(2, 4, &mut |b| assert_eq!(b, &[1, 2, 3, 4]));
        assert!(m.keys().is_none());
        let (addr, len) = m.region();
        assert_ne!(addr, 0);
        assert_eq!(len, 48);
    }

    #[test]
    fn registered_once() {
        let m = RdmaMemory::anonymous(1, 8).expect("map");
        let keys = MrKeys {
            lkey: 1,
            rkey: 2,
            addr: m.region().0,
            device_id: 3,
        };
        m.set_registration(keys, Box::new(())).expect("first");
        assert!(m.set_registration(keys, Box::new(())).is_err());
        assert_eq!(m.keys(), Some(keys));
    }

    #[test]
    #[should_panic(expected = "invariant")]
    fn out_of_bounds_slot_panics() {
        let m = RdmaMemory::anonymous(1, 8).expect("map");
        m.with_slot(1, |_| ());
    }
}
