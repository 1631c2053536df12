//! Caller placement (`Placement::Caller`, `docs/spec/protocol.md` §Caller placement): the
//! application owns the buffer and lends kvx one request's slots at a time.
//!
//! A reservation (`handle_reserve`) names a request id, the slots its chunks go to, in
//! chunk order, and the claim secret (`crate::claim`) that the application handed to the
//! one sender it chose. The first batch with that id that carries the secret claims it: it
//! is admitted at once and chunk i is granted slot i, under a fresh generation and bound to
//! that connection as every grant is. A batch without the secret is refused and costs the
//! reservation nothing: the id alone claims nothing. First batches that come before the
//! reservation wait for it up to `admission_timeout` (several may wait for one id: which of
//! them holds the secret is known only once the reservation comes); a reservation nobody
//! claims within `admission_timeout` is returned. A reservation is claimed once: a second
//! claim of its id, from any connection, is refused. The slots go back to the application with one
//! `ReceiverEvent::Returned` once the request ended and no write of its grants can land in
//! them (a slot in quarantine holds the return back until it clears).
//!
//! A reservation may say that the receiver already holds the request's first `held` chunks
//! (a vLLM decode engine's local prefix-cache hit): the sender, which cannot know that, sends
//! every chunk, and the receiver answers the first `held` as already sent, LMCache's dedup
//! answer (`already_sent_indexes`), so that they take no slot and no write; chunk `held + i`
//! is granted slot i.

use std::collections::{BTreeMap, BTreeSet};

use super::{batch, Failure, Outcome, Phase, ReceiverEvent, ReceiverLedger};
use crate::claim::ClaimSecret;
use crate::config::Placement;
use crate::ids::{PeerId, ReqId, ReqKey, SlotIndex};
use crate::slots::SlotState;
use crate::time::Instant;
use crate::wire::AllocRequest;

/// Why `handle_reserve` or `handle_withdraw` was refused; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// The receiver's slots are kvx's (`Placement::Pool`): its admission places requests.
    #[error("this receiver places requests itself (placement = pool); reservations need placement = caller")]
    NotCaller,
    /// The id is empty or longer than `req_id_bytes_max`.
    #[error("request id of {len} bytes: it must be 1..={max} bytes")]
    BadId {
        /// The id's length.
        len: usize,
        /// `req_id_bytes_max`.
        max: usize,
    },
    /// A reservation with this id is still out (not yet returned).
    #[error("request {0} is already reserved")]
    AlreadyReserved(String),
    /// The reservation names no slot.
    #[error("a reservation needs at least one slot")]
    NoSlots,
    /// A slot past the buffer's end.
    #[error("slot {slot} is outside the buffer's {capacity} slots")]
    OutOfRange {
        /// The slot named.
        slot: u32,
        /// The buffer's slots.
        capacity: u32,
    },
    /// A slot named twice, or reserved for another request not yet returned.
    #[error("slot {slot} is already reserved (for request {to}), or named twice")]
    SlotTaken {
        /// The slot named.
        slot: u32,
        /// The request it is reserved for.
        to: String,
    },
    /// No reservation with this id is out.
    #[error("request {0} is not reserved (never, or already returned)")]
    Unknown(String),
    /// The receiver itself has stopped (shut down, or its runtime ended). Never from the
    /// ledger; the handles' answer once no driver can serve them: make a new receiver.
    #[error("this receiver has stopped (shut down, or its runtime ended): make a new receiver")]
    Stopped,
}

/// One reservation: the slots the application reserved for a request, and how far it got.
#[derive(Debug, Clone)]
pub(super) struct Placed {
    /// Chunk `held + i`'s slot at i.
    pub slots: Vec<SlotIndex>,
    /// The request's first chunks, which the application holds already: never written.
    pub held: u32,
    /// What the claiming batch must carry.
    pub secret: ClaimSecret,
    pub state: PlacedState,
}

