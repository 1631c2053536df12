//! The prefill engine on a sender node: what vLLM's worker does with a `SenderHandle`. Each
//! dispatched request is one task: begin, await admission and report it, wait for the
//! router's go (with TP > 1 the router admits a request's ranks in rank order before any of
//! them transfers, `docs/spec/protocol.md` §Tensor parallelism), then stage chunk by chunk as
//! they are computed, submit in batches, and report the outcome.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvx_node::{ReceiverAddr, SenderHandle};
use kvx_proto::sender::{ChunkSpec, RequestSpec};
use kvx_proto::{PeerId, ReqId, StagingSlot};
use tokio::sync::Semaphore;

use crate::app::{content, flag, SimEnv};
use crate::commands::{Dispatch, Job};
use crate::config::SimConfig;
use crate::world::World;

pub type Peers = Arc<Mutex<BTreeMap<usize, PeerId>>>;

/// What one engine's requests share: the receivers it is connected to, its bound on requests
/// prefilled at once, and, with caller staging, its own KV memory.
#[derive(Debug, Clone)]
pub struct EngineState {
    pub peers: Peers,
    pub interleave: Arc<Semaphore>,
    pub app: Option<Arc<AppStaging>>,
}

/// With caller staging (`SenderConfig::staging_placement = Caller`), the engine's own KV
/// memory: its slots, which it hands to a request's chunks as it computes them and takes back
/// once the request reads none of them (`SenderHandle::released`), as vLLM's block pool does.
#[derive(Debug, Default)]
pub struct AppStaging {
    free: Mutex<Vec<u32>>,
    returned: tokio::sync::Notify,
}

impl AppStaging {
    pub fn new(slots: u32) -> Arc<Self> {
        Arc::new(Self {
            free: Mutex::new((0..slots).rev().collect()),
            returned: tokio::sync::Notify::new(),
        })
    }

    /// A free slot, waiting for one at most `timeout`.
    async fn take(&self, timeout: Duration) -> Option<u32> {
        let wait = async {
            loop {
                let returned = self.returned.notified();
                if let Some(slot) = lock(&self.free).pop() {
                    return slot;
                }
                returned.await;
            }
        };
        tokio::time::timeout(timeout, wait).await.ok()
    }

    fn give_back(&self, slots: Vec<u32>) {
        lock(&self.free).extend(slots);
        self.returned.notify_waiters();
    }

    /// Slots free now.
    pub fn free(&self) -> Vec<u32> {
        lock(&self.free).clone()
    }
}

pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Connects to one receiver, retrying while it is down or unreachable (bounded).
pub async fn connect(
    world: World,
    handle: SenderHandle<SimEnv>,
    receiver: String,
    d: usize,
    peers: Peers,
) {
    let addr = ReceiverAddr {
        alloc: format!("{receiver}/alloc"),
        fabric: format!("{receiver}/fabric"),
    };
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
    flag(
        &world,
        format!("could not connect to {receiver} in 200 attempts"),
    );
}

/// Runs one dispatched request to its end and reports.
pub async fn prefill(
    world: World,
    cfg: Arc<SimConfig>,
    h: SenderHandle<SimEnv>,
    p: usize,
    d: Dispatch,
    engine: EngineState,
) {
    let EngineState {
        peers,
        interleave,
        app,
    } = engine;
    let Dispatch {
        job,
        admitted,
        go,
        done,
    } = d;
    let Ok(_permit) = interleave.acquire_owned().await else {
        return;
    };
    let peer = connected(&peers, job.decode).await;
    let req_id = ReqId(job.req_id.clone());
    let began = match peer {
        None => Err("receiver not connected".to_owned()),
        Some(receiver) => {
            let spec = RequestSpec {
                req_id: req_id.clone(),
                receiver,
                total_chunks: job.declared,
                fmt: 1,
                shape: vec![2, 1, 256, 1],
                dtype: "bfloat16".into(),
                claim: None,
            };
            h.begin(spec).map_err(|e| e.to_string())
        }
    };
    if let Err(why) = began {
        let _ = admitted.send(Err(why.clone()));
        let _ = done.send(Err(why));
        return;
    }
    // With TP = 1 an engine may also ask for staging at once: the core holds it back until
    // the request is admitted. Both are valid uses.
    let early = cfg.prefill[p].allocate_first && cfg.tp == 1;
    if !early {
        let result = h.admitted(&req_id).await.map_err(|f| f.to_string());
        if result.is_ok() {
            let now = world.now();
            world
                .lock()
                .outcomes
                .on_admitted(&job.req_id, job.rank, now);
        }
        let failed = result.is_err();
        let _ = admitted.send(result);
        if failed {
            let _ = done.send(h.outcome(&req_id).await.map_err(|f| f.to_string()));
            return;
        }
    } else {
        let _ = admitted.send(Ok(()));
    }
    let mut held = Vec::new();
    if go.await.is_err() {
        // Another rank was refused: the router aborts this one.
        let _ = h.cancel(&req_id);
    } else if let Some(app) = &app {
        held = transfer_in_place(&world, &cfg, &h, p, &job, app).await;
    } else {
        transfer(&world, &cfg, &h, p, &job).await;
    }
    let _ = done.send(h.outcome(&req_id).await.map_err(|f| f.to_string()));
    if let Some(app) = app {
        // The engine's slots are its own again only once no chunk of the request reads one
        // (its writes may outlive a failure): then they go back to its pool.
        let _ = h.released(&req_id).await;
        app.give_back(held);
    }
}

