//! The receiver: admission, per-request slot ledger, rollback, leases and tombstones
//! (`docs/spec/protocol.md` §Receiver).
//!
//! - `mod.rs`: `ReceiverLedger`, its inputs (`handle_*`), outputs (`poll_*`) and timers.
//! - `batch.rs`: what one `AllocRequest` does to a request.
//! - `landing.rs`: what a landed write must prove before it counts (grant holder, slot,
//!   length, checksum).
//! - `outcome.rs`: `Failure` / `Outcome` and the reasons a sender reads.
//! - `tombstones.rs`: ended ids remembered for a while, so late batches are refused.
//! - `placement.rs`: caller placement, where the application lends each request's slots
//!   (`handle_reserve`, `handle_withdraw`, `ReceiverEvent::Returned`).
//! - `stalls.rs`: a reservation that lands nothing for `stall_timeout` while another
//!   principal waits is taken back (`Failure::Stalled`).
//! - `checks.rs`: `check_invariants`, the ledger's consistency checks.
//! - `canon.rs` (feature `testing`): the explorer's canonical encoding.

mod batch;
#[cfg(feature = "testing")]
mod canon;
mod checks;
mod landing;
mod outcome;
mod placement;
mod principals;
mod stalls;
mod tombstones;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use crate::admission::Admission;
use crate::config::{Checked, ConfigError, Placement, ReceiverConfig};
use crate::ids::{PeerId, Principal, ReqId, ReqKey, SlotIndex, Ticket, WriteTag};
use crate::slots::{GrantChange, SlotTable};
use crate::time::{earliest, Instant};
use crate::wire::{AllocRequest, AllocResponse, CancelNotif, Message};

pub use landing::{ChecksumCheck, LandedWrite, LandingVerdict};
pub use outcome::{Failure, Outcome};
pub use placement::PlacementError;
use tombstones::Tombstones;

/// Something the decoder (or a metrics exporter) should know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceiverEvent {
    /// The request holds its reservation; `waited` is its time in the admission queue.
    Admitted {
        /// The request.
        key: ReqKey,
        /// The slots reserved for it.
        total_chunks: u32,
        /// Its time in the admission queue (zero when admitted at once).
        waited: Duration,
    },
    /// Every chunk is allocated and written: the decoder may read `slots` (chunk order)
    /// and must then call `handle_consume`.
    Ready {
        /// The request.
        key: ReqKey,
        /// Its slots, one per chunk, in chunk order.
        slots: Vec<SlotIndex>,
        /// The sender's cache key of each chunk, parallel to `slots`.
        keys: Vec<String>,
        /// How its chunks are laid out, as its first batch said.
        layout: ChunkLayout,
        /// Each chunk's token count where a batch named it (its last chunk, LMCache's
        /// `last_chunk_toks`), parallel to `slots`; `None`: a full chunk of `layout.shape`.
        tokens: Vec<Option<u64>>,
    },
    /// The request ended; exactly one per request that was ever tracked or refused.
    Ended {
        /// The request.
        key: ReqKey,
        /// Consumed, or why it failed.
        outcome: Outcome,
    },
    /// Caller placement: reservation `req_id` is back with the application, and no write can
    /// land in its slots any more; exactly one per accepted `handle_reserve`, after its
    /// request's `Ended` if a sender claimed it.
    Returned {
        /// The reservation's request id.
        req_id: ReqId,
        /// Its slots, as reserved.
        slots: Vec<SlotIndex>,
        /// Its request consumed, or why not (`Withdrawn`, `Unclaimed`, or its request's
        /// failure).
        outcome: Outcome,
    },
}

/// How a request's chunks are laid out, as its first batch described them: what a decoder
/// needs to view a slot's bytes as the tensor the sender staged (LMCache's `MemoryFormat`
/// value, the shape of one full chunk, and the torch dtype name). kvx moves the bytes
/// without reading them; it only passes this on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChunkLayout {
    /// LMCache `MemoryFormat` value (`KV_2LTD` = 1).
    pub fmt: u32,
    /// Shape of one full chunk.
    pub shape: Vec<u64>,
    /// torch dtype name.
    pub dtype: String,
}

