//! Heartbeats on the alloc channel (`docs/spec/zmq.md` §5): a kvx DEALER pings a kvx ROUTER
//! every `heartbeat_interval`, the ROUTER answers with PONG, and each holds the other to
//! `heartbeat_timeout`. What they find is a peer whose process is stopped or hung: its kernel
//! keeps acknowledging bytes, so neither TCP's timers nor EOF ever would. Raw TCP peers play
//! the hung side: they complete the handshake, announce heartbeats, and then say nothing.
//! Every wait is bounded.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvx_io::transport::{ClientEvent, Inbound};
use kvx_io::Transport;
use kvx_transport::zmq::{AllowList, CurveConfig, CurveKeyPair, ZmqConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const INTERVAL: Duration = Duration::from_millis(100);
const LIVENESS: Duration = Duration::from_millis(500);

mod zmq_common;
use zmq_common::{step, transport};

/// `zmq_common::quick`, with heartbeats ten times as fast.
fn quick() -> ZmqConfig {
    ZmqConfig {
        heartbeat_interval: INTERVAL,
        heartbeat_timeout: LIVENESS,
        ..zmq_common::quick()
    }
}

/// A NULL greeting (ZMTP 3.0) and a READY of `socket_type` with `props`, as raw bytes.
fn handshake(socket_type: &[u8], props: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = vec![0u8; 64];
    out[0] = 0xff;
    out[8] = 0x01;
    out[9] = 0x7f;
    out[10] = 3;
    out[12..16].copy_from_slice(b"NULL");
    let mut body = b"\x05READY".to_vec();
    let all = std::iter::once((&b"Socket-Type"[..], socket_type)).chain(props.iter().copied());
    for (name, value) in all {
        body.push(name.len() as u8);
        body.extend_from_slice(name);
        body.extend_from_slice(&(value.len() as u32).to_be_bytes());
        body.extend_from_slice(value);
    }
    out.extend_from_slice(&[0x04, body.len() as u8]);
    out.extend_from_slice(&body);
    out
}

/// A ROUTER that handshakes (announcing heartbeats, or not) and then neither reads nor
/// answers anything, as a stopped process looks from outside. Returns its endpoint.
async fn hung_router(announce: bool) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("tcp://{}", listener.local_addr().expect("addr"));
    let props: &[(&[u8], &[u8])] = if announce {
        &[(b"X-Kvx-Heartbeat", b"1")]
    } else {
        &[]
    };
    let hello = handshake(b"ROUTER", props);
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        for _ in 0..4 {
            let Ok((mut tcp, _)) = listener.accept().await else {
                return;
            };
            let _ = tcp.write_all(&hello).await;
            held.push(tcp);
        }
        std::future::pending::<()>().await;
    });
    (endpoint, task)
}

/// A kvx DEALER gives up a ROUTER that announced heartbeats and then fell silent, after
/// `heartbeat_timeout` and with nothing outstanding, and reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_router_is_given_up_after_the_heartbeat_timeout() {
    let (endpoint, hung) = hung_router(true).await;
    let t = transport(quick());
    let start = Instant::now();
    let mut client = t.connect(&endpoint, "sender-h").await.expect("connect");
    assert_eq!(
        step("give up", client.recv()).await,
        Some(ClientEvent::Disconnected)
    );
    let took = start.elapsed();
    assert!(took >= LIVENESS, "gave up after {took:?}");
    assert!(took < LIVENESS * 4, "gave up only after {took:?}");
    assert_eq!(t.stats().peers_silent, 1);
    hung.abort();
}

/// A ROUTER that announces nothing (libzmq's, LMCache's) is never pinged nor held to the
/// deadline: an idle connection to it stays up well past `heartbeat_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_announces_nothing_is_not_held_to_heartbeats() {
    let (endpoint, quiet) = hung_router(false).await;
    let t = transport(quick());
    let mut client = t.connect(&endpoint, "sender-q").await.expect("connect");
    let idle = tokio::time::timeout(LIVENESS * 4, client.recv()).await;
    assert!(idle.is_err(), "an event on an idle connection: {idle:?}");
    assert_eq!(t.stats().peers_silent, 0);
    quiet.abort();
}

