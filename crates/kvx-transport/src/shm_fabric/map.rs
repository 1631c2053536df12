//! Shared mappings: with `splice.rs`, the only `unsafe` code in kvx-transport, kept to two
//! operations (handing a mapping to a `SlotRegion`, `StagingView::copy_out`), each with its
//! reasoning beside it.
//!
//! Two kinds of mapping:
//! - `ShmMemory`, a `SlotMemory`: a sender's staging (a file under the fabric's directory,
//!   removed when the memory is dropped) or an exposed buffer (anonymous). In-process access
//!   goes through one lock per slot (`kvx_io::SlotRegion`), so two threads of this process
//!   never touch one slot at once.
//! - `StagingView`: a receiver's read-only mapping of a sender's staging file, from which
//!   the receiver copies each admitted write into its own buffer.
//!
//! What no lock can cover is the other side of the mapping: the receiver reads a staging slot
//! the sender's process wrote. That is sound under the staging discipline every fabric keeps
//! — a sender rewrites a staging slot only after the write from it completed, and a completion
//! follows the receiver's copy — and the ack, the socket and the channel between them
//! synchronise. A sender that breaks the discipline changes only its own chunk's bytes (and
//! its checksum catches that); it never reaches the receiver's buffer.
#![allow(unsafe_code)]

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use std::ptr::NonNull;

use kvx_io::{SlotMemory, SlotRegion};
use memmap2::{MmapOptions, MmapRaw};

/// Every file this fabric creates starts with this; a sender maps nothing else.
pub(crate) const FILE_PREFIX: &str = "kvx-shm-";

/// Registered memory in a mapping: a sender's staging in a shared file, or an exposed buffer
/// (anonymous). The slots are a `SlotRegion` over the mapping, which the region owns.
pub struct ShmMemory {
    region: SlotRegion,
    /// The file the memory lives in; removed on drop.
    file: Option<PathBuf>,
}

impl fmt::Debug for ShmMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmMemory")
            .field("slots", &self.region.slots())
            .field("slot_bytes", &self.region.slot_bytes())
            .field("file", &self.file)
            .finish()
    }
}

impl ShmMemory {
    /// Private memory for a receiver's buffer. The caller has checked the geometry.
    pub(crate) fn anonymous(slots: u32, slot_bytes: usize) -> io::Result<Self> {
        // `populate`: map every page now, as registering memory pins it, so the data path
        // takes no page faults (as `SlotRegion::allocate` touches its pages).
        let map = MmapOptions::new()
            .len(slots as usize * slot_bytes)
            .populate()
            .map_anon()?;
        Ok(Self::from_map(map.into(), slots, slot_bytes, None))
    }

    /// A new file in `dir` (a tmpfs), sized and filled, mapped shared. The caller has checked
    /// the geometry. Blocking: it writes the whole buffer once.
    pub(crate) fn create_shared(dir: &Path, slots: u32, slot_bytes: usize) -> io::Result<Self> {
        let len = slots as usize * slot_bytes;
        let (file, path) = create_unique(dir)?;
        let mapped = reserve(&file, len)
            .and_then(|()| MmapOptions::new().len(len).populate().map_raw(&file));
        match mapped {
            Ok(map) => Ok(Self::from_map(map, slots, slot_bytes, Some(path))),
            Err(e) => {
                // Leave nothing behind for a buffer that never existed.
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    fn from_map(map: MmapRaw, slots: u32, slot_bytes: usize, file: Option<PathBuf>) -> Self {
        let base = NonNull::new(map.as_mut_ptr()).expect("invariant: a mapping is never at 0");
        // SAFETY: the mapping is `slots × slot_bytes` bytes long (made so above), readable and
        // writable, and lives as long as the region that owns it; what touches it outside
        // this process is the staging discipline of the module doc.
        let region = unsafe { SlotRegion::over(base, slots, slot_bytes, Box::new(map)) };
        ShmMemory { region, file }
    }

    /// The file an exposed buffer lives in (None for staging).
    pub fn path(&self) -> Option<&Path> {
        self.file.as_deref()
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

    /// The shm fabric allocates its memory itself (a sender's staging must be a file the
    /// receiver can map), so an embedding program writes and reads it through views of it.
    fn viewable(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        Some(self.region.raw())
    }
}

impl Drop for ShmMemory {
    fn drop(&mut self) {
        if let Some(path) = &self.file {
            // Senders keep their mappings; the name is what must not outlive the buffer.
            if let Err(e) = std::fs::remove_file(path) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove shm file");
                }
            }
        }
    }
}

/// A fresh file in `dir`, created exclusively (so it can be neither someone else's file nor a
/// symlink) and readable by this user only.
fn create_unique(dir: &Path) -> io::Result<(File, PathBuf)> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut last = None;
    for _ in 0..8 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("{FILE_PREFIX}{}-{n}-{nanos:08x}", std::process::id());
        let path = dir.join(name);
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(f) => return Ok((f, path)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no free shm file name")))
}

/// Gives the file its length and backs every page now. On a tmpfs a page that cannot be
/// allocated on first touch raises SIGBUS in whoever touches it (a sender, mid-copy); writing
/// the file here turns a full tmpfs into an error at `expose` instead.
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

/// A receiver's read-only mapping of a sender's staging file.
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
    /// Maps `path` read-only. It must name a regular file (not a symlink) of exactly
    /// `slots * slot_bytes` bytes, so that every in-bounds copy stays inside the mapping.
    pub(crate) fn open(path: &Path, slots: u32, slot_bytes: usize) -> io::Result<Self> {
        let len = (slots as usize)
            .checked_mul(slot_bytes)
            .filter(|&l| l > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad geometry"))?;
        // The name must be a regular file itself, and the file opened must be that one: a
        // symlink swapped in between the two looks shows up as another inode.
        let named = std::fs::symlink_metadata(path)?;
        let file = OpenOptions::new().read(true).open(path)?;
        let meta = file.metadata()?;
        let same =
            named.file_type().is_file() && named.dev() == meta.dev() && named.ino() == meta.ino();
        if !same || meta.len() != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} is not a {len}-byte staging file ({} bytes)",
                    path.display(),
                    meta.len()
                ),
            ));
        }
        let map = MmapOptions::new().len(len).map_raw_read_only(&file)?;
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

    /// Copies the first `dst.len()` bytes of staging slot `slot` into `dst`. Panics when out
    /// of bounds: the receiver checks every write first.
    pub(crate) fn copy_out(&self, slot: u32, dst: &mut [u8]) {
        assert!(
            slot < self.slots && dst.len() <= self.slot_bytes,
            "invariant: the receiver bounds-checked a copy of {} bytes from slot {slot}",
            dst.len()
        );
        let offset = slot as usize * self.slot_bytes;
        // SAFETY: the bounds check above keeps `offset + dst.len()` within the mapping, which
        // `open` made exactly `slots * slot_bytes` long and `&self` keeps alive. `dst` is the
        // receiver's own buffer (anonymous memory of this process), never this mapping, so the
        // ranges cannot overlap. The source slot is one the sender does not rewrite until this
        // copy is acked (module doc).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
    }
}
