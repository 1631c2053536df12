//! The ledger's own consistency checks (`docs/invariants.md`, R1–R14), which the harness
//! (`Cluster`, `OpWorld`) runs after every step.

use std::collections::BTreeMap;

use super::{batch, Phase, ReceiverLedger};
use crate::config::Placement;

impl ReceiverLedger {
    /// Panics if admission, the slot table and the requests disagree (reservations, owners,
    /// quarantine, bounds, timers). The harness (`Cluster`, `OpWorld`) calls it after every
    /// step.
    pub fn check_invariants(&self) {
        self.admission.check_invariants();
        self.slots.check_invariants();
        self.check_stalls();
        match self.cfg.placement {
            Placement::Pool => self.check_pool(),
            Placement::Caller => {
                assert_eq!(
                    (self.admission.reserved(), self.admission.pinned()),
                    (0, 0),
                    "invariant: caller placement leaves admission unused"
                );
                self.check_placements();
            }
        }
        // Under caller placement a claim of a reservation that is out is tracked whatever
        // the count (the reservation holds its slots); waiting claims keep the bound.
        let claimed = match self.cfg.placement {
            Placement::Caller => self.requests.len() - self.placements.claims.len(),
            Placement::Pool => 0,
        };
        assert!(
            self.requests.len() - claimed <= self.cfg.requests_max,
            "invariant: request table bound"
        );
        let queued: usize = self
            .requests
            .values()
            .filter_map(|r| match &r.phase {
                Phase::Waiting { first } => Some(batch::queued_bytes(first)),
                _ => None,
            })
            .sum();
        assert_eq!(
            queued, self.queued_bytes,
            "invariant: waiting first batches' bytes are counted"
        );
        assert!(
            self.queued_bytes <= self.cfg.queued_bytes_max,
            "invariant: waiting first batches within queued_bytes_max"
        );
        let mut owners = BTreeMap::new();
        for (key, req) in &self.requests {
            assert_eq!(
                self.tickets.get(&req.ticket),
                Some(key),
                "invariant: ticket index"
            );
            assert!(
                req.slots.len() as u32 <= req.reservation,
                "invariant: {key} allocated beyond its reservation"
            );
            assert!(
                req.reservation <= req.total,
                "invariant: {key} reserved beyond its total"
            );
            assert!(
                !req.reading || matches!(req.phase, Phase::Ready),
                "invariant: {key} is read only when ready"
            );
            assert!(
                req.doomed.is_none() || req.reading,
                "invariant: {key} is doomed only while read"
            );
            let waiting = matches!(req.phase, Phase::Waiting { .. });
            // Under caller placement a waiting request waits for its reservation, with a
            // timer (`check_placements`).
            let queued = self.cfg.placement == Placement::Pool;
            assert_eq!(
                waiting && queued,
                self.admission.is_waiting(req.ticket),
                "invariant: {key} waits iff queued"
            );
            if !waiting || !queued {
                assert!(
                    self.timers.contains(&(req.deadline, req.ticket)),
                    "invariant: {key} has a timer"
                );
            }
            for tag in &req.slots {
                assert!(
                    owners.insert(tag.slot, key).is_none(),
                    "invariant: slot {} has two owners",
                    tag.slot.0
                );
                let state = self.slots.state(tag.slot);
                assert!(
                    matches!(state, crate::slots::SlotState::Granted { owner } | crate::slots::SlotState::Landed { owner } if owner == req.ticket),
                    "invariant: {key}'s slot {} is in state {state:?}",
                    tag.slot.0
                );
            }
        }
        assert_eq!(
            owners.len() as u32,
            self.slots.held_count(),
            "invariant: every held slot has an owner"
        );
    }

    /// `check_invariants` under `Placement::Pool`: admission's books and the slots agree.
    fn check_pool(&self) {
        let reserved: u32 = self.requests.values().map(|r| r.reservation).sum();
        assert_eq!(
            reserved,
            self.admission.reserved(),
            "invariant: reservations add up"
        );
        assert_eq!(
            self.slots.quarantined_count(),
            self.admission.pinned(),
            "invariant: every quarantined slot is pinned in admission"
        );
        assert_eq!(
            self.slots.free_count() + self.slots.held_count() + self.slots.quarantined_count(),
            self.capacity(),
            "invariant: free + held + quarantined = capacity"
        );
        // Admission's view: what a new reservation may take, plus what is promised but not yet
        // allocated, plus what is allocated, plus what is quarantined, is the whole buffer.
        assert_eq!(
            self.admission.available()
                + self.reserved_unallocated()
                + self.slots.held_count()
                + self.slots.quarantined_count(),
            self.capacity(),
            "invariant: available + reserved + held + quarantined = capacity"
        );
        assert!(
            self.placements.by_id.is_empty() && self.placements.claims.is_empty(),
            "invariant: no reservation under pool placement"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ReceiverConfig;
    use crate::ids::PeerId;
    use crate::time::Instant;
    use crate::wire::{AllocRequest, Message};

    /// A pool ledger holding one admitted request of 2 of its 4 chunks and one first batch
    /// that waits (the buffer is full).
    fn ledger() -> ReceiverLedger {
        let mut l = ReceiverLedger::new(ReceiverConfig {
            buffer_slots: 4,
            ..ReceiverConfig::default()
        })
        .expect("config");
        for (peer, id) in [(1, "a"), (2, "b")] {
            let batch = AllocRequest {
                keys: vec![format!("{id}0"), format!("{id}1")],
                chunk_bytes: Some(vec![64, 64]),
                claim: None,
                fmt: 1,
                shape: vec![1],
                dtype: "float32".into(),
                last_chunk_toks: 1,
                req_id: id.into(),
                is_last_batch: false,
                total_chunks: 4,
                seq: Some(1),
            };
            l.handle_message(Instant::ZERO, PeerId(peer), Message::AllocRequest(batch));
        }
        l.check_invariants();
        assert_eq!(l.admission_queue_len(), 1, "b waits");
        l
    }

    /// The checker catches what it is there for, each by its own check: the pool's books,
    /// the requests' timers, tickets, reservations and reads, and the waiting bytes out of
    /// step with the rest.
    #[test]
    fn check_invariants_catches_pool_and_request_books_out_of_step() {
        let ledger = ledger();
        for (what, corrupt) in [
            ("has a timer", |l: &mut ReceiverLedger| {
                l.timers.clear();
            }),
            ("ticket index", |l| {
                // The waiting request's (the admitted one's is also its stall's).
                l.tickets.retain(|_, key| key.req_id.0 != "b");
            }),
            ("waiting first batches' bytes are counted", |l| {
                l.queued_bytes += 1;
            }),
            ("reservations add up", |l| {
                let r = l
                    .requests
                    .values_mut()
                    .find(|r| !matches!(r.phase, Phase::Waiting { .. }));
                let r = r.expect("the admitted request");
                r.reservation += 1;
                r.total += 1;
            }),
            ("is read only when ready", |l| {
                for r in l.requests.values_mut() {
                    r.reading = true;
                }
            }),
        ] as [(&str, fn(&mut ReceiverLedger)); 5]
        {
            let mut bad = ledger.clone();
            corrupt(&mut bad);
            let caught = crate::testing::panic_message(|| bad.check_invariants());
            assert!(
                caught.as_deref().is_some_and(|m| m.contains(what)),
                "\"{what}\" is caught by its own check: {caught:?}"
            );
        }
    }
}
