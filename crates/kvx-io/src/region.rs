//! Memory split into slots, each reached in place under its own lock: the one place where
//! kvx turns an address into bytes. Every fabric's memory stands on it — kvx's own
//! allocation (`LocalMemory`), a caller's region (`ExternalRegion`: a framework's pinned
//! buffer, a Python object's memory), a shared mapping (`ShmFabric`), memory registered with
//! a NIC (`RdmaFabric`).
//!
//! Soundness. A `SlotRegion` holds its region's owner, so the bytes stay valid as long as it
//! does; the slots do not overlap; within this process a slot's lock, held while a closure
//! runs on its bytes, makes that closure's `&mut [u8]` exclusive. What no lock covers is
//! whoever else may touch the memory: a NIC, another process mapping the same file, a caller
//! writing through its own view of an external region. The protocol keeps them apart — a
//! staging slot is written by its holder and then only read (by the fabric) until its write
//! completes; a receive slot is written only by the sender granted it and read only after
//! its landing — and a caller that lends memory promises to follow the same rule
//! (`ExternalRegion::new`).
#![allow(unsafe_code)]

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Mutex;

use crate::fabric_error::FabricError;
use crate::geometry::SlotGeometry;

/// Alignment of the memory kvx allocates itself: a page, as a NIC registration or a
/// `vmsplice` of whole pages prefers.
const PAGE: usize = 4096;

