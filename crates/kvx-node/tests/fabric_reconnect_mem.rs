//! The sender's fabric link outside the simulation: its fabric connection breaks between
//! requests, and the writes posted while the sender makes a new one wait for it (parked) and
//! are posted on it in their order; or they fail, with the reason, when the connect gives up
//! or when the write timeout passes first. Over the in-memory transport and fabric, the fabric
//! wrapped (`WiredFabric`) so that the test decides when a connect completes, whether it
//! succeeds, and which connection breaks. Every wait is bounded.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvx_io::fabric::{ConnOp, FabricConn, LocalMemory};
use kvx_io::mem::{MemFabric, MemTransport};
use kvx_io::{Fabric, FabricCredential, FabricError, FabricListener, SlotGeometry, TokioEnv};
use kvx_node::synthetic::{self, Decoded, SyntheticRequest};
use kvx_node::{
    BufferSnapshot, ChunkReader, ProxyHandle, ProxyNode, ReceiverNode, ReceiverNotice,
    SenderHandle, SenderNode,
};
use kvx_proto::proxy::ProxyFailure;
use kvx_proto::receiver::{Failure, Outcome};
use kvx_proto::sender::{ChunkSpec, SendFailure};
use kvx_proto::{PeerId, ProxyConfig, ReceiverConfig, ReqId, ReqKey, SenderConfig, WriteId};
use tokio::sync::{mpsc, watch};

const CHUNK: usize = 4096;
const BOUND: Duration = Duration::from_secs(20);
/// What "promptly" means here: far below every timeout a late message would run into
/// (`reply_timeout` is 10 s).
const PROMPT: Duration = Duration::from_secs(2);
const BUFFER_SLOTS: u32 = 16;
const STAGING_SLOTS: u32 = 8;

type WiredEnv = TokioEnv<MemTransport, WiredFabric>;

/// What the test sees of the sender's fabric connections, and decides about them.
#[derive(Debug, Default)]
struct Wiring {
    /// Connect calls so far, the one waiting at the gate included.
    connects: usize,
    /// Connect calls wait while this is false.
    gate_open: bool,
    /// When set, a connect let through the gate fails with this error.
    refuse: Option<FabricError>,
    /// The writes posted on each connection made, in posting order.
    posted: Vec<Vec<WriteId>>,
    /// Connections the test broke (indexes into `posted`).
    broken: Vec<usize>,
}

/// `MemFabric`, with every sender connection passed through a task that records its writes
/// and that the test can break.
#[derive(Debug, Clone)]
struct WiredFabric {
    inner: MemFabric,
    wiring: Arc<watch::Sender<Wiring>>,
}

impl Fabric for WiredFabric {
    type Memory = LocalMemory;

    fn allocate_staging(&self, geometry: SlotGeometry) -> Result<Arc<LocalMemory>, FabricError> {
        self.inner.allocate_staging(geometry)
    }

    async fn expose(
        &self,
        endpoint: &str,
        geometry: SlotGeometry,
    ) -> Result<FabricListener<LocalMemory>, FabricError> {
        self.inner.expose(endpoint, geometry).await
    }

