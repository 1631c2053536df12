//! Registered memory: the crate's only `unsafe` code. Three operations, each with its
//! reasoning beside it: handing a mapping to a `SlotRegion`, and (feature `rdma`)
//! the two verbs calls that hand the mapping's raw addresses to the NIC — registration
//! (`ibv_reg_mr`) and a write's scatter/gather entry.
//!
//! `RdmaMemory` is a region split into slots (`kvx_io::SlotRegion`): an anonymous mapping
//! (page-aligned, never moved) or a region the caller lends. In-process access goes through
//! one lock per slot. What no lock covers is the NIC:
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
use std::ptr::NonNull;
use std::sync::OnceLock;

use kvx_io::{ExternalRegion, SlotMemory, SlotRegion};
use memmap2::{MmapOptions, MmapRaw};

use crate::verbs_error::VerbsError;
use kvx_io::SlotGeometry;

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

/// Memory registered with an RDMA device: a sender's staging or a receiver's exposed buffer,
/// in a mapping of its own or in a region the caller lends (`external`: on a host whose NIC
/// can reach GPU memory — peer memory, `nvidia-peermem` — that region may be a GPU buffer,
/// which kvx then never reads or writes itself; see docs/operations.md).
pub struct RdmaMemory {
    // Declared before `region`: deregistered before the memory goes.
    registration: OnceLock<Registration>,
    region: SlotRegion,
    geometry: SlotGeometry,
}

impl Drop for RdmaMemory {
    /// `ibv_dereg_mr` unpins the whole region and can take as long as pinning did: the last
    /// handle may go on a tokio worker, so the registration goes off the runtime's workers
    /// (before the mapping, which the fields drop after this).
    fn drop(&mut self) {
        if let Some(registration) = self.registration.take() {
            crate::blocking::off_the_runtime(|| drop(registration));
        }
    }
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
    /// `geometry`'s zeroed bytes, not yet registered. The caller has checked the geometry
    /// (`SlotGeometry::new`, `within_one_write`); `region_len` refuses only a shape built by
    /// hand that spans no memory, since the region over the mapping is sized from it.
    pub(crate) fn anonymous(geometry: SlotGeometry) -> io::Result<Self> {
        let len = geometry.region_len().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{geometry:?} spans no addressable memory"),
            )
        })?;
        let (slots, slot_bytes) = (geometry.slots, geometry.slot_bytes as usize);
        let map = MmapOptions::new().len(len).map_anon()?;
        let map: MmapRaw = map.into();
        let base = NonNull::new(map.as_mut_ptr()).expect("invariant: a mapping is never at 0");
        // SAFETY: the mapping is `slots × slot_bytes` bytes, readable and writable, and lives
        // as long as the region that owns it; the NIC touches it only as the module doc says.
        let region = unsafe { SlotRegion::over(base, slots, slot_bytes, Box::new(map)) };
        Ok(Self::over(region))
    }

    /// The caller's region, not yet registered. The caller has checked the geometry.
    pub(crate) fn external(region: ExternalRegion) -> Self {
        Self::over(SlotRegion::external(region))
    }

    fn over(region: SlotRegion) -> Self {
        let geometry = SlotGeometry {
            slots: region.slots(),
            slot_bytes: region.slot_bytes() as u64,
        };
        RdmaMemory {
            registration: OnceLock::new(),
            region,
            geometry,
        }
    }

    pub fn geometry(&self) -> SlotGeometry {
        self.geometry
    }

    /// The keys of its registration; None before `Verbs::register`.
    pub fn keys(&self) -> Option<MrKeys> {
        self.registration.get().map(|r| r.keys)
    }

    /// The memory's start address and length, for a `Verbs` implementation's registration.
    pub fn region(&self) -> (u64, usize) {
        let (base, len) = self
            .region
            .raw()
            .expect("invariant: RDMA memory is one range (the fabric refuses joined regions)");
        (base.as_ptr() as u64, len)
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

    /// `SlotMemory::with_slot` for a closure that returns a value.
    pub fn with_slot<R>(&self, slot: u32, f: impl FnOnce(&mut [u8]) -> R) -> R {
        self.region.with_slot(slot, f)
    }
}

impl SlotMemory for RdmaMemory {
    fn slots(&self) -> u32 {
        self.geometry.slots
    }

    fn slot_bytes(&self) -> usize {
        self.geometry.slot_bytes as usize
    }

    fn with_slot(&self, slot: u32, f: &mut dyn FnMut(&mut [u8])) {
        self.region.with_slot(slot, f);
    }
}

#[cfg(feature = "rdma")]
mod ibv {
    use std::sync::Arc;

    use sideway::ibverbs::protection_domain::ProtectionDomain;
    use sideway::ibverbs::queue_pair::SetScatterGatherEntry;
    use sideway::ibverbs::AccessFlags;

    use super::{MrKeys, RdmaMemory};
    use crate::remote_access::RemoteAccess;
    use crate::verbs_error::VerbsError;

    impl RdmaMemory {
        /// Registers the whole mapping with `pd`, for peers' writes only with
        /// `RemoteAccess::Write`.
        pub(crate) fn register_ibv(
            &self,
            pd: &Arc<ProtectionDomain>,
            device_id: u64,
            remote: RemoteAccess,
        ) -> Result<(), VerbsError> {
            let (addr, len) = self.region();
            let access = match remote {
                RemoteAccess::None => AccessFlags::LocalWrite,
                RemoteAccess::Write => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
            };
            // SAFETY: `addr..addr + len` is exactly the live memory of `self.region`. The
            // returned `MemoryRegion` is stored in `self.registration`, which is dropped
            // (deregistered) before the region lets go of its memory (field order), so the
            // NIC's view never outlives the memory.
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
        let m = RdmaMemory::anonymous(SlotGeometry::new(3, 16).expect("a geometry")).expect("map");
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
        let m = RdmaMemory::anonymous(SlotGeometry::new(1, 8).expect("a geometry")).expect("map");
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
        let m = RdmaMemory::anonymous(SlotGeometry::new(1, 8).expect("a geometry")).expect("map");
        m.with_slot(1, |_| ());
    }
}
