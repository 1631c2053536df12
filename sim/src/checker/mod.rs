//! The global checker: a model of every receiver built only from what crosses the wire (the
//! requests a receiver gets, the replies it sends), the writes that land in its memory and
//! the notices its decoder hears. It never looks inside a node, so it checks the real
//! drivers from outside, like a spec:
//! - G-grant: no slot is granted while another live request holds it, or while a write of
//!   a failed request may still land in it (R8: until the write lands or `write_quarantine`);
//! - G-write: no byte is written outside a live grant of the writing request;
//! - A1: Σ reservations + quarantined slots ≤ capacity, always;
//! - W7: an ended request is never granted anything again;
//! - G2: a request ends at most once at its receiver; a CancelNotif the receiver
//!   acknowledged has released the request at once, or, while its decoder reads it (a read
//!   lease, R9: a failure during a read takes effect at consume), once the read ends;
//! - S5: ProxyNotif at most once per (request, rank), only after all its chunks landed.
//!
//! madsim advances the clock by 50–100 ns per task poll, and what one receiver step emits
//! (a reply, a decoder notice) reaches the checker through two tasks, so the checker may see
//! a re-grant a few polls before the release that allowed it. Checks that depend on that
//! order therefore allow `GRACE` (far below any message latency) before they fire.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kvx_node::BufferSnapshot;
use kvx_proto::wire::Message;
use kvx_proto::{PeerId, SlotIndex, WriteTag};

mod model;
mod wire;

use model::{End, Key, Model};

/// How much observation skew the order-dependent checks tolerate.
const GRACE: Duration = Duration::from_micros(50);

#[derive(Debug)]
enum Deferred {
    /// The receiver acknowledged this request's CancelNotif: it must have ended.
    CancelAcked(Key),
    /// `slot` was granted to `new` at `at` while `old` still held it in the model.
    Regrant {
        slot: i64,
        old: Key,
        new: Key,
        at: Duration,
    },
}

#[derive(Debug, Default)]
pub struct Checker {
    violations: Vec<String>,
    receivers: BTreeMap<String, Model>,
    landed: BTreeMap<(String, String), u32>,
    notifs: BTreeMap<(String, String), u32>,
    chunks: BTreeMap<String, u32>,
    dirty: BTreeSet<String>,
    /// Receivers whose reservations exceed capacity, since when.
    over_since: BTreeMap<String, Duration>,
    deferred: Vec<(Duration, String, Deferred)>,
    /// Requests a decoder holds a read lease on: (receiver, request).
    reading: BTreeSet<(String, Key)>,
}

impl Checker {
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// ProxyNotif messages the proxy received, per request (all ranks together).
    pub fn proxy_notifs(&self) -> BTreeMap<String, u32> {
        let mut out = BTreeMap::new();
        for ((_, req), n) in &self.notifs {
            *out.entry(req.clone()).or_default() += n;
        }
        out
    }

    /// A check outside this module (the engine's, the outcomes') failed.
    pub fn flag(&mut self, now: Duration, what: String) {
        if self.violations.len() < 20 {
            self.violations
                .push(format!("[{:.6}s] {what}", now.as_secs_f64()));
        }
    }

    /// Runs the order-dependent checks whose grace has passed.
    fn tick(&mut self, now: Duration) {
        for r in std::mem::take(&mut self.dirty) {
            let over = self
                .receivers
                .get(&r)
                .is_some_and(|m| m.reserved() + m.pinned(now) > m.capacity);
            if !over {
                self.over_since.remove(&r);
            } else {
                self.over_since.entry(r).or_insert(now);
            }
        }
        let late: Vec<String> = self
            .over_since
            .iter()
            .filter(|(_, &t)| now > t + GRACE)
            .map(|(r, _)| r.clone())
            .collect();
        for r in late {
            self.over_since.remove(&r);
            let Some(m) = self.receivers.get(&r) else {
                continue;
            };
            let (reserved, pinned) = (m.reserved(), m.pinned(now));
            if reserved + pinned > m.capacity {
                let why = format!(
                    "A1: receiver {r} reserved {reserved} + quarantined {pinned} > capacity {}",
                    m.capacity
                );
                self.flag(now, why);
            }
        }
        if self.deferred.iter().any(|(due, _, _)| *due <= now) {
            let (due, later) = std::mem::take(&mut self.deferred)
                .into_iter()
                .partition(|(due, _, _)| *due <= now);
            self.deferred = later;
            for (_, r, d) in due {
                self.settle(now, &r, d);
            }
        }
    }

    fn settle(&mut self, now: Duration, r: &str, d: Deferred) {
        let Some(m) = self.receivers.get(r) else {
            return;
        };
        let why = match d {
            // Still read: the cancel takes effect when the read ends (R9); looked at again.
            Deferred::CancelAcked(key)
                if m.requests.contains_key(&key)
                    && self.reading.contains(&(r.to_owned(), key.clone())) =>
            {
                self.deferred
                    .push((now + GRACE, r.to_owned(), Deferred::CancelAcked(key)));
                None
            }
            Deferred::CancelAcked(key) => m.requests.contains_key(&key).then(|| {
                format!(
                    "G2: {r} acknowledged the CancelNotif of {}/{} but still holds the request",
                    key.0, key.1
                )
            }),
            Deferred::Regrant { slot, old, new, at } => {
                let released = m.ended.get(&old).is_some_and(|e| e.at <= at + GRACE);
                (!released).then(|| {
                    format!(
                        "G-grant: {r} granted slot {slot} to {}/{} while {}/{} held it",
                        new.0, new.1, old.0, old.1
                    )
                })
            }
        };
        if let Some(why) = why {
            self.flag(now, why);
        }
    }

