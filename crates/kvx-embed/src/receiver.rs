//! The receiver, for an embedding program: one type whatever the transport and fabric, on a
//! receive buffer of kvx's allocation or of memory the caller owns.
//!
//! The decoder takes ready requests as `ReadLease`s (`next_ready`): a lease pins the
//! request's slots until it is consumed, even if the sender cancels meanwhile; the decoder
//! reads the chunks in place (`with_chunk`, or its own view of its memory) and consumes the
//! lease, which frees the slots for other requests. A lease dropped unconsumed is consumed
//! then, so no slot is ever leaked.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use kvx_io::{Env, SlotMemory};
use kvx_node::{
    BufferSnapshot, ChunkReader, ReadyRequest, ReceiverNode, ReceiverNotice, StartError,
};
use kvx_proto::receiver::{ChunkLayout, ConsumeError};
use kvx_proto::{ReceiverConfig, ReqKey, SlotIndex};
use tokio::sync::{mpsc, oneshot};

use crate::choice::{EnvChoice, EnvVisitor};
use crate::memory::{Memory, MemoryView};
use crate::runtime::Runtime;
use crate::EmbedError;

/// What a receiver is started with.
#[derive(Debug)]
pub struct ReceiverSettings {
    /// Transport and fabric.
    pub env: EnvChoice,
    /// The ledger's limits and timers (`buffer_slots` is the buffer's slot count).
    pub config: ReceiverConfig,
    /// Its receive buffer.
    pub buffer: Memory,
    /// Where its alloc channel binds (`tcp://host:port`; port 0 lets the OS pick).
    pub alloc_endpoint: String,
    /// Where its fabric listens.
    pub fabric_endpoint: String,
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// `ChunkReader<M>` for any memory `M`, as one type.
trait ReaderApi: Send + Sync {
    fn acquire<'a>(
        &'a self,
        key: &'a ReqKey,
    ) -> BoxFuture<'a, Result<Vec<SlotIndex>, ConsumeError>>;
    fn consume<'a>(&'a self, key: &'a ReqKey) -> BoxFuture<'a, Result<(), ConsumeError>>;
    fn consume_queued(&self, key: &ReqKey) -> bool;
    fn snapshot(&self) -> BoxFuture<'_, Result<BufferSnapshot, ConsumeError>>;
    fn shutdown(&self) -> BoxFuture<'_, ()>;
    fn inspect(&self, slot: SlotIndex, f: &mut dyn FnMut(&[u8]));
    fn memory_view(&self) -> Option<MemoryView>;
    fn slots(&self) -> u32;
    fn slot_bytes(&self) -> usize;
}

impl<M: SlotMemory> ReaderApi for ChunkReader<M> {
    fn acquire<'a>(
        &'a self,
        key: &'a ReqKey,
    ) -> BoxFuture<'a, Result<Vec<SlotIndex>, ConsumeError>> {
        Box::pin(ChunkReader::acquire(self, key))
    }
    fn consume<'a>(&'a self, key: &'a ReqKey) -> BoxFuture<'a, Result<(), ConsumeError>> {
        Box::pin(ChunkReader::consume(self, key))
    }
    fn consume_queued(&self, key: &ReqKey) -> bool {
        ChunkReader::consume_queued(self, key)
    }
    fn snapshot(&self) -> BoxFuture<'_, Result<BufferSnapshot, ConsumeError>> {
        Box::pin(ChunkReader::snapshot(self))
    }
    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(ChunkReader::shutdown(self))
    }
    fn inspect(&self, slot: SlotIndex, f: &mut dyn FnMut(&[u8])) {
        let memory = self.memory();
        memory.inspect_slot(slot.0, memory.slot_bytes(), f);
    }
    fn memory_view(&self) -> Option<MemoryView> {
        MemoryView::of(self.memory())
    }
    fn slots(&self) -> u32 {
        self.memory().slots()
    }
    fn slot_bytes(&self) -> usize {
        self.memory().slot_bytes()
    }
}

struct Started {
    reader: Box<dyn ReaderApi>,
    notices: mpsc::UnboundedReceiver<ReceiverNotice>,
    alloc_endpoint: String,
    fabric_endpoint: String,
}

struct Start {
    settings: ReceiverSettings,
}

