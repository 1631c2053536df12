//! The sender, for an embedding program: one type whatever the transport and fabric
//! (`SenderHandle<E>` behind an object-safe trait, chosen once at start), on its staging of
//! kvx's allocation or of memory the caller owns.
//!
//! A request goes: `begin` → `wait_admitted` → for each chunk, `allocate` a `StagingGuard`,
//! write the chunk into its slot (`with_slot`, or the caller's own view of its memory),
//! `add` it to the request's pending batch → `submit` the batch (the last with
//! `last = true`) → its end comes from `wait_outcome` or, for many requests at once, from
//! `next_ends`. The pending batches live in the core (`SenderFlow::handle_add`), which
//! submits them itself when only they hold staging (`docs/invariants.md` S11): this type
//! only asks. A guard dropped before `add` hands its slot back.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kvx_io::{Env, SlotMemory};
use kvx_node::{ReceiverAddr, RequestEnd, SenderHandle, SenderNode, StartError};
use kvx_proto::sender::{ChunkSpec, RequestSpec, SendError, SendFailure};
use kvx_proto::{PeerId, Placement, ReqId, SenderConfig, StagingSlot};
use tokio::sync::mpsc;

use crate::choice::{EnvChoice, EnvVisitor};
use crate::error::EmbedError;
use crate::memory::{Memory, MemoryView};
use crate::runtime::Runtime;

/// What a sender is started with.
#[derive(Debug)]
pub struct SenderSettings {
    /// Transport and fabric.
    pub env: EnvChoice,
    /// The state machine's limits and timers (`staging_slots` is the staging's slot count).
    pub config: SenderConfig,
    /// Its staging.
    pub staging: Memory,
    /// Its identity on every receiver's alloc channel, unique per sender: a receiver refuses
    /// a second connection under an identity another holds (`EmbedError::is_refused`).
    /// `unique_local_id` makes one.
    pub local_id: String,
    /// The proxy's notice endpoint; None: notices are dropped (tests without a proxy).
    pub proxy: Option<String>,
}

