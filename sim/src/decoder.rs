//! The decoder on a receiver node: what vLLM's decode worker does with a `ReceiverHandle`.
//! It hears of ready requests and of every request's end (reporting each end to the checker
//! at once), and reads a request once it is both in the buffer and declared ready by the
//! proxy: lease it, check every chunk, consume it. A request the proxy declared failed is
//! leased and dropped unread (a dropped lease releases the request).
//!
//! Two intakes, drawn per seed (`SimConfig::decoder_takes_leases`): the receiver's notices,
//! leasing each request when its verdict comes (the binary's decoder), or `ReadyLeases`,
//! which leases every ready request as it comes, in `take` calls cut short by the decoder's
//! other work (Python's `next_ready`/`ready`, whose hand-out must lose nothing to a cancelled
//! call); the lease is then held until the verdict.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvx_node::{ChunkReader, ReadLease, ReadyLeases, ReadyRequest, ReceiverNotice, RequestEnds};
use kvx_proto::receiver::{ConsumeError, Outcome};
use kvx_proto::ReqKey;
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
    pub intake: Intake,
    pub reader: ChunkReader<SimMemory>,
    pub tx: mpsc::UnboundedSender<DecoderCmd>,
    pub ready: BTreeMap<String, ReadyRequest>,
    /// Requests leased as they came (`Intake::Leases`), held until their verdict.
    pub leased: BTreeMap<String, ReadLease>,
    /// The proxy's word per request: (ready, chunks).
    pub verdicts: BTreeMap<String, (bool, u32)>,
}

/// How the decoder hears of ready requests and ends.
#[derive(Debug)]
pub enum Intake {
    /// The receiver's notices, one stream.
    Notices(mpsc::UnboundedReceiver<ReceiverNotice>),
    /// Ready requests as leases, ends on a stream of their own.
    Leases {
        leases: ReadyLeases,
        ends: RequestEnds,
    },
}

/// The longest one `take` waits for its first lease: shorter than most of the world's
/// timers, so that takes are often cut short by a command or end by their own bound.
const TAKE_WITHIN: Duration = Duration::from_millis(300);

/// What the decoder's intake gave.
enum Heard {
    Notice(ReceiverNotice),
    Leased(Vec<ReadLease>),
    Stopped,
}

impl Intake {
    /// The next thing heard; cancel-safe (a cut-short `take` gives its leases to the next).
    async fn next(&mut self) -> Heard {
        match self {
            Intake::Notices(notices) => notices.recv().await.map_or(Heard::Stopped, Heard::Notice),
            Intake::Leases { leases, ends } => tokio::select! {
                end = ends.recv() => match end {
                    Some((key, outcome)) => Heard::Notice(ReceiverNotice::Ended { key, outcome }),
                    None => Heard::Stopped,
                },
                got = leases.take(4, Some(TAKE_WITHIN)) => match got {
                    Ok(got) => Heard::Leased(got),
                    Err(ConsumeError::Stopped) => Heard::Stopped,
                    Err(_) => Heard::Leased(Vec::new()),
                },
            },
        }
    }
}

impl Decoder {
    pub async fn run(mut self, mut rx: mpsc::UnboundedReceiver<DecoderCmd>) {
        loop {
            tokio::select! {
                heard = self.intake.next() => match heard {
                    Heard::Notice(n) => self.on_notice(n),
                    Heard::Leased(leases) => {
                        for lease in leases {
                            self.on_leased(lease);
                        }
                    }
                    Heard::Stopped => return,
                },
                cmd = rx.recv() => match cmd {
                    Some(DecoderCmd::Verdict { req_id, ready, chunks }) => {
                        self.verdicts.insert(req_id.clone(), (ready, chunks));
                        self.maybe_consume(&req_id);
                    }
                    Some(DecoderCmd::Consume(req_id)) => self.consume(&req_id).await,
                    Some(DecoderCmd::Snapshot(reply)) => {
                        if let Ok(s) = self.reader.snapshot().await {
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

    /// A request leased as it came: held until its verdict.
    fn on_leased(&mut self, lease: ReadLease) {
        let req_id = lease.key().req_id.0.clone();
        self.check_destination(lease.key());
        self.reading(lease.key(), true);
        self.leased.insert(req_id.clone(), lease);
        self.maybe_consume(&req_id);
    }

    /// G1: a request arrives only at the receiver it was sent to.
    fn check_destination(&self, key: &ReqKey) {
        let req_id = &key.req_id.0;
        let meant = self
            .world
            .lock()
            .outcomes
            .reqs
            .get(req_id)
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
    }

    fn on_notice(&mut self, n: ReceiverNotice) {
        match n {
            ReceiverNotice::Ready(r) => {
                let req_id = r.key.req_id.0.clone();
                self.check_destination(&r.key);
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
                // A read lease keeps its request until it is let go of (R9), so an end comes
                // only after; one still held here would be released unread.
                if self.leased.remove(&key.req_id.0).is_some() {
                    self.reading(&key, false);
                }
            }
        }
    }

    /// Reads a request once it is both in the buffer and declared by the proxy, after the
    /// decode delay (a timer, so notices keep flowing meanwhile).
    fn maybe_consume(&self, req_id: &str) {
        if !self.cfg.decoder_consumes
            || !(self.ready.contains_key(req_id) || self.leased.contains_key(req_id))
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
        let Some(&(proxy_ready, chunks)) = self.verdicts.get(req_id) else {
            return;
        };
        // The read lease (the one Python's `next_ready` hands out): until it is consumed or
        // dropped, the slots stay put whatever happens meanwhile.
        let lease = match (self.leased.remove(req_id), self.ready.remove(req_id)) {
            (Some(lease), _) => lease,
            (None, Some(ready)) => match self.reader.lease(ready).await {
                Ok(lease) => {
                    self.reading(lease.key(), true);
                    lease
                }
                Err(_) => return,
            },
            (None, None) => return,
        };
        let key = lease.key().clone();
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
            self.reading(&key, false);
            return;
        }
        let consumed = lease.consume().await;
        self.reading(&key, false);
        if let Err(e) = consumed {
            flag(
                &self.world,
                format!("{} could not consume leased {key}: {e}", self.name),
            );
        }
    }

    /// Tells the checker that the decoder holds a read lease on `key`, or let go of it.
    fn reading(&self, key: &ReqKey, reading: bool) {
        let now = self.world.now();
        self.world
            .lock()
            .checker
            .on_reading(now, &self.name, key.peer, &key.req_id.0, reading);
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