impl EnvVisitor for Start {
    type Output = BoxFuture<'static, Result<Started, StartError>>;
    fn visit<E: Env>(self, env: E) -> Self::Output {
        let ReceiverSettings {
            config,
            buffer,
            alloc_endpoint,
            fabric_endpoint,
            ..
        } = self.settings;
        Box::pin(async move {
            let handle = match buffer {
                Memory::Allocate { slot_bytes } => {
                    ReceiverNode::start(env, config, slot_bytes, &alloc_endpoint, &fabric_endpoint)
                        .await?
                }
                Memory::External(region) => {
                    ReceiverNode::start_in(env, config, region, &alloc_endpoint, &fabric_endpoint)
                        .await?
                }
            };
            let alloc_endpoint = handle.alloc_endpoint().to_owned();
            let fabric_endpoint = handle.fabric_endpoint().to_owned();
            let (notices, reader) = handle.into_parts();
            Ok(Started {
                reader: Box::new(reader),
                notices,
                alloc_endpoint,
                fabric_endpoint,
            })
        })
    }
}

/// A running receiver. Every call may come from any thread; the blocking ones are bounded
/// and must not be called from a task of its runtime.
pub struct Receiver {
    runtime: Runtime,
    reader: Arc<dyn ReaderApi>,
    notices: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<ReceiverNotice>>>,
    /// Leases taken for callers that stopped waiting before they got them: the next caller
    /// gets them first, so that a ready request is never released unread because the call
    /// that took it off the stream was cancelled.
    returned: Arc<Returned>,
    alloc_endpoint: String,
    fabric_endpoint: String,
}

/// Leases given back, for the next caller; a caller already waiting for the stream hears of
/// them (`arrived`), since they may come while it waits.
#[derive(Default)]
struct Returned {
    leases: Mutex<VecDeque<ReadLease>>,
    arrived: tokio::sync::Notify,
}

impl Returned {
    fn give_back(&self, leases: Vec<ReadLease>) {
        if leases.is_empty() {
            return;
        }
        self.lock().extend(leases);
        self.arrived.notify_waiters();
    }

    /// Up to `max` leases given back, oldest first.
    fn take(&self, max: usize) -> Vec<ReadLease> {
        let mut leases = self.lock();
        let n = leases.len().min(max);
        leases.drain(..n).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<ReadLease>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The leases of ready requests already off the stream, on their way from the task that
/// leases them to the caller. Dropped before they arrive (the caller stopped waiting), it
/// closes the way and puts back whatever had arrived: the task then puts back the rest.
/// What the wait for a ready request found first.
enum First {
    /// Leases a caller gave back, handed out again first.
    GivenBack(Vec<ReadLease>),
    /// A request's ready notice, and the stream of them, held for the leasing.
    Notice(
        ReceiverNotice,
        tokio::sync::OwnedMutexGuard<mpsc::UnboundedReceiver<ReceiverNotice>>,
    ),
    /// The notice stream ended: the driver is gone.
    Stopped,
}

struct Handover {
    leases: oneshot::Receiver<Vec<ReadLease>>,
    returned: Arc<Returned>,
}

impl Future for Handover {
    type Output = Vec<ReadLease>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Vec<ReadLease>> {
        // An error: the leasing task panicked; its leases were released as it unwound.
        Pin::new(&mut self.leases)
            .poll(cx)
            .map(|got| got.unwrap_or_default())
    }
}

impl Drop for Handover {
    fn drop(&mut self) {
        self.leases.close();
        if let Ok(leases) = self.leases.try_recv() {
            self.returned.give_back(leases);
        }
    }
}

/// Leases `first` and the notices queued behind it, up to `max` ready requests; the stream
/// is free for other callers once this returns.
async fn lease_notices(
    runtime: &Runtime,
    reader: &Arc<dyn ReaderApi>,
    first: ReceiverNotice,
    mut notices: tokio::sync::OwnedMutexGuard<mpsc::UnboundedReceiver<ReceiverNotice>>,
    max: usize,
) -> Vec<ReadLease> {
    let mut out = Vec::new();
    let mut next = Some(first);
    while let Some(notice) = next.take() {
        if let ReceiverNotice::Ready(ready) = notice {
            if let Ok(slots) = reader.acquire(&ready.key).await {
                out.push(ReadLease {
                    runtime: runtime.clone(),
                    reader: reader.clone(),
                    ready,
                    slots,
                    consumed: false,
                });
            }
        }
        if out.len() < max {
            next = notices.try_recv().ok();
        }
    }
    out
}

impl fmt::Debug for Receiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("alloc_endpoint", &self.alloc_endpoint)
            .field("fabric_endpoint", &self.fabric_endpoint)
            .finish_non_exhaustive()
    }
}

