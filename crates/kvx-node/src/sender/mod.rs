//! The sender driver. The `SenderFlow` state machine sits behind a mutex shared by the
//! driver task and the handles: prefill threads call `allocate_blocking`, `stage`, `submit`
//! and `cancel` directly (no round trip through the task), and the task carries out what the
//! core asks for — messages to receivers and the proxy, writes to post — and feeds it
//! replies, completions and timers.
//!
//! Wake-ups: every handle call that changes the core pokes the task (`tokio::sync::Notify`,
//! which keeps a permit, so none is lost). Waiters are woken by what they wait for
//! (`sleepers.rs`), so that a completed write does not wake every thread blocked on the
//! sender: a request's event wakes the calls waiting for that request; staging that may
//! have freed (a write completed, a slot released, the oldest waiter served) wakes only
//! the allocate calls whose turn it is, blocking or async (`Shared::wake_allocators`); a
//! failure, a cancel or a stop wakes everyone (`Shared::wake_all`), so a cancel wakes a
//! thread blocked in `allocate_blocking` with an error.
//!
//! - `mod.rs`: `SenderNode::start`, and what the task and the handles share (`Shared`).
//! - `handle.rs`: `SenderHandle`, the calls a prefill makes.
//! - `driver.rs`: the task's loop: transport and fabric events into the core, its
//!   transmits, writes and events out; `driver/fabric_link.rs`: fabric connections, and
//!   writes parked while one is replaced.
//! - `staging_turn.rs`: an allocate call's wait for staging (the order is the core's).
//! - `sleepers.rs`: the calls waiting on the sender, each woken by what it waits for.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kvx_io::{Env, ExternalRegion, Fabric, SlotMemory, Transport};
use kvx_proto::sender::{SenderEvent, SenderFlow};
use kvx_proto::{Checked, IntoChecked, PeerId, SenderConfig};
use tokio::sync::{mpsc, Notify};

use crate::start::StartError;
use driver::Driver;
pub use handle::{SenderHandle, SlotChunk, WriteCounts};
use sleepers::Wakes;

mod driver;
mod handle;
mod sleepers;
mod staging_turn;

/// How long a stopping sender goes on writing the notices already due to the proxy (a
/// delivered request's `ProxyNotif`) before it ends without them.
pub const NOTICE_LINGER: std::time::Duration = std::time::Duration::from_secs(5);

/// Where a receiver (one TP rank of a decode worker) listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReceiverAddr {
    /// Its alloc channel (LMCache: `tcp://host:alloc_port[rank]`).
    pub alloc: String,
    /// Its fabric endpoint.
    pub fabric: String,
}

/// What the driver task and the handles share under one lock: the core (which also
/// remembers each request's outcome and the staging order) and the receivers connected.
#[derive(Debug)]
struct Core {
    flow: SenderFlow,
    /// When each request not yet admitted began (its admission wait, a metric); bounded by
    /// the requests the flow tracks.
    begun_at: BTreeMap<kvx_proto::ReqId, kvx_proto::Instant>,
    receivers: BTreeMap<ReceiverAddr, PeerId>,
    /// The calls waiting on the sender: allocate calls, `admitted`/`outcome` waits.
    sleepers: sleepers::Sleepers,
    next_peer: u64,
    shutdown: bool,
}

#[derive(Debug)]
struct Shared {
    core: Mutex<Core>,
    /// Pokes the driver task after a handle call changed the core.
    poke: Notify,
    /// Bytes staged in each staging slot (a partial last chunk writes fewer).
    lens: Vec<AtomicUsize>,
    /// The checksum of what each staging slot holds, with `CHECKSUM_SET` or-ed in once one
    /// is computed (`SenderConfig::checksums`).
    checksums: Vec<AtomicU64>,
    compute_checksums: bool,
    /// Fabric writes posted and their bytes (`SenderHandle::write_counts`).
    writes_posted: AtomicU64,
    write_bytes_posted: AtomicU64,
    /// Where the driver sends each request's end, once something subscribed
    /// (`SenderHandle::completions`).
    completions: Mutex<Option<mpsc::UnboundedSender<RequestEnd>>>,
}