#[derive(Debug, Clone)]
pub(super) enum PlacedState {
    /// No first batch has claimed it; returned at `deadline` if none does.
    Open { deadline: Instant },
    /// The request `key` holds it (tracked).
    Claimed(ReqKey),
    /// Ended (its request ended, or it was withdrawn or expired unclaimed): returned as soon
    /// as none of its slots is in quarantine.
    Ending(Outcome),
}

/// The reservations out, by request id, and which reservation each reserved slot belongs to.
#[derive(Debug, Clone, Default)]
pub(super) struct Placements {
    pub by_id: BTreeMap<ReqId, Placed>,
    pub reserved_by: BTreeMap<SlotIndex, ReqId>,
    /// First batches that came before their reservation, by id in the order they came,
    /// waiting (`Phase::Waiting`, with a timer at `admission_timeout`); never an empty list.
    pub claims: BTreeMap<ReqId, Vec<ReqKey>>,
    /// The waiting claims, all ids together.
    pub claims_waiting: usize,
    /// `claims` counted by their sender's principal (its share key): a principal waits for
    /// at most its share of slots (`peer_cap`) of reservations nobody made yet, and all
    /// together for at most the buffer's slots, so claims for ids nobody reserves cost
    /// little, and a claim whose reservation is out is never refused for them.
    pub waiting_by_share: BTreeMap<PeerId, u32>,
    /// The unclaimed reservations by deadline (those in `PlacedState::Open`).
    pub open: BTreeSet<(Instant, ReqId)>,
}

impl Placements {
    /// Whether `key` waits for its reservation.
    fn waits(&self, key: &ReqKey) -> bool {
        self.claims
            .get(&key.req_id)
            .is_some_and(|keys| keys.contains(key))
    }

    /// The earliest deadline of an unclaimed reservation.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.open.first().map(|(at, _)| *at)
    }

    /// Moves reservation `id` to `state`, keeping `open` in step.
    fn set_state(&mut self, id: &ReqId, state: PlacedState) {
        let placed = self
            .by_id
            .get_mut(id)
            .expect("invariant: the reservation is out");
        if let PlacedState::Open { deadline } = placed.state {
            self.open.remove(&(deadline, id.clone()));
        }
        if let PlacedState::Open { deadline } = state {
            self.open.insert((deadline, id.clone()));
        }
        placed.state = state;
    }
}

impl ReceiverLedger {
    fn caller_placement(&self) -> Result<(), PlacementError> {
        match self.cfg.placement {
            Placement::Caller => Ok(()),
            Placement::Pool => Err(PlacementError::NotCaller),
        }
    }

    /// The application lends `slots` (chunk i goes to `slots[i]`) to the request `req_id`
    /// (`Placement::Caller` only). The first batch with that id that carries `secret`, from
    /// any sender connection, claims them; one already waiting is admitted now, and waiting
    /// batches of that id without it are refused. Refused, with nothing changed, for an id
    /// reserved and not yet returned, and for a slot out of range, named twice, or reserved
    /// for another request not yet returned.
    pub fn handle_reserve(
        &mut self,
        now: Instant,
        req_id: &str,
        slots: Vec<SlotIndex>,
        secret: ClaimSecret,
    ) -> Result<(), PlacementError> {
        self.handle_reserve_held(now, req_id, 0, slots, secret)
    }

