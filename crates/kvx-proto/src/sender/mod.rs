//! The sender (prefill side): admission before staging, the staging pool, pipelined
//! control channels, writes, and exactly-once `ProxyNotif` (`docs/spec/protocol.md` §Sender).
//!
//! - `mod.rs`: `SenderFlow`, its inputs and outputs.
//! - `allocate.rs`: a caller's staging slots — taken (`try_allocate`), waited for, handed back.
//! - `batching.rs`: each request's pending batch (`handle_add`), and the flush rule that
//!   submits pending batches when only they hold staging (`allocate_or_submit`).
//! - `lifecycle.rs`: channel sends, failure and clean-up, delivery, channel reset.
//! - `queries.rs`: what a driver or a test reads without changing anything (counters, staging,
//!   requests, channels, whether a held message's reply is awaited).
//! - `invariants.rs`: `check_invariants`.
//! - `channel.rs`: one control channel to one receiver (pipelined or serial).
//! - `reply.rs`: what a receiver's reply does.
//! - `staging.rs`: the staging pool, and the order in which waiting requests get a freed slot.
//! - `canon.rs` (feature `testing`): the explorer's canonical encoding.
//! - `tests.rs`: unit tests that reach the flow's private state (its checker shown to catch
//!   a corruption).
//!
//! A request goes Admitting → Admitted → (Delivered | Failed). A failed request sends one
//! `CancelNotif` once its posted writes have completed (so it can say `drained`), then
//! leaves no state behind but its outcome, remembered (`outcomes_kept`) for `outcome`.
//!
//! Contract: a driver feeds `handle_begin`, `handle_add`, `handle_submit`, `handle_cancel`
//! (its caller's calls), `handle_message` (every decoded reply), `handle_write_done` (every
//! posted write's completion, exactly once), `handle_receiver_lost` and `handle_timeout` (at
//! `poll_timeout`); after each it drains `poll_transmit` (messages to send, in order),
//! `poll_write` (writes to post, in order) and `poll_event`. Staging: `try_allocate` takes a
//! slot or says why not; a caller that will wait for one (`WouldBlock`) registers with
//! `wait_for_staging` and leaves with `stop_waiting_for_staging`, and retries on every event
//! (a completed write frees staging without one, so a driver retries after completions too).

mod allocate;
mod batching;
#[cfg(feature = "testing")]
mod canon;
mod channel;
mod invariants;
mod lifecycle;
mod queries;
mod reply;
mod staging;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use crate::claim::ClaimSecret;
use crate::config::{Checked, ConfigError, Placement, SenderConfig};
use crate::ids::{PeerId, ReqId, SlotIndex, StagingSlot, WriteId, WriteTag};
use crate::time::{earliest, Instant};
use crate::wire::{AllocRequest, Message};

use channel::{Channel, Kind};
pub use channel::{ChunkSpec, Mode};
pub use staging::{Age, StagingPool, StagingWaiters};

/// Where a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    /// The control channel to this receiver.
    Receiver(PeerId),
    /// The notice channel to the proxy.
    Proxy,
}

/// A message to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Where to send it.
    pub to: Destination,
    /// What to send, encoded with `wire::encode`.
    pub msg: Message,
}

/// A one-sided write to post: the staged chunk into the receiver's slot. The driver reports
/// its completion with `handle_write_done(id, …)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteOp {
    /// Names the write in `handle_write_done`.
    pub id: WriteId,
    /// The request the chunk belongs to.
    pub req_id: ReqId,
    /// The receiver whose buffer it goes into (its fabric connection).
    pub receiver: PeerId,
    /// The chunk's position in its request.
    pub chunk: u32,
    /// Where the bytes are staged; the slot stays the request's until the completion.
    pub staging: StagingSlot,
    /// The receiver slot granted for the chunk.
    pub remote: SlotIndex,
    /// The immediate value to carry, when the receiver handed out generations (kvx).
    pub tag: Option<WriteTag>,
}

