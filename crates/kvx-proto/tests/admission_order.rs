//! Who admission lets in, and when (`docs/spec/protocol.md` §Admission, §Fair shares): a new
//! request is admitted at once exactly when the queue's own rule would admit it first were it
//! queued, so a request is never left waiting in a queue nothing will re-run until a
//! release, an unpin, a withdrawal or an expiry (up to `admission_timeout` later).
//!
//! The review's case: a sender at 4 of its 5-slot share queues a request for 3 (past its
//! share, and too large for the 2 slots free) and then one for 1 (within its share, but behind
//! its own first, so passed over with it); a third sender's request for 2 must be admitted at
//! once. The same rule is then checked against a model of the protocol's text over random
//! operations, with requests up to the whole buffer.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kvx_proto::admission::{Admission, Decision, Limits};
use kvx_proto::receiver::{ReceiverEvent, ReceiverLedger};
use kvx_proto::rng::SeededRng;
use kvx_proto::wire::{AllocRequest, Message};
use kvx_proto::{Instant, PeerId, ReceiverConfig, Ticket};

const P: PeerId = PeerId(1);
const Q: PeerId = PeerId(2);
const R: PeerId = PeerId(3);

fn far() -> Instant {
    Instant::ZERO + Duration::from_secs(3_600)
}

#[test]
fn a_request_that_fits_is_admitted_when_every_waiter_ahead_is_passed_over() {
    let mut adm = Admission::new(Limits {
        capacity: 10,
        queue_max: 16,
        peer_cap: 5,
        peer_queue_max: 16,
    });
    assert_eq!(adm.request(Ticket(1), P, 4, far()), Decision::Admitted);
    assert_eq!(adm.request(Ticket(2), Q, 4, far()), Decision::Admitted);
    // 4 + 3 is past P's share of 5, and 3 do not fit in 2: it waits.
    assert_eq!(adm.request(Ticket(3), P, 3, far()), Decision::Queued);
    // Within P's share, but behind P's own first request: passed over with it.
    assert_eq!(adm.request(Ticket(4), P, 1, far()), Decision::Queued);
    assert_eq!(adm.available(), 2);
    assert_eq!(
        adm.request(Ticket(5), R, 2, far()),
        Decision::Admitted,
        "every waiter ahead is passed over and 2 of 2 free slots fit"
    );
    adm.check_invariants();
    // With R gone nobody within a share waits: P's first is next, and waits for room.
    adm.release(R, 2);
    assert_eq!(adm.poll_admitted(), None);
    // P's waiters keep their order: its small request does not overtake its large one.
    adm.release(Q, 4);
    assert_eq!(adm.poll_admitted(), Some(Ticket(3)));
    assert_eq!(adm.poll_admitted(), Some(Ticket(4)));
    adm.check_invariants();
}

fn probe(req: &str, total: u32) -> Message {
    Message::AllocRequest(AllocRequest {
        keys: vec![],
        chunk_bytes: None,
        claim: None,
        fmt: 1,
        shape: vec![2, 2, 256, 64],
        dtype: "bfloat16".into(),
        last_chunk_toks: 256,
        req_id: req.into(),
        is_last_batch: false,
        total_chunks: total,
        seq: Some(1),
    })
}

/// The same case through the ledger: the other sender's probe is answered at once, not when
/// the next release or the 30 s admission timeout re-runs the queue.
#[test]
fn the_ledger_answers_a_probe_that_fits_behind_passed_over_waiters_at_once() {
    let mut ledger = ReceiverLedger::new(ReceiverConfig {
        buffer_slots: 10,
        peer_share_percent: 50,
        ..ReceiverConfig::default()
    })
    .expect("valid config");
    let now = Instant::ZERO;
    ledger.handle_message(now, P, probe("p-hold", 4));
    ledger.handle_message(now, Q, probe("q-hold", 4));
    ledger.handle_message(now, P, probe("p-large", 3));
    ledger.handle_message(now, P, probe("p-small", 1));
    let answered: Vec<PeerId> = std::iter::from_fn(|| ledger.poll_transmit())
        .map(|(peer, _)| peer)
        .collect();
    assert_eq!(answered, [P, Q], "only p-hold and q-hold are admitted");
    ledger.handle_message(now, R, probe("r", 2));
    let (peer, reply) = ledger
        .poll_transmit()
        .expect("r's probe is answered at once");
    assert_eq!(peer, R);
    assert!(!reply.is_refusal(), "{reply:?}");
    let admitted: Vec<String> = std::iter::from_fn(|| ledger.poll_event())
        .filter_map(|e| match e {
            ReceiverEvent::Admitted { key, .. } => Some(key.req_id.0),
            _ => None,
        })
        .collect();
    assert_eq!(admitted, ["p-hold", "q-hold", "r"]);
    assert_eq!(ledger.admission_queue_len(), 2);
    ledger.check_invariants();
}

/// The protocol's rule, written from `docs/spec/protocol.md` §Fair shares alone: walk the
/// queue in order; a waiter whose peer holds slots and would go past its share with it is
/// passed over with every later waiter of that peer; the first waiter not passed over is
/// admitted if it fits, and blocks everyone behind it if it does not. When every waiter is
/// passed over, the first in the queue is the one admitted if it fits. A new request joins
/// the back and the rule runs.
#[derive(Debug, Default)]
struct Model {
    capacity: u32,
    cap: u32,
    reserved: u32,
    pinned: BTreeMap<PeerId, u32>,
    footprint: BTreeMap<PeerId, u32>,
    queue: Vec<(Ticket, PeerId, u32)>,
    /// Admitted tickets and what each still reserves.
    held: BTreeMap<Ticket, (PeerId, u32)>,
}

