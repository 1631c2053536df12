//! The receiver, for an embedding program: one type whatever the transport and fabric, on a
//! receive buffer of kvx's allocation or of memory the caller owns.
//!
//! The decoder takes ready requests as `ReadLease`s (`next_ready`): a lease pins the
//! request's slots until it is consumed, even if the sender cancels meanwhile; the decoder
//! reads the chunks in place (`with_chunk`, or its own view of its memory) and consumes the
//! lease, which frees the slots for other requests. A lease dropped unconsumed is released
//! then, so no slot is ever leaked. The leases and their hand-out are kvx-node's
//! (`kvx_node::lease`), which the binary and the simulation run too; this layer adds the
//! blocking calls, each with one bound.
//!
//! Under caller placement (`Placement::Caller`: the application owns the buffer, as a vLLM
//! decode engine owns its KV blocks) the application lends each request's slots
//! (`reserve`), takes them back (`withdraw`), and hears every reservation come back
//! (`returned`) once no write can land in its slots.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use kvx_io::AnyMemory;
use kvx_node::{BufferSnapshot, ChunkReader, ReadyLeases, ReceiverNode, Returned, SharedStream};
use kvx_proto::receiver::{ChunkLayout, ConsumeError, PlacementError};
use kvx_proto::{Checked, ClaimSecret, ReceiverConfig, ReqKey, SlotIndex};

use crate::choice::EnvChoice;
use crate::error::EmbedError;
use crate::memory::{Memory, MemoryView};
use crate::runtime::Runtime;

/// What a receiver is started with.
#[derive(Debug)]
pub struct ReceiverSettings {
    /// Transport and fabric.
    pub env: EnvChoice,
    /// The ledger's limits and timers (`buffer_slots` is the buffer's slot count), checked
    /// (`ReceiverConfig::validate`) where the settings came in.
    pub config: Checked<ReceiverConfig>,
    /// Its receive buffer.
    pub buffer: Memory,
    /// Where its alloc channel binds (`tcp://host:port`; port 0 lets the OS pick).
    pub alloc_endpoint: String,
    /// Where its fabric listens.
    pub fabric_endpoint: String,
}

/// A running receiver. Every call may come from any thread; the blocking ones are bounded
/// and must not be called from a task of its runtime.
pub struct Receiver {
    runtime: Runtime,
    leases: Arc<ReadyLeases>,
    /// Returned reservations (caller placement).
    returns: Arc<SharedStream<Returned>>,
    reader: ChunkReader<AnyMemory>,
    alloc_endpoint: String,
    fabric_endpoint: String,
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
/// dropped, which releases it at once, without blocking).
pub struct ReadLease {
    runtime: Runtime,
    inner: kvx_node::ReadLease,
}

impl fmt::Debug for ReadLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl ReadLease {
    /// The request (its sender and id).
    pub fn key(&self) -> &ReqKey {
        self.inner.key()
    }

    /// Its slots, one per chunk in chunk order (slot `i` is bytes
    /// `i × slot_bytes .. (i + 1) × slot_bytes` of the buffer).
    pub fn slots(&self) -> &[SlotIndex] {
        self.inner.slots()
    }

    /// The sender's cache key of each chunk, parallel to `slots`.
    pub fn chunk_keys(&self) -> &[String] {
        self.inner.chunk_keys()
    }

    /// How its chunks are laid out (fmt, full-chunk shape, dtype), as its sender said.
    pub fn layout(&self) -> &ChunkLayout {
        self.inner.layout()
    }

    /// Each chunk's token count where its batch named it (a batch's last chunk), `None` for
    /// a full chunk of `layout().shape`; parallel to `slots`.
    pub fn chunk_tokens(&self) -> &[Option<u64>] {
        self.inner.chunk_tokens()
    }

    /// Runs `f` on chunk `chunk`'s slot (all of it) in place. Panics when `chunk` is out of
    /// range: a caller bug.
    pub fn with_chunk(&self, chunk: usize, f: &mut dyn FnMut(&[u8])) {
        self.inner.with_chunk(chunk, f);
    }

    /// Releases the request's slots and reservation, waiting at most `timeout` for the
    /// driver's answer. A request the sender cancelled after it was ready is released all
    /// the same.
    pub fn consume(self, timeout: Duration) -> Result<(), EmbedError> {
        let Self { runtime, inner } = self;
        match runtime.block_on_for(timeout, inner.consume()) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(EmbedError::Consume(e)),
            None => Err(EmbedError::TimedOut(timeout)),
        }
    }

    /// Releases the request now without waiting for the driver's answer (what a drop does).
    pub fn release(self) {
        self.inner.release();
    }
}