/// How a request was described when it began.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSpec {
    /// The proxy's request id; unique among the requests this sender runs.
    pub req_id: ReqId,
    /// The receiver (its control channel) the chunks go to.
    pub receiver: PeerId,
    /// Chunks the request will send at most; the receiver reserves this many. At least 1.
    pub total_chunks: u32,
    /// LMCache `MemoryFormat` value, sent as is.
    pub fmt: u32,
    /// Shape of one full chunk.
    pub shape: Vec<u64>,
    /// torch dtype name, sent as is.
    pub dtype: String,
    /// The secret of the receiver's caller-placement reservation (`crate::claim`), carried
    /// by the request's first message only; `None` for a receiver that places requests.
    pub claim: Option<ClaimSecret>,
}

/// Why a request failed on the sender.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendFailure {
    /// The caller cancelled it (`handle_cancel`).
    Cancelled,
    /// The receiver refused; its reason, when it gave one.
    Refused(String),
    /// The receiver's reply broke the protocol.
    BadReply(String),
    /// No reply within the configured bound.
    ReplyTimeout,
    /// The control channel to the receiver was lost.
    ChannelLost,
    /// A write completed with an error (the text is the fabric's).
    WriteFailed(String),
    /// A write did not complete within `write_timeout`.
    WriteTimeout,
    /// The caller broke the API contract (more chunks than declared, …).
    Misuse(String),
    /// The sender itself has stopped: the task that drives it (kvx-node's driver) ended,
    /// after a shutdown or close, or because its runtime went away. Never a request's
    /// outcome in the core; the handles' answer to any wait once no driver can end it.
    /// Nothing on this sender can succeed any more: make a new one.
    Stopped,
}

impl SendFailure {
    /// A short name of the kind of failure, without its details: a metric's label.
    pub fn kind(&self) -> &'static str {
        match self {
            SendFailure::Cancelled => "cancelled",
            SendFailure::Refused(_) => "refused",
            SendFailure::BadReply(_) => "bad_reply",
            SendFailure::ReplyTimeout => "reply_timeout",
            SendFailure::ChannelLost => "channel_lost",
            SendFailure::WriteFailed(_) => "write_failed",
            SendFailure::WriteTimeout => "write_timeout",
            SendFailure::Misuse(_) => "misuse",
            SendFailure::Stopped => "stopped",
        }
    }
}

impl fmt::Display for SendFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendFailure::Cancelled => f.write_str("cancelled"),
            SendFailure::Refused(why) => write!(f, "refused by the receiver: {why}"),
            SendFailure::BadReply(why) => write!(f, "bad reply from the receiver: {why}"),
            SendFailure::ReplyTimeout => f.write_str("the receiver did not reply in time"),
            SendFailure::ChannelLost => f.write_str("the control channel to the receiver was lost"),
            SendFailure::WriteFailed(why) => write!(f, "a write failed: {why}"),
            SendFailure::WriteTimeout => {
                f.write_str("a write did not complete within write_timeout")
            }
            SendFailure::Misuse(why) => write!(f, "{why}"),
            SendFailure::Stopped => f.write_str(
                "this sender has stopped (shut down, closed, or its runtime ended): make a new \
                 sender",
            ),
        }
    }
}

/// What the caller (the prefill engine, a driver) should know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SenderEvent {
    /// The receiver reserved the whole request: its chunks may now take staging.
    Admitted {
        /// The request.
        req_id: ReqId,
    },
    /// Every chunk is written and `ProxyNotif` was emitted (exactly once).
    Delivered {
        /// The request.
        req_id: ReqId,
    },
    /// The request failed; its staging is released as its writes complete, and `outcome`
    /// says why from now on.
    Failed {
        /// The request.
        req_id: ReqId,
        /// Why.
        failure: SendFailure,
    },
    /// With caller staging: a failed request's last write completed, so no chunk of it reads
    /// the caller's staging any more (a delivered request's `Delivered` says the same). It
    /// follows `Failed`, at once when no write was in flight. Only with caller staging.
    Drained {
        /// The request.
        req_id: ReqId,
    },
    /// The channel to `receiver` was reset (reply timeout or loss): the driver should
    /// reconnect and reset the fabric connection so outstanding writes are flushed.
    ChannelReset {
        /// The receiver.
        receiver: PeerId,
    },
    /// A write is overdue: the driver should reset the fabric connection to `receiver`,
    /// which flushes the write with an error.
    FabricStalled {
        /// The receiver.
        receiver: PeerId,
    },
}

