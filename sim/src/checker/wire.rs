//! What crosses the wire, as the checker sees it: a request delivered to a receiver, and
//! the receiver's reply (a grant, a refusal, a cancel's acknowledgement).

use std::time::Duration;

use kvx_proto::wire::{AllocResponse, Message};
use kvx_proto::PeerId;

use super::model::{Key, Owner, Pending};
use super::{Checker, Deferred, GRACE};

impl Checker {
    /// A message was delivered to receiver `recv` from `peer` (the node `client`).
    pub fn on_request(
        &mut self,
        now: Duration,
        recv: &str,
        peer: PeerId,
        client: &str,
        msg: &Message,
    ) {
        self.tick(now);
        let Some(m) = self.receivers.get_mut(recv) else {
            return;
        };
        m.peers.insert(peer, client.to_owned());
        let (seq, pending) = match msg {
            Message::AllocRequest(a) => {
                let key = (peer, a.req_id.clone());
                if !m.ended.contains_key(&key) {
                    m.requests.entry(key).or_default();
                }
                let p = Pending::Alloc {
                    req: a.req_id.clone(),
                    total: a.total_chunks,
                    last: a.is_last_batch,
                };
                (a.seq, p)
            }
            Message::CancelNotif(c) => {
                // The receiver acts on a cancel as it arrives, and its decoder may hear of the
                // end before the checker sees the acknowledgement: note `drained` now.
                let drained = c.drained == Some(true);
                if let Some(r) = m.requests.get_mut(&(peer, c.req_id.clone())) {
                    r.drained_cancel = drained;
                }
                (
                    c.seq,
                    Pending::Cancel {
                        req: c.req_id.clone(),
                    },
                )
            }
            _ => return,
        };
        if let Some(seq) = seq {
            m.pending.insert((peer, seq), pending);
        }
    }

    /// Receiver `recv` sent `reply` to `peer`.
    pub fn on_reply(&mut self, now: Duration, recv: &str, peer: PeerId, reply: &AllocResponse) {
        self.tick(now);
        let Some(seq) = reply.seq else { return };
        let Some(m) = self.receivers.get_mut(recv) else {
            return;
        };
        match m.pending.remove(&(peer, seq)) {
            Some(Pending::Alloc { req, total, last }) => {
                self.on_alloc_reply(now, recv, (peer, req), total, last, reply)
            }
            Some(Pending::Cancel { req }) => {
                let key = (peer, req);
                if m.requests.contains_key(&key) {
                    self.deferred
                        .push((now + GRACE, recv.to_owned(), Deferred::CancelAcked(key)));
                }
            }
            None => {}
        }
    }

    fn on_alloc_reply(
        &mut self,
        now: Duration,
        recv: &str,
        key: Key,
        total: u32,
        last: bool,
        reply: &AllocResponse,
    ) {
        let Some(m) = self.receivers.get_mut(recv) else {
            return;
        };
        if reply.is_refusal() {
            if m.requests.get(&key).is_some_and(|r| !r.admitted) {
                m.requests.remove(&key);
            }
            return;
        }
        let mut why = Vec::new();
        // A grant seen just after the request's end may have preceded it (a reply and the
        // decoder's notice reach the checker by different tasks); one seen later did not.
        let ended = m.ended.get(&key).map(|e| e.at);
        if ended.is_some_and(|at| now > at + GRACE) {
            why.push(format!(
                "W7: {recv} granted {}/{} after it ended (zombie re-admission)",
                key.0, key.1
            ));
        }
        let gens = reply.generations.clone().unwrap_or_default();
        for (i, &slot) in reply.remote_indexes.iter().enumerate() {
            let generation = gens.get(i).copied().unwrap_or(0);
            let Some(entry) = m.slots.get(slot as usize) else {
                why.push(format!(
                    "G-grant: {recv} granted slot {slot} beyond its {} slots",
                    m.capacity
                ));
                continue;
            };
            if let Some(owner) = entry {
                if m.requests.contains_key(&owner.key) {
                    let d = Deferred::Regrant {
                        slot,
                        old: owner.key.clone(),
                        new: key.clone(),
                        at: now,
                    };
                    self.deferred.push((now + GRACE, recv.to_owned(), d));
                } else if m.quarantined(owner, now + GRACE) {
                    why.push(format!("R8: {recv} granted slot {slot} to {}/{} while a write of failed {}/{} may still land in it", key.0, key.1, owner.key.0, owner.key.1));
                }
            }
            m.slots[slot as usize] = Some(Owner {
                key: key.clone(),
                generation,
                landed: false,
            });
        }
        if ended.is_some() {
            for w in why {
                self.flag(now, w);
            }
            return;
        }
        let r = m.requests.entry(key).or_default();
        if !r.admitted {
            r.admitted = true;
            r.reserved = total;
        }
        r.granted += reply.remote_indexes.len() as u32;
        if last {
            r.reserved = r.granted;
        }
        self.dirty.insert(recv.to_owned());
        for w in why {
            self.flag(now, w);
        }
    }
}