/// Why `handle_consume` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumeError {
    /// The request is not tracked: it ended (its `Ended` event is out or on its way), or
    /// never existed. A decoder skips it.
    #[error("request {0} is not known to this receiver")]
    Unknown(ReqKey),
    /// The request is tracked but not ready (for `handle_external_ready`: a kvx sender's
    /// request, or its last batch is not allocated yet). Wait for its `Ready` event.
    #[error("request {0} is not ready: its chunks are not all written yet")]
    NotReady(ReqKey),
    /// The receiver itself has stopped: the task that drives this ledger (kvx-node's driver)
    /// ended, after a shutdown or because its runtime went away. Never from the ledger; the
    /// handles' answer once no driver can serve them. Nothing on this receiver can succeed
    /// any more: make a new one.
    #[error("this receiver has stopped (shut down, or its runtime ended): make a new receiver")]
    Stopped,
}

/// Counters since start, for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Requests admitted (at once or from the queue).
    pub admitted: u64,
    /// Messages refused on arrival.
    pub refused: u64,
    /// Requests that failed after they were tracked.
    pub rolled_back: u64,
    /// Requests the decoder consumed.
    pub consumed: u64,
    /// Landed writes of a grant no longer current (duplicates, late writes into a reused
    /// slot): ignored.
    pub stale_landings: u64,
    /// Landed writes refused: not the grant holder's, or not the slot their immediate names.
    pub refused_landings: u64,
    /// Chunks that landed empty or failed their checksum (each failed its request).
    pub corrupt_chunks: u64,
    /// Reservations taken back because nothing landed for `stall_timeout` while another
    /// principal waited (`Failure::Stalled`).
    pub stalled: u64,
}

#[derive(Debug, Clone)]
pub(crate) enum Phase {
    /// The first batch waits in the admission queue; it is answered once admitted.
    Waiting { first: AllocRequest },
    /// Admitted; batches arrive.
    Receiving,
    /// The last batch is allocated; waiting for writes to land.
    Complete,
    /// Every chunk landed; waiting for the decoder.
    Ready,
}

#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub ticket: Ticket,
    /// The chunks to write: as declared, less `held`.
    pub total: u32,
    /// Caller placement: the request's first chunks, which the application holds already
    /// (answered as sent, never granted); 0 otherwise.
    pub held: u32,
    /// Of those, the ones no batch has brought yet.
    pub held_left: u32,
    /// The reservation this request holds (0 while waiting); shrinks to the allocated count
    /// when the last batch comes early (the sender sent fewer chunks than declared).
    pub reservation: u32,
    pub phase: Phase,
    pub slots: Vec<WriteTag>,
    pub keys: Vec<String>,
    /// Parallel to `keys`: the token count a batch named for its last chunk.
    pub tokens: Vec<Option<u64>>,
    /// Parallel to `keys`: each chunk's length as its batch declared it (`None`: a legacy
    /// sender's batch, which declares none). Its one write must bring exactly this many.
    pub bytes: Vec<Option<u64>>,
    /// From the first batch.
    pub layout: ChunkLayout,
    pub landed: u32,
    /// A kvx sender tells of each landed write; an LMCache sender does not, so its
    /// requests are ready only when the application says so (`handle_external_ready`).
    pub notices: bool,
    pub arrived: Instant,
    /// When this request's current timer fires (admission, idle, or unconsumed).
    pub deadline: Instant,
    /// The decoder acquired it and is reading (`handle_acquire`).
    pub reading: bool,
    /// A failure that arrived while the decoder was reading; it ends the request at consume.
    pub doomed: Option<Failure>,
}