    /// `handle_reserve` for a request whose first `held` chunks the application holds
    /// already: its sender is told they are sent (no slot, no write), and chunk `held + i`
    /// goes to `slots[i]`.
    pub fn handle_reserve_held(
        &mut self,
        now: Instant,
        req_id: &str,
        held: u32,
        slots: Vec<SlotIndex>,
        secret: ClaimSecret,
    ) -> Result<(), PlacementError> {
        self.caller_placement()?;
        if req_id.is_empty() || req_id.len() > self.cfg.req_id_bytes_max {
            return Err(PlacementError::BadId {
                len: req_id.len(),
                max: self.cfg.req_id_bytes_max,
            });
        }
        let id = ReqId(req_id.to_owned());
        if self.placements.by_id.contains_key(&id) {
            return Err(PlacementError::AlreadyReserved(req_id.to_owned()));
        }
        if slots.is_empty() {
            return Err(PlacementError::NoSlots);
        }
        let mut named = std::collections::BTreeSet::new();
        for &slot in &slots {
            if slot.0 >= self.capacity() {
                return Err(PlacementError::OutOfRange {
                    slot: slot.0,
                    capacity: self.capacity(),
                });
            }
            if let Some(to) = self.placements.reserved_by.get(&slot) {
                let to = to.0.clone();
                return Err(PlacementError::SlotTaken { slot: slot.0, to });
            }
            if !named.insert(slot) {
                let to = req_id.to_owned();
                return Err(PlacementError::SlotTaken { slot: slot.0, to });
            }
        }
        for &slot in &slots {
            debug_assert_eq!(self.slots.state(slot), SlotState::Caller);
            self.placements.reserved_by.insert(slot, id.clone());
        }
        let deadline = now + self.cfg.admission_timeout;
        let placed = Placed {
            slots,
            held,
            secret,
            state: PlacedState::Open { deadline },
        };
        self.placements.by_id.insert(id.clone(), placed);
        self.placements.open.insert((deadline, id.clone()));
        // The first waiting batch that proves the secret claims it; the others are refused.
        let waiting = self.placements.claims.get(&id).cloned().unwrap_or_default();
        for key in waiting {
            let presented = match &self.requests[&key].phase {
                Phase::Waiting { first } => first.claim.clone(),
                _ => unreachable!("invariant: a waiting claim is in Phase::Waiting"),
            };
            match self.claim_refusal(&id, presented.as_ref()) {
                None => {
                    self.stop_waiting(&key);
                    self.admit_waiting_claim(now, &key);
                }
                // Nothing was granted to a waiting claim: nothing of it can land.
                Some(failure) => self.fail(now, &key, failure, true),
            }
        }
        Ok(())
    }

    /// Why a first batch that presents `presented` may not claim reservation `id` (which is
    /// out), if it may not: it does not prove the secret, or the reservation is claimed.
    fn claim_refusal(&self, id: &ReqId, presented: Option<&ClaimSecret>) -> Option<Failure> {
        let placed = &self.placements.by_id[id];
        if !placed.secret.proven_by(presented) {
            return Some(Failure::ClaimNotProven {
                secret_sent: presented.is_some(),
            });
        }
        match placed.state {
            PlacedState::Open { .. } => None,
            PlacedState::Claimed(_) | PlacedState::Ending(_) => Some(Failure::AlreadyClaimed),
        }
    }

    /// The application takes reservation `req_id` back (its request was aborted there). An
    /// unclaimed one is returned at once; a claimed one's request fails (`Withdrawn`: its
    /// sender's next batch is refused and its grants end) and the slots are returned once no
    /// write can land in them. Withdrawing one that is already ending changes nothing.
    pub fn handle_withdraw(&mut self, now: Instant, req_id: &str) -> Result<(), PlacementError> {
        self.caller_placement()?;
        let id = ReqId(req_id.to_owned());
        let Some(placed) = self.placements.by_id.get(&id) else {
            return Err(PlacementError::Unknown(req_id.to_owned()));
        };
        match &placed.state {
            PlacedState::Open { .. } => {
                let withdrawn = PlacedState::Ending(Outcome::Failed(Failure::Withdrawn));
                self.placements.set_state(&id, withdrawn);
                self.settle_placement(&id);
            }
            PlacedState::Claimed(key) => {
                let key = key.clone();
                self.fail(now, &key, Failure::Withdrawn, false);
            }
            PlacedState::Ending(_) => {}
        }
        Ok(())
    }

