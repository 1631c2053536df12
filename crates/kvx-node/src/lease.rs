//! Read leases, the decoder's hold on a ready request: its slots stay put until the lease is
//! consumed, even if the sender cancels meanwhile. A lease dropped unconsumed is released
//! then: the release is queued for the driver at once, ahead of whatever the dropping code
//! asks next, without blocking and without a runtime (a drop may run on any thread), so no
//! slot is ever leaked. Leases are bounded by the buffer's slots, and each queues at most one
//! release, so the release queue is bounded by them too.
//!
//! `ReadyLeases` hands ready requests out as leases to decoders on several tasks or threads
//! (an embedding program's callers): a wait for the first can be cancelled at any point, and
//! once a request is off the notice stream it is leased and handed over, or given back for
//! the next caller: a ready request is never released unread because a caller stopped
//! waiting (kvx-node's one hand-over, `handover`). Each call that must wait runs as one task
//! on the receiver's runtime, so that its caller is woken once, with the leases.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use kvx_io::SlotMemory;
use kvx_proto::receiver::{ChunkLayout, ConsumeError, Outcome};
use kvx_proto::{ReqKey, SlotIndex};
use tokio::sync::mpsc;

use crate::handover::{handover, GivenBack, Handing};
use crate::receiver::{ChunkReader, ReaderLink, ReadyRequest, ReceiverHandle, ReceiverNotice};

/// A ready request the decoder holds: its slots stay put until `consume`, `release`, or the
/// lease is dropped (which releases it).
pub struct ReadLease {
    link: ReaderLink,
    memory: Arc<dyn SlotMemory>,
    ready: ReadyRequest,
    slots: Vec<SlotIndex>,
    done: bool,
}

impl fmt::Debug for ReadLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadLease")
            .field("key", &self.ready.key)
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl ReadLease {
    /// Leases `ready` through `link`: `Unknown` when the request ended after its ready
    /// notice (the sender cancelled: skip it), `Stopped` once the driver has ended.
    pub(crate) async fn take(
        link: ReaderLink,
        memory: Arc<dyn SlotMemory>,
        ready: ReadyRequest,
    ) -> Result<Self, ConsumeError> {
        let slots = link.acquire(&ready.key).await?;
        Ok(Self {
            link,
            memory,
            ready,
            slots,
            done: false,
        })
    }

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

    /// Bytes in each slot.
    pub fn slot_bytes(&self) -> usize {
        self.memory.slot_bytes()
    }

    /// Lets `f` read the first `len` bytes of chunk `chunk`'s slot in place. Panics when
    /// `chunk` or `len` is out of range: a caller bug.
    pub fn inspect_chunk(&self, chunk: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        self.memory.inspect_slot(self.slots[chunk].0, len, f);
    }

    /// Runs `f` on chunk `chunk`'s whole slot in place. Panics when `chunk` is out of range.
    pub fn with_chunk(&self, chunk: usize, f: &mut dyn FnMut(&[u8])) {
        self.inspect_chunk(chunk, self.memory.slot_bytes(), f);
    }

    /// Copies the first `out.len()` bytes of chunk `chunk`'s slot.
    pub fn read_chunk(&self, chunk: usize, out: &mut [u8]) {
        self.memory.read_slot(self.slots[chunk].0, out);
    }

    /// Releases the request's slots and reservation and waits for the driver's answer. A
    /// request the sender cancelled after it was ready is released all the same. `Stopped`
    /// once the driver has ended (which frees everything anyway).
    pub async fn consume(mut self) -> Result<(), ConsumeError> {
        self.done = true;
        self.link.consume(&self.ready.key).await
    }

    /// Releases the request now, without waiting: the release is queued for the driver ahead
    /// of anything this caller asks it next. What a drop does.
    pub fn release(mut self) {
        self.done = true;
        self.link.release(&self.ready.key);
    }
}

impl Drop for ReadLease {
    fn drop(&mut self) {
        if !self.done {
            self.link.release(&self.ready.key);
        }
    }
}

impl<M: SlotMemory> ChunkReader<M> {
    /// Leases a ready request for reading: until the lease is consumed (or released, or
    /// dropped), its slots stay put even if the request is cancelled meanwhile. A request
    /// that ended after its Ready notice gives `Unknown`: skip it. `Stopped` once the
    /// driver has ended.
    pub async fn lease(&self, ready: ReadyRequest) -> Result<ReadLease, ConsumeError> {
        ReadLease::take(self.link.clone(), self.memory.clone(), ready).await
    }
}