/// A region of `slots × slot_bytes` bytes and its owner, reached one slot at a time. It is
/// one contiguous range, or several of the same size (`ExternalRegion::join`: a serving
/// framework's per-layer KV tensors), whose slots follow one another: part p holds slots
/// `p × part_slots ..`.
pub struct SlotRegion {
    /// Each part's first byte.
    parts: Box<[NonNull<u8>]>,
    /// Slots in each part.
    part_slots: u32,
    slots: u32,
    slot_bytes: usize,
    locks: Box<[Mutex<()>]>,
    /// Keeps the bytes valid (an allocation, a mapping, a caller's object); dropped last.
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: the region is plain bytes owned through `_owner` (itself `Send + Sync`); every
// access from any thread goes through `with_slot`, which takes the slot's lock.
unsafe impl Send for SlotRegion {}
// SAFETY: as for `Send`: shared access only ever reaches the bytes under a slot's lock.
unsafe impl Sync for SlotRegion {}

impl fmt::Debug for SlotRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotRegion")
            .field("parts", &self.parts)
            .field("slots", &self.slots)
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

/// The memory kvx allocates: page-aligned, zeroed, freed with the region.
struct Allocation {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: an owned allocation, freed once in `drop`; no one else holds its pointer.
unsafe impl Send for Allocation {}
// SAFETY: `Allocation` itself never reads or writes the bytes.
unsafe impl Sync for Allocation {}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: allocated in `SlotRegion::allocate` with exactly this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl SlotRegion {
    /// `slots × slot_bytes` zeroed bytes of kvx's own, every page touched now: registering
    /// memory with a NIC pins it the same way, and the first write into a slot then costs no
    /// page fault on the data path (in the demo the faults of 192 MiB of fresh buffers were
    /// about a tenth of the run's CPU). `SlotGeometry::new` checked the shape; what is left
    /// here is what the allocator itself may refuse.
    pub fn allocate(geometry: SlotGeometry) -> Result<Self, FabricError> {
        let SlotGeometry { slots, slot_bytes } = geometry;
        let len = geometry.region_len().ok_or_else(|| {
            FabricError::Allocation(format!(
                "cannot allocate {slots} slots of {slot_bytes} bytes"
            ))
        })?;
        // At most `len`, which is a `usize`.
        let slot_bytes = slot_bytes as usize;
        let layout = std::alloc::Layout::from_size_align(len, PAGE).map_err(|e| {
            FabricError::Allocation(format!("{slots} slots of {slot_bytes} bytes: {e}"))
        })?;
        // SAFETY: `layout` has a non-zero size (`region_len` refuses zero).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            FabricError::Allocation(format!(
                "{slots} slots of {slot_bytes} bytes: out of memory"
            ))
        })?;
        let owner = Allocation { ptr, layout };
        // SAFETY: `ptr` is a fresh allocation of `len` bytes, owned by `owner`, which the
        // region keeps; nothing else refers to it.
        let region = unsafe { Self::over(ptr, slots, slot_bytes, Box::new(owner)) };
        for slot in 0..slots {
            region.with_slot(slot, |bytes| {
                // `black_box`: the allocation is known to be zeroed, so a plain zero store
                // could be optimised away and the page would stay unmapped.
                for byte in bytes.iter_mut().step_by(PAGE) {
                    *byte = std::hint::black_box(0);
                }
            });
        }
        Ok(region)
    }

    /// The region of `external` (in its parts), which keeps its owner.
    pub fn external(external: ExternalRegion) -> Self {
        let ExternalRegion {
            parts,
            part_slots,
            slot_bytes,
            owner,
        } = external;
        // SAFETY: `ExternalRegion::new`'s caller promised that each part's pointer is valid
        // for `part_slots × slot_bytes` bytes for as long as `owner` lives, and touched by
        // others only as the protocol allows (module doc); `join` keeps every part's owner.
        unsafe { Self::over_parts(parts.into_boxed_slice(), part_slots, slot_bytes, owner) }
    }

    /// A region over `base`, kept valid by `owner`.
    ///
    /// # Safety
    /// `base` must be valid for reads and writes of `slots × slot_bytes` bytes for as long
    /// as `owner` lives, and touched outside this region only as the module doc says.
    pub unsafe fn over(
        base: NonNull<u8>,
        slots: u32,
        slot_bytes: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        // SAFETY: one part, as the caller promised.
        unsafe { Self::over_parts(Box::new([base]), slots, slot_bytes, owner) }
    }

    /// # Safety
    /// Each of `parts` must be valid for reads and writes of `part_slots × slot_bytes`
    /// bytes for as long as `owner` lives, the parts must not overlap, and each is touched
    /// outside this region only as the module doc says.
    unsafe fn over_parts(
        parts: Box<[NonNull<u8>]>,
        part_slots: u32,
        slot_bytes: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        // `ExternalRegion::join` refused a count past u32.
        let slots = part_slots * parts.len() as u32;
        Self {
            parts,
            part_slots,
            slots,
            slot_bytes,
            locks: (0..slots).map(|_| Mutex::new(())).collect(),
            _owner: owner,
        }
    }

    /// Slots in the region.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Bytes in each slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The region's first byte and its length, for a NIC's registration, a `vmsplice` or a
    /// caller's view; `None` for a region in several parts, which has no single range.
    pub fn raw(&self) -> Option<(NonNull<u8>, usize)> {
        match *self.parts {
            [base] => Some((base, self.slots as usize * self.slot_bytes)),
            _ => None,
        }
    }

    /// How many separate ranges the region is made of (1 unless `ExternalRegion::join`).
    pub fn parts(&self) -> usize {
        self.parts.len()
    }

    /// Runs `f` on the slot's bytes in place, under the slot's lock. Panics when `slot` is
    /// out of bounds: a caller bug.
    pub fn with_slot<R>(&self, slot: u32, f: impl FnOnce(&mut [u8]) -> R) -> R {
        assert!(
            slot < self.slots,
            "invariant: slot {slot} < {} slots",
            self.slots
        );
        let _guard = self.locks[slot as usize]
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let base = self.parts[(slot / self.part_slots) as usize];
        let offset = (slot % self.part_slots) as usize * self.slot_bytes;
        // SAFETY: `slot < slots = parts × part_slots`, so its part exists and
        // `offset + slot_bytes <= part_slots × slot_bytes`, the length that part is valid for
        // while `_owner` lives (kept by `&self`); parts do not overlap. The slot's lock, held
        // until `f` returns, makes the `&mut` exclusive within this process; outside it, the
        // module doc's rule applies.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(base.as_ptr().add(offset), self.slot_bytes) };
        f(bytes)
    }

    /// Runs `f` on the bytes of slots `first .. first + n` as one span, in place, under
    /// those slots' locks (taken in ascending order, as every multi-slot access takes them);
    /// `None`, without calling `f`, when the slots are not all in one part (a joined
    /// region's layers are separate ranges). Panics when the slots are out of bounds or `n`
    /// is zero: a caller bug.
    pub fn with_run<R>(&self, first: u32, n: u32, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        let end = first.checked_add(n).filter(|&e| n > 0 && e <= self.slots);
        let Some(end) = end else {
            panic!("invariant: slots {first} + {n} within {} slots", self.slots);
        };
        let part = first / self.part_slots;
        if (end - 1) / self.part_slots != part {
            return None;
        }
        let _guards: Vec<_> = (first..end)
            .map(|slot| {
                self.locks[slot as usize]
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner())
            })
            .collect();
        let base = self.parts[part as usize];
        let offset = (first % self.part_slots) as usize * self.slot_bytes;
        // SAFETY: the slots lie in part `part` (checked above), so `offset + n × slot_bytes
        // <= part_slots × slot_bytes`, the length the part is valid for while `_owner`
        // lives. Their locks, held until `f` returns, make the `&mut` exclusive within this
        // process, as in `with_slot`.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(base.as_ptr().add(offset), n as usize * self.slot_bytes)
        };
        Some(f(bytes))
    }
}

