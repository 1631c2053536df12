//! A byte-driven driver of the core for fuzzing (`fuzz/fuzz_targets/core_events.rs`),
//! property tests and the explorer (`explore/`): two senders (three in the world where shares
//! bind, `OpWorld::contended`) and one receiver wired by
//! explicit FIFO queues, where each pair of input bytes picks the next event — a begin, a
//! batch, a delivery on one link, a write completing or failing, a cancel, time passing, a
//! consume, a lost connection. Every state machine's `check_invariants()` runs after each
//! event, a write may land only in a live grant of its own request (or in quarantine),
//! admission is FIFO, a caller that asks for staging before admission is refused, and at the
//! end the world heals: everything is delivered, completed and timed out, and every request
//! must have ended with both buffers entirely free. In the contended world admission follows
//! §Fair shares instead of plain FIFO (its own invariants check each admission), no request
//! that fits the buffer is refused, and healing is also a liveness check: with the decoder
//! consuming, every waiting request is admitted, none times out waiting. Under caller
//! placement (`OpWorld::placed`, `placed.rs`) a decoding application owns the buffer and
//! lends each request's slots, withdraws reservations and gets them back.

mod callers;
mod placed;

use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

use super::checker::Checker;
use crate::canon::Canon;
use crate::config::{ReceiverConfig, SenderConfig};
use crate::ids::{PeerId, ReqId, ReqKey};
use crate::receiver::{
    ChecksumCheck, Failure, LandedWrite, Outcome, ReceiverEvent, ReceiverLedger,
};
use crate::sender::{Destination, SenderEvent, SenderFlow, WriteOp};
use crate::time::Instant;
use crate::wire::{self, Message};

/// Senders of the plain world (the byte-driven events name one of these).
const SENDERS: usize = 2;
/// Senders of the contended world: enough that one can be passed over in favour of another
/// while a third contends.
const CONTENDING_SENDERS: usize = 3;
/// Upper bound on operations taken from one input, so a fuzz case stays fast.
const OPS_MAX: usize = 4_000;

/// One thing that can happen next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// `sender` begins a new request of `total` chunks.
    Begin {
        /// 0 or 1.
        sender: usize,
        /// Its `total_chunks`.
        total: u32,
    },
    /// `sender` stages and submits up to `chunks` chunks of its first admitted request with
    /// chunks left (its last batch when they are the last), after asking for staging for its
    /// unadmitted requests too (which the core must refuse).
    Submit {
        /// 0 or 1.
        sender: usize,
        /// At most this many chunks.
        chunks: u32,
    },
    /// One chunk of the youngest admitted request with chunks left, staged and submitted
    /// at once: a caller that does not follow the oldest-first order, which the core must
    /// hold to it while an older request waits for staging (S9).
    SubmitYoungest {
        /// 0 or 1.
        sender: usize,
    },
    /// One chunk of the youngest admitted request with two or more chunks left is staged
    /// and added to its pending batch, not submitted: a caller that interleaves requests
    /// and submits later, whose pending batches the core flushes when only they hold
    /// staging (S11).
    Add {
        /// 0 or 1.
        sender: usize,
    },
    /// The oldest message from this sender to the receiver arrives.
    ToReceiver(usize),
    /// The oldest message from the receiver to this sender arrives.
    ToSender(usize),
    /// `sender`'s oldest posted write completes.
    Write {
        /// 0 or 1.
        sender: usize,
        /// It fails without landing, instead of landing.
        fail: bool,
    },
    /// `sender` cancels one of the requests it began (ended ones included).
    Cancel {
        /// 0 or 1.
        sender: usize,
        /// Which request, modulo how many it began.
        pick: usize,
    },
    /// Time passes; every timer due fires.
    Advance(Duration),
    /// The decoder reads and consumes a ready request (this index modulo how many are).
    Consume(usize),
    /// This sender's control connection breaks, with its fabric connection.
    LoseConnection(usize),
    /// Caller placement (`OpWorld::placed`): the application lends slots to a begun request
    /// it has not reserved (this index modulo how many it has the slots for).
    Reserve(usize),
    /// Caller placement: the application withdraws a reservation out (an abort on the
    /// decode side; this index modulo how many are out).
    Withdraw(usize),
}

