//! The sender, for an embedding program: `SenderHandle<AnyEnv>` (one type whatever the
//! transport and fabric), on its staging of kvx's allocation or of memory the caller owns,
//! and what an embedding needs beside it: the bounded blocking waits a Python thread calls,
//! guards that hand back a staging slot a dropped caller held, and admissions and request
//! ends as streams many callers share. Every other call is the handle's (`Sender::handle`):
//! a client call is written in the core and in kvx-node's handle, not again here.
//!
//! A request goes: `handle().begin` → `handle().admitted` → for each chunk, `allocate` a
//! `StagingGuard`, write the chunk into its slot (`with_slot`, or the caller's own view of
//! its memory), `add` it to the request's pending batch → `handle().submit_added` (the last
//! with `is_last = true`) → its end from `handle().outcome` or, for many requests at once,
//! from `ends`. The pending batches live in the core (`SenderFlow::handle_add`), which
//! submits them itself when only they hold staging (`docs/invariants.md` S11): this type
//! only asks. A guard dropped before `add` hands its slot back.

use std::fmt;
use std::time::Duration;

use kvx_io::{AnyEnv, SlotMemory};
use kvx_node::{ReceiverAddr, RequestEnd, SenderHandle, SenderNode, SharedStream};
use kvx_proto::sender::{ChunkSpec, RequestSpec, SendError, SendFailure};
use kvx_proto::{Checked, PeerId, ReqId, SenderConfig, StagingSlot};
use tokio::sync::mpsc;

use crate::choice::EnvChoice;
use crate::error::EmbedError;
use crate::memory::{Memory, MemoryView};
use crate::runtime::Runtime;

/// What a sender is started with.
#[derive(Debug)]
pub struct SenderSettings {
    /// Transport and fabric.
    pub env: EnvChoice,
    /// The state machine's limits and timers (`staging_slots` is the staging's slot count),
    /// checked (`SenderConfig::validate`) where the settings came in.
    pub config: Checked<SenderConfig>,
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

/// A running sender. Every call may come from any thread; the blocking ones are bounded
/// (by their `timeout`, or the configured one) and must not be called from a task of its
/// runtime.
pub struct Sender {
    runtime: Runtime,
    handle: SenderHandle<AnyEnv>,
    ends: SharedStream<RequestEnd>,
    /// Admissions of the requests begun with `begin_reporting_admission`.
    admissions_tx: mpsc::UnboundedSender<Admission>,
    admissions: SharedStream<Admission>,
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
            .field("slots", &self.handle.staging().slots())
            .field("slot_bytes", &self.handle.staging().slot_bytes())
            .finish_non_exhaustive()
    }
}

/// A staging slot the caller holds for one request: write its chunk, then `Sender::add`
/// it. Dropped before that, the slot is handed back.
pub struct StagingGuard {
    handle: SenderHandle<AnyEnv>,
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
        self.handle.staging().slot_bytes()
    }

    /// Runs `f` on the slot's bytes in place.
    pub fn with_slot(&self, f: &mut dyn FnMut(&mut [u8])) {
        self.handle.staging().with_slot(self.slot.0, f);
    }
}

impl Drop for StagingGuard {
    fn drop(&mut self) {
        if self.armed {
            // A request that ended meanwhile released its staging already.
            let _ = self.handle.release(&self.req_id, self.slot);
        }
    }
}

impl Sender {
    /// Starts a sender on `runtime`.
    pub fn start(runtime: &Runtime, settings: SenderSettings) -> Result<Self, EmbedError> {
        let SenderSettings {
            env,
            config,
            staging,
            local_id,
            proxy,
        } = settings;
        let staging_timeout = config.staging_timeout;
        let env = env.into_env()?;
        let handle = runtime.block_on(async move {
            match staging {
                Memory::Allocate { slot_bytes } => {
                    SenderNode::start(env, config, slot_bytes, local_id, proxy).await
                }
                Memory::External(region) => {
                    SenderNode::start_in(env, config, region, local_id, proxy).await
                }
            }
        })?;
        let ends = SharedStream::new(handle.completions());
        let (admissions_tx, admissions) = mpsc::unbounded_channel();
        Ok(Self {
            runtime: runtime.clone(),
            handle,
            ends,
            admissions_tx,
            admissions: SharedStream::new(admissions),
            staging_timeout,
        })
    }

