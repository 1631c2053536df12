//! What one `AllocRequest` does (`docs/spec/protocol.md` §Receiver, batches).
//!
//! The first batch of a request asks admission for its whole `total_chunks`; later
//! batches take slots from that reservation. `total_chunks` is fixed by the first batch
//! (LMCache re-reads it from every message, W15), and a batch that would exceed it, a
//! batch after the last, or a batch while the first still waits is a protocol violation
//! that rolls back everything the request holds.

use super::{ChunkLayout, Failure, Outcome, Phase, ReceiverLedger, Request};

/// A chunk's shape has a handful of dimensions (LMCache: `[2, layers, tokens, dim]`).
const SHAPE_DIMS_MAX: usize = 16;
/// Torch dtype names are short (`"bfloat16"`).
const DTYPE_BYTES_MAX: usize = 64;

/// What a waiting first batch holds in memory, about: its strings and lists, and the
/// overhead of each.
pub(super) fn queued_bytes(msg: &AllocRequest) -> usize {
    const OVERHEAD: usize = 24;
    let keys: usize = msg.keys.iter().map(|k| k.len() + OVERHEAD).sum();
    128 + msg.req_id.len() + msg.dtype.len() + msg.shape.len() * 8 + keys
}

/// Why a batch does not say how long its chunks are, if it does not: a kvx sender's batch
/// declares each chunk's length (`AllocRequest::chunk_bytes`, parallel to `keys`, none of
/// them 0), so that a write into its slot counts only whole. A legacy sender declares none
/// (its requests are made ready by the application, not by landings).
fn undeclared_lengths(msg: &AllocRequest) -> Option<String> {
    match &msg.chunk_bytes {
        None if msg.seq.is_some() && !msg.keys.is_empty() => Some(format!(
            "the batch brings {} keys but declares no chunk_bytes",
            msg.keys.len()
        )),
        None => None,
        Some(bytes) if bytes.len() != msg.keys.len() => Some(format!(
            "the batch brings {} keys but {} chunk_bytes",
            msg.keys.len(),
            bytes.len()
        )),
        Some(bytes) if bytes.contains(&0) => {
            Some("the batch declares a chunk of 0 bytes".to_owned())
        }
        Some(_) => None,
    }
}

use crate::admission::Decision;
use crate::config::{LegacySenders, Placement};
use crate::ids::{PeerId, ReqKey};
use crate::time::Instant;
use crate::wire::{AllocRequest, AllocResponse};

impl ReceiverLedger {
    pub(super) fn on_alloc_request(&mut self, now: Instant, peer: PeerId, msg: AllocRequest) {
        if msg.req_id.is_empty() {
            return self.refuse(peer, &msg, Failure::NoReqId);
        }
        if msg.req_id.len() > self.cfg.req_id_bytes_max {
            // Not remembered: an id this long is what a tombstone must not keep.
            let failure = Failure::TooLarge(format!(
                "req_id of {} bytes exceeds req_id_bytes_max {}",
                msg.req_id.len(),
                self.cfg.req_id_bytes_max
            ));
            return self.refuse(peer, &msg, failure);
        }
        let key = ReqKey {
            peer,
            req_id: msg.req_id.as_str().into(),
        };
        let oversize = self.oversize(&msg).map(|why| (why, true));
        if let Some((why, too_large)) =
            oversize.or_else(|| undeclared_lengths(&msg).map(|w| (w, false)))
        {
            return match self.requests.get(&key).map(|r| &r.phase) {
                Some(Phase::Waiting { .. } | Phase::Receiving | Phase::Complete | Phase::Ready) => {
                    self.violation(now, &key, &msg, why)
                }
                None if too_large => {
                    self.refuse_and_remember(now, key, &msg, Failure::TooLarge(why))
                }
                None => self.refuse_and_remember(now, key, &msg, Failure::ProtocolViolation(why)),
            };
        }
        if let Some(prior) = self.tombstones.get(&key) {
            let failure = Failure::AlreadyEnded(Box::new(prior.clone()));
            return self.refuse(peer, &msg, failure);
        }
        if let Some(failure) = self.chunk_too_long(&msg) {
            return match self.requests.get(&key) {
                Some(_) => {
                    self.stats.refused += 1;
                    let reply = AllocResponse::refused(
                        msg.keys.len(),
                        format!("request {key}: {failure}"),
                        msg.seq,
                    );
                    self.fail(now, &key, failure, false);
                    self.transmits.push_back((key.peer, reply));
                }
                None => self.refuse_and_remember(now, key, &msg, failure),
            };
        }
        match self
            .requests
            .get(&key)
            .map(|r| (&r.phase, r.total + r.held))
        {
            None => self.first_batch(now, key, msg),
            Some((Phase::Waiting { .. }, _)) => {
                let why =
                    "a batch arrived while the request's first batch still waits for admission"
                        .to_owned();
                self.violation(now, &key, &msg, why);
            }
            Some((Phase::Complete | Phase::Ready, _)) => {
                let why = "a batch arrived after the last batch".to_owned();
                self.violation(now, &key, &msg, why);
            }
            Some((Phase::Receiving, total)) if msg.total_chunks != total => {
                let why = format!(
                    "total_chunks changed from {total} to {} between batches",
                    msg.total_chunks
                );
                self.violation(now, &key, &msg, why);
            }
            Some((Phase::Receiving, _)) => self.apply_batch(now, &key, msg),
        }
    }

