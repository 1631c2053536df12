//! The sender's invariants (`docs/invariants.md` S1–S4, S7, S11–S13), checked after every step
//! of every harness.

use super::channel::Kind;
use super::{SenderFlow, State};
use crate::ids::StagingSlot;

impl SenderFlow {
    /// Panics if staging, writes, channels and requests disagree (`docs/invariants.md`
    /// S1–S4, S7, S11–S13). The harness calls it after every step.
    pub fn check_invariants(&self) {
        self.staging.check_invariants();
        let mut owned = 0usize;
        let mut reads = 0u64;
        for (id, req) in &self.requests {
            // S11: a pending batch holds only slots the request holds, each once; a failing
            // request has none.
            let mut added = std::collections::BTreeSet::new();
            for c in &req.added {
                assert!(
                    req.staged.contains(&c.staging) && added.insert(c.staging),
                    "invariant: {id} added a chunk in staging slot {} it does not hold once",
                    c.staging.0
                );
            }
            assert!(
                req.state != State::Failing || req.added.is_empty(),
                "invariant: {id} keeps a pending batch while failing"
            );
            let in_writes = self.writes.values().filter(|w| &w.req_id == id).count();
            assert_eq!(
                in_writes as u32, req.writes_in_flight,
                "invariant: {id} write count"
            );
            let in_batches: usize = self
                .channels
                .get(&req.spec.receiver)
                .map(|ch| {
                    ch.queue
                        .iter()
                        .filter(|m| &m.req_id == id)
                        .map(|m| {
                            if let Kind::Batch { chunks, .. } = &m.kind {
                                chunks.len()
                            } else {
                                0
                            }
                        })
                        .sum::<usize>()
                        + ch.in_flight
                            .iter()
                            .filter(|f| &f.req_id == id)
                            .map(|f| {
                                if let Kind::Batch { chunks, .. } = &f.kind {
                                    chunks.len()
                                } else {
                                    0
                                }
                            })
                            .sum::<usize>()
                })
                .unwrap_or(0);
            let expected = if req.state == State::Failing {
                req.writes_in_flight as usize
            } else {
                req.staged.len() + req.writes_in_flight as usize + in_batches
            };
            // S13: with caller staging nothing is held; the slots are read, each by the
            // chunks submitted and not yet written (counted over every request below).
            let holds = if self.staging.is_callers() {
                assert_eq!(
                    self.staging.owned_by(id) + req.staged.len() + req.added.len(),
                    0,
                    "invariant: {id} holds caller staging"
                );
                reads += expected as u64;
                0
            } else {
                self.staging.owned_by(id)
            };
            if !self.staging.is_callers() {
                assert_eq!(holds, expected, "invariant: {id} staging accounting");
            }
            if req.state == State::Admitting {
                assert_eq!(holds, 0, "invariant: {id} holds staging before admission");
            }
            assert!(
                req.submitted <= req.spec.total_chunks,
                "invariant: {id} submitted beyond its total"
            );
            assert!(
                req.written <= req.submitted,
                "invariant: {id} wrote more than it submitted"
            );
            owned += holds;
        }
        // S12: a slot lent to a failed request's caller is neither free nor a running
        // request's.
        for (slot, id) in &self.lent {
            assert!(
                self.staging.owner(*slot) == Some(id)
                    && self
                        .requests
                        .get(id)
                        .is_none_or(|r| r.state == State::Failing),
                "invariant: staging slot {} lent to {id}'s caller is free or another's",
                slot.0
            );
        }
        if self.staging.is_callers() {
            assert_eq!(
                self.staging.reads(),
                reads,
                "invariant: caller staging is read by exactly the chunks submitted and not \
                 yet written"
            );
            // S13, slot by slot: each slot's readers are the unwritten chunks naming it, in
            // batches not yet answered and in posted writes.
            let mut named = std::collections::BTreeMap::<StagingSlot, u32>::new();
            let batches = self.channels.values().flat_map(|ch| {
                let queued = ch.queue.iter().map(|m| &m.kind);
                queued.chain(ch.in_flight.iter().map(|f| &f.kind))
            });
            for kind in batches {
                if let Kind::Batch { chunks, .. } = kind {
                    chunks
                        .iter()
                        .for_each(|c| *named.entry(c.staging).or_default() += 1);
                }
            }
            for w in self.writes.values() {
                *named.entry(w.staging).or_default() += 1;
            }
            for slot in (0..self.staging.capacity()).map(StagingSlot) {
                assert_eq!(
                    self.staging.readers(slot),
                    named.get(&slot).copied().unwrap_or(0),
                    "invariant: caller staging slot {} is read by exactly the unwritten \
                     chunks naming it",
                    slot.0
                );
            }
        } else {
            let orphan = self.staging.capacity() as usize
                - self.staging.free_count() as usize
                - owned
                - self.lent.len();
            assert_eq!(
                orphan, 0,
                "invariant: every held staging slot belongs to a tracked request"
            );
        }
        // Only admitted requests wait for staging (S8), under their own age.
        for (age, id, calls) in self.waiters.iter() {
            let req = self.requests.get(id);
            assert!(
                req.is_some_and(|r| r.state == State::Admitted && r.age == age) && calls > 0,
                "invariant: {id} waits for staging while not admitted"
            );
        }
        assert!(
            self.outcomes.len() <= self.cfg.outcomes_kept,
            "invariant: outcomes kept beyond outcomes_kept"
        );
        for ch in self.channels.values() {
            assert!(
                ch.in_flight.len() <= ch.window(self.cfg.inflight_max),
                "invariant: channel window"
            );
        }
    }
}
