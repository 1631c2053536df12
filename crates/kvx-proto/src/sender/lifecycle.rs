//! How requests move through the sender: the control channel's queue and sends, failure and
//! its clean-up (one CancelNotif, no state left), delivery (exactly one ProxyNotif), and a
//! channel reset.

use super::channel::{Channel, InFlight, Kind, Mode, Outgoing};
use super::{Destination, SendError, SendFailure, SenderEvent, SenderFlow, State, Transmit};
use crate::config::Pipelining;
use crate::ids::{PeerId, ReqId, StagingSlot};
use crate::time::Instant;
use crate::wire::{CancelNotif, FailNotif, Message, ProxyNotif};

impl SenderFlow {
    pub(super) fn channel(&mut self, receiver: PeerId) -> &mut Channel {
        let mode = match self.cfg.pipelining {
            Pipelining::Auto => Mode::Probing,
            Pipelining::Off => Mode::Serial,
        };
        self.channels
            .entry(receiver)
            .or_insert_with(|| Channel::new(mode))
    }

    pub(super) fn check_channel_room(&mut self, receiver: PeerId) -> Result<(), SendError> {
        let max = self.cfg.channel_queue_max;
        let len = self.channel(receiver).queue.len();
        if len >= max {
            return Err(SendError::ChannelFull(receiver, len));
        }
        Ok(())
    }

    pub(super) fn enqueue(
        &mut self,
        receiver: PeerId,
        req_id: ReqId,
        kind: Kind,
        mut msg: Message,
    ) {
        self.next_seq += 1;
        let seq = self.next_seq;
        match &mut msg {
            Message::AllocRequest(m) => m.seq = Some(seq),
            Message::CancelNotif(m) => m.seq = Some(seq),
            _ => {}
        }
        self.channel(receiver).queue.push_back(Outgoing {
            seq,
            req_id,
            kind,
            msg,
        });
    }

    /// Sends whatever the channel's window and rules allow.
    pub(super) fn pump(&mut self, now: Instant, receiver: PeerId) {
        loop {
            let requests = &self.requests;
            // Whether another request may still need this channel: an admitted one (it may
            // have batches to send, or fail and need a CancelNotif, until it is delivered),
            // or a failing one whose CancelNotif (which frees receiver capacity) is yet to go.
            // A serial channel must not send a probe that could wait ahead of them.
            let busy_elsewhere = |asker: &ReqId| {
                requests.iter().any(|(id, r)| {
                    id != asker
                        && r.spec.receiver == receiver
                        && match r.state {
                            State::Admitted if broken_variant!(LockAcrossAdmission) => false,
                            State::Admitted => true,
                            State::Failing => r.sent_any,
                            State::Admitting => false,
                        }
                })
            };
            let inflight_max = self.cfg.inflight_max;
            let Some(ch) = self.channels.get_mut(&receiver) else {
                return;
            };
            let Some(out) = ch.next_sendable(inflight_max, busy_elsewhere) else {
                return;
            };
            let timeout = match out.kind {
                Kind::Probe => self.cfg.admission_reply_timeout,
                _ => self.cfg.reply_timeout,
            };
            ch.in_flight.push_back(InFlight {
                seq: out.seq,
                req_id: out.req_id.clone(),
                kind: out.kind,
                deadline: now + timeout,
            });
            if let Some(req) = self.requests.get_mut(&out.req_id) {
                req.sent_any = true;
                if let Message::AllocRequest(m) = &out.msg {
                    req.keys_sent.extend(m.keys.iter().cloned());
                }
            }
            self.transmits.push_back(Transmit {
                to: Destination::Receiver(receiver),
                msg: out.msg,
            });
        }
    }

    /// Fails a request: drops its unsent messages and unsubmitted staging, tells the proxy
    /// (when configured), and sends CancelNotif once its writes are done.
    pub(super) fn fail(&mut self, now: Instant, req_id: &ReqId, failure: SendFailure) {
        let req = self
            .requests
            .get_mut(req_id)
            .expect("invariant: failing a tracked request");
        debug_assert_ne!(req.state, State::Failing);
        req.state = State::Failing;
        req.failure = Some(failure.clone());
        let receiver = req.spec.receiver;
        // It takes no more staging: its waiting calls stop holding back younger requests.
        self.waiters.remove_all(req.age);
        // Chunks added or submitted are written: their slots are free now. A slot the caller
        // took and has not added may still be being written: it stays the caller's until it
        // hands it back (S12), or the next request to get it would share it with that write.
        let added: std::collections::BTreeSet<_> = req.added.drain(..).map(|c| c.staging).collect();
        let staged = std::mem::take(&mut req.staged);
        for slot in staged {
            if added.contains(&slot) {
                self.staging.give_back(slot);
            } else {
                self.lent.insert(slot, req_id.clone());
            }
        }
        let ch = self
            .channels
            .get_mut(&receiver)
            .expect("invariant: a request's channel exists");
        let mut freed = Vec::new();
        ch.queue.retain(|m| {
            let mine = m.req_id == *req_id;
            if mine {
                if let Kind::Batch { chunks, .. } = &m.kind {
                    freed.extend(chunks.iter().map(|c| c.staging));
                }
            }
            !mine
        });
        // Batches in flight get no writes any more: their staging is free now, and their
        // entries stay only to match the replies.
        for f in ch.in_flight.iter_mut().filter(|f| f.req_id == *req_id) {
            if let Kind::Batch { chunks, .. } = &mut f.kind {
                freed.extend(chunks.drain(..).map(|c| c.staging));
            }
        }
        for slot in freed {
            self.staging.give_back(slot);
        }
        self.stats.failed += 1;
        if self.cfg.notify_proxy_on_failure {
            let msg = Message::FailNotif(FailNotif {
                req_id: req_id.0.clone(),
                reason: failure.to_string(),
            });
            self.transmits.push_back(Transmit {
                to: Destination::Proxy,
                msg,
            });
        }
        self.events.push_back(SenderEvent::Failed {
            req_id: req_id.clone(),
            failure,
        });
        self.maybe_finish_failing(now, req_id);
        self.pump(now, receiver);
    }

