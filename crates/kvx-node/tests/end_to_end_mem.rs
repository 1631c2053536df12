//! The drivers end to end over the in-memory transport and fabric: real async tasks, real
//! bytes verified by the decoder.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvx_io::mem::{MemFabric, MemTransport};
use kvx_io::TokioEnv;
use kvx_node::synthetic::{self, Decoded, SyntheticRequest};
use kvx_node::{ProxyNode, ReceiverAddr, ReceiverNode, ReceiverNotice, SenderNode};
use kvx_proto::sender::{RequestSpec, SendError, SendFailure};
use kvx_proto::{ProxyConfig, ReceiverConfig, ReqId, SenderConfig};

const CHUNK: usize = 4096;

fn env() -> TokioEnv<MemTransport, MemFabric> {
    TokioEnv::new(MemTransport::new(), MemFabric::new())
}

/// Starts a proxy and one receiver whose decoder verifies and consumes every ready request;
/// returns the receiver's address and the verified-bytes counter.
async fn cluster(
    env: &TokioEnv<MemTransport, MemFabric>,
    buffer_slots: u32,
) -> (ReceiverAddr, Arc<AtomicU64>, kvx_node::ProxyHandle) {
    let proxy = ProxyNode::start(env.clone(), ProxyConfig::default(), "proxy")
        .await
        .expect("proxy starts");
    // These tests size requests against the whole buffer, from one sender.
    let cfg = ReceiverConfig {
        buffer_slots,
        peer_share_percent: 100,
        ..ReceiverConfig::default()
    };
    let mut receiver = ReceiverNode::start(env.clone(), cfg, CHUNK, "alloc", "buffer")
        .await
        .expect("receiver starts");
    let addr = ReceiverAddr {
        alloc: receiver.alloc_endpoint().to_owned(),
        fabric: receiver.fabric_endpoint().to_owned(),
    };
    let verified = Arc::new(AtomicU64::new(0));
    let counter = verified.clone();
    tokio::spawn(async move {
        while let Some(notice) = receiver.next_notice().await {
            if let ReceiverNotice::Ready(ready) = notice {
                match synthetic::decode(receiver.reader(), ready.clone(), CHUNK, true).await {
                    Decoded::Verified(bytes) => counter.fetch_add(bytes, Ordering::Relaxed),
                    other => panic!("the decoder read {other:?} for {}", ready.key),
                };
            }
        }
    });
    (addr, verified, proxy)
}

fn sender_cfg() -> SenderConfig {
    SenderConfig {
        staging_slots: 8,
        notify_proxy_on_failure: true,
        ..SenderConfig::default()
    }
}

/// Two staging slots, and a staging bound far beyond any test's wait (a call that waits it
/// out was not woken).
fn two_staging_slots() -> SenderConfig {
    SenderConfig {
        staging_slots: 2,
        staging_timeout: Duration::from_secs(30),
        ..sender_cfg()
    }
}

/// Starts sender "s0" with `cfg`, reporting to `proxy`, connected to the receiver at `addr`.
async fn start_sender(
    env: &TokioEnv<MemTransport, MemFabric>,
    proxy: &kvx_node::ProxyHandle,
    addr: ReceiverAddr,
    cfg: SenderConfig,
) -> (
    kvx_node::SenderHandle<TokioEnv<MemTransport, MemFabric>>,
    kvx_proto::PeerId,
) {
    let sender = SenderNode::start(
        env.clone(),
        cfg,
        CHUNK,
        "s0".into(),
        Some(proxy.endpoint().into()),
    )
    .await
    .expect("sender starts");
    let peer = sender.add_receiver(addr).await.expect("connects");
    (sender, peer)
}