/// A ready request the decoder holds: its slots stay put until `consume` (or the lease is
/// dropped, which consumes it).
pub struct ReadLease {
    runtime: Runtime,
    reader: Arc<dyn ReaderApi>,
    ready: ReadyRequest,
    slots: Vec<SlotIndex>,
    consumed: bool,
}

impl fmt::Debug for ReadLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadLease")
            .field("key", &self.ready.key)
            .field("slots", &self.slots)
            .field("consumed", &self.consumed)
            .finish()
    }
}

impl ReadLease {
    /// The request (its sender and id).
    pub fn key(&self) -> &ReqKey {
        &self.ready.key
    }

    /// Its slots, one per chunk in chunk order (slot `i` is bytes
    /// `i × slot_bytes .. (i + 1) × slot_bytes` of the buffer).
    pub fn slots(&self) -> &[SlotIndex] {
        &self.slots
    }

    /// The sender's cache key of each chunk, parallel to `slots`.
    pub fn chunk_keys(&self) -> &[String] {
        &self.ready.keys
    }

    /// How its chunks are laid out (fmt, full-chunk shape, dtype), as its sender said.
    pub fn layout(&self) -> &ChunkLayout {
        &self.ready.layout
    }

    /// Each chunk's token count where its batch named it (a batch's last chunk), `None` for
    /// a full chunk of `layout().shape`; parallel to `slots`.
    pub fn chunk_tokens(&self) -> &[Option<u64>] {
        &self.ready.tokens
    }

    /// Runs `f` on chunk `chunk`'s slot (all of it) in place. Panics when `chunk` is out of
    /// range: a caller bug.
    pub fn with_chunk(&self, chunk: usize, f: &mut dyn FnMut(&[u8])) {
        self.reader.inspect(self.slots[chunk], f);
    }

    /// Releases the request's slots and reservation, waiting at most `timeout` for the
    /// driver's answer. A request the sender cancelled after it was ready is released all
    /// the same.
    pub fn consume(mut self, timeout: Duration) -> Result<(), EmbedError> {
        self.consumed = true;
        let reader = self.reader.clone();
        let key = self.ready.key.clone();
        match self
            .runtime
            .block_on_for(timeout, async move { reader.consume(&key).await })
        {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(EmbedError::Consume(e)),
            None => Err(EmbedError::TimedOut(timeout)),
        }
    }
}

impl Drop for ReadLease {
    fn drop(&mut self) {
        // A drop must not block (it may run on any thread, inside the runtime too): the
        // release is queued for the driver at once, ahead of whatever the dropping thread
        // asks next; only when the driver's queue is full does a task wait to queue it.
        if !self.consumed && !self.reader.consume_queued(&self.ready.key) {
            let reader = self.reader.clone();
            let key = self.ready.key.clone();
            self.runtime.spawn(async move {
                let _ = reader.consume(&key).await;
            });
        }
    }
}

impl Receiver {
    /// Starts a receiver on `runtime`: its alloc channel bound and its buffer exposed.
    pub fn start(runtime: &Runtime, settings: ReceiverSettings) -> Result<Self, EmbedError> {
        let start = settings.env.clone().visit(Start { settings })?;
        let started = runtime.block_on(start)?;
        Ok(Self {
            runtime: runtime.clone(),
            reader: Arc::from(started.reader),
            notices: Arc::new(tokio::sync::Mutex::new(started.notices)),
            returned: Arc::default(),
            alloc_endpoint: started.alloc_endpoint,
            fabric_endpoint: started.fabric_endpoint,
        })
    }

    /// The bound alloc endpoint (a port 0 request resolved): what senders connect to.
    pub fn alloc_endpoint(&self) -> &str {
        &self.alloc_endpoint
    }

    /// The bound fabric endpoint.
    pub fn fabric_endpoint(&self) -> &str {
        &self.fabric_endpoint
    }

    /// Up to `max` ready requests, leased, waiting at most `timeout` for the first; empty
    /// when none came. A request that ended between its ready notice and its lease (the
    /// sender cancelled) is skipped, and if it was the only one the call returns empty before
    /// its timeout. `Consume(Stopped)` once the receiver has stopped and no lease given back
    /// is left to hand out. Shared by every caller.
    pub fn next_ready(&self, max: usize, timeout: Duration) -> Result<Vec<ReadLease>, EmbedError> {
        self.runtime.block_on(self.take_ready(max, Some(timeout)))
    }

