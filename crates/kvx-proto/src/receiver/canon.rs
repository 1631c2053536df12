//! The receiver's hooks for the explorer (feature `testing`): its canonical encoding (see
//! the crate's `canon.rs` for what is renamed and why that is sound), and two questions
//! the explorer's world asks of it.
//!
//! Left out, because no later step reads them: `cfg` (fixed), `stats`, `next_ticket` (it only
//! hands out fresh tickets; live ones are renamed by rank), a request's `arrived` (read only
//! to report `waited` in the `Admitted` event) and the reason a doomed request failed (it
//! only words its outcome). The output queues are drained after every step; their lengths
//! are written all the same.

use super::{Phase, ReceiverLedger};
use crate::canon::Canon;
use crate::ids::ReqKey;

impl ReceiverLedger {
    /// Whether `key` is ready to be consumed (the decoder's acquire would succeed).
    pub(crate) fn is_ready(&self, key: &ReqKey) -> bool {
        self.requests
            .get(key)
            .is_some_and(|r| matches!(r.phase, Phase::Ready))
    }

    /// Must come before anything else that names a buffer slot or a write tag.
    /// A request admitted (or past admission) although one that arrived before it still
    /// waits: tickets are handed out on arrival, and a request that arrives while others wait
    /// queues behind them, so under FIFO admission every waiting ticket is larger than every
    /// other tracked one. Returns (the later one, the earlier one still waiting).
    pub(crate) fn admitted_out_of_order(&self) -> Option<(ReqKey, ReqKey)> {
        let waiting = |r: &&super::Request| matches!(r.phase, Phase::Waiting { .. });
        let (first_waiting, _) = self
            .requests
            .iter()
            .filter(|(_, r)| waiting(r))
            .min_by_key(|(_, r)| r.ticket)?;
        let (later, _) = self
            .requests
            .iter()
            .filter(|(_, r)| !waiting(r))
            .max_by_key(|(_, r)| r.ticket)?;
        let later_ticket = self.requests[later].ticket;
        (later_ticket > self.requests[first_waiting].ticket)
            .then(|| (later.clone(), first_waiting.clone()))
    }

    pub(crate) fn canon(&self, enc: &mut Canon) {
        self.slots.canon_free(enc);
        self.admission.canon(enc);
        enc.len(self.requests.len());
        for (key, r) in &self.requests {
            enc.u(key.peer.0);
            enc.str(&key.req_id.0);
            enc.ticket(r.ticket);
            enc.u(u64::from(r.total));
            enc.u(u64::from(r.reservation));
            match &r.phase {
                Phase::Waiting { first } => {
                    enc.len(0);
                    // Its seq belongs to the sender it came from.
                    enc.set_sender(key.peer.0 as usize);
                    enc.alloc_request(first);
                }
                Phase::Receiving => enc.len(1),
                Phase::Complete => enc.len(2),
                Phase::Ready => enc.len(3),
            }
            enc.len(r.slots.len());
            r.slots.iter().for_each(|&t| enc.tag(t));
            enc.strs(&r.keys);
            // A declared length decides what a landing does, so it is state.
            r.bytes.iter().for_each(|b| enc.u(b.map_or(0, |b| b + 1)));
            enc.u(u64::from(r.landed));
            enc.flag(r.notices);
            enc.time(r.deadline);
            enc.flag(r.reading);
            enc.flag(r.doomed.is_some());
        }
        enc.len(self.tickets.len());
        for (&ticket, key) in &self.tickets {
            enc.ticket(ticket);
            enc.u(key.peer.0);
            enc.str(&key.req_id.0);
        }
        enc.len(self.timers.len());
        for &(at, ticket) in &self.timers {
            enc.time(at);
            enc.ticket(ticket);
        }
        // A stall deadline decides when a waiter of another principal takes the buffer back.
        enc.len(self.stalls.len());
        for &(at, ticket) in self.stalls.iter() {
            enc.time(at);
            enc.ticket(ticket);
        }
        self.tombstones.canon(enc);
        self.canon_placements(enc);
        enc.len(self.transmits.len());
        enc.len(self.events.len());
        self.slots.canon_rest(enc);
    }
}