/// A message as it comes off the wire: encoded and decoded again when it is sent, so that
/// every message goes through the codec. Shared by every clone of the world (links are
/// immutable), so the explorer neither copies nor re-decodes it per state.
fn through_the_wire(msg: &Message) -> Rc<Message> {
    let bytes = wire::encode(msg);
    Rc::new(wire::decode(&bytes).expect("invariant: the codec decodes what it encoded"))
}

#[derive(Debug, Clone)]
struct Side {
    flow: SenderFlow,
    /// Requests begun here: id, declared total, chunks given staging so far (added or submitted).
    requests: Vec<(ReqId, u32, u32)>,
    to_receiver: VecDeque<Rc<Message>>,
    to_sender: VecDeque<Rc<Message>>,
    writes: VecDeque<WriteOp>,
}

/// The world the bytes drive.
#[derive(Debug, Clone)]
pub struct OpWorld {
    now: Instant,
    sides: Vec<Side>,
    receiver: ReceiverLedger,
    ready: Vec<ReqKey>,
    begun: u32,
    checker: Checker,
    /// Shares bind (§Fair shares) and the liveness checks apply (`contended`).
    contended: bool,
    /// Set while `heal` runs: a request timing out in the admission queue then is a
    /// liveness failure of the contended world.
    healing: bool,
    /// Whether `enabled` offers failing writes and cancels (`without_faults` turns them off).
    faults: bool,
    /// Caller placement's application (`placed`); `None`: the receiver places requests.
    app: Option<placed::App>,
    /// The fabric's mirror of the grants, where it is modelled (`placed_revoking`): each
    /// slot's current grant and whether its one write came. A write it does not admit fails
    /// at the sender without landing, as on the TCP and shared-memory fabrics.
    mirror: Option<Vec<Option<(crate::slots::SlotGrant, bool)>>>,
}

impl Default for OpWorld {
    fn default() -> Self {
        Self::new()
    }
}

impl OpWorld {
    /// 6 buffer slots, 4 staging slots per sender: small enough to fill.
    pub fn new() -> Self {
        Self::with_slots(6, 4)
    }

    /// `buffer_slots` at the receiver, `staging_slots` at each sender, the same timeouts: a
    /// smaller world, where fewer chunks are enough to fill the buffer or the staging.
    pub fn with_slots(buffer_slots: u32, staging_slots: u32) -> Self {
        Self::build(SENDERS, buffer_slots, staging_slots, 100)
    }

    /// Three senders whose shares bind: `peer_share_percent` of `buffer_slots` each while
    /// another contends. Admission and the sender's wait for it last far longer than every
    /// other timer chain of a small plan (600 s against a few tens), so that a request which
    /// times out waiting while the world heals was held back by the rule, not by the clock.
    pub fn contended(buffer_slots: u32, staging_slots: u32, peer_share_percent: u32) -> Self {
        Self::build(
            CONTENDING_SENDERS,
            buffer_slots,
            staging_slots,
            peer_share_percent,
        )
    }

    /// Two senders and a receiver under caller placement (`docs/spec/protocol.md` §Caller
    /// placement): the decoding application owns the `buffer_slots` and lends each begun
    /// request's slots when it has them (`Event::Reserve`), withdraws reservations
    /// (`Event::Withdraw`, a fault), and gets them back from the ledger.
    pub fn placed(buffer_slots: u32, staging_slots: u32) -> Self {
        let mut world = Self::build(SENDERS, buffer_slots, staging_slots, 100);
        let cfg = ReceiverConfig {
            placement: crate::config::Placement::Caller,
            ..world.receiver.config().clone()
        };
        world.receiver = ReceiverLedger::new(cfg).expect("invariant: valid receiver config");
        world.app = Some(placed::App::new(buffer_slots, 0));
        world
    }

    /// `placed`, where the application holds the first chunk of every request of two or more
    /// chunks already (a decode engine's local prefix hit, `handle_reserve_held`): the
    /// sender still sends it and is answered that it is sent; it takes no slot.
    pub fn placed_holding(buffer_slots: u32, staging_slots: u32) -> Self {
        let mut world = Self::placed(buffer_slots, staging_slots);
        world.app = Some(placed::App::new(buffer_slots, 1));
        world
    }