impl Model {
    fn available(&self) -> u32 {
        self.capacity - self.reserved - self.pinned.values().sum::<u32>()
    }

    fn within_share(&self, peer: PeerId, need: u32) -> bool {
        let held = self.footprint.get(&peer).copied().unwrap_or(0);
        self.cap >= self.capacity || held == 0 || held + need <= self.cap
    }

    /// The queue position the rule picks next, if any waits.
    fn next(&self) -> Option<usize> {
        let mut passed = BTreeSet::new();
        for (i, &(_, peer, need)) in self.queue.iter().enumerate() {
            if !passed.contains(&peer) && self.within_share(peer, need) {
                return Some(i);
            }
            passed.insert(peer);
        }
        (!self.queue.is_empty()).then_some(0)
    }

    /// Runs the rule; returns who it admitted, in order.
    fn admit(&mut self) -> Vec<Ticket> {
        let mut admitted = Vec::new();
        while let Some(i) = self.next() {
            let (ticket, peer, need) = self.queue[i];
            if need > self.available() {
                break;
            }
            self.queue.remove(i);
            self.reserved += need;
            *self.footprint.entry(peer).or_default() += need;
            self.held.insert(ticket, (peer, need));
            admitted.push(ticket);
        }
        admitted
    }
}

fn drain(adm: &mut Admission) -> Vec<Ticket> {
    std::iter::from_fn(|| adm.poll_admitted()).collect()
}

/// Random requests, ends (part of the reservation quarantined), unpins and withdrawals, each
/// compared with the model: the same requests admitted, at once or from the queue, in the same
/// order.
#[test]
fn request_and_the_queue_agree_with_the_protocols_rule() {
    for seed in 0..400u64 {
        let mut rng = SeededRng::new(seed);
        let capacity = rng.range_u32(2, 12);
        let cap = rng.range_u32(1, capacity);
        let limits = Limits {
            capacity,
            queue_max: 1024,
            peer_cap: cap,
            peer_queue_max: 1024,
        };
        let mut adm = Admission::new(limits);
        let mut model = Model {
            capacity,
            cap,
            ..Model::default()
        };
        let peers = [PeerId(1), PeerId(2), PeerId(3)];
        let mut next = 0u64;
        for step in 0..300 {
            let what = rng.range(0, 9);
            if what < 5 {
                next += 1;
                let ticket = Ticket(next);
                let peer = *rng.pick(&peers);
                // Up to the whole buffer: a request larger than a share is never refused.
                let need = rng.range_u32(1, capacity);
                let decision = adm.request(ticket, peer, need, far());
                model.queue.push((ticket, peer, need));
                let want = if model.admit() == [ticket] {
                    Decision::Admitted
                } else {
                    Decision::Queued
                };
                assert_eq!(
                    decision,
                    want,
                    "seed {seed} step {step}: request {ticket:?} of {peer} for {need} \
                     (model queue {:?}, available {})",
                    model.queue,
                    model.available()
                );
                assert_eq!(drain(&mut adm), [], "seed {seed} step {step}");
            } else if what < 7 && !model.held.is_empty() {
                // A request ends; part of its reservation goes to quarantine.
                let tickets: Vec<Ticket> = model.held.keys().copied().collect();
                let ticket = *rng.pick(&tickets);
                let (peer, amount) = model.held.remove(&ticket).expect("held");
                let q = rng.range_u32(0, amount);
                adm.pin_from_reservation(q);
                adm.release(peer, amount - q);
                model.reserved -= amount;
                *model.pinned.entry(peer).or_default() += q;
                *model.footprint.entry(peer).or_default() -= amount - q;
                assert_eq!(
                    drain(&mut adm),
                    model.admit(),
                    "seed {seed} step {step}: end"
                );
            } else if what < 9 && model.pinned.values().any(|&n| n > 0) {
                let pinned: Vec<PeerId> = model
                    .pinned
                    .iter()
                    .filter(|(_, &n)| n > 0)
                    .map(|(&p, _)| p)
                    .collect();
                let peer = *rng.pick(&pinned);
                adm.unpin(peer, 1);
                *model.pinned.get_mut(&peer).expect("pinned") -= 1;
                *model.footprint.get_mut(&peer).expect("footprint") -= 1;
                assert_eq!(
                    drain(&mut adm),
                    model.admit(),
                    "seed {seed} step {step}: unpin"
                );
            } else if !model.queue.is_empty() {
                let i = rng.range(0, model.queue.len() as u64 - 1) as usize;
                let (ticket, _, _) = model.queue.remove(i);
                assert!(adm.withdraw(ticket));
                assert_eq!(
                    drain(&mut adm),
                    model.admit(),
                    "seed {seed} step {step}: withdraw"
                );
            }
            assert_eq!(
                adm.queue_len(),
                model.queue.len(),
                "seed {seed} step {step}"
            );
            assert_eq!(
                adm.available(),
                model.available(),
                "seed {seed} step {step}"
            );
            assert_eq!(
                adm.reserved(),
                model.reserved,
                "seed {seed} step {step} {what}"
            );
            adm.check_invariants();
        }
    }
}
