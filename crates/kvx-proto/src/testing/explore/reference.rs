//! A check of the explorer's abstraction (`canon.rs`) against a much finer one, on plans
//! small enough to search with both: every state is told apart by its whole `Debug` form
//! (only times are taken relative to now, and statistics counters dropped), the search
//! visits every such state, and each is mapped to its canonical fingerprint.
//!
//! The canonical search visits one representative per canonical state, so it can only see
//! the canonical states that the representatives' futures reach. If two states with the same
//! encoding had different futures, some canonical state reached from one of them would be
//! missing from the canonical search: the fine search's image would be larger. Equal counts
//! are evidence (for that plan) that nothing the encoding leaves out changes what can happen.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use super::{explore_from, Order};
use crate::canon::Canon;
use crate::testing::ops::{Event, OpWorld};

/// What [`check_abstraction`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbstractionCheck {
    /// States of the fine search.
    pub fine_states: usize,
    /// Distinct canonical fingerprints among them.
    pub image: usize,
    /// States of the canonical search (must equal `image`).
    pub canonical_states: usize,
}

/// Searches `plan` from `start` completely with both fingerprints (no bound: keep the plan
/// small) and counts.
pub fn check_abstraction(start: OpWorld, plan: &[(usize, u32)]) -> AbstractionCheck {
    let mut seen = HashSet::new();
    let mut image = HashSet::new();
    let mut canon = Canon::new();
    let mut canonical = |w: &OpWorld, next: usize| {
        w.canon(&mut canon);
        canon.u(next as u64);
        canon.finish()
    };
    seen.insert(fine(&start, 0));
    image.insert(canonical(&start, 0));
    let canonical_states = explore_from(start.clone(), plan, usize::MAX, Order::DepthFirst).states;
    let mut stack = vec![(start, 0)];
    while let Some((world, next)) = stack.pop() {
        let mut events = world.enabled();
        if let Some(&(sender, total)) = plan.get(next) {
            events.push(Event::Begin { sender, total });
        }
        for event in events {
            let mut child = world.clone();
            child.apply(event);
            let child_next = next + usize::from(matches!(event, Event::Begin { .. }));
            if seen.insert(fine(&child, child_next)) {
                image.insert(canonical(&child, child_next));
                stack.push((child, child_next));
            }
        }
    }
    AbstractionCheck {
        fine_states: seen.len(),
        image: image.len(),
        canonical_states,
    }
}

/// A hash of the world's whole `Debug` form, with every time relative to now and statistics
/// dropped (they are never read).
fn fine(world: &OpWorld, next: usize) -> u64 {
    let text = format!("{world:?}");
    let now = world.now().since_epoch();
    let mut h = DefaultHasher::new();
    relative(&text, now).hash(&mut h);
    next.hash(&mut h);
    h.finish()
}

/// Rewrites every `Instant(<duration>)` as its distance from `now`, and removes every
/// `stats: …Stats { … }` block.
fn relative(text: &str, now: Duration) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("Instant(") {
        out.push_str(&rest[..i]);
        let after = &rest[i + "Instant(".len()..];
        let end = after.find(')').unwrap_or(after.len());
        match parse_duration(&after[..end]) {
            Some(d) => out.push_str(&format!(
                "T{:+}",
                d.as_nanos() as i128 - now.as_nanos() as i128
            )),
            None => out.push_str(&after[..end]),
        }
        rest = after.get(end + 1..).unwrap_or("");
    }
    out.push_str(rest);
    let mut cleaned = String::with_capacity(out.len());
    let mut rest = out.as_str();
    while let Some(i) = rest.find("stats: ") {
        cleaned.push_str(&rest[..i]);
        let after = &rest[i..];
        let end = after.find('}').map_or(after.len(), |e| e + 1);
        rest = &after[end..];
    }
    cleaned.push_str(rest);
    cleaned
}

/// Parses `Duration`'s `Debug` form (`0ns`, `1.5µs`, `100ms`, `2.25s`).
fn parse_duration(s: &str) -> Option<Duration> {
    let units: [(&str, f64); 4] = [("ns", 1.0), ("µs", 1e3), ("ms", 1e6), ("s", 1e9)];
    let (num, scale) = units
        .iter()
        .find_map(|(u, k)| s.strip_suffix(u).map(|n| (n, *k)))?;
    let value: f64 = num.parse().ok()?;
    Some(Duration::from_nanos((value * scale).round() as u64))
}