/// A sender identity no other sender has: `{prefix}-{pid}-{n}-{32 hex digits}`, where `n`
/// counts the identities made in this process and the hex digits are 128 random bits from
/// the OS. Each sender needs its own (a receiver refuses a second connection under an
/// identity another holds), several in one process too; the random part keeps a peer from
/// guessing it and claiming it while the sender reconnects (`docs/spec/zmq.md` §3). The pid
/// and the count are for whoever reads the logs, which show no more than an identity's start.
pub fn unique_local_id(prefix: &str) -> Result<String, EmbedError> {
    static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut bits = [0u8; 16];
    getrandom::fill(&mut bits).map_err(|e| {
        EmbedError::Runtime(std::io::Error::other(format!(
            "the OS random source failed: {e}"
        )))
    })?;
    let hex: String = bits.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{prefix}-{}-{n}-{hex}", std::process::id()))
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// `SenderHandle<E>` for any `E`, as one type.
trait SenderApi: Send + Sync {
    fn add_receiver(&self, addr: ReceiverAddr) -> BoxFuture<'_, Result<PeerId, StartError>>;
    fn begin(&self, spec: RequestSpec) -> Result<(), SendError>;
    fn admitted<'a>(&'a self, req_id: &'a ReqId) -> BoxFuture<'a, Result<(), SendFailure>>;
    fn outcome<'a>(&'a self, req_id: &'a ReqId) -> BoxFuture<'a, Result<(), SendFailure>>;
    fn released<'a>(&'a self, req_id: &'a ReqId) -> BoxFuture<'a, Result<(), SendFailure>>;
    fn staging_placement(&self) -> Placement;
    fn submit(&self, req_id: &ReqId, chunks: Vec<ChunkSpec>, last: bool) -> Result<(), SendError>;
    fn allocate_blocking(
        &self,
        req_id: &ReqId,
        held: &mut Vec<ChunkSpec>,
        timeout: Duration,
    ) -> Result<StagingSlot, SendError>;
    fn allocate<'a>(
        &'a self,
        req_id: &'a ReqId,
        held: &'a mut Vec<ChunkSpec>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<StagingSlot, SendError>>;
    fn with_slot(&self, slot: StagingSlot, f: &mut dyn FnMut(&mut [u8]));
    fn memory_view(&self) -> Option<MemoryView>;
    fn staged(&self, slot: StagingSlot, len: usize);
    fn add(&self, req_id: &ReqId, chunk: ChunkSpec) -> Result<(), SendError>;
    fn submit_added(&self, req_id: &ReqId, last: bool) -> Result<(), SendError>;
    fn release(&self, req_id: &ReqId, slot: StagingSlot) -> Result<(), SendError>;
    fn cancel(&self, req_id: &ReqId) -> Result<(), SendError>;
    fn completions(&self) -> mpsc::UnboundedReceiver<RequestEnd>;
    fn staging_free(&self) -> u32;
    fn write_counts(&self) -> kvx_node::WriteCounts;
    fn slots(&self) -> u32;
    fn slot_bytes(&self) -> usize;
    fn shutdown(&self);
    fn close(&self, within: Duration) -> BoxFuture<'_, bool>;
}

impl<E: Env> SenderApi for SenderHandle<E> {
    fn add_receiver(&self, addr: ReceiverAddr) -> BoxFuture<'_, Result<PeerId, StartError>> {
        Box::pin(SenderHandle::add_receiver(self, addr))
    }
    fn begin(&self, spec: RequestSpec) -> Result<(), SendError> {
        SenderHandle::begin(self, spec)
    }
    fn admitted<'a>(&'a self, req_id: &'a ReqId) -> BoxFuture<'a, Result<(), SendFailure>> {
        Box::pin(SenderHandle::admitted(self, req_id))
    }
    fn outcome<'a>(&'a self, req_id: &'a ReqId) -> BoxFuture<'a, Result<(), SendFailure>> {
        Box::pin(SenderHandle::outcome(self, req_id))
    }
    fn released<'a>(&'a self, req_id: &'a ReqId) -> BoxFuture<'a, Result<(), SendFailure>> {
        Box::pin(SenderHandle::released(self, req_id))
    }
    fn staging_placement(&self) -> Placement {
        SenderHandle::staging_placement(self)
    }
    fn submit(&self, req_id: &ReqId, chunks: Vec<ChunkSpec>, last: bool) -> Result<(), SendError> {
        SenderHandle::submit(self, req_id, chunks, last)
    }
    fn allocate_blocking(
        &self,
        req_id: &ReqId,
        held: &mut Vec<ChunkSpec>,
        timeout: Duration,
    ) -> Result<StagingSlot, SendError> {
        SenderHandle::allocate_blocking(self, req_id, held, timeout)
    }
    fn allocate<'a>(
        &'a self,
        req_id: &'a ReqId,
        held: &'a mut Vec<ChunkSpec>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<StagingSlot, SendError>> {
        Box::pin(SenderHandle::allocate_within(self, req_id, held, timeout))
    }
    fn with_slot(&self, slot: StagingSlot, f: &mut dyn FnMut(&mut [u8])) {
        self.staging().with_slot(slot.0, f);
    }
    fn memory_view(&self) -> Option<MemoryView> {
        MemoryView::of(self.staging())
    }
    fn staged(&self, slot: StagingSlot, len: usize) {
        SenderHandle::staged(self, slot, len);
    }
    fn add(&self, req_id: &ReqId, chunk: ChunkSpec) -> Result<(), SendError> {
        SenderHandle::add(self, req_id, chunk)
    }
    fn submit_added(&self, req_id: &ReqId, last: bool) -> Result<(), SendError> {
        SenderHandle::submit_added(self, req_id, last)
    }
    fn release(&self, req_id: &ReqId, slot: StagingSlot) -> Result<(), SendError> {
        SenderHandle::release(self, req_id, slot)
    }
    fn cancel(&self, req_id: &ReqId) -> Result<(), SendError> {
        SenderHandle::cancel(self, req_id)
    }
    fn completions(&self) -> mpsc::UnboundedReceiver<RequestEnd> {
        SenderHandle::completions(self)
    }
    fn write_counts(&self) -> kvx_node::WriteCounts {
        SenderHandle::write_counts(self)
    }

    fn staging_free(&self) -> u32 {
        SenderHandle::staging_free(self)
    }
    fn slots(&self) -> u32 {
        self.staging().slots()
    }
    fn slot_bytes(&self) -> usize {
        self.staging().slot_bytes()
    }
    fn shutdown(&self) {
        SenderHandle::shutdown(self);
    }
    fn close(&self, within: Duration) -> BoxFuture<'_, bool> {
        Box::pin(SenderHandle::close(self, within))
    }
}

