//! The data plane: one-sided writes of staged chunks into a remote registered buffer.
//!
//! The contract follows RDMA verbs, so that what the simulation proves holds on hardware:
//! - a receiver *exposes* a buffer of a `SlotGeometry` (`slots × slot_bytes`); a sender
//!   *connects* its staging memory to it and posts writes of one staging slot into one remote
//!   slot;
//! - completions arrive **in posting order per connection**;
//! - a local completion tells the remote side nothing: the receiver learns of a write only
//!   from a `Landed` notice, and only when the write carried an immediate value;
//! - a connection error, or `FabricConn::reset`, **flushes every outstanding write with an
//!   error**, and nothing lands after the flush;
//! - a write lands only where the peer its connection authenticated as holds the slot's
//!   current grant (`access`), once per grant; each landing is announced with what the
//!   receiver needs to check it (peer, slot, bytes, and how its checksum compared).

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use kvx_proto::receiver::LandedWrite;
use kvx_proto::{SlotIndex, StagingSlot, WriteId};
use tokio::sync::mpsc;

use crate::access::{FabricAccess, FabricCredential};
pub use crate::fabric_error::FabricError;
use crate::geometry::SlotGeometry;
use crate::region::{ExternalRegion, SlotRegion};

/// Registered memory, addressed by slot. Implementations choose where it lives (kvx's own
/// allocation, a caller's region, a shared mapping, memory registered with a NIC); every
/// access goes through the one in-place primitive, `with_slot`, from which reading,
/// writing, filling and inspecting follow without a copy or an allocation of their own.
pub trait SlotMemory: fmt::Debug + Send + Sync + 'static {
    /// Slots in the memory.
    fn slots(&self) -> u32;
    /// Bytes in each slot (one chunk).
    fn slot_bytes(&self) -> usize;
    /// The memory's shape as one value (what a handshake announces).
    fn geometry(&self) -> SlotGeometry {
        SlotGeometry {
            slots: self.slots(),
            slot_bytes: self.slot_bytes() as u64,
        }
    }
    /// Runs `f` on all of `slot`'s bytes in place, exclusively within this process. Panics
    /// when `slot` is out of bounds: a caller bug.
    fn with_slot(&self, slot: u32, f: &mut dyn FnMut(&mut [u8]));

    /// Copies `data` to the start of `slot` (a prefill thread filling staging, or a fabric
    /// landing a write). Panics when `slot` or `data` is out of bounds: a caller bug.
    fn write_slot(&self, slot: u32, data: &[u8]) {
        self.fill_slot(slot, data.len(), &mut |s| s.copy_from_slice(data));
    }

    /// Copies the first `out.len()` bytes of `slot` into `out`.
    fn read_slot(&self, slot: u32, out: &mut [u8]) {
        let len = out.len();
        self.inspect_slot(slot, len, &mut |s| out.copy_from_slice(s));
    }

    /// Lets `f` fill the first `len` bytes of `slot` in place (a prefill thread writing a
    /// chunk straight into staging).
    fn fill_slot(&self, slot: u32, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        self.with_slot(slot, &mut |s| {
            assert!(
                len <= s.len(),
                "invariant: {len} bytes fit a {}-byte slot",
                s.len()
            );
            f(&mut s[..len]);
        });
    }

    /// The memory's first byte and its length (`slots × slot_bytes`), for memory kvx
    /// allocated that an embedding program views in place (a Python `memoryview` over the
    /// shm fabric's mapping); `None` for memory that cannot be viewed so. Whoever holds a
    /// view keeps the memory alive and follows the protocol's rule (`region` module doc):
    /// it writes a staging slot only while it holds it, and reads a receive slot only while
    /// it is leased.
    fn viewable(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        None
    }

    /// Lets `f` read the first `len` bytes of `slot` in place (the decoder reading a chunk).
    fn inspect_slot(&self, slot: u32, len: usize, f: &mut dyn FnMut(&[u8])) {
        self.with_slot(slot, &mut |s| {
            assert!(
                len <= s.len(),
                "invariant: {len} bytes fit a {}-byte slot",
                s.len()
            );
            f(&s[..len]);
        });
    }
}

