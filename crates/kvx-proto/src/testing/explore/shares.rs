//! Exhaustive exploration of admission alone (§Fair shares), at a size where shares bind:
//! every order in which the senders' requests arrive (each sender's in its own order), every
//! order in which admitted requests end (whole, or with their slots quarantined), quarantined
//! slots coming back one by one, waiters withdrawn and waiters timing out. Every state checks
//! `Admission`'s invariants (work conservation and the fairness of each admission among them)
//! and that no request that fits the buffer is refused; from every state, liveness: with
//! the decoder consuming (every admitted request ends, every quarantined slot comes back)
//! and no waiter giving up, every request, those still to arrive included, is admitted.
//!
//! The whole-protocol world (`OpWorld::contended`) carries the same checks through every
//! message and write, but its state space at this size is too large to cover completely;
//! this one is small enough to, because it abstracts a request to its sender and size.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use super::Exploration;
use crate::admission::{Admission, Decision, Limits, Refusal};
use crate::ids::{PeerId, Ticket};

/// One admission world: the limits, and each sender's requests (sizes, in arrival order).
#[derive(Debug, Clone)]
pub struct SharesPlan {
    /// The admission's limits (`peer_cap` below `capacity` for shares to bind).
    pub limits: Limits,
    /// Per sender, the sizes of its requests in the order it sends them.
    pub requests: Vec<Vec<u32>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The sender's next request arrives.
    Arrive(usize),
    /// An admitted request ends; with `quarantined`, its slots go to quarantine first.
    End { ticket: Ticket, quarantined: bool },
    /// One quarantined slot of a sender comes back.
    Unpin(PeerId),
    /// A waiter is withdrawn (cancelled while it waits).
    Withdraw(Ticket),
    /// The head of the queue times out.
    Expire,
}

#[derive(Debug, Clone)]
struct World {
    adm: Admission,
    /// Requests arrived per sender.
    arrived: Vec<usize>,
    next_ticket: u64,
    /// Waiting tickets in queue (arrival) order.
    waiting: Vec<(Ticket, PeerId, u32)>,
    /// Admitted tickets still holding their reservation.
    held: BTreeMap<Ticket, (PeerId, u32)>,
    pinned: BTreeMap<PeerId, u32>,
}

impl World {
    fn new(plan: &SharesPlan) -> Self {
        Self {
            adm: Admission::new(plan.limits),
            arrived: vec![0; plan.requests.len()],
            next_ticket: 0,
            waiting: Vec::new(),
            held: BTreeMap::new(),
            pinned: BTreeMap::new(),
        }
    }

    fn steps(&self, plan: &SharesPlan) -> Vec<Step> {
        let mut steps = Vec::new();
        for (s, reqs) in plan.requests.iter().enumerate() {
            if self.arrived[s] < reqs.len() {
                steps.push(Step::Arrive(s));
            }
        }
        for &ticket in self.held.keys() {
            steps.push(Step::End {
                ticket,
                quarantined: false,
            });
            steps.push(Step::End {
                ticket,
                quarantined: true,
            });
        }
        for (&peer, &n) in &self.pinned {
            if n > 0 {
                steps.push(Step::Unpin(peer));
            }
        }
        for &(ticket, _, _) in &self.waiting {
            steps.push(Step::Withdraw(ticket));
        }
        if !self.waiting.is_empty() {
            steps.push(Step::Expire);
        }
        steps
    }

    fn apply(&mut self, plan: &SharesPlan, step: Step) {
        match step {
            Step::Arrive(s) => {
                let need = plan.requests[s][self.arrived[s]];
                self.arrived[s] += 1;
                self.next_ticket += 1;
                let ticket = Ticket(self.next_ticket);
                let peer = PeerId(s as u64);
                // Deadlines in arrival order, so that the head's is the earliest.
                let deadline = crate::time::Instant::ZERO + Duration::from_secs(self.next_ticket);
                match self.adm.request(ticket, peer, need, deadline) {
                    Decision::Admitted => {
                        self.held.insert(ticket, (peer, need));
                    }
                    Decision::Queued => self.waiting.push((ticket, peer, need)),
                    Decision::Refused(why) => refused(plan, need, why),
                }
            }
            Step::End {
                ticket,
                quarantined,
            } => {
                let (peer, amount) = self.held.remove(&ticket).expect("held");
                if quarantined {
                    self.adm.pin_from_reservation(amount);
                    *self.pinned.entry(peer).or_default() += amount;
                } else {
                    self.adm.release(peer, amount);
                }
            }
            Step::Unpin(peer) => {
                self.adm.unpin(peer, 1);
                let n = self.pinned.get_mut(&peer).expect("pinned");
                *n -= 1;
                if *n == 0 {
                    self.pinned.remove(&peer);
                }
            }
            Step::Withdraw(ticket) => {
                assert!(self.adm.withdraw(ticket), "a waiter can be withdrawn");
                self.waiting.retain(|w| w.0 != ticket);
            }
            Step::Expire => {
                let head = self.waiting[0].0;
                let at = crate::time::Instant::ZERO + Duration::from_secs(head.0);
                assert_eq!(self.adm.poll_expired(at), Some(head), "the head expires");
                self.waiting.remove(0);
            }
        }
        while let Some(ticket) = self.adm.poll_admitted() {
            let at = self
                .waiting
                .iter()
                .position(|w| w.0 == ticket)
                .expect("an admitted ticket was waiting");
            let (_, peer, need) = self.waiting.remove(at);
            self.held.insert(ticket, (peer, need));
        }
        self.adm.check_invariants();
    }

