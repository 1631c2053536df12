//! Reservation-based admission: a request reserves its whole `total_chunks` at once, or
//! waits in a FIFO queue (`docs/spec/protocol.md` §Admission).
//!
//! Strict FIFO is deliberate: a large request at the head holds back smaller ones behind it,
//! which is what keeps it from starving (LMCache's `notify_all` race admits whoever fits
//! first, W2). Deadlines are `arrival + admission_timeout`, so they are non-decreasing in
//! queue order and expiry only ever looks at the head.
//!
//! `Admission` counts; it does not know which request holds which reservation. The receiver
//! ledger keeps per-request amounts and checks that they add up to `reserved()`.

use std::collections::VecDeque;

use crate::ids::Ticket;
use crate::time::Instant;

/// Why a request is refused at once, without waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `total_chunks == 0`: LMCache's legacy senders; nothing can be reserved.
    ZeroChunks,
    /// The request needs more slots than the whole buffer has: it could never be admitted.
    LargerThanBuffer { need: u32, capacity: u32 },
    /// The admission queue is full.
    QueueFull { max: usize },
}

/// The outcome of asking for a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Admitted,
    Queued,
    Refused(Refusal),
}

#[derive(Debug, Clone, Copy)]
struct Waiter {
    ticket: Ticket,
    need: u32,
    deadline: Instant,
}

#[derive(Debug, Clone)]
pub struct Admission {
    capacity: u32,
    reserved: u32,
    pinned: u32,
    waiting: VecDeque<Waiter>,
    queue_max: usize,
    admitted: VecDeque<Ticket>,
}

impl Admission {
    pub fn new(capacity: u32, queue_max: usize) -> Self {
        Self {
            capacity,
            reserved: 0,
            pinned: 0,
            waiting: VecDeque::new(),
            queue_max,
            admitted: VecDeque::new(),
        }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
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
        self.capacity - self.reserved - self.pinned
    }

    pub fn queue_len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_waiting(&self, ticket: Ticket) -> bool {
        self.waiting.iter().any(|w| w.ticket == ticket)
    }

    /// Reserves `need` slots for `ticket` now, queues it until `deadline`, or refuses it.
    pub fn request(&mut self, ticket: Ticket, need: u32, deadline: Instant) -> Decision {
        if need == 0 {
            return Decision::Refused(Refusal::ZeroChunks);
        }
        if need > self.capacity {
            return Decision::Refused(Refusal::LargerThanBuffer {
                need,
                capacity: self.capacity,
            });
        }
        if broken_variant!(NoReservation) {
            self.reserved += need;
            return Decision::Admitted;
        }
        if self.waiting.is_empty() && need <= self.available() {
            self.reserved += need;
            return Decision::Admitted;
        }
        if self.waiting.len() >= self.queue_max {
            return Decision::Refused(Refusal::QueueFull {
                max: self.queue_max,
            });
        }
        // Keep deadlines non-decreasing so that expiry can look at the head alone.
        let floor = self.waiting.back().map_or(deadline, |w| w.deadline);
        self.waiting.push_back(Waiter {
            ticket,
            need,
            deadline: deadline.max(floor),
        });
        Decision::Queued
    }

    /// Gives back `amount` reserved slots and admits whoever now fits at the head.
    pub fn release(&mut self, amount: u32) {
        assert!(
            amount <= self.reserved,
            "invariant: release {amount} of {} reserved",
            self.reserved
        );
        self.reserved -= amount;
        self.admit_from_head();
    }

    /// Moves `amount` slots from a reservation to the pinned set (a rollback quarantines
    /// slots that a late write may still hit; they stay out of use but leave the request).
    pub fn pin_from_reservation(&mut self, amount: u32) {
        assert!(
            amount <= self.reserved,
            "invariant: pin {amount} of {} reserved",
            self.reserved
        );
        self.reserved -= amount;
        self.pinned += amount;
    }

    /// Returns pinned slots to use.
    pub fn unpin(&mut self, amount: u32) {
        assert!(
            amount <= self.pinned,
            "invariant: unpin {amount} of {} pinned",
            self.pinned
        );
        self.pinned -= amount;
        self.admit_from_head();
    }

    /// Takes `ticket` out of the queue (cancelled while waiting). False if it was not there.
    pub fn withdraw(&mut self, ticket: Ticket) -> bool {
        let Some(pos) = self.waiting.iter().position(|w| w.ticket == ticket) else {
            return false;
        };
        self.waiting.remove(pos);
        // The head may have changed: a smaller request behind a withdrawn large one may fit.
        self.admit_from_head();
        true
    }

