//! Shared mappings: with `splice.rs`, the only `unsafe` code in kvx-transport, kept to two
//! operations (handing a mapping to a `SlotRegion`, `StagingView::copy_out`), each with its
//! reasoning beside it.
//!
//! Two kinds of mapping:
//! - `ShmMemory`, a `SlotMemory`: a sender's staging (a sealed `memfd`, never a name in any
//!   filesystem) or an exposed buffer (anonymous). In-process access goes through one lock
//!   per slot (`kvx_io::SlotRegion`), so two threads of this process never touch one slot at
//!   once.
//! - `StagingView`: a receiver's read-only mapping of a sender's staging descriptor, from
//!   which the receiver copies each admitted write into its own buffer. `StagingView::sealed`
//!   maps a descriptor only if its size can never change and equals the announced geometry,
//!   and every page of it is backed and can never be punched out, so no access through the
//!   mapping can fault (no SIGBUS, no allocation) and the mapping is no larger than the
//!   geometry the receiver bounded.
//!
//! What no lock can cover is the other side of the mapping: the receiver reads a staging slot
//! the sender's process wrote. That is sound under the staging discipline every fabric keeps
//! — a sender rewrites a staging slot only after the write from it completed, and a completion
//! follows the receiver's copy — and the ack, the socket and the channel between them
//! synchronise. A sender that breaks the discipline changes only its own chunk's bytes (and
//! its checksum catches that); it never reaches the receiver's buffer.
#![allow(unsafe_code)]

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;

use kvx_io::{SlotGeometry, SlotMemory, SlotRegion};
use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

/// The seals a staging descriptor must carry: its size is fixed (it neither shrinks, which
/// would turn a mapped page into a SIGBUS, nor grows), no page can be punched out of it
/// (`FUTURE_WRITE` refuses `fallocate(PUNCH_HOLE)` and `MADV_REMOVE`, and `write` and new
/// writable mappings, while the sender's existing mapping stays writable: it writes its
/// chunks through that), and no seal can be added or removed any more.
pub(crate) const STAGING_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::FUTURE_WRITE)
    .union(SealFlags::SEAL);

/// `statfs::f_type` of tmpfs, the file system behind every `memfd` without `MFD_HUGETLB`.
const TMPFS_MAGIC: u64 = 0x0102_1994;

/// Registered memory in a mapping: a sender's staging in a sealed `memfd`, or an exposed
/// buffer (anonymous). The slots are a `SlotRegion` over the mapping, which the region owns.
pub struct ShmMemory {
    region: SlotRegion,
    /// The staging's descriptor, passed to each receiver the staging attaches to.
    memfd: Option<OwnedFd>,
}

impl fmt::Debug for ShmMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmMemory")
            .field("slots", &self.region.slots())
            .field("slot_bytes", &self.region.slot_bytes())
            .field("memfd", &self.memfd)
            .finish()
    }
}

impl ShmMemory {
    /// Private memory for a receiver's buffer (`SlotGeometry::new` checked the shape).
    pub(crate) fn anonymous(geometry: SlotGeometry) -> io::Result<Self> {
        let len = mappable_len(geometry)?;
        // `populate`: map every page now, as registering memory pins it, so the data path
        // takes no page faults (as `SlotRegion::allocate` touches its pages).
        let map = MmapOptions::new().len(len).populate().map_anon()?;
        Ok(Self::from_map(map.into(), geometry, None))
    }

