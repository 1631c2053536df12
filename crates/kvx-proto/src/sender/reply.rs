//! What a receiver's reply does to the request it answers (`docs/spec/protocol.md` §Sender,
//! replies). Replies are checked, not trusted (LMCache never checks the type or length,
//! W22): a reply of the wrong shape fails the request instead of miscounting it.

use super::channel::{ChunkSpec, Kind, Mode};
use super::{PendingWrite, SendFailure, SenderEvent, SenderFlow, State, WriteOp};
use crate::ids::{PeerId, ReqId, SlotIndex, WriteId, WriteTag};
use crate::time::Instant;
use crate::wire::{AllocResponse, Message};

impl SenderFlow {
    /// A decoded message from `receiver`'s control channel.
    pub fn handle_message(&mut self, now: Instant, receiver: PeerId, msg: Message) {
        let Message::AllocResponse(reply) = msg else {
            self.stats.stale_replies += 1;
            return;
        };
        let Some(ch) = self.channels.get_mut(&receiver) else {
            self.stats.stale_replies += 1;
            return;
        };
        if ch.mode == Mode::Probing {
            ch.mode = if reply.seq.is_some() {
                Mode::Pipelined
            } else {
                Mode::Serial
            };
        }
        let Some(answered) = ch.take_in_flight(reply.seq) else {
            self.stats.stale_replies += 1;
            return;
        };
        let live = self
            .requests
            .get(&answered.req_id)
            .is_some_and(|r| r.state != State::Failing);
        // A reply processed after its deadline (this process stalled, so the timer did not
        // fire first) is not acted on: the receiver may have reclaimed what it granted and,
        // after the quarantine, granted it to another request; writing there would land in
        // someone else's KV (found by the simulation). It counts as a reply timeout.
        let stale = answered.deadline <= now;
        match answered.kind {
            Kind::Cancel => {}
            _ if !live => {
                if let Some(req) = self.requests.get_mut(&answered.req_id) {
                    req.batches_unanswered = req.batches_unanswered.saturating_sub(1);
                }
            }
            kind if stale => {
                if let Kind::Batch { chunks, .. } = &kind {
                    self.free_chunks(chunks);
                    let req = self
                        .requests
                        .get_mut(&answered.req_id)
                        .expect("invariant: live request");
                    req.batches_unanswered -= 1;
                }
                self.fail(now, &answered.req_id, SendFailure::ReplyTimeout);
            }
            Kind::Probe => self.on_probe_reply(now, &answered.req_id, reply),
            Kind::Batch { chunks, is_last } => {
                self.on_batch_reply(now, &answered.req_id, receiver, chunks, is_last, reply)
            }
        }
        self.pump(now, receiver);
    }

    fn on_probe_reply(&mut self, now: Instant, req_id: &ReqId, reply: AllocResponse) {
        if reply.is_refusal() {
            return self.refused(now, req_id, reply);
        }
        if !reply.remote_indexes.is_empty() {
            let why = format!(
                "admission reply granted {} slots for no keys",
                reply.remote_indexes.len()
            );
            return self.fail(now, req_id, SendFailure::BadReply(why));
        }
        self.requests
            .get_mut(req_id)
            .expect("invariant: live request")
            .state = State::Admitted;
        self.events.push_back(SenderEvent::Admitted {
            req_id: req_id.clone(),
        });
    }

    fn on_batch_reply(
        &mut self,
        now: Instant,
        req_id: &ReqId,
        receiver: PeerId,
        chunks: Vec<ChunkSpec>,
        is_last: bool,
        reply: AllocResponse,
    ) {
        let req = self
            .requests
            .get_mut(req_id)
            .expect("invariant: live request");
        req.batches_unanswered -= 1;
        let first_chunk =
            req.submitted - chunks.len() as u32 - self.unanswered_chunks(req_id, receiver);
        if reply.is_refusal() {
            self.free_chunks(&chunks);
            return self.refused(now, req_id, reply);
        }
        let plan = match plan_writes(&chunks, &reply) {
            Ok(plan) => plan,
            Err(why) => {
                self.free_chunks(&chunks);
                return self.fail(now, req_id, SendFailure::BadReply(why));
            }
        };
        let req = self
            .requests
            .get_mut(req_id)
            .expect("invariant: live request");
        if is_last {
            req.last_acked = true;
        }
        for (i, chunk) in chunks.iter().enumerate() {
            match plan[i] {
                // An LMCache receiver that already holds the key (dedup): nothing to write.
                None => {
                    req.written += 1;
                    self.staging.give_back(chunk.staging);
                }
                Some((remote, tag)) => {
                    self.next_write += 1;
                    let id = WriteId(self.next_write);
                    req.writes_in_flight += 1;
                    let deadline = now + self.cfg.write_timeout;
                    let pending = PendingWrite {
                        req_id: req_id.clone(),
                        receiver,
                        staging: chunk.staging,
                        deadline,
                        stall_reported: false,
                    };
                    self.writes.insert(id, pending);
                    self.write_ops.push_back(WriteOp {
                        id,
                        req_id: req_id.clone(),
                        receiver,
                        chunk: first_chunk + i as u32,
                        staging: chunk.staging,
                        remote,
                        tag,
                    });
                }
            }
        }
        self.maybe_delivered(now, req_id);
    }