    fn first_batch(&mut self, now: Instant, key: ReqKey, msg: AllocRequest) {
        if msg.seq.is_none() && self.cfg.legacy_senders == LegacySenders::Refuse {
            return self.refuse_and_remember(now, key, &msg, Failure::LegacySender);
        }
        if msg.total_chunks == 0 {
            return self.refuse_and_remember(now, key, &msg, Failure::ZeroChunks);
        }
        // Checked before anything is queued, so a waiting first batch holds no more keys than
        // it may ever use.
        if msg.keys.len() > msg.total_chunks as usize {
            let why = format!(
                "the first batch brings {} keys but declares total_chunks={}",
                msg.keys.len(),
                msg.total_chunks
            );
            return self.refuse_and_remember(now, key, &msg, Failure::ProtocolViolation(why));
        }
        if self.cfg.placement == Placement::Caller {
            // Its own budgets: a claim of a reservation that is out is never refused for
            // what else is tracked.
            return self.claim(now, key, msg);
        }
        if self.requests.len() >= self.cfg.requests_max {
            let failure = Failure::TooManyRequests {
                max: self.cfg.requests_max,
            };
            return self.refuse_and_remember(now, key, &msg, failure);
        }
        let ticket = self.new_ticket();
        let deadline = now + self.cfg.admission_timeout;
        let decision = self.admission.request(
            ticket,
            self.principals.share_key(key.peer),
            msg.total_chunks,
            deadline,
        );
        let (phase, reservation) = match decision {
            Decision::Refused(refusal) => {
                return self.refuse_and_remember(now, key, &msg, refusal.into())
            }
            Decision::Admitted => (Phase::Receiving, msg.total_chunks),
            Decision::Queued => {
                let bytes = queued_bytes(&msg);
                if self.queued_bytes + bytes > self.cfg.queued_bytes_max {
                    self.admission.withdraw(ticket);
                    // A withdrawal re-runs the queue; whatever it admits is answered now, as
                    // after every other withdrawal (none is expected: this one was last).
                    self.drain_admitted(now);
                    let failure = Failure::TooLarge(format!(
                        "the first batches waiting for admission hold {} bytes; this one's {} \
                         would exceed queued_bytes_max {}",
                        self.queued_bytes, bytes, self.cfg.queued_bytes_max
                    ));
                    return self.refuse_and_remember(now, key, &msg, failure);
                }
                self.queued_bytes += bytes;
                (Phase::Waiting { first: msg.clone() }, 0)
            }
        };
        self.track(now, key.clone(), ticket, &msg, phase);
        self.requests
            .get_mut(&key)
            .expect("invariant: just tracked")
            .reservation = reservation;
        if decision == Decision::Admitted {
            self.on_admitted(now, &key, std::time::Duration::ZERO);
            self.apply_batch(now, &key, msg);
        }
    }

    /// Starts tracking `key` under `ticket` from its first batch `msg`, in `phase`, with no
    /// reservation and no timer yet (its deadline reads `admission_timeout` from now).
    pub(super) fn track(
        &mut self,
        now: Instant,
        key: ReqKey,
        ticket: crate::ids::Ticket,
        msg: &AllocRequest,
        phase: Phase,
    ) {
        let request = Request {
            ticket,
            total: msg.total_chunks,
            held: 0,
            held_left: 0,
            reservation: 0,
            phase,
            slots: Vec::new(),
            keys: Vec::new(),
            tokens: Vec::new(),
            bytes: Vec::new(),
            layout: ChunkLayout::default(),
            landed: 0,
            notices: msg.seq.is_some(),
            arrived: now,
            deadline: now + self.cfg.admission_timeout,
            reading: false,
            doomed: None,
        };
        self.requests.insert(key.clone(), request);
        self.tickets.insert(ticket, key);
    }

    /// A chunk the batch declares longer than the buffer's slots (`with_slot_bytes`), if any.
    fn chunk_too_long(&self, msg: &AllocRequest) -> Option<Failure> {
        let slot = self.slot_bytes?;
        let chunk = msg.chunk_bytes.as_ref()?.iter().copied().max()?;
        (chunk > slot).then_some(Failure::ChunkSizeMismatch { chunk, slot })
    }

    /// Why a batch's fields are larger than this receiver accepts, if they are: every string
    /// and list a sender controls is bounded before anything of it is kept.
    fn oversize(&self, msg: &AllocRequest) -> Option<String> {
        let cfg = &self.cfg;
        if let Some(k) = msg.keys.iter().find(|k| k.len() > cfg.key_bytes_max) {
            return Some(format!(
                "a key of {} bytes exceeds key_bytes_max {}",
                k.len(),
                cfg.key_bytes_max
            ));
        }
        if msg.shape.len() > SHAPE_DIMS_MAX || msg.dtype.len() > DTYPE_BYTES_MAX {
            return Some(format!(
                "shape of {} dimensions or dtype of {} bytes (at most {SHAPE_DIMS_MAX} and \
                 {DTYPE_BYTES_MAX})",
                msg.shape.len(),
                msg.dtype.len()
            ));
        }
        None
    }