    /// `placed`, on a fabric that stops a revoked grant's write (TCP, shared memory):
    /// the fabric's grant mirror is modelled, and the ledger returns a failed request's slots
    /// as it revokes their grants (`ReceiverLedger::with_revocation_stopping_writes`), with
    /// no quarantine.
    pub fn placed_revoking(buffer_slots: u32, staging_slots: u32) -> Self {
        let mut world = Self::placed(buffer_slots, staging_slots);
        world.receiver = world.receiver.with_revocation_stopping_writes();
        world.mirror = Some(vec![None; buffer_slots as usize]);
        world
    }

    /// Two senders whose staging is the application's own memory (`docs/spec/protocol.md`
    /// §Caller staging): a batch names the slots its chunks are read from — chunk k of every
    /// request reads slot `k % staging_slots`, so a sender's requests read the same slots at
    /// once, as requests sharing a prefix block do — and nothing is allocated. Every
    /// `Drained` is checked to come only once the failed request's posted writes have all
    /// completed (S13).
    pub fn caller_staging(buffer_slots: u32, staging_slots: u32) -> Self {
        let mut world = Self::build(SENDERS, buffer_slots, staging_slots, 100);
        for side in &mut world.sides {
            let cfg = SenderConfig {
                staging_placement: crate::config::Placement::Caller,
                ..side.flow.config().clone()
            };
            side.flow = SenderFlow::new(cfg).expect("invariant: valid sender config");
        }
        world
    }

    /// Whether the modelled fabric lets `op` (a write of sender `s`) land, closing its grant
    /// when it does; always, where no mirror is modelled.
    fn fabric_admits(&mut self, s: usize, op: &WriteOp) -> bool {
        let (Some(mirror), Some(tag)) = (self.mirror.as_mut(), op.tag) else {
            return true;
        };
        match mirror.get_mut(tag.slot.0 as usize) {
            Some(Some((grant, written)))
                if grant.peer == PeerId(s as u64)
                    && grant.generation == tag.generation
                    && !*written =>
            {
                *written = true;
                true
            }
            _ => false,
        }
    }

    fn build(senders: usize, buffer_slots: u32, staging_slots: u32, share: u32) -> Self {
        let contended = share < 100;
        let admission_timeout = if contended { 600 } else { 5 };
        let receiver_cfg = ReceiverConfig {
            buffer_slots,
            request_idle_timeout: Duration::from_secs(5),
            write_quarantine: Duration::from_secs(10),
            admission_timeout: Duration::from_secs(admission_timeout),
            unconsumed_ttl: Duration::from_secs(20),
            // At 100 admission is plain FIFO, which A2 checks; below, §Fair shares, which
            // admission's own invariants check.
            peer_share_percent: share,
            ..ReceiverConfig::default()
        };
        let sender_cfg = SenderConfig {
            staging_slots,
            reply_timeout: Duration::from_secs(2),
            admission_reply_timeout: Duration::from_secs(admission_timeout + 3),
            write_timeout: Duration::from_secs(2),
            notify_proxy_on_failure: true,
            ..SenderConfig::default()
        };
        receiver_cfg
            .check_sender(&sender_cfg)
            .expect("invariant: a valid deployment");
        let side = || Side {
            flow: SenderFlow::new(sender_cfg.clone()).expect("invariant: valid sender config"),
            requests: Vec::new(),
            to_receiver: VecDeque::new(),
            to_sender: VecDeque::new(),
            writes: VecDeque::new(),
        };
        Self {
            now: Instant::ZERO,
            sides: (0..senders).map(|_| side()).collect(),
            receiver: ReceiverLedger::new(receiver_cfg).expect("invariant: valid receiver config"),
            ready: Vec::new(),
            begun: 0,
            checker: Checker::default(),
            contended,
            healing: false,
            faults: true,
            app: None,
            mirror: None,
        }
    }

    /// The same world with neither failing writes nor cancels among the explorer's events:
    /// the interleavings of admission, batches, writes, timers and consumes alone, for a plan
    /// too large to explore with every fault (the faults are explored at smaller sizes).
    pub fn without_faults(mut self) -> Self {
        self.faults = false;
        self
    }

    /// Runs the events the bytes describe, then heals; panics on any broken rule.
    pub fn run(bytes: &[u8]) {
        let mut world = OpWorld::new();
        for pair in bytes.chunks_exact(2).take(OPS_MAX) {
            world.step(pair[0], pair[1]);
        }
        world.heal();
    }