struct Start {
    settings: SenderSettings,
}

impl EnvVisitor for Start {
    type Output = BoxFuture<'static, Result<Box<dyn SenderApi>, StartError>>;
    fn visit<E: Env>(self, env: E) -> Self::Output {
        let SenderSettings {
            config,
            staging,
            local_id,
            proxy,
            ..
        } = self.settings;
        Box::pin(async move {
            let handle = match staging {
                Memory::Allocate { slot_bytes } => {
                    SenderNode::start(env, config, slot_bytes, local_id, proxy).await?
                }
                Memory::External(region) => {
                    SenderNode::start_in(env, config, region, local_id, proxy).await?
                }
            };
            Ok(Box::new(handle) as Box<dyn SenderApi>)
        })
    }
}

/// A running sender. Every call may come from any thread; the blocking ones are bounded
/// (by their `timeout`, or the configured one) and must not be called from a task of its
/// runtime.
pub struct Sender {
    runtime: Runtime,
    api: Arc<dyn SenderApi>,
    ends: tokio::sync::Mutex<mpsc::UnboundedReceiver<RequestEnd>>,
    /// Admissions of the requests begun with `begin_reporting_admission`.
    admissions_tx: mpsc::UnboundedSender<Admission>,
    admissions: tokio::sync::Mutex<mpsc::UnboundedReceiver<Admission>>,
    staging_timeout: Duration,
}

/// A request's admission, or why it never came (`Sender::begin_reporting_admission`).
#[derive(Debug, Clone)]
pub struct Admission {
    /// The request.
    pub req_id: ReqId,
    /// `Ok`: admitted (the receiver reserved room for all its chunks); `Err`: why it will
    /// never be.
    pub outcome: Result<(), SendFailure>,
}

impl fmt::Debug for Sender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sender")
            .field("slots", &self.api.slots())
            .field("slot_bytes", &self.api.slot_bytes())
            .finish_non_exhaustive()
    }
}

/// One chunk of a batch read straight from the caller's own staging (`Sender::submit_slots`):
/// the whole of its slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotChunk {
    /// The caller's slot its bytes are in.
    pub slot: StagingSlot,
    /// Names it to the receiver.
    pub key: String,
    /// The tokens it covers.
    pub tokens: u64,
}

/// A staging slot the caller holds for one request: write its chunk, then `Sender::add`
/// it. Dropped before that, the slot is handed back.
pub struct StagingGuard {
    api: Arc<dyn SenderApi>,
    req_id: ReqId,
    slot: StagingSlot,
    armed: bool,
}

impl fmt::Debug for StagingGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingGuard")
            .field("req_id", &self.req_id)
            .field("slot", &self.slot)
            .field("armed", &self.armed)
            .finish()
    }
}

impl StagingGuard {
    /// The slot's index in the staging region (slot `i` is bytes
    /// `i × slot_bytes .. (i + 1) × slot_bytes` of it).
    pub fn index(&self) -> u32 {
        self.slot.0
    }

    /// The request it was taken for.
    pub fn req_id(&self) -> &ReqId {
        &self.req_id
    }

    /// Bytes in the slot.
    pub fn slot_bytes(&self) -> usize {
        self.api.slot_bytes()
    }

    /// Runs `f` on the slot's bytes in place.
    pub fn with_slot(&self, f: &mut dyn FnMut(&mut [u8])) {
        self.api.with_slot(self.slot, f);
    }
}

impl Drop for StagingGuard {
    fn drop(&mut self) {
        if self.armed {
            // A request that ended meanwhile released its staging already.
            let _ = self.api.release(&self.req_id, self.slot);
        }
    }
}

