//! Handles whose driver task is gone answer with the typed "stopped" errors
//! (`ConsumeError::Stopped`, `SendFailure::Stopped`, `StartError::Stopped`), never a request's
//! error (`Unknown`) or a transport's (`ChannelLost`, `Closed`), and never hang: both when the
//! driver was shut down and when it died with its runtime.

use std::time::Duration;

use kvx_io::mem::{MemFabric, MemTransport};
use kvx_io::TokioEnv;
use kvx_node::{
    ReadyRequest, ReceiverAddr, ReceiverHandle, ReceiverNode, SenderHandle, SenderNode, StartError,
};
use kvx_proto::receiver::{ChunkLayout, ConsumeError};
use kvx_proto::sender::{RequestSpec, SendError, SendFailure};
use kvx_proto::{PeerId, ReceiverConfig, ReqId, ReqKey, SenderConfig};

const CHUNK: usize = 4096;
/// Every call under test answers at once; this only keeps a regression from hanging.
const BOUND: Duration = Duration::from_secs(10);

type Env = TokioEnv<MemTransport, MemFabric>;

async fn receiver(env: &Env) -> Rx {
    let cfg = ReceiverConfig {
        buffer_slots: 4,
        ..ReceiverConfig::default()
    };
    ReceiverNode::start(env.clone(), cfg, CHUNK, "alloc", "buffer")
        .await
        .expect("receiver starts")
}

type Rx = ReceiverHandle<<MemFabric as kvx_io::Fabric>::Memory>;

/// A sender connected to a fresh receiver (kept running by the handle returned), and a
/// begun request of one chunk that is never staged (it does not end on its own).
async fn sender_with_request(env: &Env) -> (SenderHandle<Env>, ReceiverAddr, ReqId, Rx) {
    let rx = receiver(env).await;
    let addr = ReceiverAddr {
        alloc: rx.alloc_endpoint().to_owned(),
        fabric: rx.fabric_endpoint().to_owned(),
    };
    let cfg = SenderConfig {
        staging_slots: 2,
        ..SenderConfig::default()
    };
    let tx = SenderNode::start(env.clone(), cfg, CHUNK, "s0".into(), None)
        .await
        .expect("sender starts");
    let peer = tx.add_receiver(addr.clone()).await.expect("connects");
    let req_id = ReqId("r".into());
    tx.begin(spec(peer, &req_id)).expect("begins");
    (tx, addr, req_id, rx)
}

fn spec(peer: PeerId, req_id: &ReqId) -> RequestSpec {
    RequestSpec {
        req_id: req_id.clone(),
        receiver: peer,
        total_chunks: 1,
        fmt: 1,
        shape: vec![1],
        dtype: "bfloat16".into(),
        claim: None,
    }
}

fn key() -> ReqKey {
    ReqKey {
        peer: PeerId(0),
        req_id: ReqId("r".into()),
    }
}

/// A ready notice for `key()`, which the stopped receiver never gave.
fn ready() -> ReadyRequest {
    ReadyRequest {
        key: key(),
        slots: Vec::new(),
        keys: Vec::new(),
        layout: ChunkLayout::default(),
        tokens: Vec::new(),
    }
}