    /// A sender's staging: a new `memfd` (close-on-exec, sealable), sized and filled (no
    /// holes), mapped shared, then sealed with `STAGING_SEALS`: sealing last, because
    /// `FUTURE_WRITE` refuses writable mappings made after it and leaves earlier ones
    /// writable. `SlotGeometry::new` checked the shape.
    /// Blocking: it writes the whole buffer once.
    pub(crate) fn sealed_staging(geometry: SlotGeometry) -> io::Result<Self> {
        let len = mappable_len(geometry)?;
        let fd = rustix::fs::memfd_create(
            "kvx-staging",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        let file = File::from(fd);
        reserve(&file, len)?;
        let map = MmapOptions::new().len(len).populate().map_raw(&file)?;
        rustix::fs::fcntl_add_seals(&file, STAGING_SEALS)?;
        Ok(Self::from_map(map, geometry, Some(file.into())))
    }

    /// `geometry` fits the mapping: `mappable_len` sized it.
    fn from_map(map: MmapRaw, geometry: SlotGeometry, memfd: Option<OwnedFd>) -> Self {
        let (slots, slot_bytes) = (geometry.slots, geometry.slot_bytes as usize);
        let base = NonNull::new(map.as_mut_ptr()).expect("invariant: a mapping is never at 0");
        // SAFETY: the mapping is `slots × slot_bytes` bytes long (made so above), readable and
        // writable, and lives as long as the region that owns it; what touches it outside
        // this process is the staging discipline of the module doc. A staging's `memfd` is
        // sealed against shrinking, so no page of the mapping can vanish under it.
        let region = unsafe { SlotRegion::over(base, slots, slot_bytes, Box::new(map)) };
        ShmMemory { region, memfd }
    }

    /// The sealed descriptor of a sender's staging (None for an exposed buffer): what
    /// `connect` hands to the receiver.
    pub fn memfd(&self) -> Option<BorrowedFd<'_>> {
        self.memfd.as_ref().map(AsFd::as_fd)
    }
}

impl SlotMemory for ShmMemory {
    fn slots(&self) -> u32 {
        self.region.slots()
    }

    fn slot_bytes(&self) -> usize {
        self.region.slot_bytes()
    }

    fn with_slot(&self, slot: u32, f: &mut dyn FnMut(&mut [u8])) {
        self.region.with_slot(slot, f);
    }

    /// The shm fabric allocates its memory itself (a sender's staging must be a sealed memfd the
    /// receiver can map), so an embedding program writes and reads it through views of it.
    fn viewable(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        self.region.raw()
    }
}

/// The bytes a mapping of `geometry` spans; refused for a shape built by hand that has none
/// (`SlotGeometry::region_len`), since the region over the mapping is sized from it.
fn mappable_len(geometry: SlotGeometry) -> io::Result<usize> {
    geometry.region_len().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{geometry:?} spans no addressable memory"),
        )
    })
}

/// Gives the `memfd` its length and backs every page now: a page that cannot be allocated on
/// first touch would raise SIGBUS in whoever touches it (the sender writing a chunk, or the
/// receiver copying one); writing it here turns a lack of memory into an error at
/// `allocate_staging` instead.
fn reserve(file: &File, len: usize) -> io::Result<()> {
    file.set_len(len as u64)?;
    let zeros = vec![0u8; (1 << 20).min(len)];
    let mut at = 0usize;
    while at < len {
        let n = zeros.len().min(len - at);
        file.write_all_at(&zeros[..n], at as u64)?;
        at += n;
    }
    Ok(())
}

/// A receiver's read-only mapping of a sender's staging descriptor.
pub(crate) struct StagingView {
    map: MmapRaw,
    slots: u32,
    slot_bytes: usize,
}

impl fmt::Debug for StagingView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingView")
            .field("slots", &self.slots)
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