/// How one request ended, as `SenderHandle::completions` reports it: exactly one per request
/// begun after the subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestEnd {
    /// The request.
    pub req_id: kvx_proto::ReqId,
    /// `Ok`: delivered (every chunk written, the proxy notified); `Err`: why it failed.
    pub outcome: Result<(), kvx_proto::sender::SendFailure>,
}

/// Marks a `Shared::checksums` entry as computed.
const CHECKSUM_SET: u64 = 1 << 32;

impl Shared {
    /// Wakes the allocate calls waiting for staging: a slot may be free, or the turn may
    /// have passed to them. Takes the core's lock: never call it holding that.
    fn wake_allocators(&self) {
        let wakes = {
            let core = self.lock();
            core.sleepers.for_staging(&core.flow)
        };
        wakes.wake();
    }

    /// Wakes the waiters that the core's events concern (`sleepers.rs`): the calls waiting
    /// for an admitted or delivered request's state; when a request was admitted, the
    /// allocate calls waiting for their request's admission; when one was delivered, those
    /// whose staging turn it is, if a slot is free (a completed write frees its slot and
    /// wakes them then: this is only a second look); every waiting call when a request
    /// failed (its own calls must answer with the failure, and its slots come back) or a
    /// connection was reset. Takes the core's lock: never call it holding that.
    fn wake_for(&self, events: &[SenderEvent]) {
        let wakes = {
            let core = self.lock();
            let mut wakes = Wakes::default();
            for ev in events {
                wakes = wakes.and(match ev {
                    SenderEvent::Admitted { req_id } => core
                        .sleepers
                        .for_request(req_id)
                        .and(core.sleepers.unadmitted()),
                    SenderEvent::Delivered { req_id } => core
                        .sleepers
                        .for_request(req_id)
                        .and(core.sleepers.for_staging(&core.flow)),
                    SenderEvent::Drained { req_id } => core.sleepers.for_request(req_id),
                    SenderEvent::Failed { .. }
                    | SenderEvent::ChannelReset { .. }
                    | SenderEvent::FabricStalled { .. } => core.sleepers.all(),
                });
            }
            wakes
        };
        wakes.wake();
    }

    /// Wakes every waiter: a request was cancelled, or the sender stops. Takes the core's
    /// lock: never call it holding that.
    fn wake_all(&self) {
        let wakes = self.lock().sleepers.all();
        wakes.wake();
    }

    /// Records what `slot` now holds: its length and, when enabled, its checksum (computed
    /// here, while the bytes just written are still in the CPU's caches).
    fn staged(&self, slot: u32, len: usize, memory: &dyn SlotMemory) {
        self.lens[slot as usize].store(len, Ordering::Release);
        let checksum = if self.compute_checksums {
            let mut sum = 0;
            memory.inspect_slot(slot, len, &mut |bytes| sum = kvx_io::chunk_checksum(bytes));
            CHECKSUM_SET | u64::from(sum)
        } else {
            0
        };
        self.checksums[slot as usize].store(checksum, Ordering::Release);
    }

    /// The checksum of what `slot` holds, if one was computed.
    fn checksum(&self, slot: u32) -> Option<u32> {
        let v = self.checksums[slot as usize].load(Ordering::Acquire);
        (v & CHECKSUM_SET != 0).then_some(v as u32)
    }

    /// `writes` fabric writes of `bytes` in all were posted.
    fn count_writes(&self, writes: u64, bytes: u64) {
        self.writes_posted.fetch_add(writes, Ordering::Relaxed);
        self.write_bytes_posted.fetch_add(bytes, Ordering::Relaxed);
    }
}