/// A DEALER that announced heartbeats, spoke, and then fell silent is lost to the ROUTER
/// (`Inbound::Lost`) after `heartbeat_timeout`: a receiver fails its requests then instead
/// of at `request_idle_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_dealer_is_lost_after_the_heartbeat_timeout() {
    let t = transport(quick());
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("bind");
    let addr = server
        .local_endpoint()
        .trim_start_matches("tcp://")
        .to_owned();
    let mut tcp = TcpStream::connect(&addr).await.expect("connect");
    let mut hello = handshake(
        b"DEALER",
        &[(b"Identity", b"hung-dealer"), (b"X-Kvx-Heartbeat", b"1")],
    );
    hello.extend_from_slice(&[0x01, 0x00, 0x00, 0x05]); // ["", "hello"]
    hello.extend_from_slice(b"hello");
    tcp.write_all(&hello).await.expect("write");
    let Some(Inbound::Message(peer, payload)) = step("message", server.next()).await else {
        panic!("no message");
    };
    assert_eq!(payload, Bytes::from_static(b"hello"));
    let silent_from = Instant::now();
    assert_eq!(step("lost", server.next()).await, Some(Inbound::Lost(peer)));
    let took = silent_from.elapsed();
    assert!(took >= LIVENESS / 2, "lost after {took:?}");
    assert!(took < LIVENESS * 4, "lost only after {took:?}");
    assert_eq!(t.stats().peers_silent, 1);
    // The ROUTER closed the connection.
    let mut rest = Vec::new();
    let read = step("close", tcp.read_to_end(&mut rest)).await;
    assert!(read.is_ok() || read.is_err(), "closed");
}

/// A kvx DEALER and a kvx ROUTER keep an idle connection for many deadlines: every PING is
/// answered, under NULL and under CURVE (heartbeats inside MESSAGE boxes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvx_peers_keep_an_idle_connection_under_null_and_curve() {
    let (server_keys, client_keys) = (CurveKeyPair::generate(), CurveKeyPair::generate());
    let server_curve = CurveConfig {
        keys: server_keys.clone(),
        allowed_clients: Some(AllowList::new([client_keys.public()])),
        server_key: None,
    };
    let client_curve = CurveConfig {
        keys: client_keys,
        allowed_clients: None,
        server_key: Some(server_keys.public()),
    };
    for (server_side, client_side) in [(None, None), (Some(server_curve), Some(client_curve))] {
        let ts = transport(ZmqConfig {
            curve: server_side.map(Box::new),
            ..quick()
        });
        let tc = transport(ZmqConfig {
            curve: client_side.map(Box::new),
            ..quick()
        });
        let mut server = ts.serve("tcp://127.0.0.1:0").await.expect("bind");
        let mut client = step("connect", tc.connect(server.local_endpoint(), "idle-s"))
            .await
            .expect("connect");
        client.send(Bytes::from_static(b"one")).await.expect("send");
        let Some(Inbound::Message(peer, _)) = step("request", server.next()).await else {
            panic!("no request");
        };
        let idle = tokio::time::timeout(LIVENESS * 5, client.recv()).await;
        assert!(idle.is_err(), "an event on an idle connection: {idle:?}");
        let lost = tokio::time::timeout(Duration::from_millis(10), server.next()).await;
        assert!(lost.is_err(), "the ROUTER lost a live peer: {lost:?}");
        server
            .send(peer, Bytes::from_static(b"still here"))
            .await
            .expect("reply");
        assert_eq!(
            step("reply", client.recv()).await,
            Some(ClientEvent::Message(Bytes::from_static(b"still here")))
        );
        assert_eq!((ts.stats().peers_silent, tc.stats().peers_silent), (0, 0));
        assert_eq!((ts.stats().disconnects, tc.stats().disconnects), (0, 0));
    }
}

#[test]
fn heartbeat_settings_are_validated() {
    let late = ZmqConfig {
        heartbeat_interval: Duration::from_secs(3),
        heartbeat_timeout: Duration::from_secs(4),
        ..ZmqConfig::default()
    };
    let err = late.validate().expect_err("refused");
    assert!(err.to_string().contains("heartbeat_timeout"), "{err}");
    let zero = ZmqConfig {
        heartbeat_interval: Duration::ZERO,
        ..ZmqConfig::default()
    };
    assert!(zero.validate().is_err());
}