/// The decode side's state machine: admission, the buffer's slots, every tracked request
/// from its first batch to its end, and the ids of ended ones (`docs/spec/protocol.md`
/// §Receiver).
///
/// Contract: it takes each decoded control message with `handle_message(now, peer, …)`,
/// each write the fabric applied with `handle_chunk_landed`, the decoder's `handle_acquire`
/// and `handle_consume` (and `handle_external_ready` for a legacy sender's request), and
/// `handle_timeout(now)` once `now` reaches `poll_timeout()`. Each call may queue grant
/// changes (`poll_grant_change`), replies (`poll_transmit`) and events (`poll_event`:
/// `Admitted`, `Ready`, then exactly one `Ended` per request it tracked or refused; a batch
/// with an empty or overlong id gets none). After every call the driver drains them in that
/// order, applying every grant change to the fabric's access mirror before it sends a reply
/// (a reply hands grants out and the write may follow at once), then asks `poll_timeout`
/// again.
///
/// The driver guarantees that `now` never goes back; that `peer` is the same number for the
/// same control connection and that a landed write's `peer` is the control peer its fabric
/// connection authenticated as (the credential sent in the replies to that peer), so a
/// grant binds the writer; and that the decoder calls `handle_acquire` before it reads a
/// ready request's slots (which keeps them put through a cancel) and `handle_consume` once
/// it has read them. The node's driver also feeds landings already waiting before control
/// messages, so a write is seen before any message its completion caused.
#[derive(Debug, Clone)]
pub struct ReceiverLedger {
    cfg: ReceiverConfig,
    admission: Admission,
    slots: SlotTable,
    requests: BTreeMap<ReqKey, Request>,
    tickets: BTreeMap<Ticket, ReqKey>,
    timers: BTreeSet<(Instant, Ticket)>,
    /// Stall deadlines of the admitted requests (`stalls.rs`).
    stalls: stalls::Stalls,
    next_ticket: u64,
    tombstones: Tombstones,
    /// Which principal each peer's share counts under.
    principals: principals::Principals,
    /// What the first batches waiting for admission hold (`batch::queued_bytes`).
    queued_bytes: usize,
    /// Caller placement's reservations (empty under `Placement::Pool`).
    placements: placement::Placements,
    /// The driver's fabric stops a revoked grant's write (`with_revocation_stopping_writes`).
    revocation_stops_writes: bool,
    /// The buffer's slot size, when the driver told it (`with_slot_bytes`).
    slot_bytes: Option<u64>,
    transmits: VecDeque<(PeerId, AllocResponse)>,
    events: VecDeque<ReceiverEvent>,
    stats: ReceiverStats,
}

impl ReceiverLedger {
    /// An empty buffer of `cfg.buffer_slots` slots. `new` refuses what `ReceiverConfig::validate`
    /// refuses.
    pub fn new(cfg: ReceiverConfig) -> Result<Self, ConfigError> {
        Ok(Self::from_checked(cfg.validate()?))
    }

    /// `new`, with a configuration checked already (a driver's, a binding's): not checked
    /// again.
    pub fn from_checked(cfg: Checked<ReceiverConfig>) -> Self {
        let cfg = cfg.into_inner();
        Self {
            admission: Admission::new(cfg.admission_limits()),
            slots: match cfg.placement {
                Placement::Pool => SlotTable::new(cfg.buffer_slots),
                Placement::Caller => SlotTable::for_caller(cfg.buffer_slots),
            },
            placements: placement::Placements::default(),
            revocation_stops_writes: false,
            slot_bytes: None,
            tombstones: Tombstones::new(
                cfg.tombstone_ttl,
                cfg.tombstones_max,
                cfg.tombstones_bytes_max,
            ),
            queued_bytes: 0,
            principals: principals::Principals::default(),
            cfg,
            requests: BTreeMap::new(),
            tickets: BTreeMap::new(),
            timers: BTreeSet::new(),
            stalls: stalls::Stalls::default(),
            next_ticket: 0,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: ReceiverStats::default(),
        }
    }

    /// The driver's fabric lands every byte through its access mirror, so once a grant's
    /// revocation is mirrored no byte of its write can land (`FabricListener::
    /// revocation_stops_writes`: TCP, shared memory, in memory; not RDMA). Under caller
    /// placement a failed request's slots then go back to the application as its grants are
    /// revoked, without quarantine (`docs/spec/protocol.md` §Caller placement): the driver
    /// mirrors every grant change before it hands on the `Returned` event. Pool placement
    /// keeps its quarantine either way (a late write that still lands clears it).
    pub fn with_revocation_stopping_writes(mut self) -> Self {
        self.revocation_stops_writes = true;
        self
    }