/// Why a call was refused. The request's state is unchanged unless the text says so.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The request was never begun, or ended and its outcome is no longer remembered (for
    /// `handle_cancel`: it ended, a harmless race).
    #[error("request {0} is not known (never begun, or already ended)")]
    Unknown(ReqId),
    /// `handle_begin` with an id that still runs: ids must be unique among running requests.
    #[error("request {0} already exists")]
    Duplicate(ReqId),
    /// `handle_begin` with `total_chunks == 0`.
    #[error("request {0} declares total_chunks=0: declare how many chunks it will send")]
    ZeroChunks(ReqId),
    /// `requests_max` requests run; begin it again once some have ended.
    #[error("too many requests in flight ({0}); retry later")]
    TooManyRequests(usize),
    /// Staging or submit before the request's `Admitted` event: wait for it.
    #[error("request {0} is not admitted yet: wait for its Admitted event")]
    NotAdmitted(ReqId),
    /// No staging slot for this call now: none is free, or an older request's call waits
    /// for the next one. Register with `wait_for_staging` and retry after events and write
    /// completions, for at most `staging_timeout`.
    #[error("no staging slot is free: wait until writes complete")]
    WouldBlock,
    /// Every staging slot is held by chunks not yet submitted, some of them this caller's:
    /// no write can free one, so waiting could never end. Submit a (smaller) batch first.
    #[error(
        "all {0} staging slots hold unsubmitted chunks: submit a batch before allocating more"
    )]
    StagingHeldByCaller(u32),
    /// No staging slot came free within the caller's timeout (a driver's bounded allocate
    /// call): writes are slow to complete, or other requests hold the pool. The request is
    /// untouched: retry, or cancel it.
    #[error(
        "no staging slot came free within {0:?}: writes are slow to complete or other \
         requests hold every slot"
    )]
    StagingTimedOut(std::time::Duration),
    /// The request failed (or is failing while its writes drain), for the reason given:
    /// stop staging and submitting for it.
    #[error("request {0} failed: {1}")]
    Failed(ReqId, SendFailure),
    /// The call broke the API's contract (see `handle_submit`, `try_allocate`,
    /// `release_staging`). A refused batch (`handle_add`, `handle_submit`) also cancels the
    /// request, and `why` says so; a refused `try_allocate` or `release_staging` changes
    /// nothing.
    #[error("request {req_id}: {why}")]
    Misuse {
        /// The request.
        req_id: ReqId,
        /// What was wrong.
        why: String,
    },
    /// `channel_queue_max` messages wait on the channel to that receiver; nothing changed:
    /// retry later.
    #[error("the channel to {0} has {1} queued messages; retry later")]
    ChannelFull(PeerId, usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Admitting,
    Admitted,
    /// Failed: waits for its posted writes to complete, then sends CancelNotif and goes.
    Failing,
}

#[derive(Debug, Clone)]
struct SendRequest {
    spec: RequestSpec,
    /// Its place in the staging order (`StagingWaiters`).
    age: Age,
    state: State,
    /// Staging slots handed to the caller and not yet submitted.
    staged: BTreeSet<StagingSlot>,
    /// Chunks the caller added (`handle_add`) and has not submitted, in the order added:
    /// the request's pending batch. Their slots are in `staged`.
    added: Vec<ChunkSpec>,
    submitted: u32,
    written: u32,
    writes_in_flight: u32,
    batches_unanswered: u32,
    last_submitted: bool,
    last_acked: bool,
    /// Keys of every batch sent, for CancelNotif (an LMCache receiver removes exactly these).
    keys_sent: Vec<String>,
    /// A message of this request reached the receiver (so it may hold state there).
    sent_any: bool,
    /// Why it failed, once it is `Failing`.
    failure: Option<SendFailure>,
}