    /// Hands back `slot` when it is lent to `req_id`'s caller (S12): true if it was.
    pub(super) fn take_back_lent(&mut self, req_id: &ReqId, slot: StagingSlot) -> bool {
        if self.lent.get(&slot) != Some(req_id) {
            return false;
        }
        self.lent.remove(&slot);
        self.staging.give_back(slot);
        true
    }

    /// Remembers how a request that leaves ended, forgetting the oldest beyond
    /// `outcomes_kept`.
    pub(super) fn remember_outcome(&mut self, req_id: &ReqId, outcome: Result<(), SendFailure>) {
        let n = self.next_outcome;
        self.next_outcome += 1;
        self.outcomes.insert(req_id.clone(), (n, outcome));
        self.outcome_order.push_back((n, req_id.clone()));
        while self.outcome_order.len() > self.cfg.outcomes_kept {
            if let Some((n, old)) = self.outcome_order.pop_front() {
                // A later outcome of a reused id is not this entry's to forget.
                if self.outcomes.get(&old).is_some_and(|(m, _)| *m == n) {
                    self.outcomes.remove(&old);
                }
            }
        }
    }

    /// A failing request with no write outstanding cancels at the receiver and goes.
    pub(super) fn maybe_finish_failing(&mut self, now: Instant, req_id: &ReqId) {
        let req = &self.requests[req_id];
        if req.state != State::Failing || req.writes_in_flight > 0 {
            return;
        }
        let req = self
            .requests
            .remove(req_id)
            .expect("invariant: checked above");
        self.waiters.remove_all(req.age);
        let failure = req.failure.clone().unwrap_or(SendFailure::Cancelled);
        self.remember_outcome(req_id, Err(failure));
        if self.staging.is_callers() {
            self.events.push_back(SenderEvent::Drained {
                req_id: req_id.clone(),
            });
        }
        if req.sent_any {
            let msg = Message::CancelNotif(CancelNotif {
                req_id: req_id.0.clone(),
                keys: req.keys_sent,
                seq: None,
                drained: Some(true),
            });
            self.enqueue(req.spec.receiver, req_id.clone(), Kind::Cancel, msg);
            self.pump(now, req.spec.receiver);
        }
    }

    /// Emits `ProxyNotif` once every submitted chunk is written and the last batch is done.
    pub(super) fn maybe_delivered(&mut self, now: Instant, req_id: &ReqId) {
        let req = &self.requests[req_id];
        let done = req.state == State::Admitted
            && req.last_acked
            && req.batches_unanswered == 0
            && req.writes_in_flight == 0
            && req.written == req.submitted;
        if !done {
            return;
        }
        let receiver = req.spec.receiver;
        let age = req.age;
        self.requests.remove(req_id);
        self.waiters.remove_all(age);
        self.remember_outcome(req_id, Ok(()));
        self.stats.delivered += 1;
        let msg = Message::ProxyNotif(ProxyNotif {
            req_id: req_id.0.clone(),
        });
        self.transmits.push_back(Transmit {
            to: Destination::Proxy,
            msg,
        });
        self.events.push_back(SenderEvent::Delivered {
            req_id: req_id.clone(),
        });
        // A serial channel may have held a probe back for this request.
        self.pump(now, receiver);
    }

    pub(super) fn reset_channel(&mut self, now: Instant, receiver: PeerId, failure: SendFailure) {
        if !self.channels.contains_key(&receiver) {
            return;
        }
        let on_channel: Vec<ReqId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.spec.receiver == receiver && r.state != State::Failing)
            .map(|(id, _)| id.clone())
            .collect();
        for req_id in &on_channel {
            self.fail(now, req_id, failure.clone());
        }
        // Nothing on a reset channel is worth sending: the receiver rolls back what it
        // held when the connection went (leases), and cancels for it would be stale.
        let ch = self
            .channels
            .get_mut(&receiver)
            .expect("invariant: present above");
        ch.queue.clear();
        ch.in_flight.clear();
        ch.mode = match self.cfg.pipelining {
            Pipelining::Auto => Mode::Probing,
            Pipelining::Off => Mode::Serial,
        };
        self.events
            .push_back(SenderEvent::ChannelReset { receiver });
    }
}