/// The receiver's peer id once the sender is connected to it; requests wait (bounded) for a
/// connection still being made, as an engine queues work for a worker that is starting.
async fn connected(peers: &Peers, d: usize) -> Option<PeerId> {
    for _ in 0..2_000 {
        if let Some(&peer) = lock(peers).get(&d) {
            return Some(peer);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

async fn transfer(world: &World, cfg: &SimConfig, h: &SenderHandle<SimEnv>, p: usize, job: &Job) {
    let req_id = ReqId(job.req_id.clone());
    let mut buf = vec![0u8; cfg.chunk_bytes];
    // Each chunk goes to the request's pending batch in the core (`add`), the batching the
    // Python package's callers use; the core submits pending batches itself when only they
    // hold staging (S11), so the engine never submits early to avoid waiting on itself.
    for chunk in 0..job.chunks {
        let timeout = cfg.prefill[p].sender.staging_timeout;
        let Some(slot) = allocate(world, h, &req_id, timeout).await else {
            return;
        };
        // The chunk is computed into its staging slot, which takes the prefill's time: the
        // request may fail meanwhile, and its slot must stay this task's until it is handed
        // back (S12), or another request's chunk could share it.
        if !cfg.prefill_chunk_time.is_zero() {
            tokio::time::sleep(cfg.prefill_chunk_time).await;
        }
        // S2, checked from outside: staging goes only to admitted requests, so `admitted`
        // answers at once (within the shortest timer, 1 ms, far below any round trip).
        if tokio::time::timeout(Duration::from_millis(1), h.admitted(&req_id))
            .await
            .is_err()
        {
            flag(
                world,
                format!(
                    "S2: {} got a staging slot before its receiver admitted it",
                    job.req_id
                ),
            );
        }
        content(&job.req_id, job.rank, chunk, &mut buf);
        h.stage(slot, &buf);
        let added = ChunkSpec {
            key: format!("{}@{chunk}", job.req_id),
            staging: slot,
            tokens: 256,
            bytes: buf.len() as u64,
        };
        if h.add(&req_id, added).is_err() {
            return;
        }
        let pending = h.added_count(&req_id) as u32;
        let last = chunk + 1 == job.chunks;
        if (pending == job.batch_chunks || last) && h.submit_added(&req_id, last).is_err() {
            return;
        }
    }
}

/// `transfer` with caller staging: each chunk is computed into a slot of the engine's own
/// memory and the batches name those slots; nothing is allocated from kvx. Returns the slots
/// the request took, which the engine may reuse once the request reads none of them. S13 is
/// checked from outside: a slot the engine takes is read by no chunk.
async fn transfer_in_place(
    world: &World,
    cfg: &SimConfig,
    h: &SenderHandle<SimEnv>,
    p: usize,
    job: &Job,
    app: &AppStaging,
) -> Vec<u32> {
    let req_id = ReqId(job.req_id.clone());
    let mut buf = vec![0u8; cfg.chunk_bytes];
    let mut held = Vec::new();
    let mut batch = Vec::new();
    // Nothing holds an engine that asked early back until admission (as kvx's pool does
    // with `allocate`): a batch of an unadmitted request is refused. Wait for it here.
    if h.admitted(&req_id).await.is_err() {
        return held;
    }
    for chunk in 0..job.chunks {
        let Some(slot) = app.take(cfg.prefill[p].sender.staging_timeout).await else {
            world.record(format_args!("engine: no slot of its own for {req_id}"));
            let _ = h.cancel(&req_id);
            return held;
        };
        held.push(slot);
        let readers = h.staging_readers(StagingSlot(slot));
        if readers > 0 {
            flag(
                world,
                format!(
                    "S13: the engine got slot {slot} back while {readers} chunk(s) still read it"
                ),
            );
        }
        if !cfg.prefill_chunk_time.is_zero() {
            tokio::time::sleep(cfg.prefill_chunk_time).await;
        }
        content(&job.req_id, job.rank, chunk, &mut buf);
        h.stage(StagingSlot(slot), &buf);
        batch.push(ChunkSpec {
            key: format!("{}@{chunk}", job.req_id),
            staging: StagingSlot(slot),
            tokens: 256,
            bytes: buf.len() as u64,
        });
        let last = chunk + 1 == job.chunks;
        if (batch.len() as u32 == job.batch_chunks || last)
            && h.submit(&req_id, std::mem::take(&mut batch), last).is_err()
        {
            return held;
        }
    }
    held
}

/// Takes a staging slot for the request, bounded by `staging_timeout`; the core submits
/// pending batches first when only they hold staging (S11). On any failure the request is
/// cancelled (a no-op when it already ended) so that it never lingers.
async fn allocate(
    world: &World,
    h: &SenderHandle<SimEnv>,
    req_id: &ReqId,
    timeout: Duration,
) -> Option<StagingSlot> {
    match h.allocate_within(req_id, &mut Vec::new(), timeout).await {
        Ok(slot) => return Some(slot),
        Err(e) => world.record(format_args!("engine: allocate for {req_id}: {e}")),
    }
    let _ = h.cancel(req_id);
    None
}