    /// The driver's handle: every client call that needs nothing of this layer (begin,
    /// cancel, submit, the async waits for admission, outcome and release, snapshots).
    pub fn handle(&self) -> &SenderHandle<AnyEnv> {
        &self.handle
    }

    /// The runtime its driver runs on, for a caller that bounds a wait of the handle's with
    /// `Runtime::block_on_for`.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// Connects to a receiver (once per address; later calls return the same id), waiting
    /// at most `timeout`.
    pub fn add_receiver(
        &self,
        addr: ReceiverAddr,
        timeout: Duration,
    ) -> Result<PeerId, EmbedError> {
        self.runtime
            .block_on_for(timeout, self.handle.add_receiver(addr))
            .ok_or(EmbedError::TimedOut(timeout))?
            .map_err(EmbedError::Start)
    }

    /// `begin`, and the request's admission reported once through `admissions` when it
    /// comes, or why it never will (the request failed first): a caller with many requests
    /// waiting learns of each admission as an event instead of asking each in turn. The
    /// report is queued until taken.
    pub fn begin_reporting_admission(&self, spec: RequestSpec) -> Result<(), SendError> {
        let req_id = spec.req_id.clone();
        self.handle.begin(spec)?;
        let (handle, tx) = (self.handle.clone(), self.admissions_tx.clone());
        // Ends with the request: `admitted` answers once it is admitted or has failed.
        self.runtime.spawn(async move {
            let outcome = handle.admitted(&req_id).await;
            let _ = tx.send(Admission { req_id, outcome });
        });
        Ok(())
    }

    /// Up to `max` admissions of requests begun with `begin_reporting_admission`, once the
    /// first came (bound the wait with a timeout around it). Each comes once, to one
    /// caller; dropping the call loses none.
    pub async fn admissions(&self, max: usize) -> Vec<Admission> {
        self.admissions.take(max).await.unwrap_or_default()
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
        self.handle
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
        self.handle
            .allocate_within(req_id, &mut Vec::new(), timeout)
            .await
            .map(|slot| self.guard(req_id, slot))
    }

    fn guard(&self, req_id: &ReqId, slot: StagingSlot) -> StagingGuard {
        StagingGuard {
            handle: self.handle.clone(),
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
        let slot_bytes = self.handle.staging().slot_bytes();
        if len == 0 || len > slot_bytes {
            return Err(SendError::Misuse {
                req_id: guard.req_id.clone(),
                why: format!("a chunk of {len} bytes: chunks are 1..={slot_bytes} bytes"),
            });
        }
        self.handle.staged(guard.slot, len);
        // Added or refused, the slot is the core's to account for now (a refusal cancels
        // the request, which frees its staging).
        guard.armed = false;
        let chunk = ChunkSpec {
            key,
            staging: guard.slot,
            tokens,
            bytes: len as u64,
        };
        self.handle.add(&guard.req_id, chunk)
    }

    /// Up to `max` request ends once the first came (bound the wait with a timeout around
    /// it); empty once the sender has stopped and every end was taken. Every request's end
    /// from the sender's start on, each once, shared by every caller. Dropping the call
    /// loses no end.
    pub async fn ends(&self, max: usize) -> Vec<RequestEnd> {
        self.ends.take(max).await.unwrap_or_default()
    }

    /// The configured bound of `allocate` when it is given none.
    pub fn staging_timeout(&self) -> Duration {
        self.staging_timeout
    }

    /// The staging, for a view the caller keeps: what a program writes chunks through when
    /// kvx allocated the staging (the shm fabric's shared mapping). `None` when it cannot be
    /// viewed (RDMA-registered memory).
    pub fn memory_view(&self) -> Option<MemoryView> {
        MemoryView::of(self.handle.staging())
    }

    /// Stops the driver (`SenderHandle::shutdown`), then waits (at most `within`) until the
    /// notices already due to the proxy (each delivered request's `ProxyNotif`) are
    /// written: true if they were. Call it before the process exits, or the last of them may
    /// go with it.
    pub fn close(&self, within: Duration) -> bool {
        self.runtime
            .block_on_for(within, self.handle.close(within))
            .unwrap_or(false)
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.handle.shutdown();
    }
}

/// The facade's types cross threads (Python calls from any thread).
const _: () = {
    const fn is<T: Send + Sync>() {}
    is::<Sender>();
    is::<StagingGuard>();
};