impl Shared {
    /// Reports a request's end to the subscriber, if any.
    fn complete(&self, completion: RequestEnd) {
        let subscriber = self
            .completions
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if let Some(tx) = subscriber.as_ref() {
            // A subscriber that went away simply hears nothing more.
            let _ = tx.send(completion);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

/// Starts senders.
#[derive(Debug)]
pub struct SenderNode;

impl SenderNode {
    /// Starts a sender whose identity is `local_id`, with `proxy` as its notice endpoint
    /// (None: notices are dropped, for tests without a proxy), and staging of
    /// `cfg.staging_slots × chunk_bytes` that its fabric allocates.
    pub async fn start<E: Env>(
        env: E,
        cfg: impl IntoChecked<SenderConfig>,
        chunk_bytes: usize,
        local_id: String,
        proxy: Option<String>,
    ) -> Result<SenderHandle<E>, StartError> {
        // Refused before any memory is allocated or taken.
        let cfg = cfg.into_checked()?;
        let geometry = crate::start::configured_geometry(cfg.staging_slots, chunk_bytes)?;
        let memory = env.fabric().allocate_staging(geometry)?;
        Self::start_over(env, cfg, memory, local_id, proxy).await
    }

    /// `start`, with staging in memory the caller owns (a framework's pinned buffer, a
    /// Python object's memory): one staging slot per whole slot of the region, which must
    /// be `cfg.staging_slots`. A fabric that needs memory of its own kind (shared memory)
    /// refuses it (`FabricError::ExternalMemory`).
    pub async fn start_in<E: Env>(
        env: E,
        cfg: impl IntoChecked<SenderConfig>,
        staging: ExternalRegion,
        local_id: String,
        proxy: Option<String>,
    ) -> Result<SenderHandle<E>, StartError> {
        // Refused before any memory is allocated or taken.
        let cfg = cfg.into_checked()?;
        crate::start::lent_fits("staging", &staging, cfg.staging_slots)?;
        let memory = env.fabric().staging_in(staging)?;
        Self::start_over(env, cfg, memory, local_id, proxy).await
    }

    async fn start_over<E: Env>(
        env: E,
        cfg: Checked<SenderConfig>,
        memory: Arc<<E::Fabric as Fabric>::Memory>,
        local_id: String,
        proxy: Option<String>,
    ) -> Result<SenderHandle<E>, StartError> {
        // Before connecting to the proxy, which may take up to the connect timeout.
        crate::metrics::register_sender(cfg.staging_slots);
        let (staging_slots, checksums) = (cfg.staging_slots, cfg.checksums);
        let flow = SenderFlow::from_checked(cfg);
        let chunk_bytes = memory.slot_bytes();
        let sink = match &proxy {
            Some(endpoint) => Some(env.transport().notify_sink(endpoint).await?),
            None => None,
        };
        let shared = Arc::new(Shared {
            core: Mutex::new(Core {
                flow,
                begun_at: BTreeMap::new(),
                receivers: BTreeMap::new(),
                sleepers: sleepers::Sleepers::default(),
                next_peer: 0,
                shutdown: false,
            }),
            poke: Notify::new(),
            lens: (0..staging_slots)
                .map(|_| AtomicUsize::new(chunk_bytes))
                .collect(),
            checksums: (0..staging_slots).map(|_| AtomicU64::new(0)).collect(),
            compute_checksums: checksums,
            writes_posted: AtomicU64::new(0),
            write_bytes_posted: AtomicU64::new(0),
            completions: Mutex::new(None),
        });
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (alive, driver_ended) = tokio::sync::watch::channel(());
        let handle = SenderHandle::new(
            env.clone(),
            shared.clone(),
            memory.clone(),
            cmd_tx.clone(),
            driver_ended,
        );
        let driver =
            Driver::new(env.clone(), shared, memory, local_id, sink, cmd_rx, cmd_tx).holding(alive);
        env.spawn(driver.run());
        Ok(handle)
    }
}