/// Memory in this process alone, no other process maps it: kvx's own allocation
/// (`allocate`) or a region a caller lends (`external`). What the TCP and in-memory fabrics
/// write from and into.
#[derive(Debug)]
pub struct LocalMemory {
    region: SlotRegion,
}

impl LocalMemory {
    /// `geometry`'s zeroed bytes of kvx's own, every page touched now
    /// (`SlotRegion::allocate`).
    pub fn allocate(geometry: SlotGeometry) -> Result<Self, FabricError> {
        Ok(Self {
            region: SlotRegion::allocate(geometry)?,
        })
    }

    /// The caller's region, split into its slots.
    pub fn external(region: ExternalRegion) -> Self {
        Self {
            region: SlotRegion::external(region),
        }
    }

    /// `SlotMemory::with_slot` for a closure that returns a value (the TCP fabric's socket
    /// reads and writes).
    pub fn with_slot<R>(&self, slot: u32, f: impl FnOnce(&mut [u8]) -> R) -> R {
        self.region.with_slot(slot, f)
    }

    /// `SlotRegion::with_run`: slots `first .. first + n` as one span, or `None` where
    /// they are not contiguous in memory (the TCP fabric's send of a run).
    pub fn with_run<R>(&self, first: u32, n: u32, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        self.region.with_run(first, n, f)
    }
}

impl SlotMemory for LocalMemory {
    fn slots(&self) -> u32 {
        self.region.slots()
    }

    fn slot_bytes(&self) -> usize {
        self.region.slot_bytes()
    }

    fn with_slot(&self, slot: u32, f: &mut dyn FnMut(&mut [u8])) {
        self.region.with_slot(slot, f);
    }

    /// `None` for a region in several parts (`ExternalRegion::join`): no one view spans it.
    fn viewable(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        self.region.raw()
    }
}

/// One write to post: `len` bytes of staging slot `local` into remote slot `remote`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostWrite {
    /// Names the write in its `Completion`.
    pub id: WriteId,
    /// The staging slot to read; it must not change until the completion.
    pub local: StagingSlot,
    /// The receiver's slot to write.
    pub remote: SlotIndex,
    /// Bytes from the start of the slot; at most the slot size.
    pub len: usize,
    /// The immediate value (`WriteTag::to_imm`): which grant the write is for. A kvx
    /// receiver refuses writes without one.
    pub imm: Option<u32>,
    /// The chunk's checksum (`checksum::chunk_checksum` of its `len` bytes), when the sender
    /// computes them; the receiver compares it with the bytes that landed.
    pub checksum: Option<u32>,
}

/// Writes posted as **one write** (a run): each piece a `PostWrite` of its own (its id,
/// grant tag and checksum, completed and landed on its own), their staging slots
/// consecutive, their remote slots consecutive, every piece but the last a whole slot, so
/// the run's bytes are one contiguous span on both sides wherever each side's memory is
/// (a run of a layer's blocks, contiguous in the prefill and the decode engine's KV).
///
/// A fabric that carries runs (`FabricConn::carries_runs`) puts a run on the wire as one
/// write (`TcpFabric`: its headers, then its payload in one gather); the receiver still
/// admits, lands and announces each piece against its own grant, so a run is exactly its
/// pieces as far as the protocol is concerned. Other fabrics are posted the pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteRun {
    pieces: Vec<PostWrite>,
}

impl WriteRun {
    /// The most pieces in one run: bounds a receiver's queue of announced pieces, and keeps a
    /// run's headers well inside one gather.
    pub const MAX_PIECES: usize = 64;

    /// A run of one write.
    pub fn new(first: PostWrite) -> Self {
        Self {
            pieces: vec![first],
        }
    }