    /// Liveness: the decoder consumes (every admitted request ends, every quarantined slot
    /// comes back), the senders send the rest of their requests, nobody withdraws or times
    /// out; then every request must have been admitted.
    fn check_live(mut self, plan: &SharesPlan) {
        let total: usize = plan.requests.iter().map(Vec::len).sum();
        for _ in 0..=4 * total + 4 * plan.limits.capacity as usize {
            if let Some(s) =
                (0..plan.requests.len()).find(|&s| self.arrived[s] < plan.requests[s].len())
            {
                self.apply(plan, Step::Arrive(s));
            } else if let Some(&ticket) = self.held.keys().next() {
                self.apply(
                    plan,
                    Step::End {
                        ticket,
                        quarantined: false,
                    },
                );
            } else if let Some(&peer) = self.pinned.keys().next() {
                self.apply(plan, Step::Unpin(peer));
            } else {
                break;
            }
        }
        assert!(
            self.waiting.is_empty(),
            "liveness: with the decoder consuming, {:?} still wait (held {:?}, pinned {:?})",
            self.waiting,
            self.held,
            self.pinned
        );
    }

    /// The state with tickets renamed by rank: equal keys have the same futures.
    fn key(&self) -> Vec<u64> {
        let mut live: Vec<Ticket> = self.waiting.iter().map(|w| w.0).collect();
        live.extend(self.held.keys());
        live.sort();
        let rank = |t: Ticket| live.iter().position(|&l| l == t).unwrap_or(usize::MAX) as u64;
        let mut k = Vec::with_capacity(32);
        k.extend(self.arrived.iter().map(|&a| a as u64));
        k.push(u64::MAX);
        for &(t, p, n) in &self.waiting {
            k.extend([rank(t), p.0, u64::from(n)]);
        }
        k.push(u64::MAX);
        for (&t, &(p, n)) in &self.held {
            k.extend([rank(t), p.0, u64::from(n)]);
        }
        k.push(u64::MAX);
        for (&p, &n) in &self.pinned {
            k.extend([p.0, u64::from(n)]);
        }
        k
    }
}

/// A refusal is allowed only for a queue bound; never for a request that fits the buffer.
fn refused(plan: &SharesPlan, need: u32, why: Refusal) {
    match why {
        Refusal::QueueFull { .. } | Refusal::PeerQueueFull { .. }
            if plan.requests.iter().map(Vec::len).sum::<usize>()
                > plan.limits.queue_max.min(plan.limits.peer_queue_max) => {}
        Refusal::LargerThanBuffer { .. } if need > plan.limits.capacity => {}
        _ => panic!(
            "checker: a request of {need} that fits the buffer of {} was refused: {why:?}",
            plan.limits.capacity
        ),
    }
}

/// Explores every state of `plan` (depth-first, complete): invariants on every transition,
/// liveness from every state. Panics with the steps that lead to a violation.
pub fn explore_shares(plan: &SharesPlan) -> Exploration {
    let started = Instant::now();
    let mut report = Exploration {
        states: 0,
        transitions: 0,
        depth: 0,
        truncated: false,
        elapsed: Duration::ZERO,
    };
    let mut seen = HashSet::new();
    let start = World::new(plan);
    seen.insert(start.key());
    let mut stack = vec![(start, Vec::<Step>::new())];
    while let Some((world, path)) = stack.pop() {
        report.states += 1;
        report.depth = report.depth.max(path.len());
        let live = world.clone();
        if let Some(why) = super::super::panic_message(|| live.check_live(plan)) {
            panic!("exploration of shares: {why} after {path:?}");
        }
        for step in world.steps(plan) {
            let mut child = world.clone();
            report.transitions += 1;
            if let Some(why) = super::super::panic_message(|| child.apply(plan, step)) {
                panic!("exploration of shares: {why} after {path:?} then {step:?}");
            }
            if seen.insert(child.key()) {
                let mut p = path.clone();
                p.push(step);
                stack.push((child, p));
            }
        }
    }
    report.elapsed = started.elapsed();
    report
}