impl<M: SlotMemory> ReceiverHandle<M> {
    /// Ready requests as leases for callers on any number of tasks or threads, and the
    /// reader (for snapshots and shutdown). Ended requests' notices are no longer heard.
    /// Called within the receiver's runtime (it panics outside one), where the leasing then
    /// runs whoever awaits it.
    pub fn into_ready_leases(self) -> (ReadyLeases, ChunkReader<M>) {
        let memory: Arc<dyn SlotMemory> = self.reader.memory.clone();
        let leases = ReadyLeases::new(self.notices, self.reader.link.clone(), memory, None);
        (leases, self.reader)
    }

    /// `into_ready_leases`, with every request's end (consumed or failed, exactly one per
    /// request) passed on to the returned stream as `take` meets it, for a decoder that
    /// keeps account of ends (the simulation's checker). Ends arrive while some caller is in
    /// `take`.
    pub fn into_ready_leases_with_ends(self) -> (ReadyLeases, ChunkReader<M>, RequestEnds) {
        let memory: Arc<dyn SlotMemory> = self.reader.memory.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        let leases = ReadyLeases::new(self.notices, self.reader.link.clone(), memory, Some(tx));
        (leases, self.reader, rx)
    }
}

/// Each request's end, as `ReadyLeases` passes them on (`into_ready_leases_with_ends`).
pub type RequestEnds = mpsc::UnboundedReceiver<(ReqKey, Outcome)>;

/// Ready requests handed out as leases, to callers on any number of tasks or threads
/// (`ReceiverHandle::into_ready_leases`). Ended requests' notices are skipped, or passed on
/// (`into_ready_leases_with_ends`).
pub struct ReadyLeases {
    inner: Arc<Leasing>,
    /// The receiver's runtime, where each `take` runs whoever awaits it (a caller's own
    /// executor, or a thread blocked on it).
    runtime: tokio::runtime::Handle,
}

/// What a `take` needs, shared with the task that runs it.
struct Leasing {
    notices: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<ReceiverNotice>>>,
    link: ReaderLink,
    memory: Arc<dyn SlotMemory>,
    /// Leases taken for callers that stopped waiting before they got them: the next caller
    /// gets them first.
    returned: Arc<GivenBack<ReadLease>>,
    /// Where ends go, if anywhere.
    ends: Option<mpsc::UnboundedSender<(ReqKey, Outcome)>>,
}

impl fmt::Debug for ReadyLeases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadyLeases").finish_non_exhaustive()
    }
}

/// What the wait for a ready request found first.
enum First {
    /// Leases a caller gave back, handed out again first.
    GivenBack(Vec<ReadLease>),
    /// A request's ready notice, and the stream of them, held for the leasing.
    Ready(
        ReadyRequest,
        tokio::sync::OwnedMutexGuard<mpsc::UnboundedReceiver<ReceiverNotice>>,
    ),
    /// The notice stream ended: the driver is gone.
    Stopped,
}

impl ReadyLeases {
    fn new(
        notices: mpsc::UnboundedReceiver<ReceiverNotice>,
        link: ReaderLink,
        memory: Arc<dyn SlotMemory>,
        ends: Option<mpsc::UnboundedSender<(ReqKey, Outcome)>>,
    ) -> Self {
        let inner = Leasing {
            notices: Arc::new(tokio::sync::Mutex::new(notices)),
            link,
            memory,
            returned: Arc::default(),
            ends,
        };
        Self {
            inner: Arc::new(inner),
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// Up to `max` ready requests, leased, waiting for the first at most `first_within`
    /// (`None`: as long as it takes); empty when none came. Only that wait is bounded: once
    /// a request is off the stream it is leased and returned (a running driver answers at
    /// once, a stopped one with an error). A request that ended between its ready notice and
    /// its lease is skipped, and if it was the only one the call returns empty early.
    /// `Stopped` once the driver has ended and no lease given back is left to hand out.
    /// Cancel-safe: leases a cancelled call had taken go to the next one.
    ///
    /// The whole call, the wait for the first notice included, runs as a task on the
    /// receiver's runtime, and the caller is woken once, with the leases: a thread blocked
    /// on it (a Python decoder) sleeps once per call, not once for the notice and again for
    /// the leasing.
    pub async fn take(
        &self,
        max: usize,
        first_within: Option<Duration>,
    ) -> Result<Vec<ReadLease>, ConsumeError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let found = match self.inner.first_now(max) {
            Some(First::GivenBack(returned)) => return Ok(returned),
            Some(First::Stopped) => return Err(ConsumeError::Stopped),
            found => found,
        };
        let (handing, handover) = handover(self.inner.returned.clone());
        let inner = self.inner.clone();
        let task = async move { inner.take_for(handing, found, max, first_within).await };
        self.runtime.spawn(task);
        handover.await
    }

    /// Hands leases back unread: the next `take` gets them first. For a caller that took
    /// them but can no longer use them (its own caller went away).
    pub fn give_back(&self, leases: Vec<ReadLease>) {
        self.inner.returned.give_back(leases);
    }
}

impl Leasing {
    /// One `take`, handed to its caller through `handing`, from what `first_now` found
    /// (`None`: nothing yet). The wait for the first notice ends when the caller stops waiting (it
    /// is cancel-safe); from the first notice on, the leasing runs to its end and gives back
    /// what the caller is no longer there to get.
    async fn take_for(
        &self,
        mut handing: Handing<ReadLease, ConsumeError>,
        found: Option<First>,
        max: usize,
        first_within: Option<Duration>,
    ) {
        // What was found is off the stream already: it is leased whoever is still waiting.
        // Only the wait for a notice ends with the caller's (`first` is cancel-safe).
        let first = match found {
            Some(found) => Some(found),
            None => {
                let first = async {
                    match first_within {
                        Some(limit) => tokio::time::timeout(limit, self.first(max)).await.ok(),
                        None => Some(self.first(max).await),
                    }
                };
                tokio::select! {
                    biased;
                    first = first => first,
                    () = handing.closed() => return,
                }
            }
        };
        let taken = match first {
            None => Ok(Vec::new()),
            Some(First::Stopped) => Err(ConsumeError::Stopped),
            Some(First::GivenBack(returned)) => Ok(returned),
            Some(First::Ready(first, notices)) => Ok(self.lease_notices(first, notices, max).await),
        };
        handing.send(taken);
    }

