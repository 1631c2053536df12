//! Reservation-based admission: a request reserves its whole `total_chunks` at once, or
//! waits in a FIFO queue (`docs/spec/protocol.md` §Admission).
//!
//! Strict FIFO is deliberate: a large request first in line holds back smaller ones behind it,
//! which is what keeps it from starving (LMCache's `notify_all` race admits whoever fits
//! first, W2). Deadlines are `arrival + admission_timeout`, so they are non-decreasing in
//! queue order and expiry only ever looks at the head.
//!
//! **Work-conserving per-peer shares** (`docs/spec/protocol.md` §Fair shares). One peer's
//! footprint is the slots its requests reserve plus its rolled-back slots still in quarantine.
//! A waiter is *within its share* when its peer holds nothing, or when the peer's footprint
//! with the waiter stays within `peer_cap`. Next in line is the first waiter within its share
//! (a peer's requests keep their order: a waiter passed over holds back its peer's later
//! ones); only when no waiter is within its share is the head next, so a share binds only
//! while another peer contends for the buffer, and a lone peer uses all of it. Nothing that
//! fits the buffer is refused because of a share. At most `peer_queue_max` requests of one
//! peer may wait. With `peer_cap` equal to the capacity every waiter is within its share and
//! this is plain FIFO.
//!
//! `Admission` counts per peer; it does not know which request holds which reservation. The
//! receiver ledger keeps per-request amounts and checks that they add up.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::ids::{PeerId, Ticket};
use crate::time::Instant;

/// Why a request is refused at once, without waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `total_chunks == 0`: LMCache's legacy senders; nothing can be reserved.
    ZeroChunks,
    /// The request needs more slots than the whole buffer has: it could never be admitted.
    LargerThanBuffer {
        /// The request's `total_chunks`.
        need: u32,
        /// The buffer's slots.
        capacity: u32,
    },
    /// The admission queue is full.
    QueueFull {
        /// `Limits::queue_max`.
        max: usize,
    },
    /// This peer already has `max` requests waiting.
    PeerQueueFull {
        /// `Limits::peer_queue_max`.
        max: usize,
    },
}

/// The outcome of asking for a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The reservation is held now; `poll_admitted` will not report it.
    Admitted,
    /// Waiting; `poll_admitted` or `poll_expired` reports it later, unless withdrawn.
    Queued,
    /// Not queued, nothing reserved.
    Refused(Refusal),
}

#[derive(Debug, Clone, Copy)]
struct Waiter {
    ticket: Ticket,
    peer: PeerId,
    need: u32,
    deadline: Instant,
}

/// The limits of one receiver's admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Slots in the buffer.
    pub capacity: u32,
    /// Requests waiting at most.
    pub queue_max: usize,
    /// Slots one peer may hold (reserved + quarantined) while another peer's waiter is within
    /// its share; `capacity` for no cap. A peer holding nothing may reserve more.
    pub peer_cap: u32,
    /// Requests of one peer waiting at most.
    pub peer_queue_max: usize,
}

impl Limits {
    /// The plain FIFO of one buffer: no per-peer limits beyond the queue's.
    pub fn fifo(capacity: u32, queue_max: usize) -> Self {
        Self {
            capacity,
            queue_max,
            peer_cap: capacity,
            peer_queue_max: queue_max,
        }
    }
}

/// One peer's share in use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Share {
    /// Reserved + pinned slots of the peer.
    footprint: u32,
    waiting: usize,
}

/// One receiver's admission: the reservations, the FIFO queue with its per-peer shares, and
/// the slots pinned by quarantine, counted per peer (never per request).
///
/// Contract: the caller (`ReceiverLedger`) asks once per request, with `request` and a
/// ticket it never reuses. `Admitted` holds the reservation at once; `Queued` puts the ticket
/// in the queue until `deadline` (raised to the deadline of the ticket before it, so expiry
/// looks at the head alone). A queued ticket leaves in exactly one way: admitted
/// (`poll_admitted`), expired (`poll_expired(now)`, which the caller calls until `None`
/// whenever `now` reaches `next_deadline`; the ticket is already out of the queue), or
/// withdrawn by the caller (`withdraw`), which it must do when the request ends while it
/// waits, or the ticket is later reported admitted for a request nobody tracks. Slots come
/// back through `release(peer, amount)` (the request ended, or its last batch brought fewer
/// chunks than declared) and, for slots a rollback quarantined, `pin_from_reservation` then
/// one `unpin(peer, 1)` per slot when its late write lands or its quarantine ends. The caller
/// keeps each request's amount and never gives back more than the peer holds (asserted).
/// Waiters are admitted only inside `release`, `unpin`, `withdraw` and `poll_expired`; the
/// caller drains `poll_admitted` after them and answers the admitted requests' first batches.
#[derive(Debug, Clone)]
pub struct Admission {
    limits: Limits,
    reserved: u32,
    pinned: u32,
    waiting: VecDeque<Waiter>,
    admitted: VecDeque<Ticket>,
    shares: BTreeMap<PeerId, Share>,
    /// The first admission that broke §Fair shares, in words, as seen by an independent
    /// statement of the rule (`unfair_admission`); `check_invariants` reports it. Kept only
    /// where invariants are checked.
    #[cfg(any(test, feature = "testing"))]
    unfair: Option<String>,
}

