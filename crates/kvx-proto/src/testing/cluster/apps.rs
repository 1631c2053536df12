//! The applications around the protocol: the prefill engine (starts requests up to
//! `interleave`, stages and submits batches while staging lasts) and the decoder (leases,
//! verifies and consumes a request once its receiver has it ready and the proxy says so).

use super::*;

impl Cluster {
    pub(super) fn consume(&mut self, r: usize, key: ReqKey) {
        if self.receivers[r].ready.remove(&key).is_none() {
            return;
        }
        let Some(&i) = self.by_req_id.get(&key.req_id.0) else {
            return;
        };
        // The decoder leases the request before reading, as a real one does.
        let Ok(slots) = self.receivers[r].ledger.handle_acquire(&key) else {
            return;
        };
        let mut verified = 0;
        for (chunk, slot) in slots.iter().enumerate() {
            let got = self.receivers[r].mem[slot.0 as usize];
            self.checker
                .on_read(&key, chunk as u32, got, content_of(i, chunk as u32));
            verified += 1;
        }
        if self.receivers[r]
            .ledger
            .handle_consume(self.now, &key)
            .is_ok()
        {
            self.report.plans[i].consumed_at = Some(self.now);
            self.report.plans[i].chunks_verified = verified;
        }
        self.drain_receiver(r);
    }

    /// The prefill engine: starts waiting requests up to `interleave`, then round-robin
    /// stages one batch per admitted request while staging lasts.
    pub(super) fn prefill(&mut self, s: usize) {
        let now = self.now;
        while self.senders[s].active.len() < self.spec.interleave {
            let Some(i) = self.senders[s].waiting.pop_front() else {
                break;
            };
            self.begin(s, i);
        }
        let mut produced = 0u32;
        for i in self.senders[s].active.clone() {
            let req_id = ReqId(self.spec.requests[i].req_id.clone());
            // The engine tries every active request; the core refuses staging to one that is
            // not admitted yet (NotAdmitted), which the engine treats as "not yet".
            if self.runs[i].done_submitting {
                continue;
            }
            let plan = self.spec.requests[i].clone();
            let mut blocked = false;
            while self.runs[i].batch.len() < plan.batch_chunks as usize
                && self.runs[i].next_chunk < plan.chunks
            {
                // Our own staged chunks, when they alone hold staging, are submitted by
                // the call itself (the one form of that step, `allocate_or_submit`).
                let held = self.runs[i].batch.len();
                let allocated =
                    self.senders[s]
                        .flow
                        .allocate_or_submit(now, &req_id, &mut self.runs[i].batch);
                if held > 0 && self.runs[i].batch.is_empty() {
                    self.drain_sender(s);
                }
                let flow = &mut self.senders[s].flow;
                match allocated {
                    Ok(slot) => {
                        // It waited for staging (below) and got it: it waits no more.
                        if let Some(age) = flow.age(&req_id) {
                            while flow.staging_waiters().iter().any(|(a, _, _)| a == age) {
                                flow.stop_waiting_for_staging(age);
                            }
                        }
                        let chunk = self.runs[i].next_chunk;
                        self.senders[s].staging_mem[slot.0 as usize] = content_of(i, chunk);
                        let key = format!("{}@{chunk}", plan.req_id);
                        self.runs[i].batch.push(ChunkSpec {
                            key,
                            staging: slot,
                            tokens: 256,
                            // The harness's chunks are one word; every landing says 1 byte.
                            bytes: 1,
                        });
                        self.runs[i].next_chunk += 1;
                        produced += 1;
                    }
                    // Out of staging: submit what is staged (a partial batch) so that
                    // its writes free staging; holding it would wait on itself. With
                    // nothing staged, wait for a slot as a driver's allocate call does
                    // (the core hands freed slots to the oldest request waiting).
                    Err(SendError::WouldBlock | SendError::StagingHeldByCaller(_)) => {
                        let waits = flow
                            .staging_waiters()
                            .iter()
                            .any(|(_, id, _)| *id == req_id);
                        if self.runs[i].batch.is_empty() && !waits {
                            let _ = flow.wait_for_staging(&req_id);
                        }
                        blocked = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            let run = &mut self.runs[i];
            let is_last = run.next_chunk == plan.chunks;
            let full = run.batch.len() == plan.batch_chunks as usize;
            if !run.batch.is_empty() && (full || is_last || blocked) {
                let batch = std::mem::take(&mut run.batch);
                run.done_submitting = is_last;
                // An error means the request ended meanwhile; its end is reported by event.
                let _ = self.senders[s]
                    .flow
                    .handle_submit(now, &req_id, batch, is_last);
                self.drain_sender(s);
            }
            if blocked {
                break;
            }
        }
        let node = &mut self.senders[s];
        node.busy_until = now + self.spec.timing.prefill_chunk_time * produced;
        if produced > 0 {
            self.schedule_tick(s);
        }
    }

    pub(super) fn begin(&mut self, s: usize, i: usize) {
        let now = self.now;
        let plan = self.spec.requests[i].clone();
        self.senders[s].active.push(i);
        self.report.plans[i].begun_at = Some(now);
        let req_id = ReqId(plan.req_id.clone());
        self.proxy
            .handle_expect(now, req_id.clone(), 1)
            .expect("harness: unique request ids");
        self.drain_proxy();
        let spec = RequestSpec {
            req_id,
            receiver: PeerId(plan.receiver as u64),
            total_chunks: plan.declared,
            fmt: 1,
            shape: vec![2, 2, 256, 64],
            dtype: "bfloat16".into(),
            claim: None,
        };
        if let Err(e) = self.senders[s].flow.handle_begin(now, spec) {
            self.end_plan(i, End::Failed(e.to_string()));
            return;
        }
        if let Some(after) = plan.cancel_after {
            self.schedule(now + after, Ev::Cancel(i));
        }
        self.drain_sender(s);
    }

    /// The decoder reads a request once its receiver has it ready and the proxy says so.
    pub(super) fn maybe_consume(&mut self, r: usize, key: &ReqKey) {
        if !self.spec.decoder_consumes || !self.receivers[r].ready.contains_key(key) {
            return;
        }
        let Some(&i) = self.by_req_id.get(&key.req_id.0) else {
            return;
        };
        if self.runs[i].proxy_ready {
            let at = self.now + self.spec.timing.decode_delay;
            self.schedule(
                at,
                Ev::Consume {
                    r,
                    key: key.clone(),
                },
            );
        }
    }

    pub(super) fn end_plan(&mut self, i: usize, end: End) {
        let s = self.spec.requests[i].sender;
        self.checker.on_sender_end(
            &self.spec.requests[i].req_id,
            self.report.plans[i].sender_end.is_some(),
        );
        self.report.plans[i].sender_end = Some(end);
        self.report.plans[i].ended_at = Some(self.now);
        self.senders[s].active.retain(|&a| a != i);
        if let Some(run) = self.runs.get_mut(i) {
            // Chunks staged but not yet submitted were released by the sender on failure.
            run.batch.clear();
            run.done_submitting = true;
        }
        self.schedule_tick(s);
    }

    pub(super) fn schedule_tick(&mut self, s: usize) {
        let node = &mut self.senders[s];
        if !node.alive || node.tick_at.is_some() {
            return;
        }
        let at = node.busy_until.max(self.now);
        node.tick_at = Some(at);
        self.schedule(at, Ev::Tick(s));
    }
}
