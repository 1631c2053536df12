//! Exhaustive exploration of the core for small configurations: every interleaving of
//! deliveries (per link, in order), write completions and failures, cancels, consumes and
//! timeouts, over `OpWorld`. Every transition checks every invariant; from every state the
//! world must heal to one where every request has ended and every buffer is free.
//!
//! States are told apart by a 128-bit fingerprint of a canonical encoding (`canon.rs`): times
//! relative to now, counters renamed by rank, slots by first appearance, and nothing that no
//! later step reads. Equal encodings mean states with the same futures, so visiting one of
//! them covers the other.
//!
//! Breadth-first (`explore`) finds the shortest event sequence to a bug, which is what a
//! bounded search wants; depth-first (`explore_from(…, Order::DepthFirst)`) holds only the
//! current path's unexpanded siblings in memory, which is what a complete search of millions
//! of states needs. Both visit the same states when neither is truncated.
//!
//! - `canon.rs`: the canonical encoding and the fingerprint.
//! - `reference.rs`: `check_abstraction`, the encoding checked against the whole state.
//! - `shares.rs`: `explore_shares`, admission alone where shares bind, with liveness.

mod reference;
mod shares;

use std::collections::{HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

pub use reference::{check_abstraction, AbstractionCheck};
pub use shares::{explore_shares, SharesPlan};

use super::ops::{Event, OpWorld};
use super::panic_text;
use crate::canon::Canon;

/// What an exploration covered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exploration {
    /// Distinct states reached.
    pub states: usize,
    /// Transitions taken (each one checked).
    pub transitions: usize,
    /// Longest event sequence to a new state (breadth-first: the shortest way to the
    /// farthest state; depth-first: the longest path the search took).
    pub depth: usize,
    /// True when `max_states` stopped the search before every state was reached.
    pub truncated: bool,
    /// Wall time.
    pub elapsed: Duration,
}

/// Explores every interleaving of `plan` (sender, total chunks per request, begun in order)
/// breadth-first, at most `max_states` states. Panics, with the event sequence, on a broken
/// invariant or a state from which the world does not heal.
pub fn explore(plan: &[(usize, u32)], max_states: usize) -> Exploration {
    explore_from(OpWorld::new(), plan, max_states, Order::BreadthFirst)
}

/// In which order states are expanded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Shortest event sequences first: a bounded search finds the shortest way to a bug.
    BreadthFirst,
    /// Holds only the current path's unexpanded siblings: memory for the visited
    /// fingerprints alone (16 bytes a state), for complete searches.
    DepthFirst,
}

/// As [`explore`], from `start` (e.g. `OpWorld::with_slots`), in `order`.
pub fn explore_from(
    start: OpWorld,
    plan: &[(usize, u32)],
    max_states: usize,
    order: Order,
) -> Exploration {
    Explorer::new(plan, max_states).run(start, order)
}

/// A state still to expand, with the events that led to it.
struct Frame {
    world: OpWorld,
    next: usize,
    path: Vec<Event>,
}

/// Fingerprints are already uniformly random: hash them by taking their low bits.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u128 fingerprints are hashed")
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

struct Explorer<'a> {
    plan: &'a [(usize, u32)],
    max_states: usize,
    seen: HashSet<u128, BuildHasherDefault<Identity>>,
    canon: Canon,
    report: Exploration,
}

impl<'a> Explorer<'a> {
    fn new(plan: &'a [(usize, u32)], max_states: usize) -> Self {
        Self {
            plan,
            max_states,
            seen: HashSet::default(),
            canon: Canon::new(),
            report: Exploration {
                states: 0,
                transitions: 0,
                depth: 0,
                truncated: false,
                elapsed: Duration::ZERO,
            },
        }
    }

    /// The fingerprint of a world that has begun the first `next` requests of the plan.
    fn fingerprint(&mut self, world: &OpWorld, next: usize) -> u128 {
        world.canon(&mut self.canon);
        self.canon.u(next as u64);
        self.canon.finish()
    }

    fn run(mut self, start: OpWorld, order: Order) -> Exploration {
        let started = Instant::now();
        let fp = self.fingerprint(&start, 0);
        self.seen.insert(fp);
        self.report.states = 1;
        let mut pending = VecDeque::new();
        pending.push_back(Frame {
            world: start,
            next: 0,
            path: Vec::new(),
        });
        let mut children = Vec::new();
        loop {
            let frame = match order {
                Order::BreadthFirst => pending.pop_front(),
                Order::DepthFirst => pending.pop_back(),
            };
            let Some(frame) = frame else { break };
            let complete = self.expand(frame, &mut children);
            pending.extend(children.drain(..));
            if !complete {
                self.report.truncated = true;
                break;
            }
        }
        // A truncated search still checks that every state it reached heals.
        for frame in pending {
            heal(frame.world, &frame.path);
        }
        self.report.elapsed = started.elapsed();
        self.report
    }

    /// Takes every enabled event from `frame`'s world (new states go to `children`), then
    /// checks that the world itself heals. False when the state bound is reached.
    fn expand(&mut self, frame: Frame, children: &mut Vec<Frame>) -> bool {
        let Frame { world, next, path } = frame;
        let mut events = world.enabled();
        if let Some(&(sender, total)) = self.plan.get(next) {
            events.push(Event::Begin { sender, total });
        }
        for event in events {
            let mut child = world.clone();
            let applied =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| child.apply(event)));
            if let Err(e) = applied {
                panic!(
                    "exploration: {} after {:?}",
                    panic_text(&e),
                    with(&path, event)
                );
            }
            self.report.transitions += 1;
            let child_next = next + usize::from(matches!(event, Event::Begin { .. }));
            let fp = self.fingerprint(&child, child_next);
            if !self.seen.insert(fp) {
                continue;
            }
            self.report.states += 1;
            self.report.depth = self.report.depth.max(path.len() + 1);
            children.push(Frame {
                world: child,
                next: child_next,
                path: with(&path, event),
            });
            if self.report.states >= self.max_states {
                heal(world, &path);
                return false;
            }
        }
        // Every successor is taken: the world itself is not needed any more.
        heal(world, &path);
        true
    }
}

/// Every state must heal: checked once per state, when it is expanded (so that the world
/// need not be cloned for it).
fn heal(mut world: OpWorld, path: &[Event]) {
    let heal = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| world.heal()));
    if let Err(e) = heal {
        panic!(
            "exploration: no way back to quiescence after {path:?}: {}",
            panic_text(&e)
        );
    }
}

fn with(path: &[Event], event: Event) -> Vec<Event> {
    let mut p = Vec::with_capacity(path.len() + 1);
    p.extend_from_slice(path);
    p.push(event);
    p
}