/// Request `id` of `total_chunks` chunks to the receiver `peer`.
fn request(peer: kvx_proto::PeerId, id: &str, total_chunks: u32) -> RequestSpec {
    RequestSpec {
        req_id: ReqId(id.into()),
        receiver: peer,
        total_chunks,
        fmt: 1,
        shape: vec![1],
        dtype: "bfloat16".into(),
        claim: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worked_example_one_sender_interleaved() {
    let env = env();
    let (addr, verified, proxy) = cluster(&env, 10).await;
    let (sender, peer) = start_sender(&env, &proxy, addr, sender_cfg()).await;
    let mut tasks = Vec::new();
    for name in ["A", "B"] {
        let req = SyntheticRequest {
            req_id: ReqId(name.into()),
            receiver: peer,
            chunks: 8,
            batch_chunks: 2,
            chunk_bytes: CHUNK,
        };
        let ready = proxy.expect(req.req_id.clone(), 1).await.expect("fresh id");
        let sender = sender.clone();
        tasks.push(tokio::spawn(async move {
            synthetic::prefill(&sender, &req).await.expect("delivered");
            ready.await.expect("proxy answers").expect("proxy: ready");
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("no deadlock")
            .expect("task ok");
    }
    // The decoder consumes after ProxyNotif; give it a moment to finish verifying.
    tokio::time::timeout(Duration::from_secs(5), async {
        while verified.load(Ordering::Relaxed) < 16 * CHUNK as u64 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("every byte verified");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_fails_fast_and_the_proxy_is_told() {
    let env = env();
    let (addr, _, proxy) = cluster(&env, 10).await;
    let (sender, peer) = start_sender(&env, &proxy, addr, sender_cfg()).await;
    let req = SyntheticRequest {
        req_id: ReqId("big".into()),
        receiver: peer,
        chunks: 12,
        batch_chunks: 2,
        chunk_bytes: CHUNK,
    };
    let ready = proxy.expect(req.req_id.clone(), 1).await.expect("fresh id");
    let err = synthetic::prefill(&sender, &req)
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("only 10 slots"), "{err}");
    let proxy_says = tokio::time::timeout(Duration::from_secs(5), ready)
        .await
        .expect("bounded")
        .expect("answered");
    assert!(proxy_says.is_err(), "the proxy learns of the failure");
}

/// A prefill thread blocked in `allocate_blocking` (its request waits for admission behind
/// a request holding the whole buffer) is woken by a cancel, with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_wakes_a_blocked_allocate_with_an_error() {
    let env = env();
    let (addr, _, proxy) = cluster(&env, 10).await;
    let cfg = two_staging_slots();
    let (sender, peer) = start_sender(&env, &proxy, addr, cfg).await;
    let spec = |id: &str, total| request(peer, id, total);
    let (whole, waits) = (ReqId("whole".into()), ReqId("waits".into()));
    sender.begin(spec("whole", 10)).expect("begins");
    sender.admitted(&whole).await.expect("admitted");
    // Both staging slots held by the caller, unsubmitted: waiting could never end, so the
    // core says so at once instead of blocking.
    sender
        .allocate(&whole, &mut Vec::new())
        .await
        .expect("slot 1");
    sender
        .allocate(&whole, &mut Vec::new())
        .await
        .expect("slot 2");
    let (s, r) = (sender.clone(), whole.clone());
    let refused = tokio::task::spawn_blocking(move || {
        s.allocate_blocking(&r, &mut Vec::new(), Duration::from_secs(30))
    })
    .await
    .expect("join");
    assert!(
        matches!(refused, Err(SendError::StagingHeldByCaller(2))),
        "{refused:?}"
    );

    sender.begin(spec("waits", 1)).expect("begins");
    let (s, r) = (sender.clone(), waits.clone());
    let blocked = tokio::task::spawn_blocking(move || {
        s.allocate_blocking(&r, &mut Vec::new(), Duration::from_secs(30))
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!blocked.is_finished(), "the thread waits for admission");
    sender.cancel(&waits).expect("cancel");
    let woke = tokio::time::timeout(Duration::from_secs(5), blocked)
        .await
        .expect("woken promptly")
        .expect("join");
    assert!(
        matches!(woke, Err(SendError::Failed(_, SendFailure::Cancelled))),
        "{woke:?}"
    );
}

/// A request larger than the staging pool: its later chunks wait for its own earlier writes
/// to complete. Completions free staging without any core event, so the driver must wake
/// the waiting allocator itself (it once did not: the prefill hung for `staging_timeout`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_larger_than_staging_completes_promptly() {
    let env = env();
    let (addr, verified, proxy) = cluster(&env, 16).await;
    let cfg = SenderConfig {
        staging_slots: 2,
        ..sender_cfg()
    };
    let (sender, peer) = start_sender(&env, &proxy, addr, cfg).await;
    let req = SyntheticRequest {
        req_id: ReqId("long".into()),
        receiver: peer,
        chunks: 16,
        batch_chunks: 2,
        chunk_bytes: CHUNK,
    };
    tokio::time::timeout(Duration::from_secs(5), synthetic::prefill(&sender, &req))
        .await
        .expect("no wait for staging_timeout")
        .expect("delivered");
    tokio::time::timeout(Duration::from_secs(5), async {
        while verified.load(Ordering::Relaxed) < 16 * CHUNK as u64 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("every byte verified");
}

/// A chunk whose staging slot changes after it was staged (a caller rewrote it, memory went
/// bad) arrives with a checksum that no longer matches: the request fails at the sender (its
/// write is reported corrupt), at the receiver (it never becomes ready; the ledger says why)
/// and at the proxy, each with the reason; the next request goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_changed_after_staging_fails_everywhere_with_the_reason() {
    use kvx_io::SlotMemory;
    use kvx_proto::receiver::{Failure, Outcome};
    use kvx_proto::sender::ChunkSpec;
    let env = env();
    let proxy = ProxyNode::start(env.clone(), ProxyConfig::default(), "proxy")
        .await
        .expect("proxy starts");
    let cfg = ReceiverConfig {
        buffer_slots: 8,
        ..ReceiverConfig::default()
    };
    let mut receiver = ReceiverNode::start(env.clone(), cfg, CHUNK, "alloc", "buffer")
        .await
        .expect("receiver starts");
    let addr = ReceiverAddr {
        alloc: receiver.alloc_endpoint().to_owned(),
        fabric: receiver.fabric_endpoint().to_owned(),
    };
    let (ended_tx, mut ended) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(notice) = receiver.next_notice().await {
            match notice {
                ReceiverNotice::Ready(ready) => {
                    let d = synthetic::decode(receiver.reader(), ready.clone(), CHUNK, true).await;
                    assert!(matches!(d, Decoded::Verified(_)), "{d:?}");
                }
                ReceiverNotice::Ended { key, outcome } => {
                    let _ = ended_tx.send((key.req_id.0, outcome));
                }
            }
        }
    });
    let (sender, peer) = start_sender(&env, &proxy, addr, sender_cfg()).await;
    let id = ReqId("bad".into());
    let ready = proxy.expect(id.clone(), 1).await.expect("fresh id");
    sender
        .begin(RequestSpec {
            req_id: id.clone(),
            receiver: peer,
            total_chunks: 1,
            fmt: 1,
            shape: vec![1],
            dtype: "bfloat16".into(),
            claim: None,
        })
        .expect("begins");
    sender.admitted(&id).await.expect("admitted");
    let slot = sender
        .allocate(&id, &mut Vec::new())
        .await
        .expect("staging");
    sender.stage(slot, &vec![7u8; CHUNK]);
    // Changed after staging, without staging it again.
    sender.staging().write_slot(slot.0, &[8u8; 16]);
    let chunk = ChunkSpec {
        key: "k".into(),
        staging: slot,
        tokens: 1,
        // `SenderHandle::submit` sets it to the staged length.
        bytes: 0,
    };
    sender.submit(&id, vec![chunk], true).expect("submitted");
    let at_sender = tokio::time::timeout(Duration::from_secs(10), sender.outcome(&id))
        .await
        .expect("bounded");
    assert!(
        matches!(&at_sender, Err(SendFailure::WriteFailed(why)) if why.contains("corrupt")),
        "{at_sender:?}"
    );
    let at_proxy = tokio::time::timeout(Duration::from_secs(10), ready)
        .await
        .expect("bounded")
        .expect("answered");
    assert!(
        matches!(&at_proxy, Err(kvx_proto::proxy::ProxyFailure::Reported(why)) if why.contains("corrupt")),
        "{at_proxy:?}"
    );
    let (req, outcome) = tokio::time::timeout(Duration::from_secs(10), ended.recv())
        .await
        .expect("bounded")
        .expect("an end");
    assert_eq!(req, "bad");
    assert!(
        matches!(&outcome, Outcome::Failed(Failure::Integrity(why)) if why.contains("checksum")),
        "{outcome:?}"
    );
    // The next request, staged properly, is delivered and verified.
    let good = SyntheticRequest {
        req_id: ReqId("good".into()),
        receiver: peer,
        chunks: 2,
        batch_chunks: 2,
        chunk_bytes: CHUNK,
    };
    let ready = proxy
        .expect(good.req_id.clone(), 1)
        .await
        .expect("fresh id");
    synthetic::prefill(&sender, &good).await.expect("delivered");
    ready.await.expect("answered").expect("ready");
}

/// A younger request holding the only staging slot, unsubmitted, while an older one waits
/// for staging: the younger one's next allocate must be told to submit what it holds
/// (`StagingHeldByCaller`), not queued behind the older one, which waits for exactly that
/// slot. (The oldest-first staging order once queued it: both waited until
/// `staging_timeout`, and `kvx demo --staging-chunks 1 --interleave 4` lost requests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_younger_request_holding_staging_is_told_to_submit_while_an_older_one_waits() {
    let env = env();
    let (addr, _, proxy) = cluster(&env, 10).await;
    let cfg = SenderConfig {
        staging_slots: 1,
        staging_timeout: Duration::from_secs(5),
        ..sender_cfg()
    };
    let (sender, peer) = start_sender(&env, &proxy, addr, cfg).await;
    let spec = |id: &str| request(peer, id, 2);
    let (older, younger) = (ReqId("older".into()), ReqId("younger".into()));
    sender.begin(spec("older")).expect("begins");
    sender.begin(spec("younger")).expect("begins");
    sender.admitted(&older).await.expect("admitted");
    sender.admitted(&younger).await.expect("admitted");
    let held = sender
        .allocate(&younger, &mut Vec::new())
        .await
        .expect("the only slot");
    let (s, id) = (sender.clone(), older.clone());
    let older_waits = tokio::spawn(async move { s.allocate(&id, &mut Vec::new()).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !older_waits.is_finished(),
        "the older request waits for staging"
    );
    let told = tokio::time::timeout(
        Duration::from_secs(2),
        sender.allocate(&younger, &mut Vec::new()),
    )
    .await
    .expect("answered at once, not after staging_timeout");
    assert!(
        matches!(told, Err(SendError::StagingHeldByCaller(1))),
        "{told:?}"
    );
    // Submitting it frees the slot once written, and the older request gets it.
    let chunk = kvx_proto::sender::ChunkSpec {
        key: "younger@0".into(),
        staging: held,
        tokens: 1,
        // `SenderHandle::submit` sets it to the staged length.
        bytes: 0,
    };
    sender.stage(held, &[7u8; CHUNK]);
    sender
        .submit(&younger, vec![chunk], false)
        .expect("submitted");
    let got = tokio::time::timeout(Duration::from_secs(5), older_waits)
        .await
        .expect("bounded")
        .expect("join");
    assert!(got.is_ok(), "{got:?}");
}

/// The receiver states its lease and quarantine in its replies; a sender whose write
/// timeout is not below the quarantine (a slow write could land in a slot already reused)
/// fails its writes to that receiver at once, naming the rule, while one that fits is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_whose_write_timeout_breaks_the_receivers_quarantine_fails_loudly() {
    let env = env();
    let proxy = ProxyNode::start(env.clone(), ProxyConfig::default(), "proxy")
        .await
        .expect("proxy starts");
    let cfg = ReceiverConfig {
        buffer_slots: 16,
        peer_share_percent: 100,
        write_quarantine: Duration::from_secs(2),
        ..ReceiverConfig::default()
    };
    let mut receiver = ReceiverNode::start(env.clone(), cfg, CHUNK, "alloc-q", "buffer-q")
        .await
        .expect("receiver starts");
    let addr = ReceiverAddr {
        alloc: receiver.alloc_endpoint().to_owned(),
        fabric: receiver.fabric_endpoint().to_owned(),
    };
    tokio::spawn(async move {
        while let Some(notice) = receiver.next_notice().await {
            if let ReceiverNotice::Ready(ready) = notice {
                let _ = synthetic::decode(receiver.reader(), ready.clone(), CHUNK, true).await;
            }
        }
    });
    let request = |name: &str, peer| SyntheticRequest {
        req_id: ReqId(name.into()),
        receiver: peer,
        chunks: 4,
        batch_chunks: 2,
        chunk_bytes: CHUNK,
    };
    // 5 s writes against a 2 s quarantine.
    let slow = SenderConfig {
        write_timeout: Duration::from_secs(5),
        ..sender_cfg()
    };
    let (sender, peer) = start_sender(&env, &proxy, addr.clone(), slow).await;
    let outcome = tokio::time::timeout(
        Duration::from_secs(5),
        synthetic::prefill(&sender, &request("slow", peer)),
    )
    .await
    .expect("fails at once, not at a timeout");
    match outcome {
        Err(SendFailure::WriteFailed(why)) => {
            assert!(why.contains("write_quarantine"), "{why}")
        }
        other => panic!("expected a write failure naming the rule, got {other:?}"),
    }
    // 1 s writes fit.
    let fast = SenderConfig {
        write_timeout: Duration::from_secs(1),
        ..sender_cfg()
    };
    let sender = SenderNode::start(env.clone(), fast, CHUNK, "s1".into(), None)
        .await
        .expect("sender starts");
    let peer = sender.add_receiver(addr).await.expect("connects");
    tokio::time::timeout(
        Duration::from_secs(5),
        synthetic::prefill(&sender, &request("fast", peer)),
    )
    .await
    .expect("in time")
    .expect("delivered");
}

/// Prefill threads blocked in `allocate_blocking` are woken by turn (`sender/sleepers.rs`):
/// a slot freed by a completed write wakes the thread of the oldest request waiting, which,
/// served, passes the turn on. Each must get its slot at once, not at its 30 s bound (a
/// wake-up that went to no one, or a turn not passed on, would leave it asleep until then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_threads_get_freed_slots_by_turn_at_once() {
    let env = env();
    let (addr, _, proxy) = cluster(&env, 20).await;
    let cfg = two_staging_slots();
    let (sender, peer) = start_sender(&env, &proxy, addr, cfg).await;
    let spec = |id: &str, total| request(peer, id, total);
    let ids: Vec<ReqId> = (0..4).map(|i| ReqId(format!("r{i}"))).collect();
    sender.begin(spec("r0", 2)).expect("begins");
    for id in &ids[1..] {
        sender.begin(spec(&id.0, 1)).expect("begins");
    }
    for id in &ids {
        sender.admitted(id).await.expect("admitted");
    }
    let mut chunks = Vec::new();
    for c in 0..2 {
        let slot = sender
            .allocate(&ids[0], &mut Vec::new())
            .await
            .expect("a free slot");
        let mut bytes = vec![0; CHUNK];
        synthetic::chunk_bytes("r0", c, &mut bytes);
        sender.stage(slot, &bytes);
        chunks.push(kvx_proto::sender::ChunkSpec {
            key: format!("r0@{c}"),
            staging: slot,
            tokens: 1,
            // `SenderHandle::submit` sets it to the staged length.
            bytes: 0,
        });
    }
    // The youngest thread starts first: the order served is the requests', not the threads'.
    let blocked: Vec<_> = ids[1..]
        .iter()
        .rev()
        .map(|id| {
            let (s, id) = (sender.clone(), id.clone());
            tokio::task::spawn_blocking(move || {
                s.allocate_blocking(&id, &mut Vec::new(), Duration::from_secs(30))
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(blocked.iter().all(|t| !t.is_finished()), "staging is full");
    // r0's two writes free both slots: r1's thread, then r2's, each at once.
    sender.submit(&ids[0], chunks, true).expect("submitted");
    let [r3, r2, r1]: [_; 3] = blocked.try_into().expect("three threads");
    let mut served = Vec::new();
    for (thread, id) in [(r1, &ids[1]), (r2, &ids[2])] {
        let slot = tokio::time::timeout(Duration::from_secs(5), thread)
            .await
            .unwrap_or_else(|_| panic!("{id} woken at once, not at its bound"))
            .expect("join")
            .expect("a slot");
        served.push((id.clone(), slot));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!r3.is_finished(), "r3 waits: both slots are taken");
    // A slot handed back is r3's turn.
    let (id, slot) = served.remove(0);
    sender.release(&id, slot).expect("released");
    let got = tokio::time::timeout(Duration::from_secs(5), r3)
        .await
        .expect("r3 woken at once, not at its bound")
        .expect("join");
    assert!(got.is_ok(), "{got:?}");
}

/// Counts the polls of the future it wraps: a waiting call polled again was woken, and a
/// change that does not concern it must not wake it.
struct Polls<F> {
    inner: std::pin::Pin<Box<F>>,
    count: Arc<AtomicU64>,
}

impl<F: std::future::Future> std::future::Future for Polls<F> {
    type Output = F::Output;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.inner.as_mut().poll(cx)
    }
}

/// Spawns `fut` with a poll counter.
fn spawn_counted<F>(fut: F) -> (tokio::task::JoinHandle<F::Output>, Arc<AtomicU64>)
where
    F: std::future::Future + Send + 'static,
    F::Output: Send,
{
    let count = Arc::new(AtomicU64::new(0));
    let polls = Polls {
        inner: Box::pin(fut),
        count: count.clone(),
    };
    (tokio::spawn(polls), count)
}

/// Async calls are woken by what they wait for, as blocked threads are (`sender/sleepers.rs`):
/// a freed slot wakes the allocate call of the oldest request waiting and no other, and a
/// request's delivery wakes the calls waiting for that request's outcome and no other. A
/// Python thread blocked in `allocate` or `wait_outcome` waits on such a call: every
/// needless wake-up is a context switch and a GIL hand-off (docs/PERFORMANCE.md, "Python").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_calls_are_woken_only_by_what_they_wait_for() {
    let env = env();
    let (addr, _, proxy) = cluster(&env, 20).await;
    let cfg = two_staging_slots();
    let (sender, peer) = start_sender(&env, &proxy, addr, cfg).await;
    let ids: Vec<ReqId> = (0..4).map(|i| ReqId(format!("r{i}"))).collect();
    for (i, id) in ids.iter().enumerate() {
        let chunks = if i == 0 { 2 } else { 1 };
        sender.begin(request(peer, &id.0, chunks)).expect("begins");
        sender.admitted(id).await.expect("admitted");
    }
    // r0 takes both slots.
    let mut r0_slots = Vec::new();
    for _ in 0..2 {
        r0_slots.push(
            sender
                .allocate(&ids[0], &mut Vec::new())
                .await
                .expect("free"),
        );
    }
    // The youngest call starts first: the order served is the requests', not the calls'.
    let mut waiting: Vec<_> = ids[1..]
        .iter()
        .rev()
        .map(|id| {
            let (s, id) = (sender.clone(), id.clone());
            spawn_counted(async move {
                s.allocate_within(&id, &mut Vec::new(), Duration::from_secs(30))
                    .await
            })
        })
        .collect();
    waiting.reverse(); // r1, r2, r3
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        waiting.iter().all(|(t, _)| !t.is_finished()),
        "staging is full"
    );
    let polls = |w: &[(_, Arc<AtomicU64>)]| -> Vec<u64> {
        w.iter().map(|(_, c)| c.load(Ordering::Relaxed)).collect()
    };
    let asleep = polls(&waiting);

    // A slot handed back is r1's turn: r2 and r3 sleep on.
    sender
        .release(&ids[0], r0_slots.pop().expect("r0 holds a slot"))
        .expect("released");
    let (r1, _) = waiting.remove(0);
    let r1_slot = tokio::time::timeout(Duration::from_secs(5), r1)
        .await
        .expect("r1 woken at once")
        .expect("join")
        .expect("a slot");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(polls(&waiting), asleep[1..], "r2 and r3 were not woken");

    // r1 is delivered: a call waiting for r2's outcome sleeps on, r1's ends.
    let outcome_of = |id: &ReqId| {
        let (s, id) = (sender.clone(), id.clone());
        spawn_counted(async move { s.outcome(&id).await })
    };
    let (r1_outcome, _) = outcome_of(&ids[1]);
    let (r2_outcome, r2_outcome_polls) = outcome_of(&ids[2]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r2_outcome_asleep = r2_outcome_polls.load(Ordering::Relaxed);
    let mut bytes = vec![0; CHUNK];
    synthetic::chunk_bytes("r1", 0, &mut bytes);
    sender.stage(r1_slot, &bytes);
    let chunk = kvx_proto::sender::ChunkSpec {
        key: "r1@0".into(),
        staging: r1_slot,
        tokens: 1,
        bytes: 0,
    };
    sender
        .submit(&ids[1], vec![chunk], true)
        .expect("submitted");
    tokio::time::timeout(Duration::from_secs(5), r1_outcome)
        .await
        .expect("r1's outcome at once")
        .expect("join")
        .expect("delivered");
    // r1's write freed its slot: r2's turn, and r3 sleeps on.
    let (r2, _) = waiting.remove(0);
    tokio::time::timeout(Duration::from_secs(5), r2)
        .await
        .expect("r2 woken at once")
        .expect("join")
        .expect("a slot");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(polls(&waiting), asleep[2..], "r3 was not woken");
    assert_eq!(
        r2_outcome_polls.load(Ordering::Relaxed),
        r2_outcome_asleep,
        "r1's delivery did not wake the call waiting for r2's outcome"
    );
    assert!(!r2_outcome.is_finished());

    // r0's last slot handed back: r3's turn.
    sender
        .release(&ids[0], r0_slots.pop().expect("r0 holds a slot"))
        .expect("released");
    let (r3, _) = waiting.remove(0);
    let got = tokio::time::timeout(Duration::from_secs(5), r3)
        .await
        .expect("r3 woken at once")
        .expect("join");
    assert!(got.is_ok(), "{got:?}");
}

/// A caller waiting for a ready request is woken once, with its lease: the wait for the
/// notice and the leasing run as one task on the receiver's runtime. A thread blocked on
/// the call (a Python decoder) then sleeps once per call, not once for the notice and again
/// for the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_waiting_for_a_ready_request_is_woken_once_with_its_lease() {
    let env = env();
    let proxy = ProxyNode::start(env.clone(), ProxyConfig::default(), "proxy")
        .await
        .expect("proxy starts");
    let cfg = ReceiverConfig {
        buffer_slots: 4,
        peer_share_percent: 100,
        ..ReceiverConfig::default()
    };
    let receiver = ReceiverNode::start(env.clone(), cfg, CHUNK, "alloc", "buffer")
        .await
        .expect("receiver starts");
    let addr = ReceiverAddr {
        alloc: receiver.alloc_endpoint().to_owned(),
        fabric: receiver.fabric_endpoint().to_owned(),
    };
    let (leases, _reader) = receiver.into_ready_leases();
    let leases = Arc::new(leases);
    let (sender, peer) = start_sender(&env, &proxy, addr, sender_cfg()).await;
    let (take, polls) = {
        let leases = leases.clone();
        spawn_counted(async move { leases.take(4, None).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!take.is_finished(), "nothing is ready yet");
    let req = SyntheticRequest {
        req_id: ReqId("r".into()),
        receiver: peer,
        chunks: 2,
        batch_chunks: 2,
        chunk_bytes: CHUNK,
    };
    let _ready = proxy.expect(req.req_id.clone(), 1).await.expect("fresh id");
    synthetic::prefill(&sender, &req).await.expect("delivered");
    let got = tokio::time::timeout(Duration::from_secs(5), take)
        .await
        .expect("woken")
        .expect("join")
        .expect("leased");
    assert_eq!(got.len(), 1);
    assert_eq!(
        polls.load(Ordering::Relaxed),
        2,
        "polled once to wait, and once more with the lease"
    );
    for lease in got {
        lease.consume().await.expect("consumed");
    }
}