    /// What the stream holds now, without waiting: leases given back, a ready request, or
    /// its end; `None` when nothing is there yet (or another call holds the stream). A
    /// caller that need not wait is answered at once.
    fn first_now(&self, max: usize) -> Option<First> {
        let returned = self.returned.take(max);
        if !returned.is_empty() {
            return Some(First::GivenBack(returned));
        }
        let mut notices = self.notices.clone().try_lock_owned().ok()?;
        loop {
            match notices.try_recv() {
                Ok(ReceiverNotice::Ready(ready)) => return Some(First::Ready(ready, notices)),
                Ok(ReceiverNotice::Ended { key, outcome }) => {
                    pass_on(self.ends.as_ref(), key, outcome);
                }
                Err(mpsc::error::TryRecvError::Disconnected) => return Some(First::Stopped),
                Err(mpsc::error::TryRecvError::Empty) => return None,
            }
        }
    }

    /// The wait for the first ready request, or for leases given back; it can be cancelled
    /// at any point without losing one.
    async fn first(&self, max: usize) -> First {
        let mut notices = self.notices.clone().lock_owned().await;
        let next_ready = async {
            loop {
                match notices.recv().await {
                    Some(ReceiverNotice::Ready(ready)) => return Some(ready),
                    // Every request's end is noticed, consumed ones too; an end leases
                    // nothing, so it must not end the wait for a ready one.
                    Some(ReceiverNotice::Ended { key, outcome }) => {
                        pass_on(self.ends.as_ref(), key, outcome);
                    }
                    None => return None,
                }
            }
        };
        match self.returned.or_wait(max, next_ready).await {
            Ok(given) => First::GivenBack(given),
            Err(Some(ready)) => First::Ready(ready, notices),
            Err(None) => First::Stopped,
        }
    }

    /// Leases `first` and the ready notices queued behind it, up to `max`; the stream is free
    /// for other callers once this returns.
    async fn lease_notices(
        &self,
        first: ReadyRequest,
        mut notices: tokio::sync::OwnedMutexGuard<mpsc::UnboundedReceiver<ReceiverNotice>>,
        max: usize,
    ) -> Vec<ReadLease> {
        let mut out = Vec::new();
        let mut next = Some(first);
        while let Some(ready) = next.take() {
            let (link, memory) = (self.link.clone(), self.memory.clone());
            if let Ok(lease) = ReadLease::take(link, memory, ready).await {
                out.push(lease);
            }
            while out.len() < max {
                match notices.try_recv() {
                    Ok(ReceiverNotice::Ready(ready)) => {
                        next = Some(ready);
                        break;
                    }
                    Ok(ReceiverNotice::Ended { key, outcome }) => {
                        pass_on(self.ends.as_ref(), key, outcome);
                    }
                    Err(_) => break,
                }
            }
        }
        out
    }
}

/// Passes an end on where ends go, if anywhere (a receiver that stopped listening misses it).
fn pass_on(ends: Option<&mpsc::UnboundedSender<(ReqKey, Outcome)>>, key: ReqKey, outcome: Outcome) {
    if let Some(ends) = ends {
        let _ = ends.send((key, outcome));
    }
}

/// Leases cross threads (an embedding program's callers).
const _: () = {
    const fn is<T: Send + Sync>() {}
    is::<ReadLease>();
    is::<ReadyLeases>();
};