    /// The buffer's slot size in bytes, which the driver knows from its memory: a batch that
    /// declares a longer chunk fails its request at once (`Failure::ChunkSizeMismatch`),
    /// naming both sizes, rather than at its first write (which could never land).
    pub fn with_slot_bytes(mut self, bytes: u64) -> Self {
        self.slot_bytes = Some(bytes);
        self
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &ReceiverConfig {
        &self.cfg
    }

    /// Tells the ledger who stands behind `peer` (a transport's `Principal`: the client's
    /// public key, or its source address), before `peer`'s messages are handled. Its
    /// requests, quarantined slots and waiters then count against that principal's share
    /// and queue bound (§Principals). A peer that holds something keeps the key it took it
    /// under until it holds nothing; returns whether `peer` is bound to `principal` now.
    pub fn bind_principal(&mut self, peer: PeerId, principal: Principal) -> bool {
        let (requests, slots) = (&self.requests, &self.slots);
        self.principals.bind(peer, principal, |p| {
            let first = ReqKey {
                peer: p,
                req_id: ReqId(String::new()),
            };
            requests
                .range(first..)
                .next()
                .is_some_and(|(k, _)| k.peer == p)
                || slots.holds_any(p)
        })
    }

    /// A decoded control message from `peer`. Messages a receiver never receives
    /// (`AllocResponse`, `ProxyNotif`, `FailNotif`) are answered with a refusal.
    pub fn handle_message(&mut self, now: Instant, peer: PeerId, msg: Message) {
        match msg {
            Message::AllocRequest(req) => self.on_alloc_request(now, peer, req),
            Message::CancelNotif(cancel) => self.on_cancel(now, peer, cancel),
            Message::AllocResponse(_) | Message::ProxyNotif(_) | Message::FailNotif(_) => {
                // None of these carries a `seq`, so the refusal has no field for a reason
                // (`AllocResponse::refused`): it is the bare -1 LMCache's senders know.
                self.stats.refused += 1;
                self.transmits
                    .push_back((peer, AllocResponse::refused(1, String::new(), None)));
            }
        }
    }

    /// `peer`'s last control connection closed (`kvx_io::Inbound::Lost`): every request
    /// of `peer` that is not ready yet fails at once (`Failure::SenderLost`) instead of
    /// waiting out `request_idle_timeout` or `admission_timeout`, since the sender fails
    /// them on its side when its connection breaks. A ready request keeps its bytes for the
    /// decoder: every chunk of it landed and was verified. Its slots are freed as for a
    /// cancel without a drain confirmation (a write of the lost sender may still be on
    /// its way: quarantined, or under caller placement its grants revoked).
    pub fn handle_peer_lost(&mut self, now: Instant, peer: PeerId) {
        let first = ReqKey {
            peer,
            req_id: ReqId(String::new()),
        };
        let open: Vec<ReqKey> = self
            .requests
            .range(first..)
            .take_while(|(k, _)| k.peer == peer)
            .filter(|(_, r)| !matches!(r.phase, Phase::Ready))
            .map(|(k, _)| k.clone())
            .collect();
        for key in open {
            self.fail(now, &key, Failure::SenderLost, false);
        }
    }

    /// The decoder starts reading ready request `key`: until `handle_consume`, its slots stay
    /// put even if the request is cancelled meanwhile (a read is a lease; freeing the slots
    /// under it would hand the decoder another request's bytes). Returns the slots in chunk
    /// order.
    pub fn handle_acquire(&mut self, key: &ReqKey) -> Result<Vec<SlotIndex>, ConsumeError> {
        let req = self
            .requests
            .get_mut(key)
            .ok_or_else(|| ConsumeError::Unknown(key.clone()))?;
        if !matches!(req.phase, Phase::Ready) {
            return Err(ConsumeError::NotReady(key.clone()));
        }
        req.reading = true;
        Ok(req.slots.iter().map(|t| t.slot).collect())
    }

    /// The application learnt from the proxy that a legacy (LMCache) sender's request `key`
    /// is written (`LegacySenders::AfterProxy`): once its last batch is allocated it is ready.
    /// Refused for a kvx sender's request (its landings say when it is ready) and before the
    /// last batch.
    pub fn handle_external_ready(
        &mut self,
        now: Instant,
        key: &ReqKey,
    ) -> Result<(), ConsumeError> {
        let req = self
            .requests
            .get(key)
            .ok_or_else(|| ConsumeError::Unknown(key.clone()))?;
        if req.notices || !matches!(req.phase, Phase::Complete | Phase::Ready) {
            return Err(ConsumeError::NotReady(key.clone()));
        }
        if matches!(req.phase, Phase::Complete) {
            self.make_ready(now, key);
        }
        Ok(())
    }

    /// The decoder has read request `key`: its slots and reservation are released. The
    /// outcome is `Consumed`, or the failure that arrived while it was being read.
    pub fn handle_consume(&mut self, now: Instant, key: &ReqKey) -> Result<(), ConsumeError> {
        let req = self
            .requests
            .get_mut(key)
            .ok_or_else(|| ConsumeError::Unknown(key.clone()))?;
        if !matches!(req.phase, Phase::Ready) {
            return Err(ConsumeError::NotReady(key.clone()));
        }
        let outcome = match req.doomed.take() {
            Some(failure) => Outcome::Failed(failure),
            None => {
                self.stats.consumed += 1;
                Outcome::Consumed
            }
        };
        // Every chunk landed, so no write into these slots is outstanding.
        self.end(now, key, outcome, true);
        Ok(())
    }

    /// Fires every timer due at `now`: admission timeouts, idle leases, unconsumed TTLs,
    /// quarantine and tombstone expiry.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(ticket) = self.admission.poll_expired(now) {
            let key = self
                .tickets
                .get(&ticket)
                .cloned()
                .expect("invariant: waiting ticket is tracked");
            self.fail(now, &key, Failure::AdmissionTimeout, false);
        }
        self.drain_admitted(now);
        self.expire_stalls(now);
        while let Some(&(at, ticket)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.pop_first();
            let key = self
                .tickets
                .get(&ticket)
                .cloned()
                .expect("invariant: timer ticket is tracked");
            let failure = match self.requests[&key].phase {
                // Caller placement: waited `admission_timeout` for its reservation.
                Phase::Waiting { .. } if self.cfg.placement == Placement::Caller => {
                    Failure::AdmissionTimeout
                }
                Phase::Waiting { .. } => continue, // admission expiry is handled above
                Phase::Receiving | Phase::Complete => Failure::IdleTimeout,
                Phase::Ready => Failure::Unconsumed,
            };
            self.fail(now, &key, failure, false);
        }
        let mut unpinned = false;
        while let Some((slot, holder)) = self.slots.poll_quarantine_expired(now) {
            match self.cfg.placement {
                Placement::Pool => self.admission.unpin(self.principals.share_key(holder), 1),
                Placement::Caller => self.placed_slot_back(slot),
            }
            unpinned = true;
        }
        if unpinned {
            self.drain_admitted(now);
        }
        self.expire_placements(now);
        self.tombstones.expire(now);
    }

    /// The earliest instant at which `handle_timeout` has work.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let t = earliest(
            self.admission.next_deadline(),
            self.timers.first().map(|t| t.0),
        );
        let t = earliest(t, self.placements.next_deadline());
        let t = earliest(t, self.next_stall());
        earliest(
            earliest(t, self.slots.next_deadline()),
            self.tombstones.next_deadline(),
        )
    }

    /// The next change to the buffer's grants, for the fabric's mirror of them. Drain these
    /// before sending the replies from `poll_transmit`: a reply hands out the grants, and a
    /// write may follow at once.
    pub fn poll_grant_change(&mut self) -> Option<GrantChange> {
        self.slots.poll_grant_change()
    }

    /// The next reply to send.
    pub fn poll_transmit(&mut self) -> Option<(PeerId, AllocResponse)> {
        self.transmits.pop_front()
    }

    /// The next event for the decoder, in the order they happened.
    pub fn poll_event(&mut self) -> Option<ReceiverEvent> {
        self.events.pop_front()
    }

    /// Counters since start.
    pub fn stats(&self) -> &ReceiverStats {
        &self.stats
    }

    /// Slots in the buffer.
    pub fn capacity(&self) -> u32 {
        self.cfg.buffer_slots
    }

    /// Reserved but not yet allocated slots.
    pub fn reserved_unallocated(&self) -> u32 {
        self.requests
            .values()
            .map(|r| r.reservation - r.slots.len() as u32)
            .sum()
    }

    /// Slots owned by live requests (granted or landed).
    pub fn held_slots(&self) -> u32 {
        self.slots.held_count()
    }

    /// Slots of rolled-back requests that a late write may still hit.
    pub fn quarantined_slots(&self) -> u32 {
        self.slots.quarantined_count()
    }

    /// Slots no grant holds.
    pub fn free_slots(&self) -> u32 {
        self.slots.free_count()
    }

    /// Total of all reservations (the admission view).
    pub fn reserved_total(&self) -> u32 {
        self.admission.reserved()
    }

    /// First batches waiting for admission.
    pub fn admission_queue_len(&self) -> usize {
        self.admission.queue_len()
    }

    /// What the first batches waiting for admission hold, about (bounded by
    /// `queued_bytes_max`).
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    /// What the remembered ids of ended requests hold, about (bounded by
    /// `tombstones_bytes_max`).
    pub fn tombstone_bytes(&self) -> usize {
        self.tombstones.bytes()
    }

    /// Requests tracked (waiting, admitted or ready; bounded by `requests_max`).
    pub fn tracked_requests(&self) -> usize {
        self.requests.len()
    }

    /// True when nothing is reserved, held, quarantined or waiting: the buffer is entirely free
    /// (under caller placement: every slot is back with the application).
    pub fn is_quiescent(&self) -> bool {
        let unused = match self.cfg.placement {
            Placement::Pool => self.slots.free_count(),
            Placement::Caller if self.placements.by_id.is_empty() => self.slots.caller_count(),
            Placement::Caller => 0,
        };
        self.requests.is_empty() && unused == self.capacity()
    }

    /// The state of one buffer slot (for checkers).
    pub fn slot_state(&self, slot: SlotIndex) -> crate::slots::SlotState {
        self.slots.state(slot)
    }

    /// The slot tags of a tracked request, in chunk order.
    pub fn request_slots(&self, key: &ReqKey) -> Option<&[WriteTag]> {
        self.requests.get(key).map(|r| r.slots.as_slice())
    }

    fn on_cancel(&mut self, now: Instant, peer: PeerId, cancel: CancelNotif) {
        if cancel.req_id.len() > self.cfg.req_id_bytes_max {
            // No request can have such an id; and it is not worth remembering.
            return self
                .transmits
                .push_back((peer, AllocResponse::cancel_ack(cancel.seq)));
        }
        let key = ReqKey {
            peer,
            req_id: cancel.req_id.as_str().into(),
        };
        let drained = cancel.drained.unwrap_or(false);
        if broken_variant!(NoCancelRelease) {
            return self
                .transmits
                .push_back((peer, AllocResponse::cancel_ack(cancel.seq)));
        }
        if self.requests.contains_key(&key) {
            self.fail(now, &key, Failure::Cancelled, drained);
        } else if !self.tombstones.contains(&key) {
            // Remember the id anyway, so that a batch still on its way is not admitted afresh.
            self.tombstones
                .insert(now, key, Outcome::Failed(Failure::Cancelled));
        }
        self.transmits
            .push_back((peer, AllocResponse::cancel_ack(cancel.seq)));
    }

    fn new_ticket(&mut self) -> Ticket {
        self.next_ticket += 1;
        Ticket(self.next_ticket)
    }

    /// Moves the request's timer to `at`.
    fn set_timer(&mut self, key: &ReqKey, at: Instant) {
        let req = self
            .requests
            .get_mut(key)
            .expect("invariant: timer for a tracked request");
        self.timers.remove(&(req.deadline, req.ticket));
        req.deadline = at;
        self.timers.insert((at, req.ticket));
    }

    /// Progress on an admitted request renews its idle lease.
    fn touch(&mut self, key: &ReqKey, now: Instant) {
        if let Some(req) = self.requests.get(key) {
            if matches!(req.phase, Phase::Receiving | Phase::Complete) {
                self.set_timer(key, now + self.cfg.request_idle_timeout);
            }
        }
    }

    fn maybe_ready(&mut self, now: Instant, key: &ReqKey) {
        let req = self
            .requests
            .get_mut(key)
            .expect("invariant: ready check on a tracked request");
        let all_landed = req.landed as usize == req.slots.len();
        // An LMCache sender sends no landing notices: nothing here says its bytes are in, so
        // it waits for `handle_external_ready`.
        let ready = matches!(req.phase, Phase::Complete) && all_landed && req.notices;
        if !ready {
            return;
        }
        self.make_ready(now, key);
    }

    fn make_ready(&mut self, now: Instant, key: &ReqKey) {
        let req = self
            .requests
            .get_mut(key)
            .expect("invariant: ready check on a tracked request");
        req.phase = Phase::Ready;
        let ticket = req.ticket;
        self.stalls.disarm(ticket);
        let req = &self.requests[key];
        let event = ReceiverEvent::Ready {
            key: key.clone(),
            slots: req.slots.iter().map(|t| t.slot).collect(),
            keys: req.keys.clone(),
            layout: req.layout.clone(),
            tokens: req.tokens.clone(),
        };
        self.events.push_back(event);
        self.set_timer(key, now + self.cfg.unconsumed_ttl);
    }

    /// Rolls back `key` and tells its sender when a first batch still waits for its reply.
    fn fail(&mut self, now: Instant, key: &ReqKey, failure: Failure, drained: bool) {
        if let Some(req) = self.requests.get_mut(key) {
            // The decoder is reading it: the failure takes effect at `handle_consume`. Only
            // the unconsumed TTL (a decoder that never finishes) overrides the lease.
            if req.reading && failure != Failure::Unconsumed {
                req.doomed.get_or_insert(failure);
                return;
            }
        }
        self.stats.rolled_back += 1;
        if let Some(Request {
            phase: Phase::Waiting { first },
            ticket,
            ..
        }) = self.requests.get(key)
        {
            let reply = AllocResponse::refused(first.keys.len(), failure.to_string(), first.seq);
            self.queued_bytes -= batch::queued_bytes(first);
            if self.cfg.placement == Placement::Pool {
                self.admission.withdraw(*ticket);
            }
            self.transmits.push_back((key.peer, reply));
        }
        self.end(now, key, Outcome::Failed(failure), drained);
    }

    /// Ends a tracked request: frees or quarantines its slots, returns its reservation,
    /// remembers its id, and reports the outcome. `drained`: no write into its slots can
    /// still land.
    fn end(&mut self, now: Instant, key: &ReqKey, outcome: Outcome, drained: bool) {
        let req = self
            .requests
            .remove(key)
            .expect("invariant: ending a tracked request");
        self.tickets.remove(&req.ticket);
        self.timers.remove(&(req.deadline, req.ticket));
        self.stalls.disarm(req.ticket);
        // Under caller placement on a fabric that stops revoked writes, revoking the grants
        // (mirrored before the application hears `Returned`) is as good as a drain.
        let revoked = self.cfg.placement == Placement::Caller && self.revocation_stops_writes;
        let drained = drained || revoked || broken_variant!(ReuseSlotEarly);
        let until = now + self.cfg.write_quarantine;
        let mut quarantined = 0;
        for tag in &req.slots {
            if drained {
                self.slots.release(tag.slot);
            } else if self.slots.quarantine(tag.slot, until) {
                quarantined += 1;
            }
        }
        self.tombstones.insert(now, key.clone(), outcome.clone());
        self.events.push_back(ReceiverEvent::Ended {
            key: key.clone(),
            outcome: outcome.clone(),
        });
        match self.cfg.placement {
            Placement::Pool => {
                self.admission.pin_from_reservation(quarantined);
                self.admission.release(
                    self.principals.share_key(key.peer),
                    req.reservation - quarantined,
                );
                self.drain_admitted(now);
            }
            Placement::Caller => self.placement_ended(key, &outcome),
        }
    }

    /// Answers the first batches of requests that admission has just let in.
    fn drain_admitted(&mut self, now: Instant) {
        while let Some(ticket) = self.admission.poll_admitted() {
            let key = self
                .tickets
                .get(&ticket)
                .cloned()
                .expect("invariant: admitted ticket is tracked");
            let req = self
                .requests
                .get_mut(&key)
                .expect("invariant: ticket maps to a request");
            let Phase::Waiting { first } = std::mem::replace(&mut req.phase, Phase::Receiving)
            else {
                panic!("invariant: only waiting requests are admitted from the queue");
            };
            self.queued_bytes -= batch::queued_bytes(&first);
            req.reservation = req.total;
            let waited = now - req.arrived;
            self.on_admitted(now, &key, waited);
            self.apply_batch(now, &key, first);
        }
    }

    fn on_admitted(&mut self, now: Instant, key: &ReqKey, waited: Duration) {
        self.stats.admitted += 1;
        let total_chunks = self.requests[key].total;
        self.events.push_back(ReceiverEvent::Admitted {
            key: key.clone(),
            total_chunks,
            waited,
        });
        self.set_timer(key, now + self.cfg.request_idle_timeout);
        let req = &self.requests[key];
        let (ticket, notices) = (req.ticket, req.notices);
        self.stall_progress(ticket, notices, now);
    }
}