    /// `key`, no longer waiting for its reservation (it came, or `key` ended). Whether it
    /// waited.
    fn stop_waiting(&mut self, key: &ReqKey) -> bool {
        let Some(keys) = self.placements.claims.get_mut(&key.req_id) else {
            return false;
        };
        let Some(at) = keys.iter().position(|k| k == key) else {
            return false;
        };
        keys.remove(at);
        if keys.is_empty() {
            self.placements.claims.remove(&key.req_id);
        }
        self.placements.claims_waiting -= 1;
        let share = self.principals.share_key(key.peer);
        let waiting = &mut self.placements.waiting_by_share;
        match waiting.get_mut(&share) {
            Some(n) if *n > 1 => *n -= 1,
            _ => {
                waiting.remove(&share);
            }
        }
        true
    }

    /// Why a first batch of `key`'s sender may not wait for a reservation nobody made yet,
    /// if it may not: its principal waits for its share of slots already, or all senders
    /// together for the buffer's slots, or the receiver tracks `requests_max` requests.
    fn claim_budget_refusal(&self, key: &ReqKey) -> Option<Failure> {
        let limits = self.admission.limits();
        let share = self.principals.share_key(key.peer);
        let own = self
            .placements
            .waiting_by_share
            .get(&share)
            .copied()
            .unwrap_or(0);
        if own >= limits.peer_cap.max(1) {
            return Some(Failure::TooManyWaitingClaims {
                max: limits.peer_cap.max(1),
                whose: "this sender's share of the buffer",
            });
        }
        if self.placements.claims_waiting >= limits.capacity as usize {
            return Some(Failure::TooManyWaitingClaims {
                max: limits.capacity,
                whose: "the buffer's slots, all senders together",
            });
        }
        if self.requests.len() >= self.cfg.requests_max {
            return Some(Failure::TooManyRequests {
                max: self.cfg.requests_max,
            });
        }
        None
    }

    /// A first batch under caller placement: admitted on its reservation when it proves
    /// the reservation's secret (whatever else waits: the reservation already counts against
    /// the buffer), refused when it does not (the reservation keeps waiting for its own
    /// sender), or waiting for a reservation nobody made yet within the claim budgets
    /// (`claim_budget_refusal`). The common checks (id, sizes) are done.
    pub(super) fn claim(&mut self, now: Instant, key: ReqKey, msg: AllocRequest) {
        if msg.claim.is_none() {
            // Every reservation has a secret: a batch without one can never claim.
            let failure = Failure::ClaimNotProven { secret_sent: false };
            return self.refuse_and_remember(now, key, &msg, failure);
        }
        if self.placements.by_id.contains_key(&key.req_id) {
            return match self.claim_refusal(&key.req_id, msg.claim.as_ref()) {
                None => {
                    let ticket = self.new_ticket();
                    self.track(now, key.clone(), ticket, &msg, Phase::Receiving);
                    self.admit_claim(now, &key, std::time::Duration::ZERO, msg);
                }
                Some(failure) => self.refuse_and_remember(now, key, &msg, failure),
            };
        }
        // No reservation yet: wait for it, within the budgets.
        if let Some(failure) = self.claim_budget_refusal(&key) {
            return self.refuse_and_remember(now, key, &msg, failure);
        }
        let bytes = batch::queued_bytes(&msg);
        if self.queued_bytes + bytes > self.cfg.queued_bytes_max {
            let failure = Failure::TooLarge(format!(
                "the first batches waiting for their reservation hold {} bytes; this \
                 one's {bytes} would exceed queued_bytes_max {}",
                self.queued_bytes, self.cfg.queued_bytes_max
            ));
            return self.refuse_and_remember(now, key, &msg, failure);
        }
        self.queued_bytes += bytes;
        let ticket = self.new_ticket();
        let phase = Phase::Waiting { first: msg.clone() };
        self.track(now, key.clone(), ticket, &msg, phase);
        self.set_timer(&key, now + self.cfg.admission_timeout);
        let share = self.principals.share_key(key.peer);
        *self.placements.waiting_by_share.entry(share).or_insert(0) += 1;
        self.placements.claims_waiting += 1;
        let waiting = self.placements.claims.entry(key.req_id.clone());
        waiting.or_default().push(key);
    }