    /// One event, decoded from two bytes.
    pub fn step(&mut self, op: u8, arg: u8) {
        let sender = usize::from(arg) % SENDERS;
        let event = match op % 10 {
            0 => Event::Begin {
                sender,
                total: 1 + u32::from(arg / 2) % 8,
            },
            1 => Event::Submit {
                sender,
                chunks: 1 + u32::from(arg / 2) % 3,
            },
            2 => Event::ToReceiver(sender),
            3 => Event::ToSender(sender),
            4 => Event::Write {
                sender,
                fail: arg & 0x80 != 0,
            },
            5 => Event::Cancel {
                sender,
                pick: usize::from(arg / 2),
            },
            6 => Event::Advance(Duration::from_millis(100 * u64::from(arg))),
            7 => Event::Consume(usize::from(arg)),
            8 if arg > 240 => Event::LoseConnection(sender),
            8 if arg.is_multiple_of(2) => Event::Add { sender },
            9 => Event::SubmitYoungest { sender },
            _ => Event::ToReceiver(sender),
        };
        self.apply(event);
    }

    /// Applies one event, then checks every invariant.
    pub fn apply(&mut self, event: Event) {
        match event {
            Event::Begin { sender, total } => self.begin(sender, total),
            Event::Submit { sender, chunks } => self.submit(sender, chunks),
            Event::SubmitYoungest { sender } => self.submit_youngest(sender),
            Event::Add { sender } => self.add(sender),
            Event::ToReceiver(s) => self.deliver_to_receiver(s),
            Event::ToSender(s) => self.deliver_to_sender(s),
            Event::Write { sender, fail } => self.complete_write(sender, fail),
            Event::Cancel { sender, pick } => self.cancel(sender, pick),
            Event::Advance(by) => self.advance(by),
            Event::Consume(pick) => self.consume(pick),
            Event::LoseConnection(s) => self.lose_connection(s),
            Event::Reserve(pick) => self.reserve(pick),
            Event::Withdraw(pick) => self.withdraw(pick),
        }
        self.pump();
        self.check();
    }

    /// The events that would change something now, for the explorer: each queue's head, each
    /// side's oldest write (landing or failing), a cancel of each request still live, a
    /// consume of each ready request, a batch of one chunk (and of two, where that differs),
    /// and time jumping to the next deadline. Events that would change nothing (a batch with
    /// no admitted request or no free staging, a cancel of a request already failing or gone,
    /// a consume of an entry whose request is no longer ready) are left out: they would only
    /// lead back to the same state.
    pub fn enabled(&self) -> Vec<Event> {
        let mut events = Vec::new();
        for (s, side) in self.sides.iter().enumerate() {
            // `submit` takes the first admitted request with chunks left.
            let left = side
                .requests
                .iter()
                .find(|(id, total, done)| done < total && side.flow.is_admitted(id))
                .map_or(0, |(_, total, done)| total - done);
            let free = side.flow.staging_free();
            // With no staging free, `submit` registers the request as waiting for it (once).
            let oldest = side
                .requests
                .iter()
                .find(|(id, total, done)| done < total && side.flow.is_admitted(id));
            let waits = oldest.is_some_and(|(id, _, _)| {
                side.flow.staging_waiters().iter().any(|(_, w, _)| w == id)
            });
            if left > 0 && (free > 0 || !waits) {
                events.push(Event::Submit {
                    sender: s,
                    chunks: 1,
                });
            }
            let youngest = side
                .requests
                .iter()
                .rfind(|(id, total, done)| done < total && side.flow.is_admitted(id));
            if free > 0 && youngest.map(|y| &y.0) != oldest.map(|o| &o.0) {
                events.push(Event::SubmitYoungest { sender: s });
            }
            // `add` takes the youngest admitted request with two or more chunks left.
            let adds_to = side
                .requests
                .iter()
                .rfind(|(id, total, done)| done + 1 < *total && side.flow.is_admitted(id));
            let add_waits = adds_to.is_some_and(|(id, _, _)| {
                side.flow.staging_waiters().iter().any(|(_, w, _)| w == id)
            });
            if adds_to.is_some() && (free > 0 || !add_waits) {
                events.push(Event::Add { sender: s });
            }
            if left > 1 && free > 1 {
                events.push(Event::Submit {
                    sender: s,
                    chunks: 2,
                });
            }
            if !side.to_receiver.is_empty() {
                events.push(Event::ToReceiver(s));
            }
            if !side.to_sender.is_empty() {
                events.push(Event::ToSender(s));
            }
            if !side.writes.is_empty() {
                events.push(Event::Write {
                    sender: s,
                    fail: false,
                });
                if self.faults {
                    events.push(Event::Write {
                        sender: s,
                        fail: true,
                    });
                }
            }
            for (pick, (id, _, _)) in side.requests.iter().enumerate() {
                if self.faults && side.flow.is_cancellable(id) {
                    events.push(Event::Cancel { sender: s, pick });
                }
            }
        }
        for (pick, key) in self.ready.iter().enumerate() {
            let first = self.ready.iter().position(|k| k == key) == Some(pick);
            if first && self.receiver.is_ready(key) {
                events.push(Event::Consume(pick));
            }
        }
        self.placed_events(&mut events);
        if let Some(at) = self.next_deadline() {
            events.push(Event::Advance(at - self.now));
        }
        events
    }

