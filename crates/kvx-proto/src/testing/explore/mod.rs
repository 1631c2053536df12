//! Exhaustive exploration of the core for small configurations: every interleaving of
//! deliveries (per link, in order), write completions and failures, cancels, consumes and
//! timeouts, over `OpWorld`. States are deduplicated by a hash of their full `Debug` form,
//! every transition checks every invariant, and from every reachable state the world must
//! heal to a state where every request has ended and every buffer is free.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashSet, VecDeque};
use std::hash::{Hash, Hasher};

use super::ops::{Event, OpWorld};

/// What an exploration covered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exploration {
    /// Distinct states reached.
    pub states: usize,
    /// Transitions taken (each one checked).
    pub transitions: usize,
    /// Longest event sequence to a new state.
    pub depth: usize,
    /// True when `max_states` stopped the search before every state was reached.
    pub truncated: bool,
}

/// A hash of the world's full `Debug` form, abstracted so that states differing only in
/// what cannot change behaviour compare equal: times are taken relative to `now` (only
/// deadlines' distance matters), and statistics counters are dropped.
fn fingerprint(world: &OpWorld, next: usize) -> u64 {
    let text = format!("{world:?}");
    let now = world.now().since_epoch();
    let mut h = DefaultHasher::new();
    abstract_form(&text, now).hash(&mut h);
    next.hash(&mut h);
    h.finish()
}

/// Rewrites every `Instant(<duration>)` as its distance from `now`, and removes every
/// `stats: …Stats { … }` block.
fn abstract_form(text: &str, now: std::time::Duration) -> String {
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
fn parse_duration(s: &str) -> Option<std::time::Duration> {
    let units: [(&str, f64); 4] = [("ns", 1.0), ("µs", 1e3), ("ms", 1e6), ("s", 1e9)];
    let (num, scale) = units
        .iter()
        .find_map(|(u, k)| s.strip_suffix(u).map(|n| (n, *k)))?;
    let value: f64 = num.parse().ok()?;
    Some(std::time::Duration::from_nanos(
        (value * scale).round() as u64
    ))
}

/// Explores every interleaving of `plan` (sender, total chunks per request, begun in order),
/// at most `max_states` states. Panics, with the event sequence, on a broken invariant or a
/// state from which the world does not heal.
pub fn explore(plan: &[(usize, u32)], max_states: usize) -> Exploration {
    let mut seen = HashSet::new();
    let mut queue: VecDeque<(OpWorld, usize, Vec<Event>)> = VecDeque::new();
    let start = OpWorld::new();
    seen.insert(fingerprint(&start, 0));
    queue.push_back((start, 0, Vec::new()));
    let mut report = Exploration {
        states: 1,
        transitions: 0,
        depth: 0,
        truncated: false,
    };
    while let Some((world, next, path)) = queue.pop_front() {
        let mut events = world.enabled();
        if let Some(&(sender, total)) = plan.get(next) {
            events.push(Event::Begin { sender, total });
        }
        for event in events {
            let mut child = world.clone();
            let mut child_path = path.clone();
            child_path.push(event);
            let applied =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| child.apply(event)));
            if let Err(e) = applied {
                panic!("exploration: {} after {child_path:?}", panic_text(&e));
            }
            report.transitions += 1;
            let child_next = next + usize::from(matches!(event, Event::Begin { .. }));
            if !seen.insert(fingerprint(&child, child_next)) {
                continue;
            }
            report.states += 1;
            report.depth = report.depth.max(child_path.len());
            let mut healed = child.clone();
            let heal = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| healed.heal()));
            if let Err(e) = heal {
                panic!(
                    "exploration: no way back to quiescence after {child_path:?}: {}",
                    panic_text(&e)
                );
            }
            if report.states >= max_states {
                report.truncated = true;
                return report;
            }
            queue.push_back((child, child_next, child_path));
        }
    }
    report
}

fn panic_text(e: &Box<dyn std::any::Any + Send>) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}