impl Admission {
    /// The limits it was made with.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// An empty buffer: nothing reserved, pinned or waiting.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            reserved: 0,
            pinned: 0,
            waiting: VecDeque::new(),
            admitted: VecDeque::new(),
            shares: BTreeMap::new(),
            #[cfg(any(test, feature = "testing"))]
            unfair: None,
        }
    }

    /// Slots `peer` holds: reserved by its requests, or quarantined after its rollbacks.
    pub fn footprint(&self, peer: PeerId) -> u32 {
        self.shares.get(&peer).map_or(0, |s| s.footprint)
    }

    fn share(&mut self, peer: PeerId) -> &mut Share {
        self.shares.entry(peer).or_default()
    }

    /// Forgets peers that hold and wait for nothing (the map stays as small as the set of
    /// active peers).
    fn tidy(&mut self, peer: PeerId) {
        if self.shares.get(&peer) == Some(&Share::default()) {
            self.shares.remove(&peer);
        }
    }

    /// Whether a waiter of `peer` needing `need` is within its peer's share: the peer holds
    /// nothing (a request larger than the share is admitted on its own), or holds little
    /// enough that the waiter keeps it within `peer_cap`.
    fn within_share(&self, peer: PeerId, need: u32) -> bool {
        let held = self.footprint(peer);
        self.limits.peer_cap >= self.limits.capacity
            || held == 0
            || held + need <= self.limits.peer_cap
    }

    /// Slots promised to admitted requests (allocated or not yet).
    pub fn reserved(&self) -> u32 {
        self.reserved
    }

    /// Slots out of use that belong to no reservation (quarantined after a rollback).
    pub fn pinned(&self) -> u32 {
        self.pinned
    }

    /// Slots a new reservation may take.
    pub fn available(&self) -> u32 {
        self.limits.capacity - self.reserved - self.pinned
    }

    /// Requests waiting.
    pub fn queue_len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether a request of a peer other than `peer` waits (linear in the queue's length).
    pub fn waits_for_other_than(&self, peer: PeerId) -> bool {
        self.waiting.iter().any(|w| w.peer != peer)
    }

    /// Whether `ticket` is in the queue (linear in the queue's length).
    pub fn is_waiting(&self, ticket: Ticket) -> bool {
        self.waiting.iter().any(|w| w.ticket == ticket)
    }

    /// Reserves `need` slots for `ticket` of `peer` now, queues it until `deadline`, or
    /// refuses it.
    pub fn request(
        &mut self,
        ticket: Ticket,
        peer: PeerId,
        need: u32,
        deadline: Instant,
    ) -> Decision {
        let limits = self.limits;
        if need == 0 {
            return Decision::Refused(Refusal::ZeroChunks);
        }
        if need > limits.capacity {
            return Decision::Refused(Refusal::LargerThanBuffer {
                need,
                capacity: limits.capacity,
            });
        }
        if broken_variant!(NoReservation) {
            self.reserve(peer, need);
            return Decision::Admitted;
        }
        // Admitted at once exactly when the queue's rule, run with this request at the back,
        // would pick it next: every waiter ahead is passed over (none of them is this peer's
        // own, whose requests keep their order) and it is within its share, or the queue is
        // empty. Any other rule here either queues a request that fits, which nothing re-runs
        // the queue for until the next release, unpin, withdrawal or expiry, or lets it
        // overtake a waiter.
        let candidate = Waiter {
            ticket,
            peer,
            need,
            deadline,
        };
        let behind = self.waiting.len();
        let next = self.next_in_line(self.waiting.iter().chain([&candidate]));
        if next == Some(behind) && need <= self.available() {
            self.note_fairness(&candidate);
            self.reserve(peer, need);
            return Decision::Admitted;
        }
        if self.waiting.len() >= limits.queue_max {
            return Decision::Refused(Refusal::QueueFull {
                max: limits.queue_max,
            });
        }
        if self.shares.get(&peer).map_or(0, |s| s.waiting) >= limits.peer_queue_max {
            return Decision::Refused(Refusal::PeerQueueFull {
                max: limits.peer_queue_max,
            });
        }
        // Keep deadlines non-decreasing so that expiry can look at the head alone.
        let floor = self.waiting.back().map_or(deadline, |w| w.deadline);
        self.waiting.push_back(Waiter {
            ticket,
            peer,
            need,
            deadline: deadline.max(floor),
        });
        self.share(peer).waiting += 1;
        Decision::Queued
    }

    fn reserve(&mut self, peer: PeerId, need: u32) {
        self.reserved += need;
        self.share(peer).footprint += need;
    }

    /// Gives back `amount` slots `peer` reserved and admits whoever now fits.
    pub fn release(&mut self, peer: PeerId, amount: u32) {
        assert!(
            amount <= self.reserved && amount <= self.footprint(peer),
            "invariant: release {amount} of {} reserved ({} by {peer})",
            self.reserved,
            self.footprint(peer)
        );
        self.reserved -= amount;
        self.share(peer).footprint -= amount;
        self.tidy(peer);
        self.admit_eligible();
    }

    /// Moves `amount` reserved slots to the pinned set (a rollback quarantines slots that a
    /// late write may still hit; they stay out of use, and count against the share of the
    /// peer whose reservation they were, but leave the request). That peer's footprint is
    /// unchanged, so no peer is named; `unpin` later gives them back to it one by one.
    pub fn pin_from_reservation(&mut self, amount: u32) {
        assert!(
            amount <= self.reserved,
            "invariant: pin {amount} of {} reserved",
            self.reserved
        );
        self.reserved -= amount;
        self.pinned += amount;
    }

    /// Returns `amount` of `peer`'s pinned slots to use.
    pub fn unpin(&mut self, peer: PeerId, amount: u32) {
        assert!(
            amount <= self.pinned && amount <= self.footprint(peer),
            "invariant: unpin {amount} of {} pinned ({} held by {peer})",
            self.pinned,
            self.footprint(peer)
        );
        self.pinned -= amount;
        self.share(peer).footprint -= amount;
        self.tidy(peer);
        self.admit_eligible();
    }

    /// Takes `ticket` out of the queue (cancelled while waiting). False if it was not there.
    pub fn withdraw(&mut self, ticket: Ticket) -> bool {
        let Some(pos) = self.waiting.iter().position(|w| w.ticket == ticket) else {
            return false;
        };
        if let Some(w) = self.waiting.remove(pos) {
            self.unqueue(w.peer);
        }
        // A smaller request behind a withdrawn large one may fit now.
        self.admit_eligible();
        true
    }

    fn unqueue(&mut self, peer: PeerId) {
        self.share(peer).waiting -= 1;
        self.tidy(peer);
    }

    /// The next waiter whose deadline has passed, removed from the queue.
    pub fn poll_expired(&mut self, now: Instant) -> Option<Ticket> {
        if self.waiting.front().is_some_and(|w| w.deadline <= now) {
            let expired = self.waiting.pop_front()?;
            self.unqueue(expired.peer);
            self.admit_eligible();
            return Some(expired.ticket);
        }
        None
    }

    /// The next request admitted from the queue since the last call.
    pub fn poll_admitted(&mut self) -> Option<Ticket> {
        self.admitted.pop_front()
    }

    /// When the head of the queue times out.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiting.front().map(|w| w.deadline)
    }

    /// Who is next in line (§Fair shares): the one rule `request`, `admit_eligible` and
    /// `check_invariants` all use, so that they cannot disagree about who is ahead. Walking
    /// `waiters` in queue order, a waiter is passed over when it is beyond its peer's share,
    /// or when a waiter of its peer was passed over before it (a peer's requests keep their
    /// order); the first one not passed over is next, whether or not it fits. When every
    /// waiter is passed over, nobody within a share contends, and the first waiter is next:
    /// a share binds only while another peer's waiter is within its own.
    fn next_in_line<'w>(&self, waiters: impl Iterator<Item = &'w Waiter>) -> Option<usize> {
        let mut passed_over = BTreeSet::new();
        let mut any = false;
        for (i, w) in waiters.enumerate() {
            any = true;
            if !passed_over.contains(&w.peer) && self.within_share(w.peer, w.need) {
                return Some(i);
            }
            passed_over.insert(w.peer);
        }
        any.then_some(0)
    }

    /// Admits the waiter next in line while it fits; the first that does not fit blocks
    /// everyone behind it.
    fn admit_eligible(&mut self) {
        while let Some(i) = self.next_in_line(self.waiting.iter()) {
            let w = self.waiting[i];
            if w.need > self.available() {
                break;
            }
            self.waiting.remove(i);
            self.unqueue(w.peer);
            self.note_fairness(&w);
            self.reserve(w.peer, w.need);
            self.admitted.push_back(w.ticket);
        }
    }

    /// The waiter next in line, if any (for invariants).
    fn first_in_line(&self) -> Option<Waiter> {
        self.next_in_line(self.waiting.iter())
            .map(|i| self.waiting[i])
    }

    /// Records the first admission that §Fair shares forbids, stated on its own terms rather
    /// than through `next_in_line`, so that a mistake there is caught: a waiter of a peer that
    /// already holds slots goes past its share only while no other peer has a waiter within
    /// its own (the first waiter of each other peer, with its peer's footprint).
    fn note_fairness(&mut self, w: &Waiter) {
        #[cfg(any(test, feature = "testing"))]
        if self.unfair.is_none() {
            self.unfair = self.unfair_admission(w);
        }
        let _ = w;
    }

    #[cfg(any(test, feature = "testing"))]
    fn unfair_admission(&self, w: &Waiter) -> Option<String> {
        let cap = self.limits.peer_cap;
        if cap >= self.limits.capacity {
            return None;
        }
        let held = self.footprint(w.peer);
        if held == 0 || held + w.need <= cap {
            return None;
        }
        let mut firsts = BTreeMap::new();
        for other in self.waiting.iter().filter(|o| o.peer != w.peer) {
            firsts.entry(other.peer).or_insert(*other);
        }
        let contender = firsts.values().find(|o| {
            let held = self.footprint(o.peer);
            held == 0 || held + o.need <= cap
        })?;
        Some(format!(
            "{} was admitted past its share ({held} held + {} > {cap}) while {}'s waiter of {} \
             was within its own",
            w.peer, w.need, contender.peer, contender.need
        ))
    }

    /// The explorer's canonical encoding (feature `testing`); capacity and queue bound are
    /// fixed by the configuration.
    #[cfg(feature = "testing")]
    pub(crate) fn canon(&self, enc: &mut crate::canon::Canon) {
        enc.u(u64::from(self.reserved));
        enc.u(u64::from(self.pinned));
        enc.len(self.waiting.len());
        for w in &self.waiting {
            enc.ticket(w.ticket);
            enc.u(w.peer.0);
            enc.u(u64::from(w.need));
            enc.time(w.deadline);
        }
        // Per-peer shares follow from the requests and the quarantine, which are encoded.
        enc.len(self.admitted.len());
        self.admitted.iter().for_each(|&t| enc.ticket(t));
    }

    /// Panics if the counts disagree, a bound or a share is exceeded, deadlines are out of
    /// order, or the first eligible waiter would fit (it should have been admitted).
    pub fn check_invariants(&self) {
        assert!(
            self.reserved + self.pinned <= self.limits.capacity,
            "invariant: reserved {} + pinned {} exceed capacity {}",
            self.reserved,
            self.pinned,
            self.limits.capacity
        );
        assert!(
            self.waiting.len() <= self.limits.queue_max,
            "invariant: admission queue over its bound"
        );
        let footprints: u32 = self.shares.values().map(|s| s.footprint).sum();
        assert_eq!(
            footprints,
            self.reserved + self.pinned,
            "invariant: the peers' footprints add up to reserved + pinned"
        );
        for (peer, share) in &self.shares {
            let waiting = self.waiting.iter().filter(|w| w.peer == *peer).count();
            assert_eq!(
                share.waiting, waiting,
                "invariant: {peer}'s waiters are counted"
            );
            assert!(
                share.waiting <= self.limits.peer_queue_max,
                "invariant: {peer} has more waiters than its bound"
            );
        }
        for pair in self.waiting.iter().zip(self.waiting.iter().skip(1)) {
            assert!(
                pair.0.deadline <= pair.1.deadline,
                "invariant: queue deadlines are FIFO"
            );
        }
        // Work conservation, stated on its own terms: when no peer's first waiter is within
        // its share, nothing is held back for a contender, and the head waits only when it
        // does not fit (a share never idles the buffer by itself).
        let cap = self.limits.peer_cap;
        let mut firsts = BTreeMap::new();
        for w in &self.waiting {
            firsts.entry(w.peer).or_insert(*w);
        }
        let contended = firsts.values().any(|w| {
            let held = self.footprint(w.peer);
            cap >= self.limits.capacity || held == 0 || held + w.need <= cap
        });
        if let (false, Some(head)) = (contended, self.waiting.front()) {
            assert!(
                head.need > self.available(),
                "invariant: with no waiter within its share, the head waits only when it does not \
                 fit (work conservation)"
            );
        }
        if let Some(first) = self.first_in_line() {
            assert!(
                first.need > self.available(),
                "invariant: the waiter next in line waits only when it does not fit"
            );
        }
        #[cfg(any(test, feature = "testing"))]
        if let Some(unfair) = &self.unfair {
            panic!("invariant: {unfair} (§Fair shares)");
        }
    }
}

#[cfg(test)]
mod tests;