#[derive(Debug, Clone)]
struct PendingWrite {
    req_id: ReqId,
    receiver: PeerId,
    staging: StagingSlot,
    deadline: Instant,
    stall_reported: bool,
}

/// Counters since start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SenderStats {
    /// Requests begun.
    pub begun: u64,
    /// Requests delivered (`ProxyNotif` sent).
    pub delivered: u64,
    /// Requests failed.
    pub failed: u64,
    /// Pending batches submitted by the flush rule (`allocate_or_submit`, `handle_add`)
    /// rather than by their caller.
    pub flushed_batches: u64,
    /// Messages dropped: not an `AllocResponse`, from a receiver with no channel, or
    /// answering nothing in flight.
    pub stale_replies: u64,
}

/// The prefill side's state machine: the requests, one control channel per receiver, the
/// staging pool and the posted writes. Its contract is in the module documentation: the
/// caller's calls, replies, every write's completion exactly once, and timers in;
/// `poll_transmit`, `poll_write` and `poll_event` drained after each.
#[derive(Debug, Clone)]
pub struct SenderFlow {
    cfg: SenderConfig,
    requests: BTreeMap<ReqId, SendRequest>,
    channels: BTreeMap<PeerId, Channel>,
    staging: StagingPool,
    writes: BTreeMap<WriteId, PendingWrite>,
    next_write: u64,
    next_seq: u64,
    transmits: VecDeque<Transmit>,
    write_ops: VecDeque<WriteOp>,
    events: VecDeque<SenderEvent>,
    stats: SenderStats,
    next_age: Age,
    /// Allocate calls waiting for staging, oldest request first.
    waiters: StagingWaiters,
    /// Staging slots a failed request's caller still holds — taken (`try_allocate`) and not
    /// yet added or submitted — with the request: out of the pool until the caller hands each
    /// back (`release_staging`, or an add or submit that the failed request refuses), since it
    /// may still be writing the slot (S12).
    lent: BTreeMap<StagingSlot, ReqId>,
    /// How ended requests ended (at most `outcomes_kept`, the oldest forgotten first), with
    /// the order in which they were remembered, so a caller that comes back after the
    /// request left learns how, not "unknown".
    outcomes: BTreeMap<ReqId, (u64, Result<(), SendFailure>)>,
    outcome_order: VecDeque<(u64, ReqId)>,
    next_outcome: u64,
}

impl SenderFlow {
    /// No request, channel or write; all staging free. `new` refuses what
    /// `SenderConfig::validate` refuses.
    pub fn new(cfg: SenderConfig) -> Result<Self, ConfigError> {
        Ok(Self::from_checked(cfg.validate()?))
    }