    /// The reservation of a first batch that waited for it has come.
    fn admit_waiting_claim(&mut self, now: Instant, key: &ReqKey) {
        let req = self
            .requests
            .get_mut(key)
            .expect("invariant: a waiting claim is tracked");
        let Phase::Waiting { first } = std::mem::replace(&mut req.phase, Phase::Receiving) else {
            panic!("invariant: a waiting claim is in Phase::Waiting");
        };
        self.queued_bytes -= batch::queued_bytes(&first);
        let waited = now - req.arrived;
        self.admit_claim(now, key, waited, first);
    }

    /// Binds the open reservation of `key.req_id` to `key` (tracked, `Receiving`) and
    /// allocates its first batch, or fails it when it declares more chunks than the
    /// reservation's slots.
    fn admit_claim(
        &mut self,
        now: Instant,
        key: &ReqKey,
        waited: std::time::Duration,
        first: AllocRequest,
    ) {
        self.placements
            .set_state(&key.req_id, PlacedState::Claimed(key.clone()));
        let placed = &self.placements.by_id[&key.req_id];
        let (reserved, held) = (placed.slots.len() as u32, placed.held);
        let declared = self.requests[key].total;
        // The chunks the application holds are answered as sent: the request writes the rest.
        let total = declared.saturating_sub(held);
        let failure = if total > reserved {
            Some(Failure::LargerThanReservation {
                need: total,
                reserved,
            })
        } else if total == 0 {
            Some(Failure::ProtocolViolation(format!(
                "total_chunks={declared}, but the receiver holds the first {held} chunks \
                 already: nothing to write"
            )))
        } else {
            None
        };
        if let Some(failure) = failure {
            let reply = crate::wire::AllocResponse::refused(
                first.keys.len(),
                format!("request {key}: {failure}"),
                first.seq,
            );
            self.stats.refused += 1;
            self.fail(now, key, failure, true);
            return self.transmits.push_back((key.peer, reply));
        }
        let req = self
            .requests
            .get_mut(key)
            .expect("invariant: claimed request is tracked");
        req.reservation = total;
        req.total = total;
        req.held = held;
        req.held_left = held;
        self.on_admitted(now, key, waited);
        self.apply_batch(now, key, first);
    }

    /// `key` ended: its reservation, if it holds one, is returned once none of its slots is
    /// in quarantine. A first batch that was still waiting for its reservation is forgotten.
    pub(super) fn placement_ended(&mut self, key: &ReqKey, outcome: &Outcome) {
        self.stop_waiting(key);
        let Some(placed) = self.placements.by_id.get(&key.req_id) else {
            return;
        };
        if matches!(&placed.state, PlacedState::Claimed(k) if k == key) {
            let id = key.req_id.clone();
            self.placements
                .set_state(&id, PlacedState::Ending(outcome.clone()));
            self.settle_placement(&id);
        }
    }

    /// A slot of an ended reservation left quarantine (its late write landed, or its time
    /// ran out): the reservation may be returned now.
    pub(super) fn placed_slot_back(&mut self, slot: SlotIndex) {
        if let Some(id) = self.placements.reserved_by.get(&slot).cloned() {
            self.settle_placement(&id);
        }
    }

    /// Unclaimed reservations whose time ran out are returned.
    pub(super) fn expire_placements(&mut self, now: Instant) {
        while let Some((at, id)) = self.placements.open.first().cloned() {
            if at > now {
                break;
            }
            let unclaimed = PlacedState::Ending(Outcome::Failed(Failure::Unclaimed));
            self.placements.set_state(&id, unclaimed);
            self.settle_placement(&id);
        }
    }