    pub fn register_request(&mut self, req: &str, chunks: u32) {
        self.chunks.insert(req.to_owned(), chunks);
    }

    pub fn on_receiver_start(
        &mut self,
        now: Duration,
        node: &str,
        capacity: u32,
        quarantine: Duration,
    ) {
        self.tick(now);
        let model = Model {
            capacity,
            quarantine,
            peers: BTreeMap::new(),
            requests: BTreeMap::new(),
            ended: BTreeMap::new(),
            slots: (0..capacity).map(|_| None).collect(),
            pending: BTreeMap::new(),
        };
        self.receivers.insert(node.to_owned(), model);
    }

    /// A crashed receiver's requests are gone with its memory; its model starts afresh.
    pub fn on_crash(&mut self, now: Duration, node: &str) {
        self.tick(now);
        self.receivers.remove(node);
        self.over_since.remove(node);
        self.deferred.retain(|(_, r, _)| r != node);
        self.reading.retain(|(r, _)| r != node);
    }

    /// The decoder of `recv` holds a read lease on a request (`reading`), or let go of it.
    pub fn on_reading(
        &mut self,
        now: Duration,
        recv: &str,
        peer: PeerId,
        req: &str,
        reading: bool,
    ) {
        self.tick(now);
        let entry = (recv.to_owned(), (peer, req.to_owned()));
        if reading {
            self.reading.insert(entry);
        } else {
            self.reading.remove(&entry);
        }
    }

    /// The decoder of `recv` heard that a request ended.
    pub fn on_ended(&mut self, now: Duration, recv: &str, peer: PeerId, req: &str, consumed: bool) {
        self.tick(now);
        let Some(m) = self.receivers.get_mut(recv) else {
            return;
        };
        let key = (peer, req.to_owned());
        let drained = m.requests.remove(&key).is_some_and(|r| r.drained_cancel);
        let again = m
            .ended
            .insert(
                key,
                End {
                    consumed,
                    at: now,
                    drained,
                },
            )
            .is_some();
        self.dirty.insert(recv.to_owned());
        if again {
            self.flag(now, format!("G2: {peer}/{req} ended twice at {recv}"));
        }
    }

    /// A write from `sender` lands in `slot` of `recv`.
    pub fn on_write(
        &mut self,
        now: Duration,
        recv: &str,
        sender: &str,
        slot: SlotIndex,
        imm: Option<u32>,
    ) {
        self.tick(now);
        let Some(m) = self.receivers.get_mut(recv) else {
            return;
        };
        let Some(imm) = imm else { return };
        let tag = WriteTag::from_imm(imm);
        let why = match m.slots.get_mut(slot.0 as usize).and_then(|o| o.as_mut()) {
            None => Some(format!(
                "G-write: {sender} wrote slot {} of {recv}, which was never granted",
                slot.0
            )),
            Some(owner) => {
                let granted = WriteTag {
                    slot,
                    generation: owner.generation,
                };
                let ours = m.peers.get(&owner.key.0).is_some_and(|s| s == sender)
                    && granted.same_grant(tag);
                let consumed = m.ended.get(&owner.key).is_some_and(|e| e.consumed);
                if !ours {
                    Some(format!("G-write: {sender} wrote slot {} of {recv} outside a live grant (generation {}): the slot is granted to {}/{} (generation {})", slot.0, tag.generation, owner.key.0, owner.key.1, owner.generation))
                } else if consumed {
                    Some(format!(
                        "G-write: {sender} wrote slot {} of {recv} after the decoder consumed {}",
                        slot.0, owner.key.1
                    ))
                } else {
                    owner.landed = true;
                    *self
                        .landed
                        .entry((sender.to_owned(), owner.key.1.clone()))
                        .or_default() += 1;
                    None
                }
            }
        };
        if let Some(why) = why {
            self.flag(now, why);
        }
    }

    /// A notice from `sender` reached the proxy.
    pub fn on_notice(&mut self, now: Duration, sender: &str, msg: &Message) {
        self.tick(now);
        let Message::ProxyNotif(n) = msg else { return };
        let key = (sender.to_owned(), n.req_id.clone());
        let count = self.notifs.entry(key.clone()).or_default();
        *count += 1;
        let count = *count;
        let landed = self.landed.get(&key).copied().unwrap_or(0);
        let chunks = self.chunks.get(&n.req_id).copied();
        if count > 1 {
            self.flag(
                now,
                format!(
                    "S5: {sender} sent ProxyNotif for {} {count} times",
                    n.req_id
                ),
            );
        }
        if chunks.is_some_and(|c| landed < c) {
            let c = chunks.unwrap_or(0);
            self.flag(
                now,
                format!(
                    "S5: {sender} sent ProxyNotif for {} with {landed} of {c} chunks written",
                    n.req_id
                ),
            );
        }
    }

    /// The receiver's own accounting, read through its handle.
    pub fn on_snapshot(&mut self, now: Duration, recv: &str, s: &BufferSnapshot) {
        self.tick(now);
        if s.free + s.held + s.quarantined != s.capacity
            || s.held + s.reserved_unallocated + s.quarantined > s.capacity
        {
            self.flag(now, format!("R2: receiver {recv} accounts {s:?}"));
        }
    }

    /// At quiescence: the pending checks run, and no receiver may still hold a request.
    pub fn finish(&mut self, now: Duration) {
        self.tick(now + GRACE * 2);
        let stuck: Vec<String> = self
            .receivers
            .iter()
            .flat_map(|(r, m)| {
                m.requests
                    .keys()
                    .map(move |k| format!("G3: {}/{} never ended at {r}", k.0, k.1))
            })
            .collect();
        for why in stuck {
            self.flag(now, why);
        }
    }
}
