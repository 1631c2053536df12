//! Stalled reservations (`docs/spec/protocol.md` §Stalls): a request that holds its
//! reservation but lands no chunk for `stall_timeout` while another principal waits for the
//! buffer loses the reservation (`Failure::Stalled`).
//!
//! Why: a sender that took the buffer while alone could otherwise keep it for its requests'
//! whole lifetime (`total_chunks × request_idle_timeout`) by trickling one chunk just before
//! each idle timeout, and a sender of another host would wait out its admission timeout. A
//! request alone is never failed by this rule: its stall deadline is looked at only while
//! another principal waits (`ReceiverLedger::poll_timeout`), so a slow but lone sender keeps
//! today's behaviour, and one whose chunks land at the fabric's pace is never stalled.
//!
//! Armed for an admitted request of a kvx sender (which tells of each landed write) under
//! pool placement, re-armed at every chunk that lands, disarmed once the request is ready
//! or ends. A deadline that passes while nobody else waits stays put, so the first
//! principal to start waiting finds every request that was stalled already.

use std::collections::{BTreeMap, BTreeSet};

use super::{Failure, Phase, ReceiverLedger};
use crate::config::Placement;
use crate::ids::Ticket;
use crate::time::Instant;

/// The armed requests by stall deadline.
#[derive(Debug, Clone, Default)]
pub(super) struct Stalls {
    by_deadline: BTreeSet<(Instant, Ticket)>,
    of: BTreeMap<Ticket, Instant>,
}

impl Stalls {
    /// (Re)arms `ticket` at `at`.
    fn arm(&mut self, ticket: Ticket, at: Instant) {
        if let Some(old) = self.of.insert(ticket, at) {
            self.by_deadline.remove(&(old, ticket));
        }
        self.by_deadline.insert((at, ticket));
    }

    /// Disarms `ticket`, if armed.
    pub fn disarm(&mut self, ticket: Ticket) {
        if let Some(at) = self.of.remove(&ticket) {
            self.by_deadline.remove(&(at, ticket));
        }
    }

    /// The earliest stall deadline.
    pub fn next(&self) -> Option<Instant> {
        self.by_deadline.first().map(|&(at, _)| at)
    }

    /// Whether `ticket` is armed.
    pub fn armed(&self, ticket: Ticket) -> Option<Instant> {
        self.of.get(&ticket).copied()
    }

    /// Armed requests.
    pub fn len(&self) -> usize {
        self.of.len()
    }

    /// The armed tickets with their deadlines, in deadline order.
    pub fn iter(&self) -> impl Iterator<Item = &(Instant, Ticket)> {
        self.by_deadline.iter()
    }
}

impl ReceiverLedger {
    /// `ticket`'s request made progress at `now` (admitted, or a chunk landed): its stall
    /// deadline moves to `now + stall_timeout`, if the rule applies to it.
    pub(super) fn stall_progress(&mut self, ticket: Ticket, notices: bool, now: Instant) {
        if self.cfg.placement == Placement::Pool && notices {
            self.stalls.arm(ticket, now + self.cfg.stall_timeout);
        }
    }

    /// The earliest stall deadline that matters now: only while someone waits for
    /// admission (the rule looks for another principal among the waiters when it fires).
    pub(super) fn next_stall(&self) -> Option<Instant> {
        if self.admission.queue_len() == 0 {
            return None;
        }
        self.stalls.next()
    }

    /// Fails each request whose stall deadline passed while a principal other than its own
    /// waits (`Stalled`); one whose only waiters are its own principal's is re-armed a
    /// stall time on, so no deadline fires without end.
    pub(super) fn expire_stalls(&mut self, now: Instant) {
        if self.admission.queue_len() == 0 {
            return;
        }
        while let Some(&(at, ticket)) = self.stalls.by_deadline.first() {
            if at > now {
                break;
            }
            let key = self
                .tickets
                .get(&ticket)
                .cloned()
                .expect("invariant: an armed stall is tracked");
            let own = self.principals.share_key(key.peer);
            if self.admission.waits_for_other_than(own) {
                let after = self.cfg.stall_timeout;
                // A write granted before may still land: the slots are quarantined (or
                // their grants revoked where the fabric stops revoked writes).
                self.stats.stalled += 1;
                self.fail(now, &key, Failure::Stalled { after }, false);
                debug_assert!(self.stalls.armed(ticket).is_none());
            } else {
                self.stalls.arm(ticket, now + self.cfg.stall_timeout);
            }
        }
    }

    /// Panics if the armed stalls and the requests disagree.
    pub(super) fn check_stalls(&self) {
        for &(at, ticket) in self.stalls.iter() {
            let key = self
                .tickets
                .get(&ticket)
                .unwrap_or_else(|| panic!("invariant: stall of untracked ticket {ticket:?}"));
            let req = &self.requests[key];
            assert!(
                matches!(req.phase, Phase::Receiving | Phase::Complete) && req.notices,
                "invariant: {key} armed for a stall while {:?} (notices: {})",
                req.phase,
                req.notices
            );
            assert_eq!(
                self.stalls.armed(ticket),
                Some(at),
                "invariant: stall index"
            );
        }
        if self.cfg.placement == Placement::Pool {
            let armed = self
                .requests
                .values()
                .filter(|r| matches!(r.phase, Phase::Receiving | Phase::Complete) && r.notices)
                .count();
            assert_eq!(
                armed,
                self.stalls.len(),
                "invariant: every receiving request of a kvx sender is armed for a stall"
            );
        }
    }
}