    /// Returns an ending reservation to the application once none of its slots is held or
    /// in quarantine.
    fn settle_placement(&mut self, id: &ReqId) {
        let placed = &self.placements.by_id[id];
        let PlacedState::Ending(outcome) = &placed.state else {
            return;
        };
        if placed
            .slots
            .iter()
            .any(|&s| self.slots.state(s) != SlotState::Caller)
        {
            return;
        }
        let outcome = outcome.clone();
        let placed = self
            .placements
            .by_id
            .remove(id)
            .expect("invariant: settling a reservation that is out");
        for slot in &placed.slots {
            self.placements.reserved_by.remove(slot);
        }
        self.events.push_back(ReceiverEvent::Returned {
            req_id: id.clone(),
            slots: placed.slots,
            outcome,
        });
    }

    /// Panics if the reservations, their slots, the waiting claims and the requests
    /// disagree (caller placement).
    pub(super) fn check_placements(&self) {
        let p = &self.placements;
        let reserved: usize = p.by_id.values().map(|r| r.slots.len()).sum();
        let open: BTreeSet<(Instant, ReqId)> = p
            .by_id
            .iter()
            .filter_map(|(id, r)| match r.state {
                PlacedState::Open { deadline } => Some((deadline, id.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(
            open, p.open,
            "invariant: the unclaimed reservations' deadlines are indexed"
        );
        assert_eq!(
            reserved,
            p.reserved_by.len(),
            "invariant: every reserved slot is indexed once"
        );
        for (id, placed) in &p.by_id {
            assert!(
                !placed.slots.is_empty(),
                "invariant: {} lends no slot",
                id.0
            );
            for slot in &placed.slots {
                assert_eq!(
                    p.reserved_by.get(slot),
                    Some(id),
                    "invariant: slot {} indexed",
                    slot.0
                );
            }
            match &placed.state {
                PlacedState::Open { .. } => {
                    for &slot in &placed.slots {
                        assert_eq!(
                            self.slots.state(slot),
                            SlotState::Caller,
                            "invariant: an unclaimed reservation's slot {} has no grant",
                            slot.0
                        );
                    }
                    assert!(
                        !p.claims.contains_key(id),
                        "invariant: {} reserved and waiting",
                        id.0
                    );
                }
                PlacedState::Claimed(key) => {
                    let req = self.requests.get(key).unwrap_or_else(|| {
                        panic!("invariant: {key}'s reservation is claimed by a tracked request")
                    });
                    assert_eq!(&key.req_id, id, "invariant: claimed under its own id");
                    assert!(
                        req.total as usize <= placed.slots.len(),
                        "invariant: {key} fits its reservation"
                    );
                    assert!(
                        req.held == placed.held && req.held_left <= req.held,
                        "invariant: {key} skips exactly the chunks its reservation holds"
                    );
                    for (tag, slot) in req.slots.iter().zip(&placed.slots) {
                        assert_eq!(
                            tag.slot, *slot,
                            "invariant: {key}'s chunks are in its reserved slots, in order"
                        );
                    }
                }
                PlacedState::Ending(_) => {
                    assert!(
                        placed
                            .slots
                            .iter()
                            .any(|&s| matches!(self.slots.state(s), SlotState::Quarantined { .. })),
                        "invariant: ended reservation {} is returned once no slot is in quarantine",
                        id.0
                    );
                }
            }
        }
        let mut by_share: BTreeMap<PeerId, u32> = BTreeMap::new();
        assert_eq!(
            p.claims.values().map(Vec::len).sum::<usize>(),
            p.claims_waiting,
            "invariant: the waiting claims are counted"
        );
        for key in p.claims.values().flatten() {
            *by_share
                .entry(self.principals.share_key(key.peer))
                .or_insert(0) += 1;
        }
        assert_eq!(
            by_share, p.waiting_by_share,
            "invariant: waiting claims are counted by principal"
        );
        let limits = self.admission.limits();
        assert!(
            p.claims_waiting <= limits.capacity as usize
                && by_share.values().all(|&n| n <= limits.peer_cap.max(1)),
            "invariant: waiting claims within their budgets"
        );
        for (id, key) in p
            .claims
            .iter()
            .flat_map(|(id, keys)| keys.iter().map(move |k| (id, k)))
        {
            assert!(
                !p.claims[id].is_empty(),
                "invariant: no empty list of waiting claims"
            );
            assert_eq!(&key.req_id, id, "invariant: a claim waits under its own id");
            assert!(
                matches!(
                    self.requests.get(key).map(|r| &r.phase),
                    Some(Phase::Waiting { .. })
                ),
                "invariant: waiting claim {key} is tracked and waiting"
            );
        }
        for (key, req) in &self.requests {
            let waiting = matches!(req.phase, Phase::Waiting { .. });
            assert_eq!(
                waiting,
                p.waits(key),
                "invariant: {key} waits iff it waits for its reservation"
            );
            if !waiting {
                assert!(
                    matches!(p.by_id.get(&key.req_id).map(|r| &r.state), Some(PlacedState::Claimed(k)) if k == key),
                    "invariant: {key} holds its reservation"
                );
            }
        }
        for slot in (0..self.capacity()).map(SlotIndex) {
            if self.slots.state(slot) != SlotState::Caller {
                assert!(
                    p.reserved_by.contains_key(&slot),
                    "invariant: slot {} is used only while reserved",
                    slot.0
                );
            }
        }
    }

    /// The explorer's canonical encoding of the reservations (feature `testing`).
    #[cfg(feature = "testing")]
    pub(super) fn canon_placements(&self, enc: &mut crate::canon::Canon) {
        enc.len(self.placements.by_id.len());
        for (id, placed) in &self.placements.by_id {
            enc.str(&id.0);
            enc.len(placed.slots.len());
            placed.slots.iter().for_each(|&s| enc.slot(s));
            match &placed.state {
                PlacedState::Open { deadline } => {
                    enc.len(0);
                    enc.time(*deadline);
                }
                PlacedState::Claimed(key) => {
                    enc.len(1);
                    enc.u(key.peer.0);
                }
                PlacedState::Ending(outcome) => {
                    enc.len(2);
                    enc.flag(matches!(outcome, Outcome::Consumed));
                }
            }
        }
        enc.len(self.placements.claims.len());
        for (id, keys) in &self.placements.claims {
            enc.str(&id.0);
            enc.len(keys.len());
            keys.iter().for_each(|key| enc.u(key.peer.0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ReceiverConfig;
    use crate::ids::PeerId;

    /// The checker catches what it is there for: the reserved-slot index, a reservation's state
    /// or the waiting claims out of step with the rest.
    #[test]
    fn check_placements_catches_books_out_of_step() {
        let cfg = ReceiverConfig {
            buffer_slots: 4,
            placement: Placement::Caller,
            ..ReceiverConfig::default()
        };
        let mut ledger = ReceiverLedger::new(cfg).expect("config");
        ledger
            .handle_reserve(
                Instant::ZERO,
                "r",
                vec![SlotIndex(1), SlotIndex(2)],
                ClaimSecret::new("the-secret-of-r!").expect("secret"),
            )
            .expect("reserve");
        ledger.check_invariants();
        let id = ReqId("r".into());
        for (what, corrupt) in [
            ("a reserved slot not indexed", |l: &mut ReceiverLedger| {
                l.placements.reserved_by.remove(&SlotIndex(1));
            }),
            (
                "an ended reservation kept although nothing is in quarantine",
                |l| {
                    let placed = l.placements.by_id.get_mut(&ReqId("r".into())).expect("out");
                    placed.state = PlacedState::Ending(Outcome::Consumed);
                },
            ),
            ("a waiting claim with no request", |l| {
                let key = ReqKey {
                    peer: PeerId(1),
                    req_id: ReqId("w".into()),
                };
                l.placements.claims.insert(key.req_id.clone(), vec![key]);
                l.placements.claims_waiting += 1;
            }),
        ] as [(&str, fn(&mut ReceiverLedger)); 3]
        {
            let mut bad = ledger.clone();
            corrupt(&mut bad);
            let caught = crate::testing::panic_message(|| bad.check_invariants());
            assert!(caught.is_some(), "{what} is caught");
        }
        assert!(ledger.placements.by_id.contains_key(&id));
    }
}