    /// Whether `next` continues the run: its staging and remote slots follow the last
    /// piece's, the last piece fills its `slot_bytes`-byte slot, and the run has room.
    pub fn continues(&self, next: &PostWrite, slot_bytes: usize) -> bool {
        let last = self.last();
        self.pieces.len() < Self::MAX_PIECES
            && last.len == slot_bytes
            && last.local.0.checked_add(1) == Some(next.local.0)
            && last.remote.0.checked_add(1) == Some(next.remote.0)
    }

    /// Appends `next` when it `continues` the run; gives it back otherwise.
    pub fn push(&mut self, next: PostWrite, slot_bytes: usize) -> Result<(), PostWrite> {
        if self.continues(&next, slot_bytes) {
            self.pieces.push(next);
            Ok(())
        } else {
            Err(next)
        }
    }

    /// Whether the run is what `push` builds for slots of `slot_bytes`: consecutive staging
    /// and remote slots, every piece but the last a whole slot, at most `MAX_PIECES`. A
    /// fabric checks it against its own staging before carrying the run as one write.
    pub fn fits(&self, slot_bytes: usize) -> bool {
        self.pieces.len() <= Self::MAX_PIECES
            && self.pieces.windows(2).all(|w| {
                w[0].len == slot_bytes
                    && w[0].local.0.checked_add(1) == Some(w[1].local.0)
                    && w[0].remote.0.checked_add(1) == Some(w[1].remote.0)
            })
    }

    /// The pieces, in posting order (never empty).
    pub fn pieces(&self) -> &[PostWrite] {
        &self.pieces
    }

    /// The pieces, given back (to post one by one).
    pub fn into_pieces(self) -> Vec<PostWrite> {
        self.pieces
    }

    /// The last piece.
    pub fn last(&self) -> &PostWrite {
        self.pieces
            .last()
            .expect("invariant: a run holds at least one piece")
    }

    /// Bytes the run carries.
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }
}

/// A posted write finished, in posting order per connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The write's `PostWrite::id`.
    pub id: WriteId,
    /// `Ok`: the bytes are in the receiver's memory (on RDMA, where the NIC writes first, a
    /// write the receiver ignores completes `Ok` too). An error: the write failed, and
    /// nothing of it lands after this.
    pub result: Result<(), FabricError>,
}

/// Why a sender's staging cannot attach to a receiver's buffer: every fabric requires the
/// same chunk size on both sides (a smaller sender chunk would leave the rest of each slot
/// stale, which the decoder would read as the chunk's tail).
pub fn slot_size_mismatch(staging_slot_bytes: usize, remote_slot_bytes: usize) -> String {
    format!(
        "the sender's chunks are {staging_slot_bytes} bytes but the receiver's slots are \
         {remote_slot_bytes} bytes: start both with the same chunk size"
    )
}

/// The channel of landing notices from a fabric to the receiver's driver. Bounded: the
/// access rules announce at most one write per grant, and the driver handles a notice
/// before the slot it names can be granted again, so no more than about one notice per slot
/// is ever queued; the room left over absorbs the moments when a slot freed by a timer is
/// re-granted and written before the driver has read an older notice. A fabric that finds
/// it full anyway drops the notice (its request then times out): never a safety matter.
pub fn landing_channel(slots: u32) -> (mpsc::Sender<LandedWrite>, mpsc::Receiver<LandedWrite>) {
    mpsc::channel(2 * slots as usize + 64)
}

/// What a connection's IO task is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnOp {
    /// Post this write.
    Write(PostWrite),
    /// Post this run as one write (only to a connection that `carries_runs`).
    Run(WriteRun),
    /// Tear the connection down: flush every outstanding write with `FabricError::Flushed`.
    Reset,
}

impl ConnOp {
    /// The op as single writes (a run's pieces, in order), for a connection task that
    /// carries no runs.
    pub fn unrolled(self) -> Vec<ConnOp> {
        match self {
            ConnOp::Run(run) => run.into_pieces().into_iter().map(ConnOp::Write).collect(),
            op => vec![op],
        }
    }
}