    async fn connect(
        &self,
        endpoint: &str,
        staging: Arc<LocalMemory>,
        credential: FabricCredential,
    ) -> Result<FabricConn, FabricError> {
        self.wiring.send_modify(|w| w.connects += 1);
        let mut seen = self.wiring.subscribe();
        let refuse = {
            let wiring = seen.wait_for(|w| w.gate_open).await.expect("wiring kept");
            wiring.refuse.clone()
        };
        if let Some(error) = refuse {
            return Err(error);
        }
        let (poster, mut completions) = self
            .inner
            .connect(endpoint, staging, credential)
            .await?
            .split();
        let mut index = 0;
        self.wiring.send_modify(|w| {
            w.posted.push(Vec::new());
            index = w.posted.len() - 1;
        });
        let (ops_tx, mut ops_rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let wiring = self.wiring.clone();
        tokio::spawn(async move {
            let mut seen = wiring.subscribe();
            loop {
                tokio::select! {
                    // Broken: dropping both channels fails later posts and ends the
                    // completion stream, as a dropped socket does.
                    _ = seen.wait_for(|w| w.broken.contains(&index)) => return,
                    op = ops_rx.recv() => match op {
                        Some(ConnOp::Write(write)) => {
                            wiring.send_modify(|w| w.posted[index].push(write.id));
                            let _ = poster.post(write);
                        }
                        Some(ConnOp::Run(_)) => unreachable!("this fabric carries no runs"),
                        Some(ConnOp::Reset) => poster.reset(),
                        None => return,
                    },
                    done = completions.recv() => match done {
                        Some(done) => {
                            let _ = done_tx.send(done);
                        }
                        None => return,
                    },
                }
            }
        });
        Ok(FabricConn::new(ops_tx, done_rx))
    }
}

/// A proxy, one receiver whose decoder verifies every byte, and sender "s0" connected to it.
struct Setup {
    wiring: Arc<watch::Sender<Wiring>>,
    sender: SenderHandle<WiredEnv>,
    peer: PeerId,
    proxy: ProxyHandle,
    /// The receiver's buffer accounting (`snapshot`).
    reader: ChunkReader<LocalMemory>,
    verified: Arc<AtomicU64>,
    /// Every request the receiver ended, with how.
    ended: mpsc::UnboundedReceiver<(ReqKey, Outcome)>,
}

async fn setup(write_timeout: Duration) -> Setup {
    let wiring = Arc::new(watch::Sender::new(Wiring {
        gate_open: true,
        ..Wiring::default()
    }));
    let fabric = WiredFabric {
        inner: MemFabric::new(),
        wiring: wiring.clone(),
    };
    let env = TokioEnv::new(MemTransport::new(), fabric);
    let proxy = ProxyNode::start(env.clone(), ProxyConfig::default(), "proxy")
        .await
        .expect("proxy starts");
    let cfg = ReceiverConfig {
        buffer_slots: BUFFER_SLOTS,
        peer_share_percent: 100,
        ..ReceiverConfig::default()
    };
    let mut receiver = ReceiverNode::start(env.clone(), cfg, CHUNK, "alloc", "buffer")
        .await
        .expect("receiver starts");
    let addr = kvx_node::ReceiverAddr {
        alloc: receiver.alloc_endpoint().to_owned(),
        fabric: receiver.fabric_endpoint().to_owned(),
    };
    let reader = receiver.reader().clone();
    let verified = Arc::new(AtomicU64::new(0));
    let (counter, (ended_tx, ended)) = (verified.clone(), mpsc::unbounded_channel());
    tokio::spawn(async move {
        while let Some(notice) = receiver.next_notice().await {
            match notice {
                ReceiverNotice::Ready(ready) => {
                    match synthetic::decode(receiver.reader(), ready.clone(), CHUNK, true).await {
                        Decoded::Verified(bytes) => counter.fetch_add(bytes, Ordering::Relaxed),
                        other => panic!("the decoder read {other:?} for {}", ready.key),
                    };
                }
                ReceiverNotice::Ended { key, outcome } => {
                    let _ = ended_tx.send((key, outcome));
                }
            }
        }
    });
    let sender_cfg = SenderConfig {
        staging_slots: STAGING_SLOTS,
        notify_proxy_on_failure: true,
        write_timeout,
        ..SenderConfig::default()
    };
    let sender = SenderNode::start(
        env.clone(),
        sender_cfg,
        CHUNK,
        "s0".into(),
        Some(proxy.endpoint().into()),
    )
    .await
    .expect("sender starts");
    let peer = sender.add_receiver(addr).await.expect("connects");
    Setup {
        wiring,
        sender,
        peer,
        proxy,
        reader,
        verified,
        ended,
    }
}

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {BOUND:?}"))
}

impl Setup {
    /// Waits, bounded, until the wiring satisfies `done`.
    async fn wiring_until(&self, what: &str, done: impl FnMut(&Wiring) -> bool) {
        let mut seen = self.wiring.subscribe();
        bounded(what, seen.wait_for(done))
            .await
            .expect("wiring kept");
    }

    fn posted(&self) -> Vec<Vec<WriteId>> {
        self.wiring.borrow().posted.clone()
    }

    fn request(&self, id: &str, chunks: u32) -> SyntheticRequest {
        SyntheticRequest {
            req_id: ReqId(id.into()),
            receiver: self.peer,
            chunks,
            batch_chunks: chunks,
            chunk_bytes: CHUNK,
        }
    }

    /// A whole request over the fabric as it is: delivered, told to the proxy, read and
    /// consumed.
    async fn deliver(&mut self, id: &str, chunks: u32) {
        let req = self.request(id, chunks);
        let at_proxy = self
            .proxy
            .expect(req.req_id.clone(), 1)
            .await
            .expect("fresh id");
        bounded(id, synthetic::prefill(&self.sender, &req))
            .await
            .unwrap_or_else(|e| panic!("{id} not delivered: {e}"));
        let told = bounded(id, at_proxy).await.expect("the proxy runs");
        assert_eq!(told, Ok(()), "{id} at the proxy");
        let (key, outcome) = self.next_end().await;
        assert_eq!((key.req_id, outcome), (req.req_id, Outcome::Consumed));
    }

    /// Breaks the live fabric connection (the first one: `deliver` made it) and holds the
    /// sender's connect to a new one at the gate.
    async fn break_the_connection(&self) {
        assert_eq!(self.posted().len(), 1, "one connection so far");
        self.wiring.send_modify(|w| {
            w.gate_open = false;
            w.broken.push(0);
        });
        // The driver sees the completion stream end and connects again, at once.
        self.wiring_until("a new connect", |w| w.connects == 2)
            .await;
    }