    /// The next waiter whose deadline has passed, removed from the queue.
    pub fn poll_expired(&mut self, now: Instant) -> Option<Ticket> {
        if self.waiting.front().is_some_and(|w| w.deadline <= now) {
            let expired = self.waiting.pop_front().map(|w| w.ticket);
            self.admit_from_head();
            return expired;
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

    fn admit_from_head(&mut self) {
        while let Some(head) = self.waiting.front() {
            if head.need > self.available() {
                break;
            }
            self.reserved += head.need;
            self.admitted.push_back(head.ticket);
            self.waiting.pop_front();
        }
    }

    /// The explorer's canonical encoding (feature `testing`); capacity and queue bound are
    /// fixed by the configuration.
    #[cfg(feature = "testing")]
    pub(crate) fn canon(&self, enc: &mut crate::testing::Canon) {
        enc.u(u64::from(self.reserved));
        enc.u(u64::from(self.pinned));
        enc.len(self.waiting.len());
        for w in &self.waiting {
            enc.ticket(w.ticket);
            enc.u(u64::from(w.need));
            enc.time(w.deadline);
        }
        enc.len(self.admitted.len());
        self.admitted.iter().for_each(|&t| enc.ticket(t));
    }

    pub fn check_invariants(&self) {
        assert!(
            self.reserved + self.pinned <= self.capacity,
            "invariant: reserved {} + pinned {} exceed capacity {}",
            self.reserved,
            self.pinned,
            self.capacity
        );
        assert!(
            self.waiting.len() <= self.queue_max,
            "invariant: admission queue over its bound"
        );
        for pair in self.waiting.iter().zip(self.waiting.iter().skip(1)) {
            assert!(
                pair.0.deadline <= pair.1.deadline,
                "invariant: queue deadlines are FIFO"
            );
        }
        if let Some(head) = self.waiting.front() {
            assert!(
                head.need > self.available(),
                "invariant: the queue head waits only when it does not fit"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const T0: Instant = Instant::ZERO;

    fn later(ms: u64) -> Instant {
        T0 + Duration::from_millis(ms)
    }

    #[test]
    fn seed_example_b_waits_until_a_releases() {
        let mut adm = Admission::new(10, 8);
        assert_eq!(adm.request(Ticket(1), 8, later(100)), Decision::Admitted);
        assert_eq!(adm.request(Ticket(2), 8, later(100)), Decision::Queued);
        assert_eq!(adm.poll_admitted(), None);
        adm.release(8);
        assert_eq!(adm.poll_admitted(), Some(Ticket(2)));
        assert_eq!(adm.reserved(), 8);
        adm.check_invariants();
    }

    #[test]
    fn fifo_holds_small_requests_behind_a_large_head() {
        let mut adm = Admission::new(10, 8);
        assert_eq!(adm.request(Ticket(1), 6, later(100)), Decision::Admitted);
        assert_eq!(adm.request(Ticket(2), 8, later(100)), Decision::Queued);
        // 4 slots are free, but the 8-chunk head came first.
        assert_eq!(adm.request(Ticket(3), 2, later(100)), Decision::Queued);
        adm.release(6);
        assert_eq!(adm.poll_admitted(), Some(Ticket(2)));
        assert_eq!(adm.poll_admitted(), Some(Ticket(3)));
        adm.check_invariants();
    }

    #[test]
    fn refusals_are_immediate() {
        let mut adm = Admission::new(10, 1);
        assert_eq!(
            adm.request(Ticket(1), 0, later(1)),
            Decision::Refused(Refusal::ZeroChunks)
        );
        assert_eq!(
            adm.request(Ticket(2), 11, later(1)),
            Decision::Refused(Refusal::LargerThanBuffer {
                need: 11,
                capacity: 10
            })
        );
        assert_eq!(adm.request(Ticket(3), 10, later(1)), Decision::Admitted);
        assert_eq!(adm.request(Ticket(4), 1, later(1)), Decision::Queued);
        assert_eq!(
            adm.request(Ticket(5), 1, later(1)),
            Decision::Refused(Refusal::QueueFull { max: 1 })
        );
    }

    #[test]
    fn expiry_and_withdraw_unblock_the_queue() {
        let mut adm = Admission::new(10, 8);
        adm.request(Ticket(1), 5, later(10));
        adm.request(Ticket(2), 9, later(10));
        adm.request(Ticket(3), 4, later(20));
        assert_eq!(adm.poll_expired(later(5)), None);
        assert_eq!(adm.poll_expired(later(10)), Some(Ticket(2)));
        assert_eq!(adm.poll_admitted(), Some(Ticket(3)));
        adm.request(Ticket(4), 9, later(30));
        assert!(adm.withdraw(Ticket(4)));
        assert!(!adm.withdraw(Ticket(4)));
        adm.check_invariants();
    }

    #[test]
    fn pinned_slots_are_not_available() {
        let mut adm = Admission::new(4, 8);
        adm.request(Ticket(1), 4, later(10));
        adm.pin_from_reservation(2);
        adm.release(2);
        assert_eq!(adm.available(), 2);
        assert_eq!(adm.request(Ticket(2), 3, later(10)), Decision::Queued);
        adm.unpin(2);
        assert_eq!(adm.poll_admitted(), Some(Ticket(2)));
    }
}
