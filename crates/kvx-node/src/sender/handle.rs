//! `SenderHandle`: what a prefill calls — begin, await admission, take staging (blocking or
//! async), stage bytes, submit, cancel, await the outcome. It works on the shared core
//! directly and pokes the driver task when the core has something for it to carry out.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use kvx_io::{Env, Fabric, SlotMemory};
use kvx_proto::sender::{ChunkSpec, RequestSpec, SendError, SendFailure, SenderFlow};
use kvx_proto::{PeerId, Placement, ReqId, StagingSlot};
use tokio::sync::{mpsc, watch};

use super::driver::Cmd;
use super::sleepers::{TaskSleeper, Wake};
use super::staging_turn::StagingTurn;
use super::{ReceiverAddr, RequestEnd, Shared};
use crate::start::StartError;

/// Handle to a running sender; clone it freely, use it from any thread.
#[derive(Debug)]
pub struct SenderHandle<E: Env> {
    env: E,
    shared: Arc<Shared>,
    memory: Arc<<E::Fabric as Fabric>::Memory>,
    cmds: mpsc::UnboundedSender<Cmd>,
    /// Closed when the driver task has ended (`close`).
    driver: watch::Receiver<()>,
}

impl<E: Env> Clone for SenderHandle<E> {
    fn clone(&self) -> Self {
        Self {
            env: self.env.clone(),
            shared: self.shared.clone(),
            memory: self.memory.clone(),
            cmds: self.cmds.clone(),
            driver: self.driver.clone(),
        }
    }
}

impl<E: Env> SenderHandle<E> {
    pub(super) fn new(
        env: E,
        shared: Arc<Shared>,
        memory: Arc<<E::Fabric as Fabric>::Memory>,
        cmds: mpsc::UnboundedSender<Cmd>,
        driver: watch::Receiver<()>,
    ) -> Self {
        Self {
            env,
            shared,
            memory,
            cmds,
            driver,
        }
    }
}

impl<E: Env> SenderHandle<E> {
    fn now(&self) -> kvx_proto::Instant {
        self.env.now()
    }

    /// Whether this sender has stopped: shut down, or its driver task ended (it returned,
    /// panicked, or its runtime went away), so nothing it is asked can happen any more.
    fn stopped(&self, core: &super::Core) -> bool {
        core.shutdown || self.driver.has_changed().is_err()
    }

    /// Resolves once the driver task has ended.
    async fn driver_ended(&self) {
        let mut driver = self.driver.clone();
        while driver.changed().await.is_ok() {}
    }

    /// Connects to a receiver (once; later calls return the same id). `StartError::Stopped`
    /// once the driver has ended.
    pub async fn add_receiver(&self, addr: ReceiverAddr) -> Result<PeerId, StartError> {
        // Always through the driver: only it knows whether a known receiver's channel is
        // up yet, and a caller must not get the id before it is.
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.cmds
            .send(Cmd::AddReceiver(addr, tx))
            .map_err(|_| StartError::Stopped)?;
        rx.await.map_err(|_| StartError::Stopped)?
    }

    /// Begins a request: its admission probe goes out; await `admitted` before staging.
    /// `Failed(_, Stopped)` once the sender has stopped: no driver would send it.
    pub fn begin(&self, spec: RequestSpec) -> Result<(), SendError> {
        let now = self.now();
        {
            let mut core = self.shared.lock();
            let req_id = spec.req_id.clone();
            if self.stopped(&core) {
                return Err(SendError::Failed(req_id, SendFailure::Stopped));
            }
            core.flow.handle_begin(now, spec)?;
            core.begun_at.insert(req_id, now);
        }
        self.shared.poke.notify_one();
        Ok(())
    }

    /// Waits until the receiver admitted `req_id` (or it ended: delivered counts as
    /// admitted).
    pub async fn admitted(&self, req_id: &ReqId) -> Result<(), SendFailure> {
        self.wait_for(req_id, |flow| {
            let admitted = flow.is_admitted(req_id).then_some(Ok(()));
            flow.outcome(req_id).or(admitted)
        })
        .await
    }