/// A sender's connection to one exposed buffer.
#[derive(Debug)]
pub struct FabricConn {
    ops: mpsc::UnboundedSender<ConnOp>,
    completions: mpsc::UnboundedReceiver<Completion>,
    carries_runs: bool,
}

impl FabricConn {
    /// For implementations. The channels are unbounded because the sender bounds them: its
    /// writes outstanding are at most its staging pool's slots, or, with caller staging, the
    /// chunks its receivers granted (each a slot of a bounded buffer).
    pub fn new(
        ops: mpsc::UnboundedSender<ConnOp>,
        completions: mpsc::UnboundedReceiver<Completion>,
    ) -> Self {
        Self {
            ops,
            completions,
            carries_runs: false,
        }
    }

    /// `new`, for a connection whose task takes `ConnOp::Run` and carries each run as one
    /// write.
    pub fn carrying_runs(
        ops: mpsc::UnboundedSender<ConnOp>,
        completions: mpsc::UnboundedReceiver<Completion>,
    ) -> Self {
        Self {
            carries_runs: true,
            ..Self::new(ops, completions)
        }
    }

    /// Whether a `WriteRun` goes as one write here (else `post_run` posts its pieces).
    pub fn carries_runs(&self) -> bool {
        self.carries_runs
    }

    /// Posts `run`: as one write where the connection `carries_runs`, else piece by piece;
    /// every piece completes on `next_completion`, in order. Returns the writes it made (1,
    /// or the pieces). On an error, the pieces not taken are given back (a connection that
    /// closed takes nothing more; those it took complete).
    pub fn post_run(&self, run: WriteRun) -> Result<usize, (FabricError, Vec<PostWrite>)> {
        post_run(&self.ops, self.carries_runs, run)
    }

    /// Posts a write; its completion follows on `next_completion`.
    pub fn post(&self, write: PostWrite) -> Result<(), FabricError> {
        self.ops
            .send(ConnOp::Write(write))
            .map_err(|_| FabricError::Closed)
    }

    /// Flushes every outstanding write with an error (the driver's answer to a stalled
    /// write); the connection is unusable afterwards.
    pub fn reset(&self) {
        // A closed connection has nothing outstanding; ignoring the error is right.
        let _ = self.ops.send(ConnOp::Reset);
    }

    /// The next completion; None once the connection is gone and drained. Cancel-safe.
    pub async fn next_completion(&mut self) -> Option<Completion> {
        self.completions.recv().await
    }

    /// Splits the connection into its posting side and its completion stream, so one task
    /// can post while another waits for completions.
    pub fn split(self) -> (ConnPoster, mpsc::UnboundedReceiver<Completion>) {
        let poster = ConnPoster {
            ops: self.ops,
            carries_runs: self.carries_runs,
        };
        (poster, self.completions)
    }
}

fn post_run(
    ops: &mpsc::UnboundedSender<ConnOp>,
    carries_runs: bool,
    run: WriteRun,
) -> Result<usize, (FabricError, Vec<PostWrite>)> {
    if carries_runs {
        return match ops.send(ConnOp::Run(run)) {
            Ok(()) => Ok(1),
            Err(mpsc::error::SendError(op)) => {
                let pieces = op.unrolled().into_iter().filter_map(|op| match op {
                    ConnOp::Write(w) => Some(w),
                    _ => None,
                });
                Err((FabricError::Closed, pieces.collect()))
            }
        };
    }
    let pieces = run.into_pieces();
    let n = pieces.len();
    for (i, w) in pieces.iter().enumerate() {
        if ops.send(ConnOp::Write(*w)).is_err() {
            return Err((FabricError::Closed, pieces[i..].to_vec()));
        }
    }
    Ok(n)
}

/// The posting side of a split `FabricConn`.
#[derive(Debug, Clone)]
pub struct ConnPoster {
    ops: mpsc::UnboundedSender<ConnOp>,
    carries_runs: bool,
}