    /// Stages all of `req` and submits it as one (last) batch.
    async fn stage_and_submit(&self, req: &SyntheticRequest) {
        let mut batch = Vec::new();
        for chunk in 0..req.chunks {
            let slot = bounded(
                "staging",
                self.sender.allocate(&req.req_id, &mut Vec::new()),
            )
            .await
            .expect("staging");
            self.sender.stage_with(slot, CHUNK, &mut |out| {
                synthetic::chunk_bytes(&req.req_id.0, chunk, out)
            });
            batch.push(ChunkSpec {
                key: format!("{}@{chunk}", req.req_id),
                staging: slot,
                tokens: 256,
                // `SenderHandle::submit` sets it to the staged length.
                bytes: 0,
            });
        }
        self.sender
            .submit(&req.req_id, batch, true)
            .expect("submitted");
    }

    /// Submits `parked` whole while no fabric connection is up, and returns once its writes
    /// are parked: `barrier`'s admission probe follows its batch on the control channel, so
    /// the driver has handled the batch's reply, and posted its writes, before the probe's.
    async fn park(&self, parked: &SyntheticRequest, barrier: &SyntheticRequest) {
        bounded("admission", synthetic::admit(&self.sender, parked))
            .await
            .expect("admitted");
        self.stage_and_submit(parked).await;
        bounded("barrier admission", synthetic::admit(&self.sender, barrier))
            .await
            .expect("barrier admitted");
        let w = self.wiring.borrow();
        assert!(!w.gate_open, "the new connection is still held");
        assert_eq!(w.posted.len(), 1, "no connection but the broken one");
    }

    async fn next_end(&mut self) -> (ReqKey, Outcome) {
        bounded("the receiver ends a request", self.ended.recv())
            .await
            .expect("the decoder task runs")
    }

    /// The next request the receiver ends, within `PROMPT`.
    async fn next_end_promptly(&mut self) -> (ReqKey, Outcome) {
        tokio::time::timeout(PROMPT, self.ended.recv())
            .await
            .unwrap_or_else(|_| panic!("the receiver heard of no end within {PROMPT:?}"))
            .expect("the decoder task runs")
    }