/// Memory a caller lends kvx — a serving framework's pinned buffer, a Python object's bytes —
/// with what keeps it valid. kvx reaches it only through `SlotRegion::with_slot` and the
/// fabric's own data path.
pub struct ExternalRegion {
    /// Each part's first byte (one part unless `join`ed).
    parts: Vec<NonNull<u8>>,
    /// Whole slots in each part.
    part_slots: u32,
    slot_bytes: usize,
    owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: as `SlotRegion`: the caller of `new` promised the memory may be used from any
// thread under the protocol's rule; the owner is `Send + Sync`.
unsafe impl Send for ExternalRegion {}
// SAFETY: `ExternalRegion` gives no access to the bytes by itself.
unsafe impl Sync for ExternalRegion {}

impl fmt::Debug for ExternalRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExternalRegion")
            .field("parts", &self.parts)
            .field("part_slots", &self.part_slots)
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

impl ExternalRegion {
    /// `len` bytes at `ptr`, split into slots of `slot_bytes` (a shorter tail beyond the
    /// last whole slot is left alone), kept valid by `owner` (dropped when kvx no longer
    /// uses the memory: after its fabric's last access).
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as `owner` lives.
    /// While kvx uses the region, nothing else may write a slot except its current holder as
    /// the protocol defines it (a sender filling a staging slot it took and has not yet
    /// submitted, or, with caller staging, the application writing a slot no submitted chunk
    /// reads; a receiver's fabric landing a granted write), and nothing may read a
    /// receive slot before its request is ready. Breaking this corrupts KV bytes (a checksum
    /// catches a changed staging slot) but it is also a data race, which Rust calls undefined
    /// behaviour.
    pub unsafe fn new(
        ptr: *mut u8,
        len: usize,
        slot_bytes: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Self, FabricError> {
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| FabricError::Allocation("an external region at address 0".into()))?;
        if slot_bytes == 0 {
            return Err(FabricError::Allocation(
                "an external region of 0-byte slots".into(),
            ));
        }
        let slots = u32::try_from(len / slot_bytes).map_err(|_| {
            FabricError::Allocation(format!(
                "an external region of {len} bytes holds more than 2^32 slots of {slot_bytes}"
            ))
        })?;
        if slots == 0 {
            return Err(FabricError::Allocation(format!(
                "an external region of {len} bytes holds no slot of {slot_bytes} bytes"
            )));
        }
        Ok(Self {
            parts: vec![ptr],
            part_slots: slots,
            slot_bytes,
            owner,
        })
    }