/// Every sender call that needs the driver says `Stopped`; calls about `req_id` may instead
/// give one of `decided`, an outcome the request already had when its driver stopped.
async fn assert_sender_stopped(
    tx: &SenderHandle<Env>,
    addr: ReceiverAddr,
    req_id: &ReqId,
    decided: &[SendFailure],
) {
    let stopped_or_decided = |f: &SendFailure| *f == SendFailure::Stopped || decided.contains(f);
    let outcome = tokio::time::timeout(BOUND, tx.outcome(req_id))
        .await
        .expect("answers");
    assert!(
        matches!(&outcome, Err(f) if stopped_or_decided(f)),
        "{outcome:?}"
    );
    // (`admitted` shares `outcome`'s wait, and may rightly answer Ok: the request may
    // have been admitted before the driver stopped.)
    let mut held = Vec::new();
    let allocated = tokio::time::timeout(BOUND, tx.allocate_within(req_id, &mut held, BOUND))
        .await
        .expect("answers");
    assert!(
        matches!(&allocated, Err(SendError::Failed(id, f)) if id == req_id && stopped_or_decided(f)),
        "{allocated:?}"
    );
    let other = ReqId("later".into());
    assert_eq!(
        tx.begin(spec(PeerId(0), &other)),
        Err(SendError::Failed(other, SendFailure::Stopped))
    );
    let added = tokio::time::timeout(BOUND, tx.add_receiver(addr))
        .await
        .expect("answers");
    assert!(matches!(added, Err(StartError::Stopped)), "{added:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_receiver_answers_stopped() {
    let env = Env::new(MemTransport::new(), MemFabric::new());
    let (leases, reader) = receiver(&env).await.into_ready_leases();
    reader.shutdown().await;
    for _ in 0..2 {
        // Whether the driver took the command before it stopped or not.
        assert_eq!(
            reader.lease(ready()).await.err(),
            Some(ConsumeError::Stopped)
        );
        assert_eq!(
            leases.take(4, None).await.err(),
            Some(ConsumeError::Stopped)
        );
        assert_eq!(
            reader.legacy_ready(&key()).await,
            Err(ConsumeError::Stopped)
        );
        assert_eq!(reader.snapshot().await, Err(ConsumeError::Stopped));
    }
    assert_eq!(
        ConsumeError::Stopped.to_string(),
        "this receiver has stopped (shut down, or its runtime ended): make a new receiver"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_sender_answers_stopped() {
    let env = Env::new(MemTransport::new(), MemFabric::new());
    let (tx, addr, req_id, _rx) = sender_with_request(&env).await;
    assert!(tx.close(BOUND).await, "the driver ends");
    assert_sender_stopped(&tx, addr, &req_id, &[]).await;
}

/// A driver that dies without a shutdown (its runtime dropped, as when an embedding program
/// tears its runtime down) is noticed too: no wait is left hanging on it.
#[test]
fn handles_whose_runtime_is_gone_answer_stopped() {
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let env = Env::new(MemTransport::new(), MemFabric::new());
    let (tx, addr, req_id, rx) = first.block_on(sender_with_request(&env));
    let reader = rx.reader().clone();
    drop(first);
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    second.block_on(async {
        assert_eq!(
            reader.lease(ready()).await.err(),
            Some(ConsumeError::Stopped)
        );
        // Both drivers were in the dropped runtime: the sender's may have seen its control
        // channel to the receiver close, and failed the request so, before it was dropped.
        assert_sender_stopped(&tx, addr, &req_id, &[SendFailure::ChannelLost]).await;
    });
}

/// A blocking allocate call asleep on staging hears its driver die with the runtime at once,
/// not at its timeout: the driver wakes every sleeper however it ends.
#[test]
#[allow(clippy::disallowed_methods)] // the test measures the wait with the wall clock
fn a_blocking_allocate_hears_its_driver_die_with_the_runtime() {
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let env = Env::new(MemTransport::new(), MemFabric::new());
    let (tx, addr, holder, _rx) = first.block_on(sender_with_request(&env));
    let (other, waiter) = (ReqId("other".into()), ReqId("waiter".into()));
    first.block_on(async {
        let peer = tx.add_receiver(addr).await.expect("the same receiver");
        for id in [&other, &waiter] {
            tx.begin(spec(peer, id)).expect("begins");
        }
        for id in [&holder, &other, &waiter] {
            tokio::time::timeout(BOUND, tx.admitted(id))
                .await
                .expect("answers")
                .expect("admitted");
        }
    });
    // Two requests' chunks fill staging (2 slots) and nobody submits them: the third
    // request's call sleeps.
    for id in [&holder, &other] {
        tx.allocate_blocking(id, &mut Vec::new(), BOUND)
            .expect("a free slot");
    }
    let started = std::time::Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            drop(first);
        });
        let got = tx.allocate_blocking(&waiter, &mut Vec::new(), BOUND);
        assert!(
            matches!(got, Err(SendError::Failed(_, SendFailure::Stopped))),
            "{got:?}"
        );
    });
    assert!(
        started.elapsed() < BOUND / 2,
        "the call waited {:?} for a driver that was gone",
        started.elapsed()
    );
}