    /// Waits until `req_id` was delivered (its ProxyNotif sent) or failed. The outcome stays
    /// readable for `SenderConfig::outcomes_kept` ended requests.
    pub async fn outcome(&self, req_id: &ReqId) -> Result<(), SendFailure> {
        self.wait_for(req_id, |flow| flow.outcome(req_id)).await
    }

    /// With caller staging (`SenderConfig::staging_placement = Caller`): waits until
    /// `req_id` reads none of the caller's slots any more — delivered, or failed and drained
    /// (its last posted write completed: `SenderEvent::Drained`) — and says how it ended.
    /// Until then the caller must not change or free the memory its chunks named. With
    /// kvx's pool it is `outcome`, once the request's writes are done.
    pub async fn released(&self, req_id: &ReqId) -> Result<(), SendFailure> {
        self.wait_for(req_id, |flow| {
            let outcome = flow.outcome(req_id)?;
            // kvx's own staging is not the caller's to reuse: nothing to wait for (and no
            // `Drained` would wake the wait).
            let callers = flow.config().staging_placement == Placement::Caller;
            (!callers || !flow.is_tracked(req_id)).then_some(outcome)
        })
        .await
    }

    /// With caller staging, the submitted chunks that read `slot` now (`SenderFlow::
    /// staging_readers`): the application must not change it while any does.
    pub fn staging_readers(&self, slot: StagingSlot) -> u32 {
        self.shared.lock().flow.staging_readers(slot)
    }

    /// Fabric writes this sender posted so far, and their bytes: a run of chunks
    /// consecutive in staging and in the receiver's buffer is one write where the fabric
    /// carries runs (TCP), so writes ≤ chunks written.
    pub fn write_counts(&self) -> WriteCounts {
        WriteCounts {
            writes: self.shared.writes_posted.load(Ordering::Relaxed),
            bytes: self.shared.write_bytes_posted.load(Ordering::Relaxed),
        }
    }

    /// Whose memory the chunks are read from (`SenderConfig::staging_placement`).
    pub fn staging_placement(&self) -> Placement {
        self.shared.lock().flow.config().staging_placement
    }

    /// Waits until `settled` says how the wait ends; `Stopped` once the sender has stopped
    /// first, and misuse for a request the sender does not know.
    async fn wait_for(
        &self,
        req_id: &ReqId,
        settled: impl Fn(&SenderFlow) -> Option<Result<(), SendFailure>>,
    ) -> Result<(), SendFailure> {
        // Woken by an event of this request, or by one that concerns every waiter
        // (`sleepers.rs`).
        let mut sleeper = TaskSleeper::new(&self.shared);
        let changed = std::future::poll_fn(|cx| {
            let mut core = self.shared.lock();
            sleeper.leave(&mut core.sleepers);
            if let Some(settled) = settled(&core.flow) {
                return Poll::Ready(settled);
            }
            if !core.flow.knows(req_id) {
                return Poll::Ready(Err(SendFailure::Misuse(format!(
                    "request {req_id} is not known"
                ))));
            }
            if self.stopped(&core) {
                return Poll::Ready(Err(SendFailure::Stopped));
            }
            let wake = Wake::Task(cx.waker().clone());
            sleeper.sleeper = Some(core.sleepers.join_request(req_id, wake));
            Poll::Pending
        });
        tokio::select! {
            result = changed => result,
            // A driver that ended without a shutdown (a panic, its runtime dropped)
            // changes no status: its end is heard here.
            () = self.driver_ended() => Err(SendFailure::Stopped),
        }
    }