    /// Allocates one batch of an admitted request and answers it.
    pub(super) fn apply_batch(&mut self, now: Instant, key: &ReqKey, mut msg: AllocRequest) {
        let req = self
            .requests
            .get_mut(key)
            .expect("invariant: batch for a tracked request");
        // Caller placement: the leading chunks the application holds already are answered
        // as sent (LMCache's dedup answer) and take no slot.
        let held_here = req.held_left.min(msg.keys.len() as u32);
        if held_here > 0 {
            req.held_left -= held_here;
            msg.keys.drain(..held_here as usize);
            if let Some(bytes) = msg.chunk_bytes.as_mut() {
                bytes.drain(..held_here as usize);
            }
        }
        let n = msg.keys.len() as u32;
        let allocated = req.slots.len() as u32;
        if allocated + n > req.total {
            let why = format!(
                "declared total_chunks={} but this batch brings the count to {}",
                req.total,
                allocated + n
            );
            return self.violation(now, key, &msg, why);
        }
        let ticket = req.ticket;
        let mut indexes = Vec::with_capacity(msg.keys.len());
        let mut generations = Vec::with_capacity(msg.keys.len());
        if req.keys.is_empty() {
            req.layout = ChunkLayout {
                fmt: msg.fmt,
                shape: msg.shape.clone(),
                dtype: msg.dtype.clone(),
            };
        }
        let last = msg.keys.len().saturating_sub(1);
        for (i, chunk_key) in msg.keys.into_iter().enumerate() {
            let bytes = msg.chunk_bytes.as_ref().map(|b| b[i]);
            let tag = match self.cfg.placement {
                // Admission guarantees a free slot for every reserved chunk (quarantined and
                // held slots are counted against capacity), so this cannot fail.
                Placement::Pool => self
                    .slots
                    .grant(ticket, key.peer, bytes)
                    .expect("invariant: a reserved chunk always finds a free slot"),
                // The slot the application reserved for this chunk.
                Placement::Caller => {
                    let slot = self.placements.by_id[&key.req_id].slots[req.slots.len()];
                    self.slots.grant_at(slot, ticket, key.peer, bytes)
                }
            };
            req.bytes.push(bytes);
            indexes.push(i64::from(tag.slot.0));
            generations.push(tag.generation);
            req.slots.push(tag);
            req.keys.push(chunk_key);
            req.tokens.push((i == last).then_some(msg.last_chunk_toks));
        }
        if msg.is_last_batch {
            req.phase = Phase::Complete;
            // A request may send fewer chunks than it declared (LMCache drops a partial last
            // chunk in some configurations, W13): the unused part of the reservation goes back.
            let unused = req.reservation - req.slots.len() as u32;
            let unused = if broken_variant!(ReleaseBeforeComplete) {
                req.reservation
            } else {
                unused
            };
            req.reservation -= unused;
            self.admission
                .release(self.principals.share_key(key.peer), unused);
        }
        let generations = msg.seq.map(|_| generations);
        let mut reply = AllocResponse::granted(indexes, generations, msg.seq);
        reply.already_sent_indexes = (0..i64::from(held_here)).collect();
        self.transmits.push_back((key.peer, reply));
        self.touch(key, now);
        self.maybe_ready(now, key);
        self.drain_admitted(now);
    }

    /// A protocol violation: refuse this batch and roll back everything the request holds.
    fn violation(&mut self, now: Instant, key: &ReqKey, msg: &AllocRequest, why: String) {
        let failure = Failure::ProtocolViolation(why);
        self.stats.refused += 1;
        let reply =
            AllocResponse::refused(msg.keys.len(), format!("request {key}: {failure}"), msg.seq);
        self.fail(now, key, failure, false);
        self.transmits.push_back((key.peer, reply));
    }

    /// Refuses a first batch that never became a request, and remembers its id so its later
    /// batches are refused too (it fails once, not once per batch).
    pub(super) fn refuse_and_remember(
        &mut self,
        now: Instant,
        key: ReqKey,
        msg: &AllocRequest,
        failure: Failure,
    ) {
        self.refuse(key.peer, msg, failure.clone());
        let outcome = Outcome::Failed(failure);
        self.tombstones.insert(now, key.clone(), outcome.clone());
        self.events
            .push_back(super::ReceiverEvent::Ended { key, outcome });
    }

    fn refuse(&mut self, peer: PeerId, msg: &AllocRequest, failure: Failure) {
        self.stats.refused += 1;
        let id: String = msg.req_id.chars().take(64).collect();
        let reason = format!(
            "request {}{}: {failure}",
            if id.is_empty() { "\"\"" } else { &id },
            if id.len() < msg.req_id.len() {
                "…"
            } else {
                ""
            }
        );
        self.transmits.push_back((
            peer,
            AllocResponse::refused(msg.keys.len(), reason, msg.seq),
        ));
    }
}
