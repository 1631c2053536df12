//! The sender's canonical encoding for the explorer (feature `testing`; see
//! the crate's `canon.rs` for what is renamed and why that is sound).
//!
//! Left out, because no later step reads them: `cfg` (fixed), `stats`, `next_write` and
//! `next_seq` (they only hand out fresh values; the encoder renames the live ones by rank),
//! a failing request's `failure` and `outcomes` (they only word the errors `admitted()`
//! returns to a caller and the outcomes it reads, which nothing in the core acts on), and a reported stall's deadline (a write whose
//! stall was reported has no timer any more). The output queues are drained after every
//! step; their lengths are written all the same.

use super::channel::Kind;
use super::{SenderFlow, State};
use crate::canon::Canon;
use crate::ids::ReqId;

impl SenderFlow {
    /// Whether a cancel of `req_id` would do anything: it is tracked and not failing yet.
    pub(crate) fn is_cancellable(&self, req_id: &ReqId) -> bool {
        self.requests
            .get(req_id)
            .is_some_and(|r| r.state != State::Failing)
    }

    pub(crate) fn canon(&self, enc: &mut Canon) {
        // The free stack first: which slot `take` hands out next depends on its order.
        self.staging.canon_free(enc);
        enc.len(self.requests.len());
        for (id, r) in &self.requests {
            enc.str(&id.0);
            enc.u(r.spec.receiver.0);
            enc.u(u64::from(r.spec.total_chunks));
            enc.len(match r.state {
                State::Admitting => 0,
                State::Admitted => 1,
                State::Failing => 2,
            });
            enc.len(r.staged.len());
            r.staged.iter().for_each(|&s| enc.staging(s));
            enc.len(r.added.len());
            for c in &r.added {
                enc.str(&c.key);
                enc.staging(c.staging);
                enc.u(c.tokens);
                enc.u(c.bytes);
            }
            enc.u(u64::from(r.submitted));
            enc.u(u64::from(r.written));
            enc.u(u64::from(r.writes_in_flight));
            enc.u(u64::from(r.batches_unanswered));
            enc.flag(r.last_submitted);
            enc.flag(r.last_acked);
            enc.strs(&r.keys_sent);
            enc.flag(r.sent_any);
        }
        // The staging order: requests by age (only their relative order matters), then the
        // waiting calls, oldest first.
        let mut by_age: Vec<(u64, &ReqId)> =
            self.requests.iter().map(|(id, r)| (r.age, id)).collect();
        by_age.sort();
        by_age.iter().for_each(|(_, id)| enc.str(&id.0));
        enc.len(self.waiters.iter().count());
        for (_, id, calls) in self.waiters.iter() {
            enc.str(&id.0);
            enc.u(u64::from(calls));
        }
        enc.len(self.lent.len());
        for (slot, id) in &self.lent {
            enc.staging(*slot);
            enc.str(&id.0);
        }
        enc.len(self.channels.len());
        for (peer, ch) in &self.channels {
            enc.u(peer.0);
            enc.len(ch.mode as usize);
            enc.len(ch.queue.len());
            for out in &ch.queue {
                enc.seq(Some(out.seq));
                enc.str(&out.req_id.0);
                kind(enc, &out.kind);
                enc.message(&out.msg);
            }
            enc.len(ch.in_flight.len());
            for f in &ch.in_flight {
                enc.seq(Some(f.seq));
                enc.str(&f.req_id.0);
                kind(enc, &f.kind);
                enc.time(f.deadline);
            }
        }
        enc.len(self.writes.len());
        for (&id, w) in &self.writes {
            enc.write_id(id);
            enc.str(&w.req_id.0);
            enc.u(w.receiver.0);
            enc.staging(w.staging);
            enc.flag(w.stall_reported);
            if !w.stall_reported {
                enc.time(w.deadline);
            }
        }
        for slot in enc.named_staging(self.staging.capacity()) {
            match self.staging.owner(slot) {
                Some(owner) => enc.str(&owner.0),
                None => enc.len(0),
            }
        }
        enc.len(self.transmits.len());
        enc.len(self.write_ops.len());
        enc.len(self.events.len());
    }
}

fn kind(enc: &mut Canon, kind: &Kind) {
    match kind {
        Kind::Probe => enc.len(0),
        Kind::Batch { chunks, is_last } => {
            enc.len(1);
            enc.flag(*is_last);
            enc.len(chunks.len());
            for c in chunks {
                enc.str(&c.key);
                enc.staging(c.staging);
                enc.u(c.tokens);
            }
        }
        Kind::Cancel => enc.len(2),
    }
}
