//! The proxy driver over real ZeroMQ on 127.0.0.1 counts a request's notices only from the
//! senders it is bound to (`docs/spec/protocol.md` §Proxy): under CURVE another allowed key's
//! forged `ProxyNotif` and `FailNotif` for a request are refused and counted while the
//! request's own key still completes it; without CURVE one PUSH connection's two notices
//! stand for one TP rank, not two. Every wait is bounded.

use std::time::Duration;

use bytes::Bytes;
use kvx_io::mem::MemFabric;
use kvx_io::{NotifySink, TokioEnv, Transport};
use kvx_node::{ProxyHandle, ProxyNode, ProxyOutcome};
use kvx_proto::proxy::ProxyFailure;
use kvx_proto::wire::{self, FailNotif, Message, ProxyNotif};
use kvx_proto::ProxyConfig;
use kvx_transport::zmq::{AllowList, CurveConfig, CurveKeyPair, ZmqConfig, ZmqTransport};
use tokio::sync::oneshot;

const STEP: Duration = Duration::from_secs(20);

async fn step<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(STEP, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {STEP:?}"))
}

fn zmq(curve: Option<CurveConfig>) -> ZmqTransport {
    ZmqTransport::new(ZmqConfig {
        curve: curve.map(Box::new),
        connect_timeout: Duration::from_secs(3),
        ..ZmqConfig::default()
    })
    .expect("valid")
}

async fn proxy(transport: ZmqTransport) -> ProxyHandle {
    let env = TokioEnv::new(transport, MemFabric::new());
    ProxyNode::start(env, ProxyConfig::default(), "tcp://127.0.0.1:0")
        .await
        .expect("proxy binds")
}

async fn send(sink: &NotifySink, msg: Message) {
    sink.send(Bytes::from(wire::encode(&msg)))
        .await
        .expect("notice queued");
}

fn notif(id: &str) -> Message {
    Message::ProxyNotif(ProxyNotif { req_id: id.into() })
}

/// Waits until every notice `sink` sent before has reached the tracker: a request of one
/// rank whose notice follows them on the same connection (FIFO) is ready.
async fn flushed(proxy: &ProxyHandle, sink: &NotifySink, marker: &str) {
    let ready = proxy.expect(marker.into(), 1).await.expect("awaited");
    send(sink, notif(marker)).await;
    let outcome = step(marker, ready).await.expect("an outcome");
    assert_eq!(outcome, Ok(()), "{marker}");
}

/// Waits (at most `STEP`) until the proxy has refused `want` notices in all, while the awaited
/// request stays undecided: a notice that should be refused and decided it instead fails the
/// test at once, saying how.
async fn refused(proxy: &ProxyHandle, want: u64, outcome: &mut oneshot::Receiver<ProxyOutcome>) {
    step("the refusals counted", async {
        while proxy.notices_refused() < want {
            if let Ok(decided) = outcome.try_recv() {
                panic!("a notice that should have been refused decided the request: {decided:?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(proxy.notices_refused(), want);
    assert!(
        matches!(outcome.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
        "the refused notices decided nothing"
    );
}

/// Two keys on the proxy's allow-list: B forges A's request ready and failed; both notices
/// are refused and counted, and A's own second rank, on another connection of A's key,
/// completes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_curve_another_allowed_keys_notices_are_refused_and_counted() {
    let (server, a, b) = (
        CurveKeyPair::generate(),
        CurveKeyPair::generate(),
        CurveKeyPair::generate(),
    );
    let allowed = AllowList::new([a.public(), b.public()]);
    let proxy = proxy(zmq(Some(CurveConfig {
        keys: server.clone(),
        allowed_clients: Some(allowed),
        server_key: None,
    })))
    .await;
    let client = |keys: &CurveKeyPair| {
        zmq(Some(CurveConfig {
            keys: keys.clone(),
            allowed_clients: None,
            server_key: Some(server.public()),
        }))
    };
    let (ta, tb) = (client(&a), client(&b));
    let endpoint = proxy.endpoint().to_owned();
    let a_rank0 = step("A's rank 0", ta.notify_sink(&endpoint))
        .await
        .expect("A connects");
    let b_sink = step("B", tb.notify_sink(&endpoint))
        .await
        .expect("B connects");

    let mut outcome = proxy.expect("a-req".into(), 2).await.expect("awaited");
    send(&a_rank0, notif("a-req")).await;
    flushed(&proxy, &a_rank0, "a-flushed").await;
    send(&b_sink, notif("a-req")).await;
    let forged = FailNotif {
        req_id: "a-req".into(),
        reason: "forged by B".into(),
    };
    send(&b_sink, Message::FailNotif(forged)).await;
    refused(&proxy, 2, &mut outcome).await;

    let a_rank1 = step("A's rank 1", ta.notify_sink(&endpoint))
        .await
        .expect("A connects again");
    send(&a_rank1, notif("a-req")).await;
    assert_eq!(step("a-req", outcome).await, Ok(Ok(())));
    assert_eq!(proxy.notices_refused(), 2);
}

/// Without CURVE one PUSH's two notices for a request of two ranks count once (the second
/// refused and counted); the other rank's own connection completes it. A failure from a
/// connection not heard from yet still fails a request: it may be the rank that failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_curve_one_connection_speaks_for_one_rank() {
    let proxy = proxy(zmq(None)).await;
    let t = zmq(None);
    let endpoint = proxy.endpoint().to_owned();
    let rank0 = step("rank 0", t.notify_sink(&endpoint))
        .await
        .expect("connects");
    let mut outcome = proxy.expect("r".into(), 2).await.expect("awaited");
    send(&rank0, notif("r")).await;
    send(&rank0, notif("r")).await;
    refused(&proxy, 1, &mut outcome).await;
    let rank1 = step("rank 1", t.notify_sink(&endpoint))
        .await
        .expect("connects");
    send(&rank1, notif("r")).await;
    assert_eq!(step("r", outcome).await, Ok(Ok(())));

    let failing = proxy.expect("f".into(), 2).await.expect("awaited");
    send(&rank0, notif("f")).await;
    let failure = FailNotif {
        req_id: "f".into(),
        reason: "rank 1 refused".into(),
    };
    send(&rank1, Message::FailNotif(failure)).await;
    assert_eq!(
        step("f", failing).await,
        Ok(Err(ProxyFailure::Reported("rank 1 refused".into())))
    );
}