impl Receiver {
    /// Starts a receiver on `runtime`: its alloc channel bound and its buffer exposed.
    pub fn start(runtime: &Runtime, settings: ReceiverSettings) -> Result<Self, EmbedError> {
        let ReceiverSettings {
            env,
            config,
            buffer,
            alloc_endpoint,
            fabric_endpoint,
        } = settings;
        let env = env.into_env()?;
        // Within the runtime: the leases run their waits on it.
        runtime.block_on(async move {
            let mut handle = match buffer {
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
            let returns = handle
                .take_returns()
                .expect("invariant: a new handle's returns are untaken");
            let (leases, reader) = handle.into_ready_leases();
            Ok::<_, EmbedError>(Self {
                runtime: runtime.clone(),
                leases: Arc::new(leases),
                returns: Arc::new(SharedStream::new(returns)),
                reader,
                alloc_endpoint,
                fabric_endpoint,
            })
        })
    }

    /// The driver's reader: every call that needs nothing of this layer (the async forms
    /// of `snapshot`, `reserve`, `withdraw`; the buffer's memory).
    pub fn reader(&self) -> &ChunkReader<AnyMemory> {
        &self.reader
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
        let got = self.runtime.block_on(self.leases.take(max, Some(timeout)));
        self.wrap(got)
    }

    /// The async form of `next_ready`, waiting for the first as long as it takes. Dropping
    /// it (a timeout, a cancelled task) loses nothing: leases it had taken go to the next
    /// call.
    pub async fn ready(&self, max: usize) -> Result<Vec<ReadLease>, EmbedError> {
        let got = self.leases.take(max, None).await;
        self.wrap(got)
    }

    fn wrap(
        &self,
        got: Result<Vec<kvx_node::ReadLease>, ConsumeError>,
    ) -> Result<Vec<ReadLease>, EmbedError> {
        let leases = got.map_err(EmbedError::Consume)?;
        Ok(leases
            .into_iter()
            .map(|inner| ReadLease {
                runtime: self.runtime.clone(),
                inner,
            })
            .collect())
    }

    /// Hands leases back unread: the next `next_ready`/`ready` call gets them first. For a
    /// caller that took them but can no longer use them (its own caller went away).
    pub fn give_back(&self, leases: Vec<ReadLease>) {
        self.leases
            .give_back(leases.into_iter().map(|l| l.inner).collect());
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

    /// Caller placement: lends `slots` (chunk i to `slots[i]`) to request `req_id`, waiting at
    /// most `timeout` for the driver. `Placement(reason)` when refused (nothing changed):
    /// the receiver places requests itself, the id is reserved already, a slot is out of
    /// range, named twice or reserved for another request not yet returned. The request's
    /// first `held` chunks are the application's already (its sender is told they are sent;
    /// chunk `held + i` goes to `slots[i]`). Only a first batch that carries `secret`
    /// claims the reservation.
    pub fn reserve(
        &self,
        req_id: &str,
        held: u32,
        slots: Vec<SlotIndex>,
        secret: ClaimSecret,
        timeout: Duration,
    ) -> Result<(), EmbedError> {
        self.runtime
            .block_on_for(
                timeout,
                self.reader.reserve_held(req_id, held, slots, secret),
            )
            .ok_or(EmbedError::TimedOut(timeout))?
            .map_err(EmbedError::Placement)
    }

    /// Caller placement: takes reservation `req_id` back (the application aborted its
    /// request), waiting at most `timeout` for the driver; its slots come back through
    /// `returned` once no write can land in them.
    pub fn withdraw(&self, req_id: &str, timeout: Duration) -> Result<(), EmbedError> {
        self.runtime
            .block_on_for(timeout, self.reader.withdraw(req_id))
            .ok_or(EmbedError::TimedOut(timeout))?
            .map_err(EmbedError::Placement)
    }

    /// Caller placement: up to `max` returned reservations, once the first has come (bound
    /// the wait with a timeout around it); `Placement(Stopped)` once the receiver has
    /// stopped and every return was taken. Cancel-safe: nothing is lost to a dropped call.
    pub async fn returned(&self, max: usize) -> Result<Vec<Returned>, EmbedError> {
        self.returns
            .take(max)
            .await
            .ok_or(EmbedError::Placement(PlacementError::Stopped))
    }

    /// Hands returned reservations back unseen: the next `returned` call gets them first.
    /// For a caller that took them but can no longer pass them on (its own caller went
    /// away), as `give_back` is for leases.
    pub fn give_back_returns(&self, returns: Vec<Returned>) {
        self.returns.give_back(returns);
    }

    /// The receive buffer, for a view the caller keeps: what a program reads leased chunks
    /// through when kvx allocated the buffer (the shm fabric). `None` when it cannot be
    /// viewed (RDMA-registered memory).
    pub fn memory_view(&self) -> Option<MemoryView> {
        MemoryView::of(self.reader.memory())
    }
}

/// The facade's types cross threads (Python calls from any thread).
const _: () = {
    const fn is<T: Send + Sync>() {}
    is::<Receiver>();
    is::<ReadLease>();
};
