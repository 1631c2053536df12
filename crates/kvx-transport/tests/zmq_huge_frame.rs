//! A peer that announces a huge ZMTP frame must not take a kvx process down
//! (`docs/spec/zmq.md` §6). zeromq 0.7 reserves a frame's announced length before reading it,
//! so on its sockets nine bytes announcing 1 TiB abort the process ("memory allocation of …
//! bytes failed"); these tests did exactly that before kvx read ZMTP itself. Now the
//! attacker's connection is closed, and everyone else is served: on the bound sockets (ROUTER,
//! PULL) and on a DEALER whose "receiver" is the attacker.

use std::fs;
use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::ClientEvent;
use kvx_io::Transport;
use kvx_transport::zmq::ZmqConfig;
use kvx_transport::zmq::ZmqTransport;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const C2S: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/golden/zmtp_alloc_conn0_c2s.hex"
);

const PUSH_C2S: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/golden/zmtp_proxy_conn0_c2s.hex"
);

/// A captured client stream's greeting and first command (READY), then the 9-byte header of a
/// long frame announcing 1 TiB (after an empty delimiter frame when `delimiter`).
fn attack(golden: &str, delimiter: bool) -> Vec<u8> {
    let text = fs::read_to_string(golden).expect("golden stream (is shared/ beside the checkout?)");
    let c2s = hex::decode(text.trim()).expect("hex");
    let handshake = &c2s[..64 + 2 + usize::from(c2s[65])];
    let mut attack = handshake.to_vec();
    if delimiter {
        attack.extend_from_slice(&[0x01, 0x00]);
    }
    attack.push(0x02);
    attack.extend_from_slice(&(1u64 << 40).to_be_bytes());
    attack
}

/// Sends `attack` to `endpoint` and checks that the connection gets closed.
async fn attacker_is_dropped(endpoint: &str, attack: &[u8]) {
    let addr = endpoint.strip_prefix("tcp://").expect("tcp endpoint");
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(attack).await.expect("write");
    let mut sink = vec![0u8; 4096];
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match tcp.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // the server's greeting and READY
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the attacker's connection is closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_survives_a_frame_header_announcing_a_terabyte() {
    let t = ZmqTransport::default();
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    attacker_is_dropped(&endpoint, &attack(C2S, true)).await;

    // Everyone else is still served.
    let client = t.connect(&endpoint, "honest").await.expect("connect");
    client.send(Bytes::from_static(b"hi")).await.expect("send");
    let got = tokio::time::timeout(Duration::from_secs(10), server.recv())
        .await
        .expect("the server answers within 10 s");
    assert_eq!(got.map(|(_, p)| p), Some(Bytes::from_static(b"hi")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_survives_a_frame_header_announcing_a_terabyte() {
    let t = ZmqTransport::default();
    let mut source = t.notify_source("tcp://127.0.0.1:0").await.expect("bind");
    let endpoint = source.local_endpoint().to_owned();
    attacker_is_dropped(&endpoint, &attack(PUSH_C2S, false)).await;

    let sink = t.notify_sink(&endpoint).await.expect("connect");
    sink.send(Bytes::from_static(b"notice"))
        .await
        .expect("send");
    let got = tokio::time::timeout(Duration::from_secs(10), source.recv())
        .await
        .expect("the notice arrives within 10 s");
    assert_eq!(got, Some(Bytes::from_static(b"notice")));
}

/// What a ROUTER sends first (captured from LMCache's receiver): greeting and READY.
const S2C: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/golden/zmtp_alloc_conn0_s2c.hex"
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dealer_survives_a_router_announcing_a_terabyte() {
    let config = ZmqConfig {
        reconnect_backoff_min: Duration::from_millis(20),
        reconnect_backoff_max: Duration::from_millis(100),
        ..ZmqConfig::default()
    };
    let t = ZmqTransport::new(config).expect("valid");
    // The "receiver": a captured ROUTER handshake, then a 1 TiB reply frame once a request
    // arrives.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("tcp://{}", listener.local_addr().expect("addr"));
    let attacker = tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.expect("accept");
        tcp.write_all(&attack(S2C, true)).await.expect("write");
        let mut sink = vec![0u8; 4096];
        // Held open until the DEALER hangs up.
        while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {}
        listener
    });
    let mut client = t.connect(&endpoint, "victim").await.expect("connect");
    client.send(Bytes::from_static(b"hi")).await.expect("send");
    let got = tokio::time::timeout(Duration::from_secs(10), client.recv())
        .await
        .expect("the DEALER reacts within 10 s");
    assert_eq!(got, Some(ClientEvent::Disconnected));
    let listener = tokio::time::timeout(Duration::from_secs(10), attacker)
        .await
        .expect("the DEALER hung up")
        .expect("attacker task");
    drop(listener);
    assert_eq!(t.stats().disconnects, 1);
}
