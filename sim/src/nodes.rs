//! What runs on each simulated node: the real kvx-node drivers, started by the node's init
//! (so a restart starts them afresh), plus the application around them — a prefill engine on
//! each sender node and a decoder on each receiver node — that drive them through their
//! public handles as vLLM would.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvx_io::TokioEnv;
use kvx_node::{BufferSnapshot, ReadyRequest, ReceiverAddr, ReceiverHandle, ReceiverNode, ReceiverNotice, SenderHandle, SenderNode};
use kvx_proto::receiver::Outcome;
use kvx_proto::sender::{ChunkSpec, RequestSpec, SendError};
use kvx_proto::{PeerId, ReqId};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::config::{receiver_node, sender_node, SimConfig, PROXY_ENDPOINT};
use crate::fabric::{SimFabric, SimMemory};
use crate::known_bugs::KnownBug;
use crate::net::SimTransport;
use crate::world::World;

pub type SimEnv = TokioEnv<SimTransport, SimFabric>;

pub fn env(world: &World, node: &str) -> SimEnv {
    TokioEnv::new(SimTransport::new(world.clone(), node), SimFabric::new(world.clone(), node))
}

/// One rank's share of a request, as the router hands it to a prefill engine.
#[derive(Debug, Clone)]
pub struct Job {
    pub req_id: String,
    pub rank: usize,
    pub decode: usize,
    pub chunks: u32,
    pub declared: u32,
    pub batch_chunks: u32,
}

#[derive(Debug)]
pub enum EngineCmd {
    Prefill(Job, oneshot::Sender<Result<(), String>>),
    Cancel(String),
    /// (free, capacity) of the staging pool.
    Staging(oneshot::Sender<(u32, u32)>),
}

#[derive(Debug)]
pub enum DecoderCmd {
    /// The proxy's word on a request: ready (read and verify it) or failed (discard it).
    Verdict { req_id: String, rank: usize, ready: bool, chunks: u32 },
    Consume(String),
    Snapshot(oneshot::Sender<BufferSnapshot>),
}

/// The bytes chunk `chunk` of one rank of a request carries.
pub fn content(req_id: &str, rank: usize, chunk: u32, out: &mut [u8]) {
    kvx_node::synthetic::chunk_bytes(&format!("{req_id}/r{rank}"), chunk, out);
}