impl Sender {
    /// Starts a sender on `runtime`.
    pub fn start(runtime: &Runtime, settings: SenderSettings) -> Result<Self, EmbedError> {
        let staging_timeout = settings.config.staging_timeout;
        let start = settings.env.clone().visit(Start { settings })?;
        let api: Arc<dyn SenderApi> = Arc::from(runtime.block_on(start)?);
        let ends = tokio::sync::Mutex::new(api.completions());
        let (admissions_tx, admissions) = mpsc::unbounded_channel();
        Ok(Self {
            runtime: runtime.clone(),
            api,
            ends,
            admissions_tx,
            admissions: tokio::sync::Mutex::new(admissions),
            staging_timeout,
        })
    }

    /// Connects to a receiver (once per address; later calls return the same id), waiting
    /// at most `timeout`.
    pub fn add_receiver(
        &self,
        addr: ReceiverAddr,
        timeout: Duration,
    ) -> Result<PeerId, EmbedError> {
        self.runtime
            .block_on_for(timeout, self.api.add_receiver(addr))
            .ok_or(EmbedError::TimedOut(timeout))?
            .map_err(EmbedError::Start)
    }

    /// Begins a request: its admission probe goes out.
    pub fn begin(&self, spec: RequestSpec) -> Result<(), SendError> {
        self.api.begin(spec)
    }

    /// `begin`, and the request's admission reported once through `next_admissions` when it
    /// comes, or why it never will (the request failed first): a caller with many requests
    /// waiting learns of each admission as an event instead of asking each in turn. The
    /// report is queued until taken.
    pub fn begin_reporting_admission(&self, spec: RequestSpec) -> Result<(), SendError> {
        let req_id = spec.req_id.clone();
        self.api.begin(spec)?;
        let (api, tx) = (self.api.clone(), self.admissions_tx.clone());
        // Ends with the request: `admitted` answers once it is admitted or has failed.
        self.runtime.spawn(async move {
            let outcome = api.admitted(&req_id).await;
            let _ = tx.send(Admission { req_id, outcome });
        });
        Ok(())
    }

    /// Up to `max` admissions of requests begun with `begin_reporting_admission`, waiting
    /// at most `timeout` for the first; empty when none came. Each comes once, to one
    /// caller.
    pub fn next_admissions(&self, max: usize, timeout: Duration) -> Vec<Admission> {
        if max == 0 {
            return Vec::new();
        }
        self.runtime
            .block_on_for(timeout, self.admissions(max))
            .unwrap_or_default()
    }

    /// The async form of `next_admissions`, unbounded: up to `max` once the first came.
    /// Dropping it loses none.
    pub async fn admissions(&self, max: usize) -> Vec<Admission> {
        up_to(&self.admissions, max).await
    }

    /// Waits at most `timeout` for the receiver to admit `req_id` (`Ok(false)`: not yet).
    pub fn wait_admitted(&self, req_id: &ReqId, timeout: Duration) -> Result<bool, SendFailure> {
        self.runtime
            .block_on_for(timeout, self.api.admitted(req_id))
            .map_or(Ok(false), |r| r.map(|()| true))
    }

    /// The async form of `wait_admitted`, unbounded (bound it with a timeout of your own).
    pub async fn admitted(&self, req_id: &ReqId) -> Result<(), SendFailure> {
        self.api.admitted(req_id).await
    }

    /// Waits at most `timeout` for `req_id`'s end: `Some(Ok)` delivered, `Some(Err)` failed,
    /// None not yet.
    pub fn wait_outcome(
        &self,
        req_id: &ReqId,
        timeout: Duration,
    ) -> Option<Result<(), SendFailure>> {
        self.runtime.block_on_for(timeout, self.api.outcome(req_id))
    }

    /// The async form of `wait_outcome`, unbounded.
    pub async fn outcome(&self, req_id: &ReqId) -> Result<(), SendFailure> {
        self.api.outcome(req_id).await
    }