    /// `new`, with a configuration checked already (a driver's, a binding's): not checked
    /// again.
    pub fn from_checked(cfg: Checked<SenderConfig>) -> Self {
        let cfg = cfg.into_inner();
        Self {
            staging: match cfg.staging_placement {
                Placement::Pool => StagingPool::new(cfg.staging_slots),
                Placement::Caller => StagingPool::callers(cfg.staging_slots),
            },
            cfg,
            requests: BTreeMap::new(),
            channels: BTreeMap::new(),
            writes: BTreeMap::new(),
            next_write: 0,
            next_seq: 0,
            transmits: VecDeque::new(),
            write_ops: VecDeque::new(),
            events: VecDeque::new(),
            stats: SenderStats::default(),
            next_age: 0,
            waiters: StagingWaiters::default(),
            lent: BTreeMap::new(),
            outcomes: BTreeMap::new(),
            outcome_order: VecDeque::new(),
            next_outcome: 0,
        }
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &SenderConfig {
        &self.cfg
    }

    /// Starts a request: queues its admission probe to the receiver.
    pub fn handle_begin(&mut self, now: Instant, spec: RequestSpec) -> Result<(), SendError> {
        if spec.total_chunks == 0 {
            return Err(SendError::ZeroChunks(spec.req_id));
        }
        if self.requests.contains_key(&spec.req_id) {
            return Err(SendError::Duplicate(spec.req_id));
        }
        if self.requests.len() >= self.cfg.requests_max {
            return Err(SendError::TooManyRequests(self.cfg.requests_max));
        }
        // Only the first message (the claim) carries the secret.
        let probe = self.alloc_request(&spec, Vec::new(), 0, false, spec.claim.clone());
        self.check_channel_room(spec.receiver)?;
        self.stats.begun += 1;
        self.outcomes.remove(&spec.req_id);
        let req_id = spec.req_id.clone();
        let receiver = spec.receiver;
        let age = self.next_age;
        self.next_age += 1;
        self.requests.insert(
            req_id.clone(),
            SendRequest {
                spec,
                age,
                state: State::Admitting,
                staged: BTreeSet::new(),
                added: Vec::new(),
                submitted: 0,
                written: 0,
                writes_in_flight: 0,
                batches_unanswered: 0,
                last_submitted: false,
                last_acked: false,
                keys_sent: Vec::new(),
                sent_any: false,
                failure: None,
            },
        );
        self.enqueue(receiver, req_id, Kind::Probe, probe);
        self.pump(now, receiver);
        Ok(())
    }

    /// How `req_id` ended: `Some(Ok)` delivered, `Some(Err)` failed (from the moment it
    /// fails, while its writes drain, and for `outcomes_kept` ended requests after), `None`
    /// while it runs or when it is not known (`knows`).
    pub fn outcome(&self, req_id: &ReqId) -> Option<Result<(), SendFailure>> {
        match self.requests.get(req_id) {
            Some(req) if req.state == State::Failing => {
                Some(Err(req.failure.clone().unwrap_or(SendFailure::Cancelled)))
            }
            Some(_) => None,
            None => self.outcomes.get(req_id).map(|(_, o)| o.clone()),
        }
    }

    /// `req_id`'s place in the staging order (the order requests were begun), while it runs.
    pub fn age(&self, req_id: &ReqId) -> Option<Age> {
        self.requests.get(req_id).map(|r| r.age)
    }

    /// The allocate calls waiting for staging (`wait_for_staging`), oldest request first.
    pub fn staging_waiters(&self) -> &StagingWaiters {
        &self.waiters
    }

    /// Whether `req_id` is still tracked: it runs, or failed and some posted write of it is
    /// outstanding. A request leaves once delivered, or failed with no write outstanding;
    /// from then on it reads no staging.
    pub fn is_tracked(&self, req_id: &ReqId) -> bool {
        let gone_early =
            |r: &SendRequest| broken_variant!(ReleasedWhileWritesRead) && r.state == State::Failing;
        self.requests.get(req_id).is_some_and(|r| !gone_early(r))
    }

    /// Whether `req_id` runs, or ended recently enough that its outcome is remembered.
    pub fn knows(&self, req_id: &ReqId) -> bool {
        self.requests.contains_key(req_id) || self.outcomes.contains_key(req_id)
    }

    /// Submits one batch: the request's added chunks (`handle_add`), then `chunks` (empty
    /// only as the last batch). Misuse — more
    /// chunks than declared, a slot the request does not hold, a batch after the last —
    /// cancels the request, since its declared shape can no longer be trusted.
    pub fn handle_submit(
        &mut self,
        now: Instant,
        req_id: &ReqId,
        mut chunks: Vec<ChunkSpec>,
        is_last: bool,
    ) -> Result<(), SendError> {
        let req = match self.admitted(req_id) {
            Ok(req) => req,
            Err(refused) => {
                // A failed request's caller hands back the slots it was still holding.
                for c in &chunks {
                    self.take_back_lent(req_id, c.staging);
                }
                return Err(refused);
            }
        };
        if !req.added.is_empty() {
            // The pending batch goes first, in the order its chunks were added.
            let mut batch = req.added.clone();
            batch.append(&mut chunks);
            chunks = batch;
        }
        if let Some(why) = self.misuse_of(req, &chunks, is_last) {
            self.fail(now, req_id, SendFailure::Misuse(why.clone()));
            return Err(SendError::Misuse {
                req_id: req_id.clone(),
                why: format!("{why} (the request was cancelled)"),
            });
        }
        let receiver = req.spec.receiver;
        self.check_channel_room(receiver)?;
        let req = self
            .requests
            .get_mut(req_id)
            .expect("invariant: checked above");
        req.added.clear();
        for c in &chunks {
            req.staged.remove(&c.staging);
        }
        if self.staging.is_callers() {
            chunks.iter().for_each(|c| self.staging.read(c.staging));
        }
        req.submitted += chunks.len() as u32;
        req.last_submitted = is_last;
        req.batches_unanswered += 1;
        let keys = chunks.iter().map(|c| c.key.clone()).collect();
        let last_toks = chunks.last().map_or(0, |c| c.tokens);
        let spec = req.spec.clone();
        let mut msg = self.alloc_request(&spec, keys, last_toks, is_last, None);
        if let Message::AllocRequest(m) = &mut msg {
            m.chunk_bytes = Some(chunks.iter().map(|c| c.bytes).collect());
        }
        self.enqueue(
            receiver,
            req_id.clone(),
            Kind::Batch { chunks, is_last },
            msg,
        );
        self.pump(now, receiver);
        Ok(())
    }

    /// Aborts a request from any state and any thread's point of view: pending staging is
    /// released, the receiver is told with one `CancelNotif` once no write of the request
    /// is outstanding, and the request leaves no state behind.
    pub fn handle_cancel(&mut self, now: Instant, req_id: &ReqId) -> Result<(), SendError> {
        let req = self
            .requests
            .get(req_id)
            .ok_or_else(|| SendError::Unknown(req_id.clone()))?;
        if req.state == State::Failing {
            return Ok(());
        }
        self.fail(now, req_id, SendFailure::Cancelled);
        Ok(())
    }

    /// A posted write completed, with an error text on failure.
    pub fn handle_write_done(&mut self, now: Instant, id: WriteId, result: Result<(), String>) {
        let Some(w) = self.writes.remove(&id) else {
            return;
        };
        self.staging.give_back(w.staging);
        let req = self
            .requests
            .get_mut(&w.req_id)
            .expect("invariant: a pending write's request is tracked");
        req.writes_in_flight -= 1;
        match (result, req.state) {
            (Ok(()), State::Admitted) => {
                req.written += 1;
                self.maybe_delivered(now, &w.req_id);
            }
            (Err(why), State::Admitted) => self.fail(now, &w.req_id, SendFailure::WriteFailed(why)),
            (_, _) => self.maybe_finish_failing(now, &w.req_id),
        }
    }

    /// The control channel to `receiver` broke (the driver saw the connection drop): every
    /// request on it fails; the channel starts afresh.
    pub fn handle_receiver_lost(&mut self, now: Instant, receiver: PeerId) {
        self.reset_channel(now, receiver, SendFailure::ChannelLost);
    }

    /// Resets every channel with a reply overdue (its requests fail with `ReplyTimeout`)
    /// and reports each overdue write once (`FabricStalled`; its request fails with
    /// `WriteTimeout`).
    pub fn handle_timeout(&mut self, now: Instant) {
        let overdue: Vec<PeerId> = self
            .channels
            .iter()
            .filter(|(_, ch)| ch.next_deadline().is_some_and(|d| d <= now))
            .map(|(p, _)| *p)
            .collect();
        for receiver in overdue {
            self.reset_channel(now, receiver, SendFailure::ReplyTimeout);
        }
        let stalled: Vec<WriteId> = self
            .writes
            .iter()
            .filter(|(_, w)| !w.stall_reported && w.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in stalled {
            let w = self.writes.get_mut(&id).expect("invariant: listed above");
            w.stall_reported = true;
            let (req_id, receiver) = (w.req_id.clone(), w.receiver);
            self.events
                .push_back(SenderEvent::FabricStalled { receiver });
            if self
                .requests
                .get(&req_id)
                .is_some_and(|r| r.state != State::Failing)
            {
                self.fail(now, &req_id, SendFailure::WriteTimeout);
            }
        }
    }

    /// The earliest reply or write deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let channels = self
            .channels
            .values()
            .filter_map(Channel::next_deadline)
            .min();
        let writes = self
            .writes
            .values()
            .filter(|w| !w.stall_reported)
            .map(|w| w.deadline)
            .min();
        earliest(channels, writes)
    }

    /// The next message to send; per destination, in the order they must arrive.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next write to post. Its deadline runs from when it was queued here.
    pub fn poll_write(&mut self) -> Option<WriteOp> {
        self.write_ops.pop_front()
    }

    /// The next event, in the order they happened.
    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.events.pop_front()
    }