    /// Takes a staging slot for `req_id`, blocking the calling thread for at most `timeout`
    /// (`SendError::StagingTimedOut` then). For prefill worker threads; a cancel of the
    /// request wakes it with an error. Never call it from an async task. The slot is the
    /// caller's until it adds, submits or releases it, even after the request fails (the
    /// failed request's add, submit or release then hands it back): a slot dropped silently
    /// is lost to the pool.
    ///
    /// `held` is the batch the caller is building: chunks it staged and has not submitted.
    /// When they alone stand between it and a slot (every slot holds an unsubmitted chunk),
    /// they are submitted as a batch that is not the last and `held` is emptied
    /// (`SenderFlow::allocate_or_submit`); push the new slot's chunk onto `held` and submit
    /// it when the batch is full. Pass an empty vector when not batching.
    pub fn allocate_blocking(
        &self,
        req_id: &ReqId,
        held: &mut Vec<ChunkSpec>,
        timeout: Duration,
    ) -> Result<StagingSlot, SendError> {
        // The Env's clock, as everywhere in the drivers (a simulated one in the simulation).
        let deadline = self.now() + timeout;
        let mut turn = StagingTurn::new(&self.shared);
        let mut core = self.shared.lock();
        loop {
            if self.stopped(&core) {
                turn.leave(&mut core);
                return Err(SendError::Failed(req_id.clone(), SendFailure::Stopped));
            }
            if let Some(result) = turn.attempt(&mut core, self.now(), req_id, held) {
                return result;
            }
            let left = deadline.saturating_since(self.now());
            if left.is_zero() {
                turn.leave(&mut core);
                return Err(SendError::StagingTimedOut(timeout));
            }
            // Woken by its turn (`sleepers.rs`), or by the bound.
            let cv = Arc::new(std::sync::Condvar::new());
            let holding = !held.is_empty();
            let wake = Wake::Thread(cv.clone());
            let sleeper = core.sleepers.join(turn.waiting(), holding, wake);
            core = cv
                .wait_timeout(core, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            core.sleepers.leave(&sleeper);
        }
    }

    /// The async form of `allocate_blocking`, bounded by the configured `staging_timeout`.
    pub async fn allocate(
        &self,
        req_id: &ReqId,
        held: &mut Vec<ChunkSpec>,
    ) -> Result<StagingSlot, SendError> {
        let timeout = self.shared.lock().flow.config().staging_timeout;
        self.allocate_within(req_id, held, timeout).await
    }

    /// `allocate`, bounded by `timeout` instead of the configured `staging_timeout`.
    pub async fn allocate_within(
        &self,
        req_id: &ReqId,
        held: &mut Vec<ChunkSpec>,
        timeout: Duration,
    ) -> Result<StagingSlot, SendError> {
        let mut turn = StagingTurn::new(&self.shared);
        // Registered by turn as a blocked thread is (`sleepers.rs`): a freed slot wakes the
        // call whose turn it is, not every waiting one.
        let mut sleeper = TaskSleeper::new(&self.shared);
        let attempt = std::future::poll_fn(|cx| {
            let now = self.now();
            let mut core = self.shared.lock();
            sleeper.leave(&mut core.sleepers);
            if self.stopped(&core) {
                turn.leave(&mut core);
                return Poll::Ready(Err(SendError::Failed(req_id.clone(), SendFailure::Stopped)));
            }
            if let Some(result) = turn.attempt(&mut core, now, req_id, held) {
                return Poll::Ready(result);
            }
            let wake = Wake::Task(cx.waker().clone());
            let holding = !held.is_empty();
            sleeper.sleeper = Some(core.sleepers.join(turn.waiting(), holding, wake));
            Poll::Pending
        });
        let deadline = self.now() + timeout;
        tokio::select! {
            result = attempt => result,
            () = self.driver_ended() => {
                Err(SendError::Failed(req_id.clone(), SendFailure::Stopped))
            }
            () = self.env.sleep_until(deadline) => Err(SendError::StagingTimedOut(timeout)),
        }
        // `sleeper` and `turn` leave the queues here if the call ended while waiting.
    }

    /// Copies a chunk's bytes into a staging slot the caller holds (and computes its
    /// checksum, when enabled).
    pub fn stage(&self, slot: StagingSlot, bytes: &[u8]) {
        self.memory.write_slot(slot.0, bytes);
        self.shared.staged(slot.0, bytes.len(), &*self.memory);
    }

    /// Lets `fill` write a chunk of `len` bytes straight into a staging slot the caller holds
    /// (no intermediate copy where the memory allows it), then computes its checksum.
    pub fn stage_with(&self, slot: StagingSlot, len: usize, fill: &mut dyn FnMut(&mut [u8])) {
        self.memory.fill_slot(slot.0, len, fill);
        self.shared.staged(slot.0, len, &*self.memory);
    }

    /// The staging memory, for callers that fill slots in place themselves. A slot written
    /// after `stage`/`stage_with` without staging it again keeps its old checksum, and the
    /// receiver refuses the chunk as corrupt: stage again after every change.
    pub fn staging(&self) -> &Arc<<E::Fabric as Fabric>::Memory> {
        &self.memory
    }

    /// Submits staged chunks as one batch, after the request's pending batch (`add`). Each
    /// chunk's `bytes` is set to the length staged in its slot (`stage`, `stage_with`,
    /// `staged`; the slot's size if none was): that is what its write brings, and the
    /// receiver lands a chunk only at its declared length.
    pub fn submit(
        &self,
        req_id: &ReqId,
        mut chunks: Vec<ChunkSpec>,
        is_last: bool,
    ) -> Result<(), SendError> {
        for c in &mut chunks {
            if let Some(len) = self.shared.lens.get(c.staging.0 as usize) {
                c.bytes = len.load(std::sync::atomic::Ordering::Acquire) as u64;
            }
        }
        let now = self.now();
        let result = self
            .shared
            .lock()
            .flow
            .handle_submit(now, req_id, chunks, is_last);
        self.shared.poke.notify_one();
        if result.is_err() {
            // A failed request's slots came back to the pool (S12): a waiting call may take
            // them.
            self.shared.wake_allocators();
        }
        result
    }

    /// Caller staging (`SenderConfig::staging_placement = Caller`): submits one batch of
    /// `req_id`'s chunks read straight from the caller's own staging slots, where their
    /// bytes already are (`is_last`: it completes the request). Each chunk is its whole
    /// slot, so that several requests may name one slot at once and agree on what it holds;
    /// its checksum is taken now, from the slot. The slots must not change until `released`
    /// says the request reads them no more. Refused, touching nothing, on a sender that
    /// stages in kvx's pool (where the slots belong to the requests that took them) and for
    /// a slot out of range.
    pub fn submit_slots(
        &self,
        req_id: &ReqId,
        chunks: Vec<SlotChunk>,
        is_last: bool,
    ) -> Result<(), SendError> {
        let misuse = |why: String| SendError::Misuse {
            req_id: req_id.clone(),
            why,
        };
        if self.staging_placement() != Placement::Caller {
            return Err(misuse(
                "submit_slots is for caller staging (staging_placement = caller): this \
                 sender stages in kvx's pool (allocate, add, submit)"
                    .to_owned(),
            ));
        }
        let slots = self.memory.slots();
        if let Some(c) = chunks.iter().find(|c| c.slot.0 >= slots) {
            return Err(misuse(format!(
                "chunk {} in slot {}: the staging has slots 0..{slots}",
                c.key, c.slot.0
            )));
        }
        let slot_bytes = self.memory.slot_bytes();
        let specs = chunks
            .into_iter()
            .map(|c| {
                self.staged(c.slot, slot_bytes);
                ChunkSpec {
                    key: c.key,
                    staging: c.slot,
                    tokens: c.tokens,
                    bytes: slot_bytes as u64,
                }
            })
            .collect();
        self.submit(req_id, specs, is_last)
    }

    /// Adds a chunk staged in a slot the caller holds for `req_id` to the request's pending
    /// batch, which its next `submit` (or `submit_added`) sends first
    /// (`SenderFlow::handle_add`). The chunk's `bytes` is set to the length staged in its
    /// slot, as `submit` does. Stage the slot first: its checksum is taken then. When
    /// allocate calls wait and only unsubmitted chunks hold staging, the core submits every
    /// pending batch now.
    pub fn add(&self, req_id: &ReqId, mut chunk: ChunkSpec) -> Result<(), SendError> {
        if let Some(len) = self.shared.lens.get(chunk.staging.0 as usize) {
            chunk.bytes = len.load(std::sync::atomic::Ordering::Acquire) as u64;
        }
        let now = self.now();
        let mut core = self.shared.lock();
        if self.stopped(&core) {
            return Err(SendError::Failed(req_id.clone(), SendFailure::Stopped));
        }
        let flushed = core.flow.stats().flushed_batches;
        let result = core.flow.handle_add(now, req_id, chunk);
        let poke = result.is_err() || core.flow.stats().flushed_batches != flushed;
        drop(core);
        if poke {
            self.shared.poke.notify_one();
        }
        if result.is_err() {
            // A failed request's slot came back to the pool (S12): a waiting call may take it.
            self.shared.wake_allocators();
        }
        result
    }

    /// Submits `req_id`'s pending batch (`add`); `is_last`: it completes the request. An
    /// empty batch that is not the last is a no-op.
    pub fn submit_added(&self, req_id: &ReqId, is_last: bool) -> Result<(), SendError> {
        let now = self.now();
        let result = self.shared.lock().flow.submit_added(now, req_id, is_last);
        self.shared.poke.notify_one();
        result
    }

    /// From now on, every request's end (delivered, or failed with its reason) in the order
    /// they end: one stream that any number of requests share, for callers that poll ends in
    /// batches rather than await each request's `outcome`. A later call replaces the stream
    /// (the earlier one hears nothing more). Requests that ended before the call are not in
    /// it; `outcome` still tells theirs while it is kept.
    pub fn completions(&self) -> mpsc::UnboundedReceiver<RequestEnd> {
        let (tx, rx) = mpsc::unbounded_channel();
        *self
            .shared
            .completions
            .lock()
            .unwrap_or_else(|poison| poison.into_inner()) = Some(tx);
        rx
    }

    /// Marks `len` bytes of `slot` as the chunk it holds, after the caller wrote them in
    /// place through the staging memory (`staging`): records the length and computes the
    /// checksum the receiver checks. Call it after the last write to the slot, before
    /// `submit`.
    pub fn staged(&self, slot: StagingSlot, len: usize) {
        self.shared.staged(slot.0, len, &*self.memory);
    }

    /// Hands back a staging slot the caller took for `req_id` and will not submit (a guard
    /// dropped unused); waiting allocate calls are woken.
    pub fn release(&self, req_id: &ReqId, slot: StagingSlot) -> Result<(), SendError> {
        let result = self.shared.lock().flow.release_staging(req_id, slot);
        self.shared.wake_allocators();
        result
    }

    /// Aborts a request from any state; waiters get an error.
    pub fn cancel(&self, req_id: &ReqId) -> Result<(), SendError> {
        let now = self.now();
        let result = self.shared.lock().flow.handle_cancel(now, req_id);
        self.shared.poke.notify_one();
        result
    }

    /// Chunks in `req_id`'s pending batch (`add`) now: 0 once they were submitted, by the
    /// caller or by the core (a snapshot).
    pub fn added_count(&self, req_id: &ReqId) -> usize {
        self.shared.lock().flow.added_count(req_id)
    }

    /// Staging slots free now (a snapshot: other callers may take them first).
    pub fn staging_free(&self) -> u32 {
        self.shared.lock().flow.staging_free()
    }

    /// Stops the driver as `shutdown` does and waits, at most `within`, until it has ended:
    /// true if it did. A driver ends once the notices already due (a delivered request's
    /// `ProxyNotif`) are written to the proxy, so a process that calls this before it exits
    /// does not take its last notices with it.
    pub async fn close(&self, within: Duration) -> bool {
        self.shutdown();
        let deadline = self.now() + within;
        tokio::select! {
            () = self.driver_ended() => true,
            () = self.env.sleep_until(deadline) => false,
        }
    }

    /// Stops the driver task; waiters get `SendFailure::Stopped`. It goes on writing the notices
    /// already due to the proxy (for at most `NOTICE_LINGER`); `close` waits for that.
    pub fn shutdown(&self) {
        self.shared.lock().shutdown = true;
        self.shared.poke.notify_one();
        self.shared.wake_all();
    }
}

/// One chunk of a batch read straight from the caller's own staging
/// (`SenderHandle::submit_slots`): the whole of its slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotChunk {
    /// The caller's slot its bytes are in.
    pub slot: StagingSlot,
    /// Names it to the receiver.
    pub key: String,
    /// The tokens it covers.
    pub tokens: u64,
}

/// `SenderHandle::write_counts`: fabric writes posted and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteCounts {
    /// Fabric writes posted (a run counts once where the fabric carries runs).
    pub writes: u64,
    /// Bytes those writes carry.
    pub bytes: u64,
}