impl ConnPoster {
    /// See `FabricConn::post`.
    pub fn post(&self, write: PostWrite) -> Result<(), FabricError> {
        self.ops
            .send(ConnOp::Write(write))
            .map_err(|_| FabricError::Closed)
    }

    /// See `FabricConn::carries_runs`.
    pub fn carries_runs(&self) -> bool {
        self.carries_runs
    }

    /// See `FabricConn::post_run`.
    pub fn post_run(&self, run: WriteRun) -> Result<usize, (FabricError, Vec<PostWrite>)> {
        post_run(&self.ops, self.carries_runs, run)
    }

    /// See `FabricConn::reset`.
    pub fn reset(&self) {
        let _ = self.ops.send(ConnOp::Reset);
    }
}

/// A receiver's exposed buffer, the notices of writes landing in it, and its access rules
/// (the driver mirrors the ledger's grants into `access` and hands out its credentials).
#[derive(Debug)]
pub struct FabricListener<M> {
    /// The endpoint actually exposed (a port chosen by the OS is filled in).
    pub local_endpoint: String,
    /// The receive buffer the decoder reads.
    pub memory: Arc<M>,
    /// One notice per accepted write (`landing_channel`); the receiver's driver feeds each
    /// to `ReceiverLedger::handle_chunk_landed`.
    pub landed: mpsc::Receiver<LandedWrite>,
    /// The grant mirror every write is checked against, and the credentials it issues.
    pub access: Arc<FabricAccess>,
    /// Every byte of a write goes into the buffer through `FabricAccess::land`, so once the
    /// driver has mirrored a revocation no byte of that grant's write can land (TCP, shared
    /// memory, in memory). False where the device writes before the rules are checked
    /// (RDMA): there a revoked grant's write may still land, and its slot waits in quarantine.
    pub revocation_stops_writes: bool,
}

/// Makes memory, exposes receive buffers and connects staging to them.
pub trait Fabric: Clone + Send + Sync + 'static {
    /// The memory it exposes and writes from.
    type Memory: SlotMemory;

    /// Local staging memory of `geometry` for a sender. `SlotGeometry::new` checked the
    /// shape; an implementation adds only a limit of its own (RDMA's largest write).
    fn allocate_staging(&self, geometry: SlotGeometry) -> Result<Arc<Self::Memory>, FabricError>;

    /// Staging in memory the caller owns (`ExternalRegion`). A fabric that needs memory of
    /// its own kind (a shared mapping another process can map) refuses it, saying so.
    fn staging_in(&self, region: ExternalRegion) -> Result<Arc<Self::Memory>, FabricError> {
        drop(region);
        Err(FabricError::ExternalMemory(
            std::any::type_name::<Self>().to_owned(),
        ))
    }

    /// `expose`, over a receive buffer in memory the caller owns. Refused as `staging_in`
    /// is by a fabric that needs memory of its own kind.
    fn expose_in(
        &self,
        endpoint: &str,
        region: ExternalRegion,
    ) -> impl Future<Output = Result<FabricListener<Self::Memory>, FabricError>> + Send {
        let _ = endpoint;
        drop(region);
        let refused = Err(FabricError::ExternalMemory(
            std::any::type_name::<Self>().to_owned(),
        ));
        async move { refused }
    }

    /// Creates a receive buffer of `geometry` and accepts writes into it at `endpoint` (port
    /// 0: the OS picks; `local_endpoint` tells).
    fn expose(
        &self,
        endpoint: &str,
        geometry: SlotGeometry,
    ) -> impl Future<Output = Result<FabricListener<Self::Memory>, FabricError>> + Send;

    /// Connects `staging` to the buffer exposed at `endpoint`, as the control peer that
    /// `credential` was issued to (the receiver refuses a credential it did not issue).
    /// The staging slots must be exactly as large as the receiver's.
    fn connect(
        &self,
        endpoint: &str,
        staging: Arc<Self::Memory>,
        credential: FabricCredential,
    ) -> impl Future<Output = Result<FabricConn, FabricError>> + Send;
}