    /// The request, if it is admitted; else why the caller cannot use it now.
    fn admitted(&self, req_id: &ReqId) -> Result<&SendRequest, SendError> {
        let Some(req) = self.requests.get(req_id) else {
            // A request that failed and left still answers with why, for a while.
            return Err(match self.outcomes.get(req_id) {
                Some((_, Err(failure))) => SendError::Failed(req_id.clone(), failure.clone()),
                _ => SendError::Unknown(req_id.clone()),
            });
        };
        match (&req.state, &req.failure) {
            (State::Admitting, _) if broken_variant!(StageBeforeAdmit) => Ok(req),
            (State::Admitting, _) => Err(SendError::NotAdmitted(req_id.clone())),
            (State::Failing, failure) => Err(SendError::Failed(
                req_id.clone(),
                failure.clone().unwrap_or(SendFailure::Cancelled),
            )),
            (State::Admitted, _) => Ok(req),
        }
    }

    fn misuse_of(&self, req: &SendRequest, chunks: &[ChunkSpec], is_last: bool) -> Option<String> {
        if req.last_submitted {
            return Some("a batch was submitted after the last batch".into());
        }
        if chunks.is_empty() && !is_last {
            return Some("an empty batch that is not the last batch".into());
        }
        let count = req.submitted + chunks.len() as u32;
        if count > req.spec.total_chunks {
            return Some(format!(
                "declared total_chunks={} but submitted {count}",
                req.spec.total_chunks
            ));
        }
        let mut seen = BTreeSet::new();
        for c in chunks {
            if c.bytes == 0 {
                return Some(format!("chunk {} declares 0 bytes", c.key));
            }
            if self.staging.is_callers() {
                // The caller's own memory: any slot of it, once per batch.
                if c.staging.0 >= self.staging.capacity() || !seen.insert(c.staging) {
                    return Some(format!(
                        "staging slot {} is out of range (the caller's {} slots) or named \
                         twice in one batch",
                        c.staging.0,
                        self.staging.capacity()
                    ));
                }
            } else if !req.staged.contains(&c.staging) || !seen.insert(c.staging) {
                return Some(format!(
                    "staging slot {} is not held by this request",
                    c.staging.0
                ));
            }
        }
        None
    }

    fn alloc_request(
        &mut self,
        spec: &RequestSpec,
        keys: Vec<String>,
        last_toks: u64,
        is_last: bool,
        claim: Option<ClaimSecret>,
    ) -> Message {
        Message::AllocRequest(AllocRequest {
            keys,
            fmt: spec.fmt,
            shape: spec.shape.clone(),
            dtype: spec.dtype.clone(),
            last_chunk_toks: last_toks,
            req_id: spec.req_id.0.clone(),
            is_last_batch: is_last,
            total_chunks: spec.total_chunks,
            seq: None, // set when enqueued
            chunk_bytes: None,
            claim,
        })
    }
}

#[cfg(test)]
mod tests;
