//! kvx's own ZMTP sockets against another implementation's, live on loopback: the `zeromq`
//! crate's ROUTER and PULL serve kvx's DEALER and PUSH, and its DEALER and PUSH talk to kvx's
//! ROUTER and PULL. (libzmq itself: the captured streams in `zmq_golden.rs` and the pyzmq
//! client in `crates/kvx-node/tests`.) Every wait is bounded.

use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::ClientEvent;
use kvx_io::Transport;
use kvx_transport::zmq::ZmqTransport;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const STEP: Duration = Duration::from_secs(10);

async fn step<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(STEP, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {STEP:?}"))
}

fn frames(message: ZmqMessage) -> Vec<Bytes> {
    message.into_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvx_dealer_and_push_to_zeromq_router_and_pull() {
    let t = ZmqTransport::default();
    let mut router = zeromq::RouterSocket::new();
    let bound = step("bind", router.bind("tcp://127.0.0.1:0"))
        .await
        .expect("bind");
    let mut client = t
        .connect(&bound.to_string(), "s0-to-r0")
        .await
        .expect("connect");
    client
        .send(Bytes::from_static(b"request"))
        .await
        .expect("send");
    let got = frames(step("request", router.recv()).await.expect("recv"));
    // The identity from kvx's READY, LMCache's empty delimiter, the payload.
    assert_eq!(got, [&b"s0-to-r0"[..], b"", b"request"]);
    let reply = ZmqMessage::try_from(vec![
        got[0].clone(),
        Bytes::new(),
        Bytes::from(vec![0x52; 300]), // a long frame
    ])
    .expect("frames");
    step("reply", router.send(reply)).await.expect("send");
    assert_eq!(
        step("reply", client.recv()).await,
        Some(ClientEvent::Message(Bytes::from(vec![0x52; 300])))
    );

    let mut pull = zeromq::PullSocket::new();
    let bound = step("bind", pull.bind("tcp://127.0.0.1:0"))
        .await
        .expect("bind");
    let sink = t.notify_sink(&bound.to_string()).await.expect("connect");
    sink.send(Bytes::from_static(b"notice"))
        .await
        .expect("send");
    let got = frames(step("notice", pull.recv()).await.expect("recv"));
    assert_eq!(got, [&b"notice"[..]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zeromq_dealer_and_push_to_kvx_router_and_pull() {
    let t = ZmqTransport::default();
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let mut options = zeromq::SocketOptions::default();
    options.peer_identity(b"their-dealer".to_vec().try_into().expect("identity"));
    let mut dealer = zeromq::DealerSocket::with_options(options);
    step("connect", dealer.connect(server.local_endpoint()))
        .await
        .expect("connect");
    let request =
        ZmqMessage::try_from(vec![Bytes::new(), Bytes::from_static(b"request")]).expect("frames");
    step("send", dealer.send(request)).await.expect("send");
    let (peer, payload) = step("request", server.recv()).await.expect("open");
    assert_eq!(payload, Bytes::from_static(b"request"));
    assert_eq!(
        t.peer_identity(peer),
        Some(Bytes::from_static(b"their-dealer"))
    );
    server
        .send(peer, Bytes::from_static(b"reply"))
        .await
        .expect("reply");
    let got = frames(step("reply", dealer.recv()).await.expect("recv"));
    assert_eq!(got, [&b""[..], b"reply"]);

    let mut source = t.notify_source("tcp://127.0.0.1:0").await.expect("bind");
    let mut push = zeromq::PushSocket::new();
    step("connect", push.connect(source.local_endpoint()))
        .await
        .expect("connect");
    step(
        "send",
        push.send(ZmqMessage::from(Bytes::from_static(b"notice"))),
    )
    .await
    .expect("send");
    assert_eq!(
        step("notice", source.recv()).await,
        Some(Bytes::from_static(b"notice"))
    );
}