impl StagingView {
    /// Maps a sender's staging descriptor read-only, if it is a tmpfs `memfd` carrying
    /// `STAGING_SEALS`, exactly `slots × slot_bytes` bytes long, at most `bytes_max`, and
    /// without holes. The seals make the size and the backed pages permanent, so a copy that
    /// stays inside the geometry reads pages that exist for as long as the mapping lives:
    /// reading never allocates (a hole would fault a page in, charged to this process, and
    /// raise SIGBUS if that allocation failed). `Err` says why the descriptor is refused.
    pub(crate) fn sealed(
        fd: OwnedFd,
        slots: u32,
        slot_bytes: u64,
        bytes_max: u64,
    ) -> Result<Self, String> {
        let len = u64::from(slots)
            .checked_mul(slot_bytes)
            .filter(|&l| l > 0)
            .ok_or_else(|| {
                format!("the geometry {slots} × {slot_bytes} bytes is empty or overflows")
            })?;
        // Bounded before anything is mapped: the address space a peer can make this process
        // reserve is the geometry, and the geometry is at most this.
        if len > bytes_max {
            return Err(format!(
                "the staging's {len} bytes exceed the {bytes_max} this receiver maps"
            ));
        }
        let fs = rustix::fs::fstatfs(&fd).map_err(|e| format!("fstatfs: {e}"))?;
        // `f_type`'s integer type differs by architecture.
        #[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
        let fs_type = fs.f_type as u64;
        if fs_type != TMPFS_MAGIC {
            return Err(format!(
                "the descriptor is not a memfd (file system type {fs_type:#x})"
            ));
        }
        // Only a `memfd` created with `MFD_ALLOW_SEALING` can carry these seals; the size
        // is read after them, as only then it cannot change.
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| format!("F_GET_SEALS: {e}"))?;
        if !seals.contains(STAGING_SEALS) {
            return Err(format!(
                "the memfd is not sealed against shrinking, growing, hole punching and \
                 resealing (seals {seals:?}, needs {STAGING_SEALS:?})"
            ));
        }
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| format!("fstat: {e}"))?;
        if !meta.is_file() || meta.len() != len {
            return Err(format!(
                "the memfd holds {} bytes, the geometry {slots} × {slot_bytes} = {len}",
                meta.len()
            ));
        }
        // Sealed against punching, a memfd backed everywhere now stays so.
        let hole = rustix::fs::seek(&file, rustix::fs::SeekFrom::Hole(0))
            .map_err(|e| format!("SEEK_HOLE: {e}"))?;
        if hole < len {
            return Err(format!(
                "the memfd has a hole at byte {hole} of {len} (it must be backed throughout)"
            ));
        }
        let len = usize::try_from(len).map_err(|_| "the staging exceeds the address space")?;
        let slot_bytes =
            usize::try_from(slot_bytes).map_err(|_| "slots exceed the address space")?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw_read_only(&file)
            .map_err(|e| format!("mmap: {e}"))?;
        Ok(StagingView {
            map,
            slots,
            slot_bytes,
        })
    }

    pub(crate) fn slots(&self) -> u32 {
        self.slots
    }

    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Copies the first `dst.len()` bytes of staging slot `slot` into `dst`, and returns
    /// the checksum of the copy when `checksum` asks for it (taken during the copy, one pass
    /// over the bytes). Panics when out of bounds: the receiver checks every write first.
    pub(crate) fn copy_out(&self, slot: u32, dst: &mut [u8], checksum: bool) -> Option<u32> {
        assert!(
            slot < self.slots && dst.len() <= self.slot_bytes,
            "invariant: the receiver bounds-checked a copy of {} bytes from slot {slot}",
            dst.len()
        );
        let offset = slot as usize * self.slot_bytes;
        // SAFETY: the bounds check above keeps `offset + dst.len()` within the mapping, which
        // `sealed` made exactly `slots * slot_bytes` long and `&self` keeps alive; the file
        // under it is sealed at that size, so every page of the range exists (no SIGBUS).
        // `dst` is the receiver's own buffer (anonymous memory of this process), never this
        // mapping, so the ranges cannot overlap. The source slot is one the sender does not
        // rewrite until this copy is acked (module doc); if it does, the checksum is of what
        // `dst` received, and it fails its own request.
        unsafe {
            let src = self.map.as_ptr().add(offset);
            if checksum {
                Some(kvx_io::checksum::copy_shared_with_checksum(dst, src))
            } else {
                std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len());
                None
            }
        }
    }
}