    /// Takes a staging slot for `req_id`, blocking at most `timeout` (None: the configured
    /// `staging_timeout`): one bounded wait. When no slot is free and only unsubmitted
    /// chunks hold staging, the core submits the pending batches (none as the last) first.
    pub fn allocate(
        &self,
        req_id: &ReqId,
        timeout: Option<Duration>,
    ) -> Result<StagingGuard, SendError> {
        let timeout = timeout.unwrap_or(self.staging_timeout);
        self.api
            .allocate_blocking(req_id, &mut Vec::new(), timeout)
            .map(|slot| self.guard(req_id, slot))
    }

    /// The async form of `allocate`.
    pub async fn allocate_async(
        &self,
        req_id: &ReqId,
        timeout: Option<Duration>,
    ) -> Result<StagingGuard, SendError> {
        let timeout = timeout.unwrap_or(self.staging_timeout);
        self.api
            .allocate(req_id, &mut Vec::new(), timeout)
            .await
            .map(|slot| self.guard(req_id, slot))
    }

    fn guard(&self, req_id: &ReqId, slot: StagingSlot) -> StagingGuard {
        StagingGuard {
            api: self.api.clone(),
            req_id: req_id.clone(),
            slot,
            armed: true,
        }
    }

    /// Adds the chunk written into `guard`'s slot to its request's pending batch: its first
    /// `len` bytes (at most the slot size) are the chunk, `key` names it to the receiver,
    /// `tokens` is the number of tokens it covers. The checksum is computed now: do not
    /// write the slot after this.
    pub fn add(
        &self,
        mut guard: StagingGuard,
        key: String,
        len: usize,
        tokens: u64,
    ) -> Result<(), SendError> {
        let slot_bytes = self.api.slot_bytes();
        if len == 0 || len > slot_bytes {
            return Err(SendError::Misuse {
                req_id: guard.req_id.clone(),
                why: format!("a chunk of {len} bytes: chunks are 1..={slot_bytes} bytes"),
            });
        }
        self.api.staged(guard.slot, len);
        // Added or refused, the slot is the core's to account for now (a refusal cancels
        // the request, which frees its staging).
        guard.armed = false;
        let chunk = ChunkSpec {
            key,
            staging: guard.slot,
            tokens,
            bytes: len as u64,
        };
        self.api.add(&guard.req_id, chunk)
    }

    /// Submits `req_id`'s pending batch (`last`: it completes the request, whose declared
    /// chunk count must then be reached). An empty batch that is not the last is a no-op.
    pub fn submit(&self, req_id: &ReqId, last: bool) -> Result<(), SendError> {
        self.api.submit_added(req_id, last)
    }

    /// Caller staging (`SenderConfig::staging_placement = Caller`): submits one batch of
    /// `req_id`'s chunks read straight from the caller's own staging slots, where their
    /// bytes already are (`last`: it completes the request). Each chunk is its whole slot,
    /// so that several requests may name one slot at once and agree on what it holds; its
    /// checksum is taken now, from the slot. The slots must not change until `released`
    /// says the request reads them no more. Refused, touching nothing, on a sender that
    /// stages in kvx's pool (where the slots belong to the requests that took them) and for a
    /// slot out of range.
    pub fn submit_slots(
        &self,
        req_id: &ReqId,
        chunks: Vec<SlotChunk>,
        last: bool,
    ) -> Result<(), SendError> {
        let misuse = |why: String| SendError::Misuse {
            req_id: req_id.clone(),
            why,
        };
        if self.api.staging_placement() != Placement::Caller {
            return Err(misuse(
                "submit_slots is for caller staging (staging_placement = caller): this \
                 sender stages in kvx's pool (allocate, add, submit)"
                    .to_owned(),
            ));
        }
        let slots = self.api.slots();
        if let Some(c) = chunks.iter().find(|c| c.slot.0 >= slots) {
            return Err(misuse(format!(
                "chunk {} in slot {}: the staging has slots 0..{slots}",
                c.key, c.slot.0
            )));
        }
        let slot_bytes = self.api.slot_bytes();
        let specs = chunks
            .into_iter()
            .map(|c| {
                self.api.staged(c.slot, slot_bytes);
                ChunkSpec {
                    key: c.key,
                    staging: c.slot,
                    tokens: c.tokens,
                    bytes: slot_bytes as u64,
                }
            })
            .collect();
        self.api.submit(req_id, specs, last)
    }

