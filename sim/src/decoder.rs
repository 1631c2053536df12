//! The decoder on a receiver node: what vLLM's decode worker does with a `ReceiverHandle`.
//! It hears the receiver's notices (and reports every end to the checker at once), and reads
//! a request once it is both in the buffer and declared ready by the proxy: lease it, check
//! every chunk, consume it. A request the proxy declared failed is leased and dropped unread
//! (a dropped lease releases the request).

use std::collections::BTreeMap;
use std::sync::Arc;

use kvx_node::{ReadLease, ReadyRequest, ReceiverHandle, ReceiverNotice};
use kvx_proto::receiver::Outcome;
use tokio::sync::mpsc;

use crate::app::{content, flag};
use crate::commands::DecoderCmd;
use crate::config::{receiver_node, SimConfig};
use crate::fabric::SimMemory;
use crate::world::World;

#[derive(Debug)]
pub struct Decoder {
    pub world: World,
    pub cfg: Arc<SimConfig>,
    pub name: String,
    pub rank: usize,
    pub handle: ReceiverHandle<SimMemory>,
    pub tx: mpsc::UnboundedSender<DecoderCmd>,
    pub ready: BTreeMap<String, ReadyRequest>,
    /// The proxy's word per request: (ready, chunks).
    pub verdicts: BTreeMap<String, (bool, u32)>,
}

impl Decoder {
    pub async fn run(mut self, mut rx: mpsc::UnboundedReceiver<DecoderCmd>) {
        loop {
            tokio::select! {
                n = self.handle.next_notice() => match n {
                    Some(n) => self.on_notice(n),
                    None => return,
                },
                cmd = rx.recv() => match cmd {
                    Some(DecoderCmd::Verdict { req_id, ready, chunks }) => {
                        self.verdicts.insert(req_id.clone(), (ready, chunks));
                        self.maybe_consume(&req_id);
                    }
                    Some(DecoderCmd::Consume(req_id)) => self.consume(&req_id).await,
                    Some(DecoderCmd::Snapshot(reply)) => {
                        if let Ok(s) = self.handle.reader().snapshot().await {
                            let now = self.world.now();
                            self.world.lock().checker.on_snapshot(now, &self.name, &s);
                            let _ = reply.send(s);
                        }
                    }
                    None => return,
                },
            }
        }
    }

    fn on_notice(&mut self, n: ReceiverNotice) {
        match n {
            ReceiverNotice::Ready(r) => {
                let req_id = r.key.req_id.0.clone();
                let meant = self
                    .world
                    .lock()
                    .outcomes
                    .reqs
                    .get(&req_id)
                    .map(|rec| receiver_node(rec.plan.decode, self.rank));
                if let Some(meant) = meant.filter(|m| *m != self.name) {
                    flag(
                        &self.world,
                        format!(
                            "G1: {req_id} arrived at {}, but it was sent to {meant}",
                            self.name
                        ),
                    );
                }
                self.ready.insert(req_id.clone(), r);
                self.maybe_consume(&req_id);
            }
            ReceiverNotice::Ended { key, outcome } => {
                let now = self.world.now();
                let consumed = outcome == Outcome::Consumed;
                let mut w = self.world.lock();
                w.checker
                    .on_ended(now, &self.name, key.peer, &key.req_id.0, consumed);
                w.outcomes
                    .on_receiver_end(&key.req_id.0, self.rank, outcome.to_string());
                w.trace
                    .record(now, format_args!("{} ended {key}: {outcome}", self.name));
                drop(w);
                self.ready.remove(&key.req_id.0);
                self.verdicts.remove(&key.req_id.0);
            }
        }
    }

    /// Reads a request once it is both in the buffer and declared by the proxy, after the
    /// decode delay (a timer, so notices keep flowing meanwhile).
    fn maybe_consume(&self, req_id: &str) {
        if !self.cfg.decoder_consumes
            || !self.ready.contains_key(req_id)
            || !self.verdicts.contains_key(req_id)
        {
            return;
        }
        let (tx, req, delay) = (self.tx.clone(), req_id.to_owned(), self.cfg.decode_delay);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = tx.send(DecoderCmd::Consume(req));
        });
    }

    async fn consume(&mut self, req_id: &str) {
        let (Some(ready), Some(&(proxy_ready, chunks))) =
            (self.ready.remove(req_id), self.verdicts.get(req_id))
        else {
            return;
        };
        // The read lease (the one Python's `next_ready` hands out): until it is consumed or
        // dropped, the slots stay put whatever happens meanwhile.
        let Ok(lease) = self.handle.reader().lease(ready).await else {
            return;
        };
        if proxy_ready {
            let ok = self.verify(&lease, chunks);
            self.world
                .lock()
                .outcomes
                .on_verified(req_id, self.rank, ok);
        }
        let now = self.world.now();
        self.world.lock().outcomes.on_read(req_id, self.rank, now);
        if !proxy_ready {
            // Unread: dropped, as a decoder drops a lease it has no use for; the release is
            // queued without a wait, and its end must come all the same.
            drop(lease);
            return;
        }
        let key = lease.key().clone();
        if let Err(e) = lease.consume().await {
            flag(
                &self.world,
                format!("{} could not consume leased {key}: {e}", self.name),
            );
        }
    }

    /// G1: the decoder reads exactly the bytes the prefill produced.
    fn verify(&self, lease: &ReadLease, chunks: u32) -> bool {
        let mut got = vec![0u8; self.cfg.chunk_bytes];
        let mut want = vec![0u8; self.cfg.chunk_bytes];
        let key = lease.key();
        if lease.slots().len() as u32 != chunks {
            flag(
                &self.world,
                format!(
                    "G1: {key} is ready at {} with {} chunks, not {chunks}",
                    self.name,
                    lease.slots().len()
                ),
            );
            return false;
        }
        for (chunk, slot) in lease.slots().iter().enumerate() {
            lease.read_chunk(chunk, &mut got);
            content(&key.req_id.0, self.rank, chunk as u32, &mut want);
            if got != want {
                flag(
                    &self.world,
                    format!(
                        "G1: {} read corrupt bytes in {key} chunk {chunk} (slot {})",
                        self.name, slot.0
                    ),
                );
                return false;
            }
        }
        true
    }
}