    /// Chunks of `req_id` in batches sent after the one being answered (still unanswered).
    fn unanswered_chunks(&self, req_id: &ReqId, receiver: PeerId) -> u32 {
        let Some(ch) = self.channels.get(&receiver) else {
            return 0;
        };
        let count = |kind: &Kind| {
            if let Kind::Batch { chunks, .. } = kind {
                chunks.len() as u32
            } else {
                0
            }
        };
        let in_flight: u32 = ch
            .in_flight
            .iter()
            .filter(|f| &f.req_id == req_id)
            .map(|f| count(&f.kind))
            .sum();
        let queued: u32 = ch
            .queue
            .iter()
            .filter(|m| &m.req_id == req_id)
            .map(|m| count(&m.kind))
            .sum();
        in_flight + queued
    }

    fn free_chunks(&mut self, chunks: &[ChunkSpec]) {
        for c in chunks {
            self.staging.give_back(c.staging);
        }
    }

    /// The receiver refused and has already rolled the request back (kvx and LMCache
    /// both do), so no CancelNotif follows: a second removal of the same keys is LMCache's
    /// double-remove bug (W20).
    fn refused(&mut self, now: Instant, req_id: &ReqId, reply: AllocResponse) {
        let reason = reply
            .error
            .unwrap_or_else(|| "no reason given (an LMCache receiver)".to_owned());
        if let Some(req) = self.requests.get_mut(req_id) {
            req.sent_any = false;
        }
        self.fail(now, req_id, SendFailure::Refused(reason));
    }
}

/// Per chunk of a batch: the slot to write and the immediate tag, or None (already held).
type WritePlan = Vec<Option<(SlotIndex, Option<WriteTag>)>>;

/// For each chunk of the batch: where to write it (slot and immediate tag), or None when
/// the receiver already holds it. Checks the reply's shape against the batch.
fn plan_writes(chunks: &[ChunkSpec], reply: &AllocResponse) -> Result<WritePlan, String> {
    let n = chunks.len();
    let mut skip = vec![false; n];
    for &i in &reply.already_sent_indexes {
        let i = usize::try_from(i)
            .ok()
            .filter(|&i| i < n)
            .ok_or_else(|| format!("already_sent index {i} out of range 0..{n}"))?;
        if std::mem::replace(&mut skip[i], true) {
            return Err(format!("already_sent index {i} repeated"));
        }
    }
    let to_write = n - reply.already_sent_indexes.len();
    if reply.remote_indexes.len() != to_write {
        return Err(format!(
            "{} remote indexes for {to_write} chunks to write",
            reply.remote_indexes.len()
        ));
    }
    if let Some(g) = &reply.generations {
        if g.len() != to_write {
            return Err(format!(
                "{} generations for {to_write} chunks to write",
                g.len()
            ));
        }
    }
    // Two chunks of one batch in one slot would overwrite each other: a receiver that grants
    // that is broken or lying, and the request must not be delivered.
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = reply.remote_indexes.iter().find(|&&i| !seen.insert(i)) {
        return Err(format!("remote index {dup} granted twice in one batch"));
    }
    let mut remote = reply.remote_indexes.iter().enumerate();
    let mut plan = Vec::with_capacity(n);
    for &skipped in &skip {
        if skipped {
            plan.push(None);
            continue;
        }
        let (k, &index) = remote.next().expect("invariant: lengths checked above");
        let slot = u32::try_from(index)
            .map(SlotIndex)
            .map_err(|_| format!("remote index {index} out of range"))?;
        let tag = reply.generations.as_ref().map(|g| WriteTag {
            slot,
            generation: g[k],
        });
        plan.push(Some((slot, tag)));
    }
    Ok(plan)
}