    /// Caller staging: waits at most `timeout` until `req_id` reads none of the caller's
    /// slots any more — delivered (`Some(Ok)`), or failed (`Some(Err)`) once its last posted
    /// write completed; None: not yet. With kvx's pool it is `wait_outcome`.
    pub fn wait_released(
        &self,
        req_id: &ReqId,
        timeout: Duration,
    ) -> Option<Result<(), SendFailure>> {
        self.runtime
            .block_on_for(timeout, self.api.released(req_id))
    }

    /// The async form of `wait_released`, unbounded.
    pub async fn released(&self, req_id: &ReqId) -> Result<(), SendFailure> {
        self.api.released(req_id).await
    }

    /// Aborts a request from any state; its pending batch is dropped (its staging freed by
    /// the core) and waiters get an error.
    pub fn cancel(&self, req_id: &ReqId) -> Result<(), SendError> {
        self.api.cancel(req_id)
    }

    /// Up to `max` request ends, waiting at most `timeout` for the first; empty when none
    /// came. Every request's end from the sender's start on, each once, shared by every
    /// caller (one caller's wait does not take another's timeout: they queue for the
    /// stream within their own).
    pub fn next_ends(&self, max: usize, timeout: Duration) -> Vec<RequestEnd> {
        if max == 0 {
            return Vec::new();
        }
        self.runtime
            .block_on_for(timeout, self.ends(max))
            .unwrap_or_default()
    }

    /// The async form of `next_ends`, unbounded: up to `max` request ends once the first
    /// came; empty once the sender has stopped and every end was taken. Dropping it loses
    /// no end.
    pub async fn ends(&self, max: usize) -> Vec<RequestEnd> {
        up_to(&self.ends, max).await
    }

    /// The configured bound of `allocate` when it is given none.
    pub fn staging_timeout(&self) -> Duration {
        self.staging_timeout
    }

    /// Staging slots free now (a snapshot).
    pub fn staging_free(&self) -> u32 {
        self.api.staging_free()
    }

    /// Fabric writes posted so far and their bytes (`SenderHandle::write_counts`): a run of
    /// chunks consecutive in staging and in the receiver's buffer is one write over TCP.
    pub fn write_counts(&self) -> kvx_node::WriteCounts {
        self.api.write_counts()
    }

    /// Staging slots in all.
    pub fn slots(&self) -> u32 {
        self.api.slots()
    }

    /// Bytes per staging slot.
    pub fn slot_bytes(&self) -> usize {
        self.api.slot_bytes()
    }

    /// The staging, for a view the caller keeps: what a program writes chunks through when
    /// kvx allocated the staging (the shm fabric's shared mapping). `None` when it cannot be
    /// viewed (RDMA-registered memory).
    pub fn memory_view(&self) -> Option<MemoryView> {
        self.api.memory_view()
    }

    /// Stops the driver; waiters, and every later call that needs it, get
    /// `SendFailure::Stopped`. Also done on drop. The notices already
    /// due to the proxy are still written while the runtime runs; `close` waits for them.
    pub fn shutdown(&self) {
        self.api.shutdown();
    }

    /// `shutdown`, then waits (at most `within`) until the notices already due to the proxy
    /// (each delivered request's `ProxyNotif`) are written: true if they were. Call it
    /// before the process exits, or the last of them may go with it.
    pub fn close(&self, within: Duration) -> bool {
        self.runtime
            .block_on_for(within, self.api.close(within))
            .unwrap_or(false)
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.api.shutdown();
    }
}

/// The facade's types cross threads (Python calls from any thread).
const _: () = {
    const fn is<T: Send + Sync>() {}
    is::<Sender>();
    is::<StagingGuard>();
};

/// Up to `max` of a stream's items once the first came (empty once it closed and every
/// item was taken); one caller at a time. `recv_many` is cancel safe: a caller that stops
/// waiting takes nothing.
async fn up_to<T>(stream: &tokio::sync::Mutex<mpsc::UnboundedReceiver<T>>, max: usize) -> Vec<T> {
    let mut out = Vec::new();
    if max > 0 {
        stream.lock().await.recv_many(&mut out, max).await;
    }
    out
}
