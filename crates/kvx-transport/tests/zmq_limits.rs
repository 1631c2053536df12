//! What a `ZmqTransport` ROUTER or PULL refuses from a hostile peer, with small limits so
//! that each bound is reached quickly, and the counter each refusal lands in
//! (`docs/spec/zmq.md` §3, §5). The same attacks against real `kvx` processes, with the
//! default limits, are `crates/kvx/tests/hostile_zmtp.rs`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvx_io::transport::{ClientEvent, ControlClient, ControlServer, TransportError};
use kvx_io::Transport;
use kvx_transport::zmq::{ZmqConfig, ZmqTransport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const STEP: Duration = Duration::from_secs(5);

fn small() -> ZmqConfig {
    ZmqConfig {
        connections_max: 4,
        handshake_timeout: Duration::from_millis(300),
        message_timeout: Duration::from_millis(300),
        ..ZmqConfig::default()
    }
}

/// Greeting and READY of a ZMTP 3.0 peer of `socket_type`, with `identity` if given.
fn hello(socket_type: &[u8], identity: Option<&[u8]>) -> Vec<u8> {
    let mut out = vec![0u8; 64];
    out[0] = 0xff;
    out[9] = 0x7f;
    out[10] = 3;
    out[12..16].copy_from_slice(b"NULL");
    let mut body = b"\x05READY".to_vec();
    let mut property = |name: &[u8], value: &[u8]| {
        body.push(name.len() as u8);
        body.extend_from_slice(name);
        body.extend_from_slice(&(value.len() as u32).to_be_bytes());
        body.extend_from_slice(value);
    };
    property(b"Socket-Type", socket_type);
    if let Some(identity) = identity {
        property(b"Identity", identity);
    }
    out.push(0x06); // COMMAND | LONG
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

async fn raw(endpoint: &str, bytes: &[u8]) -> TcpStream {
    let addr = endpoint.strip_prefix("tcp://").expect("tcp endpoint");
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(bytes).await.expect("write");
    tcp
}

/// How long until the server closes `tcp` (whatever it sends first is discarded), if it
/// does within `within`.
async fn closed_after(tcp: &mut TcpStream, within: Duration) -> Option<Duration> {
    let began = Instant::now();
    let mut sink = [0u8; 4096];
    tokio::time::timeout(within, async {
        loop {
            match tcp.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
    .map(|()| began.elapsed())
}

async fn round_trip(client: &mut ControlClient, server: &mut ControlServer, text: &'static str) {
    client
        .send(Bytes::from_static(text.as_bytes()))
        .await
        .expect("send");
    let (peer, payload) = tokio::time::timeout(STEP, server.recv())
        .await
        .expect("request within 5 s")
        .expect("server open");
    server.send(peer, payload).await.expect("reply");
    let got = tokio::time::timeout(STEP, client.recv())
        .await
        .expect("reply within 5 s");
    assert_eq!(
        got,
        Some(ClientEvent::Message(Bytes::from_static(text.as_bytes())))
    );
}

/// A second connection under an identity already connected is closed; the first keeps it
/// (and never sees a disconnect). libzmq's ROUTER does the same with ROUTER_HANDOVER off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_identity_is_refused_and_the_connected_dealer_keeps_it() {
    let t = ZmqTransport::new(small()).expect("valid");
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    let mut sender = t.connect(&endpoint, "sender-a").await.expect("connect");
    round_trip(&mut sender, &mut server, "before").await;
    for _ in 0..3 {
        let mut impostor = raw(&endpoint, &hello(b"DEALER", Some(b"sender-a"))).await;
        // Its request, sent at once, must never reach the server.
        impostor
            .write_all(&[0x01, 0x00, 0x00, 0x06, b'c', b'a', b'n', b'c', b'e', b'l'])
            .await
            .expect("write");
        assert!(closed_after(&mut impostor, STEP).await.is_some());
    }
    round_trip(&mut sender, &mut server, "after").await;
    assert_eq!(t.stats().identities_refused, 3);
    assert_eq!(
        t.stats().disconnects,
        0,
        "the sender never lost its connection"
    );
}

/// A kvx DEALER whose identity another connection holds hears why: the ROUTER answers its
/// READY with an ERROR command, and `connect` fails with `Refused` and the ROUTER's reason,
/// not with a connection that opens and then breaks. The holder keeps its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dealer_refused_its_identity_is_told_why() {
    let t = ZmqTransport::new(small()).expect("valid");
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    let mut sender = t.connect(&endpoint, "sender-a").await.expect("connect");
    let second = tokio::time::timeout(STEP, t.connect(&endpoint, "sender-a"))
        .await
        .expect("an answer within 5 s");
    match second {
        Err(TransportError::Refused { why, .. }) => {
            assert!(why.contains("another connection holds it"), "{why}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    round_trip(&mut sender, &mut server, "still here").await;
    assert_eq!(t.stats().identities_refused, 1);
    assert_eq!(t.stats().disconnects, 0);
}

/// Identities a ROUTER must not take from the wire: one beginning with a zero byte (the
/// ROUTER's own names for anonymous peers) and one over 255 bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_and_overlong_identities_are_refused() {
    let t = ZmqTransport::new(small()).expect("valid");
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    for identity in [&[0u8, 0, 0, 0, 1][..], &[0, b'x'], &[b'y'; 256]] {
        let mut attacker = raw(&endpoint, &hello(b"DEALER", Some(identity))).await;
        assert!(closed_after(&mut attacker, STEP).await.is_some());
    }
    assert_eq!(t.stats().identities_refused, 3);
    let mut longest = raw(&endpoint, &hello(b"DEALER", Some(&[b'z'; 255]))).await;
    longest
        .write_all(&[0x01, 0x00, 0x00, 0x02, b'o', b'k'])
        .await
        .expect("write");
    let (peer, payload) = tokio::time::timeout(STEP, server.recv())
        .await
        .expect("within 5 s")
        .expect("open");
    assert_eq!(payload, Bytes::from_static(b"ok"));
    assert_eq!(t.peer_identity(peer).map(|i| i.len()), Some(255));
}

/// Past `connections_max` a newcomer is taken and the quietest connection is closed for it:
/// of those that never sent a message, the oldest first; one that has talked keeps its place.
/// On the ROUTER and the PULL alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_cap_the_quietest_connection_is_closed_for_a_newcomer() {
    let t = ZmqTransport::new(small()).expect("valid");
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let mut source = t.notify_source("tcp://127.0.0.1:0").await.expect("bind");
    let (router, pull) = (
        server.local_endpoint().to_owned(),
        source.local_endpoint().to_owned(),
    );
    let mut evicted = 0;
    for (endpoint, kind) in [(router.as_str(), &b"DEALER"[..]), (pull.as_str(), b"PUSH")] {
        let mut held = Vec::new();
        for i in 0..4u8 {
            held.push(raw(endpoint, &hello(kind, Some(&[b'a' + i]))).await);
        }
        // The first one talks: a message ("hi"; after an empty delimiter to a ROUTER).
        let message: &[u8] = if kind == b"DEALER" {
            &[0x01, 0x00, 0x00, 0x02, b'h', b'i']
        } else {
            &[0x00, 0x02, b'h', b'i']
        };
        held[0].write_all(message).await.expect("write");
        if kind == b"DEALER" {
            let (_, got) = tokio::time::timeout(STEP, server.recv())
                .await
                .expect("within 5 s")
                .expect("open");
            assert_eq!(got, Bytes::from_static(b"hi"));
        } else {
            let got = tokio::time::timeout(STEP, source.recv())
                .await
                .expect("within 5 s")
                .expect("open");
            assert_eq!(got, Bytes::from_static(b"hi"));
        }
        for (newcomer, quietest) in [(b"new-1", 1), (b"new-2", 2)] {
            let mut new = raw(endpoint, &hello(kind, Some(newcomer))).await;
            let after = closed_after(&mut held[quietest], STEP)
                .await
                .expect("closed");
            assert!(after < Duration::from_secs(1), "at once: {after:?}");
            evicted += 1;
            assert!(
                closed_after(&mut new, Duration::from_millis(100))
                    .await
                    .is_none(),
                "the newcomer is kept"
            );
            held.push(new);
        }
        assert!(
            closed_after(&mut held[0], Duration::from_millis(100))
                .await
                .is_none(),
            "the connection that talked keeps its place"
        );
        assert_eq!(t.stats().connections_refused, evicted);
    }
}

/// A connection that says nothing, or trickles its greeting, is closed after
/// `handshake_timeout`; one that starts a message and trickles it, after `message_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_handshakes_and_slow_messages_are_cut_off() {
    let t = ZmqTransport::new(small()).expect("valid");
    let server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    let mut silent = raw(&endpoint, b"").await;
    let after = closed_after(&mut silent, STEP).await.expect("closed");
    assert!(after >= Duration::from_millis(250), "{after:?}");
    assert_eq!(t.stats().handshakes_failed, 1);

    let mut slow = raw(&endpoint, &hello(b"DEALER", Some(b"slow"))).await;
    // A 64 KiB frame after the delimiter, of which one byte arrives every 50 ms.
    slow.write_all(&[0x01, 0x00, 0x02]).await.expect("write");
    slow.write_all(&(64u64 << 10).to_be_bytes())
        .await
        .expect("write");
    let began = Instant::now();
    let mut cut_off = false;
    for _ in 0..100 {
        if slow.write_all(&[0x55]).await.is_err() || t.stats().messages_timed_out == 1 {
            cut_off = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(cut_off, "cut off within 5 s");
    assert!(began.elapsed() >= Duration::from_millis(250));
    assert!(closed_after(&mut slow, STEP).await.is_some());
    assert_eq!(t.stats().messages_timed_out, 1);
}

/// A peer cycling through new identities fills the identity table (`peers_max`); a sender
/// whose connection holds its identity keeps its `PeerId` however long it was quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connected_senders_peer_id_outlives_identities_cycling_through_the_table() {
    let t = ZmqTransport::new(ZmqConfig {
        peers_max: 4,
        ..small()
    })
    .expect("valid");
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    let sender = t.connect(&endpoint, "quiet-sender").await.expect("connect");
    sender
        .send(Bytes::from_static(b"first"))
        .await
        .expect("send");
    let (first, _) = tokio::time::timeout(STEP, server.recv())
        .await
        .expect("within 5 s")
        .expect("open");
    for i in 0..12u8 {
        let mut cycling = raw(&endpoint, &hello(b"DEALER", Some(&[b'c', i]))).await;
        cycling
            .write_all(&[0x01, 0x00, 0x00, 0x01, i])
            .await
            .expect("write");
        let (_, payload) = tokio::time::timeout(STEP, server.recv())
            .await
            .expect("within 5 s")
            .expect("open");
        assert_eq!(payload, Bytes::copy_from_slice(&[i]));
    }
    sender
        .send(Bytes::from_static(b"again"))
        .await
        .expect("send");
    let (again, _) = tokio::time::timeout(STEP, server.recv())
        .await
        .expect("within 5 s")
        .expect("open");
    assert_eq!(again, first, "the same PeerId");
    assert_eq!(
        t.peer_identity(first),
        Some(Bytes::from_static(b"quiet-sender"))
    );
}

/// Messages a ROUTER's handle has not taken yet hold at most `inbound_bytes_max` (here
/// 4 MiB): four DEALERs each send 64 messages of 1 MiB to a handle that reads nothing, and
/// their writes stall once the budget, one message per connection and the kernel's socket
/// buffers are full, instead of the queue taking `CHANNEL_DEPTH` (1024) messages. Once the
/// handle reads, every message arrives, in order per connection: nothing is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn received_messages_wait_within_the_inbound_budget_and_none_is_lost() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    const CONNECTIONS: u64 = 4;
    const MESSAGES: u64 = 64;
    const MIB: usize = 1 << 20;
    let t = ZmqTransport::new(ZmqConfig {
        inbound_bytes_max: 4 * MIB,
        message_timeout: Duration::from_secs(30),
        ..ZmqConfig::default()
    })
    .expect("valid");
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    let written = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::new();
    for c in 0..CONNECTIONS {
        let identity = format!("flood-{c}");
        let mut tcp = raw(&endpoint, &hello(b"DEALER", Some(identity.as_bytes()))).await;
        let written = written.clone();
        writers.push(tokio::spawn(async move {
            for m in 0..MESSAGES {
                // ["", payload]: the payload's first bytes say whose and which it is.
                let mut message = vec![0x01, 0x00, 0x02];
                message.extend_from_slice(&(MIB as u64).to_be_bytes());
                let mut payload = vec![0u8; MIB];
                payload[..16].copy_from_slice(&[c.to_le_bytes(), m.to_le_bytes()].concat());
                message.extend_from_slice(&payload);
                tcp.write_all(&message).await.expect("write");
                written.fetch_add(1, Ordering::Relaxed);
            }
            tcp
        }));
    }
    // Wait until the writers stall: no progress for a second (bounded: 30 s).
    let began = Instant::now();
    let mut last = u64::MAX;
    while began.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = written.load(Ordering::Relaxed);
        if now == last || now == CONNECTIONS * MESSAGES {
            break;
        }
        last = now;
    }
    let stalled_at = written.load(Ordering::Relaxed);
    eprintln!("writers stalled after {stalled_at} MiB");
    assert!(
        stalled_at < CONNECTIONS * MESSAGES / 2,
        "{stalled_at} of {} MiB were taken while the handle read nothing",
        CONNECTIONS * MESSAGES
    );
    let mut next = [0u64; CONNECTIONS as usize];
    for _ in 0..CONNECTIONS * MESSAGES {
        let (_, payload) = tokio::time::timeout(STEP, server.recv())
            .await
            .expect("a message within 5 s")
            .expect("server open");
        let c = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes")) as usize;
        let m = u64::from_le_bytes(payload[8..16].try_into().expect("8 bytes"));
        assert_eq!(m, next[c], "connection {c}'s messages in order");
        next[c] += 1;
    }
    for w in writers {
        tokio::time::timeout(STEP, w)
            .await
            .expect("writer done")
            .expect("writer ok");
    }
}