/// A sender node's life: start the driver, connect to its rank's receivers, serve the engine.
pub async fn sender_main(world: World, cfg: Arc<SimConfig>, p: usize, rank: usize) {
    let name = sender_node(p, rank);
    let inc = world.node_started(&name);
    let worker = &cfg.prefill[p];
    let local_id = format!("{name}.{inc}");
    let started = SenderNode::start(env(&world, &name), worker.sender.clone(), cfg.chunk_bytes, local_id, Some(PROXY_ENDPOINT.to_owned())).await;
    let handle = match started {
        Ok(h) => h,
        Err(e) => return flag(&world, format!("sender {name} could not start: {e}")),
    };
    let peers: Arc<Mutex<BTreeMap<usize, PeerId>>> = Arc::default();
    if world.lock().exposed.contains(&KnownBug::PeerIdReuse) {
        for d in 0..cfg.decode.len() {
            tokio::spawn(connect(world.clone(), handle.clone(), receiver_node(d, rank), d, peers.clone()));
        }
    } else {
        let (world, handle, peers, n) = (world.clone(), handle.clone(), peers.clone(), cfg.decode.len());
        tokio::spawn(async move {
            for d in 0..n {
                connect(world.clone(), handle.clone(), receiver_node(d, rank), d, peers.clone()).await;
            }
        });
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    world.lock().engines.insert(name.clone(), tx);
    let interleave = Arc::new(Semaphore::new(worker.interleave));
    while let Some(cmd) = rx.recv().await {
        match cmd {
            EngineCmd::Prefill(job, reply) => {
                let peer = lock(&peers).get(&job.decode).copied();
                let run = prefill(world.clone(), cfg.clone(), handle.clone(), p, job, peer, interleave.clone());
                tokio::spawn(async move {
                    let _ = reply.send(run.await);
                });
            }
            EngineCmd::Cancel(req) => {
                // Unknown: it ended already, a harmless race.
                let _ = handle.cancel(&ReqId(req));
            }
            EngineCmd::Staging(reply) => {
                let _ = reply.send((handle.staging_free(), worker.sender.staging_slots));
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn flag(world: &World, what: String) {
    let now = world.now();
    world.lock().checker.flag(now, what);
}

/// Connects to one receiver, retrying while it is down or unreachable (bounded).
async fn connect(world: World, handle: SenderHandle<SimEnv>, receiver: String, d: usize, peers: Arc<Mutex<BTreeMap<usize, PeerId>>>) {
    let addr = ReceiverAddr { alloc: format!("{receiver}/alloc"), fabric: format!("{receiver}/fabric") };
    let mut backoff = Duration::from_millis(10);
    for _ in 0..200 {
        match handle.add_receiver(addr.clone()).await {
            Ok(peer) => {
                lock(&peers).insert(d, peer);
                return;
            }
            Err(e) => world.record(format_args!("add_receiver {receiver}: {e}")),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
    flag(&world, format!("could not connect to {receiver} in 200 attempts"));
}

/// Prefills one rank of a request the way an engine does: begin, stage chunk by chunk as they
/// are computed, submit in batches, and await the outcome.
async fn prefill(world: World, cfg: Arc<SimConfig>, h: SenderHandle<SimEnv>, p: usize, job: Job, peer: Option<PeerId>, interleave: Arc<Semaphore>) -> Result<(), String> {
    let Ok(_permit) = interleave.acquire_owned().await else { return Err("engine stopped".into()) };
    let Some(receiver) = peer else { return Err("receiver not connected".into()) };
    let req_id = ReqId(job.req_id.clone());
    let spec = RequestSpec { req_id: req_id.clone(), receiver, total_chunks: job.declared, fmt: 1, shape: vec![2, 1, 256, 1], dtype: "bfloat16".into() };
    h.begin(spec).map_err(|e| e.to_string())?;
    if !cfg.prefill[p].allocate_first {
        h.admitted(&req_id).await.map_err(|f| f.to_string())?;
    }
    let mut buf = vec![0u8; cfg.chunk_bytes];
    let mut batch: Vec<ChunkSpec> = Vec::new();
    for chunk in 0..job.chunks {
        tokio::time::sleep(cfg.prefill_chunk_time).await;
        // Never wait for staging while holding unsubmitted chunks: that wait could be on
        // ourselves. Submit what is staged first.
        if !batch.is_empty() && h.staging_free() == 0 && h.submit(&req_id, std::mem::take(&mut batch), false).is_err() {
            break;
        }
        let timeout = cfg.prefill[p].sender.staging_timeout;
        let Some(slot) = allocate(&world, &h, &req_id, &mut batch, timeout).await else { break };
        // S2, checked from outside: staging goes only to admitted requests.
        if tokio::time::timeout(Duration::from_nanos(1), h.admitted(&req_id)).await.is_err() {
            flag(&world, format!("S2: {} got a staging slot before its receiver admitted it", job.req_id));
        }
        content(&job.req_id, job.rank, chunk, &mut buf);
        h.stage(slot, &buf);
        batch.push(ChunkSpec { key: format!("{}@{chunk}", job.req_id), staging: slot, tokens: 256 });
        let last = chunk + 1 == job.chunks;
        if (batch.len() as u32 == job.batch_chunks || last) && h.submit(&req_id, std::mem::take(&mut batch), last).is_err() {
            break;
        }
    }
    h.outcome(&req_id).await.map_err(|f| f.to_string())
}

/// Takes a staging slot for the request, bounded by `staging_timeout`. On any failure the
/// request is cancelled (a no-op when it already ended) so that it never lingers.
async fn allocate(world: &World, h: &SenderHandle<SimEnv>, req_id: &ReqId, batch: &mut Vec<ChunkSpec>, timeout: Duration) -> Option<kvx_proto::StagingSlot> {
    let poll = !world.lock().exposed.contains(&KnownBug::AllocateWakeup);
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        let got = if poll {
            match tokio::time::timeout(Duration::from_millis(1), h.allocate(req_id)).await {
                Ok(got) => got,
                Err(_) => continue,
            }
        } else {
            h.allocate(req_id).await
        };
        match got {
            Ok(slot) => return Some(slot),
            // Our own unsubmitted chunks hold staging: submit them.
            Err(SendError::StagingHeldByCaller(_)) if !batch.is_empty() => {
                if h.submit(req_id, std::mem::take(batch), false).is_err() {
                    break;
                }
            }
            // Other requests' unsubmitted chunks hold it (the core cannot tell callers
            // apart); their tasks submit them before they wait, so try again shortly.
            Err(SendError::StagingHeldByCaller(_)) => tokio::time::sleep(Duration::from_micros(100)).await,
            Err(e) => {
                world.record(format_args!("engine: allocate for {req_id}: {e}"));
                break;
            }
        }
    }
    let _ = h.cancel(req_id);
    None
}

/// A receiver node's life: start the driver, then serve as the decoder.
pub async fn receiver_main(world: World, cfg: Arc<SimConfig>, d: usize, rank: usize) {
    let name = receiver_node(d, rank);
    world.node_started(&name);
    let rc = cfg.decode[d].receiver.clone();
    let (alloc, fabric) = (format!("{name}/alloc"), format!("{name}/fabric"));
    let handle = match ReceiverNode::start(env(&world, &name), rc.clone(), cfg.chunk_bytes, &alloc, &fabric).await {
        Ok(h) => h,
        Err(e) => return flag(&world, format!("receiver {name} could not start: {e}")),
    };
    let now = world.now();
    world.lock().checker.on_receiver_start(now, &name, rc.buffer_slots, rc.write_quarantine);
    let (tx, rx) = mpsc::unbounded_channel();
    world.lock().decoders.insert(name.clone(), tx.clone());
    let decoder = Decoder { world, cfg, name, rank, handle, tx, ready: BTreeMap::new(), verdicts: BTreeMap::new() };
    decoder.run(rx).await;
}

struct Decoder {
    world: World,
    cfg: Arc<SimConfig>,
    name: String,
    rank: usize,
    handle: ReceiverHandle<SimMemory>,
    tx: mpsc::UnboundedSender<DecoderCmd>,
    ready: BTreeMap<String, ReadyRequest>,
    verdicts: BTreeMap<String, (usize, bool, u32)>,
}

impl Decoder {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<DecoderCmd>) {
        loop {
            tokio::select! {
                n = self.handle.next_notice() => match n {
                    Some(n) => self.on_notice(n),
                    None => return,
                },
                cmd = rx.recv() => match cmd {
                    Some(DecoderCmd::Verdict { req_id, rank, ready, chunks }) => {
                        self.verdicts.insert(req_id.clone(), (rank, ready, chunks));
                        self.maybe_consume(&req_id);
                    }
                    Some(DecoderCmd::Consume(req_id)) => self.consume(&req_id).await,
                    Some(DecoderCmd::Snapshot(reply)) => {
                        if let Some(s) = self.handle.snapshot().await {
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
                let meant = self.world.lock().outcomes.reqs.get(&req_id).map(|rec| receiver_node(rec.plan.decode, self.rank));
                if meant.as_ref().is_some_and(|m| *m != self.name) {
                    flag(&self.world, format!("G1: {req_id} arrived at {}, but it was sent to {}", self.name, meant.unwrap_or_default()));
                }
                self.ready.insert(req_id.clone(), r);
                self.maybe_consume(&req_id);
            }
            ReceiverNotice::Ended { key, outcome } => {
                let now = self.world.now();
                let consumed = outcome == Outcome::Consumed;
                self.world.lock().checker.on_ended(now, &self.name, key.peer, &key.req_id.0, consumed);
                self.world.record(format_args!("{} ended {key}: {outcome}", self.name));
                self.world.lock().outcomes.on_receiver_end(&key.req_id.0, self.rank, outcome.to_string());
                self.ready.remove(&key.req_id.0);
                self.verdicts.remove(&key.req_id.0);
            }
        }
    }

    /// Reads a request once it is both in the buffer and declared by the proxy, after the
    /// decode delay (a timer, so notices keep flowing meanwhile).
    fn maybe_consume(&self, req_id: &str) {
        if !self.cfg.decoder_consumes || !self.ready.contains_key(req_id) || !self.verdicts.contains_key(req_id) {
            return;
        }
        let (tx, req, delay) = (self.tx.clone(), req_id.to_owned(), self.cfg.decode_delay);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = tx.send(DecoderCmd::Consume(req));
        });
    }

    async fn consume(&mut self, req_id: &str) {
        let (Some(ready), Some(&(rank, proxy_ready, chunks))) = (self.ready.remove(req_id), self.verdicts.get(req_id)) else { return };
        if proxy_ready {
            let ok = self.verify(&ready, rank, chunks);
            self.world.lock().outcomes.on_verified(req_id, rank, ok);
        }
        if let Err(e) = self.handle.consume(&ready.key).await {
            self.world.record(format_args!("{} consume {}: {e}", self.name, ready.key));
        }
    }

    /// G1: the decoder reads exactly the bytes the prefill produced.
    fn verify(&self, ready: &ReadyRequest, rank: usize, chunks: u32) -> bool {
        let mut got = vec![0u8; self.cfg.chunk_bytes];
        let mut want = vec![0u8; self.cfg.chunk_bytes];
        if ready.slots.len() as u32 != chunks {
            flag(&self.world, format!("G1: {} is ready at {} with {} chunks, not {chunks}", ready.key, self.name, ready.slots.len()));
            return false;
        }
        for (chunk, slot) in ready.slots.iter().enumerate() {
            self.handle.read_chunk(*slot, &mut got);
            content(&ready.key.req_id.0, rank, chunk as u32, &mut want);
            if got != want {
                flag(&self.world, format!("G1: {} read corrupt bytes in {} chunk {chunk} (slot {})", self.name, ready.key, slot.0));
                return false;
            }
        }
        true
    }
}