    /// One region of `parts` laid end to end — a serving framework's per-layer KV tensors,
    /// each one part — whose slots follow one another: slot `p × part_slots + i` is slot i
    /// of part p. Every part must have as many slots of the same size (refused otherwise,
    /// saying which differs), and none may overlap another; each keeps its owner. Parts that
    /// follow one another in memory, in the order given (views of one allocation), make a
    /// region of one part: one range, which a NIC registers once.
    pub fn join(parts: Vec<ExternalRegion>) -> Result<Self, FabricError> {
        let Some(first) = parts.first() else {
            return Err(FabricError::Allocation("a region of no parts".into()));
        };
        let (part_slots, slot_bytes) = (
            first.part_slots * first.parts.len() as u32,
            first.slot_bytes,
        );
        let mut ranges = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            if part.slots() != part_slots || part.slot_bytes != slot_bytes {
                return Err(FabricError::Allocation(format!(
                    "part {i} holds {} slots of {} bytes, part 0 {part_slots} of {slot_bytes}: \
                     every part must be the same",
                    part.slots(),
                    part.slot_bytes
                )));
            }
            let Some((start, len)) = part.range() else {
                return Err(FabricError::Allocation(format!(
                    "part {i} is itself in several parts"
                )));
            };
            ranges.push((start, start + len, i));
        }
        ranges.sort_unstable();
        if let Some(w) = ranges.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(FabricError::Allocation(format!(
                "parts {} and {} overlap",
                w[0].2, w[1].2
            )));
        }
        u32::try_from(part_slots as u64 * parts.len() as u64).map_err(|_| {
            FabricError::Allocation(format!(
                "{} parts of {part_slots} slots are more than 2^32 slots",
                parts.len()
            ))
        })?;
        let mut ptrs = Vec::with_capacity(parts.len());
        let mut owners = Vec::with_capacity(parts.len());
        for part in parts {
            ptrs.extend(part.parts);
            owners.push(part.owner);
        }
        let part_len = part_slots as usize * slot_bytes;
        let end_to_end = ptrs.windows(2).all(|w| {
            (w[0].as_ptr() as usize).checked_add(part_len) == Some(w[1].as_ptr() as usize)
        });
        let (ptrs, part_slots) = if end_to_end {
            // Checked above: every slot fits in u32.
            (vec![ptrs[0]], part_slots * ptrs.len() as u32)
        } else {
            (ptrs, part_slots)
        };
        Ok(Self {
            parts: ptrs,
            part_slots,
            slot_bytes,
            owner: Box::new(owners),
        })
    }

    /// A one-part region's address range.
    fn range(&self) -> Option<(usize, usize)> {
        match *self.parts {
            [ptr] => Some((
                ptr.as_ptr() as usize,
                self.part_slots as usize * self.slot_bytes,
            )),
            _ => None,
        }
    }

    /// Whole slots in the region (in all its parts).
    pub fn slots(&self) -> u32 {
        self.part_slots * self.parts.len() as u32
    }

    /// How many separate ranges it is made of (1 unless `join`ed).
    pub fn parts(&self) -> usize {
        self.parts.len()
    }

    /// Bytes in each slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_disjoint_and_zeroed() {
        let r = SlotRegion::allocate(SlotGeometry::new(3, 5000).expect("a geometry"))
            .expect("allocates");
        for slot in 0..3u32 {
            r.with_slot(slot, |b| {
                assert!(b.iter().all(|&x| x == 0));
                b.fill(slot as u8 + 1);
            });
        }
        for slot in 0..3u32 {
            r.with_slot(slot, |b| assert!(b.iter().all(|&x| x == slot as u8 + 1)));
        }
        assert_eq!(
            r.raw().expect("one part").0.as_ptr() as usize % PAGE,
            0,
            "page-aligned"
        );
    }

    #[test]
    fn an_external_region_is_the_callers_bytes_and_keeps_its_owner() {
        let mut backing = vec![0u8; 10 * 64 + 7].into_boxed_slice();
        let ptr = backing.as_mut_ptr();
        let len = backing.len();
        let owner = std::sync::Arc::new(());
        let keep = (owner.clone(), backing);
        // SAFETY: `ptr` is `keep.1`'s bytes, valid while `keep` lives; only this test uses it.
        let ext = unsafe { ExternalRegion::new(ptr, len, 64, Box::new(keep)) }.expect("valid");
        assert_eq!(ext.slots(), 10, "the 7-byte tail is no slot");
        let region = SlotRegion::external(ext);
        region.with_slot(9, |b| b[63] = 42);
        // SAFETY: reading the byte just written, through the region's own pointer.
        let seen = unsafe { *region.raw().expect("one part").0.as_ptr().add(9 * 64 + 63) };
        assert_eq!(seen, 42);
        assert_eq!(
            std::sync::Arc::strong_count(&owner),
            2,
            "the region keeps the owner"
        );
        drop(region);
        assert_eq!(std::sync::Arc::strong_count(&owner), 1, "and lets go of it");
    }

    /// A region over `backing`, which it keeps.
    fn lent(backing: Vec<u8>, slot_bytes: usize) -> ExternalRegion {
        let mut backing = backing.into_boxed_slice();
        let (ptr, len) = (backing.as_mut_ptr(), backing.len());
        // SAFETY: `ptr` is `backing`'s bytes, valid while the region keeps it; only the test
        // reaches them, through the region.
        unsafe { ExternalRegion::new(ptr, len, slot_bytes, Box::new(backing)) }.expect("valid")
    }

    #[test]
    fn a_joined_region_numbers_its_parts_slots_one_after_another() {
        let parts = vec![lent(vec![0; 3 * 64], 64), lent(vec![0; 3 * 64], 64)];
        let joined = ExternalRegion::join(parts).expect("two equal parts");
        assert_eq!((joined.slots(), joined.parts()), (6, 2));
        let region = SlotRegion::external(joined);
        assert!(region.raw().is_none(), "no single range spans two parts");
        for slot in 0..6u32 {
            region.with_slot(slot, |b| {
                assert_eq!(b.len(), 64);
                b.fill(slot as u8 + 1);
            });
        }
        for slot in 0..6u32 {
            region.with_slot(slot, |b| assert!(b.iter().all(|&x| x == slot as u8 + 1)));
        }
        // Joining a joined region with another of its size nests.
        let nested = ExternalRegion::join(vec![lent(vec![0; 128], 64), lent(vec![0; 128], 64)])
            .expect("joined");
        let err = ExternalRegion::join(vec![nested, lent(vec![0; 256], 64)]).expect_err("nested");
        assert!(err.to_string().contains("several parts"), "{err}");
    }

    /// Per-layer views of one allocation, in order, are one range (one NIC registration);
    /// out of order they stay parts, whose slots follow the order given.
    #[test]
    fn parts_end_to_end_in_memory_are_one_range() {
        let mut backing = vec![0u8; 3 * 2 * 64].into_boxed_slice();
        let ptr = backing.as_mut_ptr();
        let views = |order: [usize; 3]| {
            order
                .iter()
                .map(|&i| {
                    // SAFETY: each view is a third of `backing`, which outlives the regions;
                    // they do not overlap.
                    unsafe { ExternalRegion::new(ptr.add(i * 128), 128, 64, Box::new(())) }
                        .expect("valid")
                })
                .collect::<Vec<_>>()
        };
        let joined = ExternalRegion::join(views([0, 1, 2])).expect("joined");
        assert_eq!((joined.slots(), joined.parts()), (6, 1));
        let region = SlotRegion::external(joined);
        assert_eq!(
            region.raw().map(|(p, len)| (p.as_ptr(), len)),
            Some((ptr, 6 * 64))
        );
        for slot in 0..6u32 {
            region.with_slot(slot, |b| b.fill(slot as u8 + 1));
        }
        drop(region);
        assert!(backing
            .chunks(64)
            .enumerate()
            .all(|(i, c)| c.iter().all(|&x| x == i as u8 + 1)));
        let shuffled = ExternalRegion::join(views([1, 0, 2])).expect("joined");
        assert_eq!((shuffled.slots(), shuffled.parts()), (6, 3));
        let region = SlotRegion::external(shuffled);
        region.with_slot(0, |b| b.fill(0xAA)); // part 0 is the middle third
        drop(region);
        assert!(backing[128..192].iter().all(|&x| x == 0xAA));
        drop(backing);
    }

    #[test]
    fn parts_that_differ_or_overlap_are_refused_with_a_reason() {
        let err = ExternalRegion::join(vec![lent(vec![0; 3 * 64], 64), lent(vec![0; 2 * 64], 64)])
            .expect_err("unequal");
        assert!(err.to_string().contains("part 1 holds 2 slots"), "{err}");
        let err = ExternalRegion::join(vec![lent(vec![0; 128], 64), lent(vec![0; 128], 32)])
            .expect_err("other slot size");
        assert!(err.to_string().contains("of 32 bytes"), "{err}");
        assert!(ExternalRegion::join(Vec::new()).is_err());
        let mut backing = vec![0u8; 4 * 64].into_boxed_slice();
        let ptr = backing.as_mut_ptr();
        // SAFETY: both views are of `backing`, which outlives them; they are refused before
        // any use.
        let (a, b) = unsafe {
            (
                ExternalRegion::new(ptr, 2 * 64, 64, Box::new(())).expect("valid"),
                ExternalRegion::new(ptr.add(64), 2 * 64, 64, Box::new(())).expect("valid"),
            )
        };
        let err = ExternalRegion::join(vec![a, b]).expect_err("overlapping");
        assert!(err.to_string().contains("parts 0 and 1 overlap"), "{err}");
        drop(backing);
    }

    #[test]
    fn bad_regions_are_refused_with_a_reason() {
        let by_hand = |slots, slot_bytes| SlotGeometry { slots, slot_bytes };
        assert!(SlotRegion::allocate(by_hand(0, 64)).is_err());
        assert!(SlotRegion::allocate(by_hand(4, 0)).is_err());
        // SAFETY: refused before any use.
        let null = unsafe { ExternalRegion::new(std::ptr::null_mut(), 64, 64, Box::new(())) };
        assert!(null.is_err());
        let mut b = [0u8; 10];
        // SAFETY: refused before any use.
        let small = unsafe { ExternalRegion::new(b.as_mut_ptr(), 10, 64, Box::new(())) };
        assert!(matches!(small, Err(FabricError::Allocation(why)) if why.contains("no slot")));
    }
}