    /// Waits, bounded, until the receiver's buffer is entirely free, and checks that it keeps
    /// nothing else either.
    async fn buffer_entirely_free(&self) {
        let mut last = None;
        let waited = tokio::time::timeout(BOUND, async {
            loop {
                let snapshot = self.reader.snapshot().await.expect("the receiver runs");
                if snapshot.free == snapshot.capacity {
                    return snapshot;
                }
                last = Some(snapshot);
                // The ledger announces no event when a slot's quarantine ends: poll.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        let snapshot = waited.unwrap_or_else(|_| panic!("the buffer never got free: {last:?}"));
        assert_eq!(
            snapshot,
            BufferSnapshot {
                capacity: BUFFER_SLOTS,
                free: BUFFER_SLOTS,
                ..BufferSnapshot::default()
            }
        );
        assert_eq!(self.sender.staging_free(), STAGING_SLOTS);
    }
}

/// The connection breaks between requests; the next request's writes are posted while the
/// new connection is being made: they wait for it, are posted on it in their order, land,
/// and the request is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_posted_while_the_fabric_reconnects_wait_and_land_on_the_new_connection() {
    let mut t = setup(SenderConfig::default().write_timeout).await;
    t.deliver("warm-up", 2).await;
    t.break_the_connection().await;
    let (parked, barrier) = (t.request("parked", 4), t.request("barrier", 1));
    let at_proxy = t
        .proxy
        .expect(parked.req_id.clone(), 1)
        .await
        .expect("fresh id");
    t.park(&parked, &barrier).await;

    t.wiring.send_modify(|w| w.gate_open = true);
    let outcome = bounded("parked outcome", t.sender.outcome(&parked.req_id)).await;
    assert_eq!(outcome, Ok(()), "the parked writes landed");
    assert_eq!(bounded("proxy", at_proxy).await, Ok(Ok(())));
    let posted = t.posted();
    assert_eq!(
        posted[0].len(),
        2,
        "only the warm-up's writes on the broken connection"
    );
    assert_eq!(
        posted[1].len(),
        4,
        "the parked writes, each once, on the new one"
    );
    assert!(
        posted[1].windows(2).all(|pair| pair[0] < pair[1]),
        "in posting order: {:?}",
        posted[1]
    );

    t.stage_and_submit(&barrier).await;
    let outcome = bounded("barrier outcome", t.sender.outcome(&barrier.req_id)).await;
    assert_eq!(outcome, Ok(()));
    assert_eq!(t.posted().len(), 2, "no further connection");
    for req in [parked, barrier] {
        let (key, outcome) = t.next_end().await;
        assert_eq!((key.req_id, outcome), (req.req_id, Outcome::Consumed));
    }
    assert_eq!(t.verified.load(Ordering::Relaxed), 7 * CHUNK as u64);
    t.buffer_entirely_free().await;
}

/// The new connection cannot be made (the receiver's fabric answers "incompatible"): the
/// parked writes fail with that reason, the request fails everywhere, and a later write
/// connects afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_writes_fail_with_the_reason_when_the_connect_gives_up() {
    let mut t = setup(SenderConfig::default().write_timeout).await;
    t.deliver("warm-up", 2).await;
    t.break_the_connection().await;
    let (parked, barrier) = (t.request("parked", 4), t.request("barrier", 1));
    let at_proxy = t
        .proxy
        .expect(parked.req_id.clone(), 1)
        .await
        .expect("fresh id");
    t.park(&parked, &barrier).await;

    let refusal = FabricError::Incompatible {
        endpoint: "buffer".into(),
        why: "refused by the test".into(),
    };
    t.wiring.send_modify(|w| {
        w.refuse = Some(refusal.clone());
        w.gate_open = true;
    });
    let outcome = bounded("parked outcome", t.sender.outcome(&parked.req_id)).await;
    assert_eq!(outcome, Err(SendFailure::WriteFailed(refusal.to_string())));
    let told = bounded("proxy", at_proxy).await.expect("the proxy runs");
    assert_eq!(
        told,
        Err(ProxyFailure::Reported(
            SendFailure::WriteFailed(refusal.to_string()).to_string()
        ))
    );
    let (key, outcome) = t.next_end().await;
    assert_eq!(
        (key.req_id, outcome),
        (parked.req_id.clone(), Outcome::Failed(Failure::Cancelled))
    );

    // The next write connects afresh, and the request it belongs to is delivered.
    t.wiring.send_modify(|w| w.refuse = None);
    t.stage_and_submit(&barrier).await;
    let outcome = bounded("barrier outcome", t.sender.outcome(&barrier.req_id)).await;
    assert_eq!(outcome, Ok(()));
    let posted = t.posted();
    assert_eq!(
        posted.len(),
        2,
        "connections: the broken one and the new one"
    );
    assert_eq!(
        posted[1].len(),
        1,
        "none of the failed writes was posted: {posted:?}"
    );
    let (key, outcome) = t.next_end().await;
    assert_eq!((key.req_id, outcome), (barrier.req_id, Outcome::Consumed));
    t.buffer_entirely_free().await;
}

/// The new connection takes longer than the write timeout: the parked writes fail when it
/// passes (none waits longer), the request fails everywhere at once, the other requests on
/// the channel are unharmed, and none of the failed writes is posted on the connection made
/// afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_writes_fail_when_the_write_timeout_passes_first() {
    let write_timeout = Duration::from_millis(500);
    let mut t = setup(write_timeout).await;
    t.deliver("warm-up", 2).await;
    t.break_the_connection().await;
    let (parked, barrier) = (t.request("parked", 4), t.request("barrier", 1));
    let at_proxy = t
        .proxy
        .expect(parked.req_id.clone(), 1)
        .await
        .expect("fresh id");
    t.park(&parked, &barrier).await;

    let outcome = bounded("parked outcome", t.sender.outcome(&parked.req_id)).await;
    assert_eq!(outcome, Err(SendFailure::WriteTimeout));
    let told = bounded("proxy", at_proxy).await.expect("the proxy runs");
    assert_eq!(
        told,
        Err(ProxyFailure::Reported(
            SendFailure::WriteTimeout.to_string()
        ))
    );
    // The receiver hears of it at once, while the connection is still held: the parked
    // writes were failed, not left waiting, and the cancel that follows was sent.
    let (key, outcome) = t.next_end_promptly().await;
    assert_eq!(
        (key.req_id, outcome),
        (parked.req_id.clone(), Outcome::Failed(Failure::Cancelled))
    );

    t.wiring.send_modify(|w| w.gate_open = true);
    t.stage_and_submit(&barrier).await;
    let outcome = bounded("barrier outcome", t.sender.outcome(&barrier.req_id)).await;
    assert_eq!(outcome, Ok(()));
    let posted = t.posted();
    assert_eq!(
        posted.len(),
        2,
        "connections: the broken one and the new one"
    );
    assert_eq!(
        posted[1].len(),
        1,
        "none of the timed-out writes was posted: {posted:?}"
    );
    let (key, outcome) = t.next_end().await;
    assert_eq!((key.req_id, outcome), (barrier.req_id, Outcome::Consumed));
    t.buffer_entirely_free().await;
}