    /// The async form of `next_ready`, waiting for the first as long as it takes. Dropping
    /// it (a timeout, a cancelled task) loses nothing: leases it had taken go to the next
    /// call.
    pub async fn ready(&self, max: usize) -> Result<Vec<ReadLease>, EmbedError> {
        self.take_ready(max, None).await
    }

    /// Hands leases back unread: the next `next_ready`/`ready` call gets them first. For a
    /// caller that took them but can no longer use them (its own caller went away).
    pub fn give_back(&self, leases: Vec<ReadLease>) {
        self.returned.give_back(leases);
    }

    /// Only the wait for the first notice is bounded by `timeout`: once a request is taken
    /// off the stream it is leased and returned, never dropped by a timeout (a lease is
    /// answered at once by a running driver, and with an error by a stopped one).
    async fn take_ready(
        &self,
        max: usize,
        timeout: Option<Duration>,
    ) -> Result<Vec<ReadLease>, EmbedError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        // Waiting for the first notice can be cancelled at any point without losing one.
        let first = async {
            let mut notices = self.notices.clone().lock_owned().await;
            loop {
                // Armed before the look, so that leases given back after it wake the wait.
                let arrived = self.returned.arrived.notified();
                tokio::pin!(arrived);
                arrived.as_mut().enable();
                let returned = self.returned.take(max);
                if !returned.is_empty() {
                    return First::GivenBack(returned);
                }
                tokio::select! {
                    first = notices.recv() => match first {
                        // Every request's end is noticed, consumed ones too; an end leases
                        // nothing, so it must not end the wait for a ready one.
                        Some(ReceiverNotice::Ended { .. }) => {}
                        Some(first) => return First::Notice(first, notices),
                        // The driver is gone: no notice will come.
                        None => return First::Stopped,
                    },
                    () = &mut arrived => {}
                }
            }
        };
        let first = match timeout {
            Some(limit) => match tokio::time::timeout(limit, first).await {
                Ok(first) => first,
                Err(_) => return Ok(Vec::new()),
            },
            None => first.await,
        };
        let (first, notices) = match first {
            First::Stopped => return Err(EmbedError::Consume(ConsumeError::Stopped)),
            First::GivenBack(returned) => return Ok(returned),
            First::Notice(first, notices) => (first, notices),
        };
        // From here the notices are off the stream: they are leased by a task that the
        // caller cannot cancel, and handed over, or put back if the caller left.
        let (tx, leases) = oneshot::channel();
        let (runtime, reader, returned) = (
            self.runtime.clone(),
            self.reader.clone(),
            self.returned.clone(),
        );
        self.runtime.spawn(async move {
            let out = lease_notices(&runtime, &reader, first, notices, max).await;
            if let Err(out) = tx.send(out) {
                returned.give_back(out);
            }
        });
        Ok(Handover {
            leases,
            returned: self.returned.clone(),
        }
        .await)
    }

    /// The buffer's accounting now (for leak checks and monitoring), waiting at most
    /// `timeout`: `TimedOut` after it, `Consume(Stopped)` when the receiver has stopped.
    pub fn snapshot(&self, timeout: Duration) -> Result<BufferSnapshot, EmbedError> {
        self.runtime
            .block_on_for(timeout, self.reader.snapshot())
            .ok_or(EmbedError::TimedOut(timeout))?
            .map_err(EmbedError::Consume)
    }

    /// Stops the receiver now (its sockets close), waiting at most `timeout` for the driver
    /// to hear it; without it, the receiver stops once it and every lease are dropped.
    pub fn shutdown(&self, timeout: Duration) {
        let _ = self.runtime.block_on_for(timeout, self.reader.shutdown());
    }

    /// Slots in the buffer.
    pub fn slots(&self) -> u32 {
        self.reader.slots()
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.reader.slot_bytes()
    }

    /// The receive buffer, for a view the caller keeps: what a program reads leased chunks
    /// through when kvx allocated the buffer (the shm fabric). `None` when it cannot be
    /// viewed (RDMA-registered memory).
    pub fn memory_view(&self) -> Option<MemoryView> {
        self.reader.memory_view()
    }
}

/// The facade's types cross threads (Python calls from any thread).
const _: () = {
    const fn is<T: Send + Sync>() {}
    is::<Receiver>();
    is::<ReadLease>();
};