    /// The explorer's canonical encoding of the world (`canon.rs`). Left out: `now`
    /// (every time is written relative to it); `begun` (the explorer's position in its plan,
    /// which it hashes itself); the checker (its violations are empty, or `check` panicked,
    /// and `writes_landed` is read only by `Cluster`'s delivery check, never here); and
    /// `ready`, which follows from the receiver: a request is ready iff it has an entry
    /// (pushed when it became ready; removing one consumes it), and an entry whose request
    /// is not ready is stale, its consume a no-op. Of the harness's own request records only
    /// an admitted request's count of submitted chunks is ever read (`submit`).
    pub(crate) fn canon(&self, enc: &mut Canon) {
        enc.reset(self.now);
        self.canon_app(enc);
        self.receiver.canon(enc);
        for (s, side) in self.sides.iter().enumerate() {
            enc.set_sender(s);
            side.flow.canon(enc);
            enc.len(side.requests.len());
            for (id, _, done) in &side.requests {
                let admitted = side.flow.is_admitted(id);
                enc.u(if admitted { 1 + u64::from(*done) } else { 0 });
            }
            for link in [&side.to_receiver, &side.to_sender] {
                enc.len(link.len());
                link.iter().for_each(|m| enc.message(m));
            }
            enc.len(side.writes.len());
            for op in &side.writes {
                enc.write_id(op.id);
                enc.str(&op.req_id.0);
                enc.u(op.receiver.0);
                enc.u(u64::from(op.chunk));
                enc.staging(op.staging);
                enc.slot(op.remote);
                match op.tag {
                    Some(tag) => enc.tag(tag),
                    None => enc.len(usize::MAX),
                }
            }
        }
        // A mirrored grant is always the slot's current one (the ledger's generation), so
        // its holder and whether its write came say all of it.
        if let Some(mirror) = &self.mirror {
            for slot in enc.named_slots(self.receiver.capacity()) {
                match mirror[slot.0 as usize] {
                    None => enc.len(0),
                    Some((grant, written)) => {
                        enc.len(1 + usize::from(written));
                        enc.u(grant.peer.0);
                    }
                }
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let senders = self
            .sides
            .iter()
            .filter_map(|s| s.flow.poll_timeout())
            .min();
        crate::time::earliest(senders, self.receiver.poll_timeout())
    }

    /// The world's clock.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// True when every request has ended and both buffers are entirely free.
    pub fn settled(&self) -> bool {
        self.sides
            .iter()
            .all(|s| s.flow.is_quiescent() && s.to_receiver.is_empty() && s.to_sender.is_empty())
            && self.receiver.is_quiescent()
            && self.app_settled()
    }

    fn deliver_to_receiver(&mut self, s: usize) {
        if let Some(msg) = self.sides[s].to_receiver.pop_front() {
            let msg = Rc::unwrap_or_clone(msg);
            let cancelled = match &msg {
                Message::CancelNotif(c) => Some(ReqKey {
                    peer: PeerId(s as u64),
                    req_id: ReqId(c.req_id.clone()),
                }),
                _ => None,
            };
            self.receiver
                .handle_message(self.now, PeerId(s as u64), msg);
            // A cancel releases the request at once (no decoder holds a read lease here:
            // consumes are atomic in this world), or it only looked acknowledged.
            if let Some(key) = cancelled {
                assert!(
                    self.receiver.request_slots(&key).is_none(),
                    "checker: {key}'s CancelNotif was acknowledged but the receiver still holds the request"
                );
            }
        }
    }

    fn deliver_to_sender(&mut self, s: usize) {
        if let Some(msg) = self.sides[s].to_sender.pop_front() {
            let msg = Rc::unwrap_or_clone(msg);
            self.sides[s].flow.handle_message(self.now, PeerId(0), msg);
        }
    }

    /// The oldest posted write of sender `s` completes (verbs: in order per connection):
    /// it lands and succeeds, or fails without landing.
    fn complete_write(&mut self, s: usize, fail: bool) {
        let Some(op) = self.sides[s].writes.pop_front() else {
            return;
        };
        // A write the fabric's mirror refuses fails without landing.
        let fail = fail || !self.fabric_admits(s, &op);
        if !fail {
            let key = ReqKey {
                peer: PeerId(s as u64),
                req_id: op.req_id.clone(),
            };
            self.checker.on_write(&self.receiver, &key, &op);
            if let Some(tag) = op.tag {
                self.receiver.handle_chunk_landed(
                    self.now,
                    LandedWrite {
                        peer: PeerId(s as u64),
                        slot: op.remote,
                        tag,
                        bytes: 1,
                        checksum: ChecksumCheck::Match,
                    },
                );
            }
        }
        let result = if fail {
            Err("injected".to_owned())
        } else {
            Ok(())
        };
        self.sides[s]
            .flow
            .handle_write_done(self.now, op.id, result);
    }

    fn cancel(&mut self, s: usize, pick: usize) {
        let side = &mut self.sides[s];
        if side.requests.is_empty() {
            return;
        }
        let id = side.requests[pick % side.requests.len()].0.clone();
        let _ = side.flow.handle_cancel(self.now, &id);
    }

    fn advance(&mut self, by: Duration) {
        self.now = self.now + by;
        for side in &mut self.sides {
            side.flow.handle_timeout(self.now);
        }
        self.receiver.handle_timeout(self.now);
    }

    fn consume(&mut self, pick: usize) {
        if self.ready.is_empty() {
            return;
        }
        let key = self.ready.remove(pick % self.ready.len());
        if self.receiver.handle_acquire(&key).is_ok() {
            let _ = self.receiver.handle_consume(self.now, &key);
        }
    }

    /// The control connection of sender `s` breaks: both directions lose what was queued.
    /// Its fabric connection is reset too, which flushes its writes without landing them.
    fn lose_connection(&mut self, s: usize) {
        let side = &mut self.sides[s];
        side.to_receiver.clear();
        side.to_sender.clear();
        side.flow.handle_receiver_lost(self.now, PeerId(0));
        while let Some(op) = side.writes.pop_front() {
            side.flow
                .handle_write_done(self.now, op.id, Err("flushed".into()));
        }
    }

    fn pump(&mut self) {
        for side in &mut self.sides {
            while let Some(t) = side.flow.poll_transmit() {
                if t.to == Destination::Receiver(PeerId(0)) {
                    side.to_receiver.push_back(through_the_wire(&t.msg));
                }
            }
            while let Some(op) = side.flow.poll_write() {
                side.writes.push_back(op);
            }
            let mut stalled = false;
            while let Some(ev) = side.flow.poll_event() {
                stalled |= matches!(ev, SenderEvent::FabricStalled { .. });
                // S13: the application may reuse a drained request's slots: no posted write
                // of it may still read one, and it failed.
                if let SenderEvent::Drained { req_id } = &ev {
                    assert!(
                        !side.writes.iter().any(|w| &w.req_id == req_id),
                        "checker: {} drained while a posted write still reads its staging",
                        req_id.0
                    );
                    assert!(
                        matches!(side.flow.outcome(req_id), Some(Err(_))),
                        "checker: {} drained without having failed",
                        req_id.0
                    );
                }
                // The receiver here is kvx's own: a reply its sender cannot use is its bug.
                if let SenderEvent::Failed {
                    req_id,
                    failure: crate::sender::SendFailure::BadReply(why),
                    ..
                } = &ev
                {
                    panic!("checker: {} got a reply it cannot use: {why}", req_id.0);
                }
            }
            // What a driver does on a stalled write: reset the fabric connection, which
            // flushes every outstanding write with an error; nothing lands after that.
            if stalled {
                while let Some(op) = side.writes.pop_front() {
                    side.flow
                        .handle_write_done(self.now, op.id, Err("flushed".into()));
                }
                while side.flow.poll_event().is_some() {}
            }
        }
        // The fabric's mirror of the grants, where it is modelled (`placed_revoking`; the
        // cluster harness models it too), takes every change before the replies go out.
        while let Some(change) = self.receiver.poll_grant_change() {
            if let Some(mirror) = self.mirror.as_mut() {
                mirror[change.slot.0 as usize] = change.grant.map(|g| (g, false));
            }
        }
        while let Some((peer, reply)) = self.receiver.poll_transmit() {
            let side = &mut self.sides[peer.0 as usize];
            side.to_sender
                .push_back(through_the_wire(&Message::AllocResponse(reply)));
        }
        while let Some(ev) = self.receiver.poll_event() {
            match ev {
                ReceiverEvent::Ready { key, .. } => self.ready.push(key),
                ReceiverEvent::Returned {
                    req_id,
                    slots,
                    outcome,
                } => self.on_returned(&req_id, slots, &outcome),
                ReceiverEvent::Ended {
                    key,
                    outcome: Outcome::Failed(why),
                } if self.contended => self.check_served(&key, &why),
                _ => {}
            }
        }
    }

    /// The contended world's promise (§Fair shares): every request fits its buffer, so none
    /// is refused for its size or a queue bound, and with the decoder consuming none times
    /// out waiting for admission.
    fn check_served(&self, key: &ReqKey, why: &Failure) {
        match why {
            Failure::LargerThanBuffer { .. }
            | Failure::AdmissionQueueFull { .. }
            | Failure::PeerQueueFull { .. }
            | Failure::TooManyRequests { .. } => {
                panic!("checker: {key} fits the buffer but was refused: {why}")
            }
            Failure::AdmissionTimeout if self.healing => panic!(
                "liveness: {key} timed out waiting for admission while the decoder consumed \
                 and every sender finished its requests"
            ),
            _ => {}
        }
    }

    fn check(&self) {
        for side in &self.sides {
            side.flow.check_invariants();
        }
        self.receiver.check_invariants();
        // FIFO admission is the plain world's rule; shares reorder the contended world's, and
        // under caller placement the application's reservations decide the order.
        let fifo = !self.contended && self.app.is_none();
        if let (true, Some((admitted, waiting))) = (fifo, self.receiver.admitted_out_of_order()) {
            panic!("checker: {admitted} was admitted while {waiting}, which queued before it, waits (A2: admission is FIFO)");
        }
        if let Err(v) = self.checker.first_violation() {
            panic!("checker: {v}");
        }
    }

    /// Faults stop: deliver and complete everything, consume what is ready, let time pass.
    /// Every request must end and both buffers must be entirely free.
    pub fn heal(&mut self) {
        self.healing = true;
        for round in 0..10_000 {
            let busy = self.sides.iter().any(|s| {
                !s.to_receiver.is_empty() || !s.to_sender.is_empty() || !s.writes.is_empty()
            });
            if busy {
                for s in 0..self.sides.len() {
                    self.deliver_to_receiver(s);
                    self.pump();
                    self.deliver_to_sender(s);
                    self.pump();
                    self.complete_write(s, false);
                    self.pump();
                    self.submit(s, 3);
                    self.pump();
                }
            } else if !self.ready.is_empty() {
                self.consume(0);
                self.pump();
            } else {
                let unfinished = self.sides.iter().any(|s| !s.flow.is_quiescent())
                    || !self.receiver.is_quiescent()
                    || !self.app_settled();
                if !unfinished {
                    return;
                }
                self.reserve_all();
                // Let every timer run (leases, TTLs, quarantines); submit what can be.
                for s in 0..self.sides.len() {
                    self.submit(s, 3);
                }
                self.advance(Duration::from_secs(1));
                self.pump();
            }
            self.check();
            assert!(round < 9_999, "healed world did not settle: {self:?}");
        }
    }
}
