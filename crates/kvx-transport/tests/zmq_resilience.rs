//! `ZmqTransport` when things go wrong, on loopback: a receiver that restarts, a receiver
//! that stops answering, peers that cannot be reached, oversize frames and malformed
//! multipart messages. Every wait is bounded.

use std::fs;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvx_io::transport::{
    ClientEvent, ControlClient, ControlServer, TransportError, DISCONNECT_ACK,
};
use kvx_io::Transport;
use kvx_proto::wire::DEFAULT_FRAME_MAX_BYTES;
use kvx_transport::zmq::{ZmqConfig, ZmqTransport};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use zeromq::{Socket, SocketSend, ZmqMessage};

mod zmq_common;
use zmq_common::{quick, serve_again, step, transport};

async fn event(client: &mut ControlClient, what: &str) -> ClientEvent {
    step(what, client.recv()).await.expect("client open")
}

async fn round_trip(client: &mut ControlClient, server: &mut ControlServer, text: &'static str) {
    client
        .send(Bytes::from_static(text.as_bytes()))
        .await
        .expect("send");
    let (peer, payload) = step("request", server.recv()).await.expect("server open");
    assert_eq!(payload, Bytes::from_static(text.as_bytes()));
    server.send(peer, payload).await.expect("reply");
    assert_eq!(
        event(client, "reply").await,
        ClientEvent::Message(Bytes::from_static(text.as_bytes()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dealer_reconnects_after_the_router_restarts() {
    let t = transport(quick());
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    let mut client = t.connect(&endpoint, "sender-a").await.expect("connect");
    client
        .send(Bytes::from_static(b"before"))
        .await
        .expect("send");
    let (peer, _) = step("request", server.recv()).await.expect("open");
    server
        .send(peer, Bytes::from_static(b"re:before"))
        .await
        .expect("reply");
    assert_eq!(
        event(&mut client, "reply").await,
        ClientEvent::Message(Bytes::from_static(b"re:before"))
    );

    drop(server);
    assert_eq!(
        event(&mut client, "disconnect").await,
        ClientEvent::Disconnected
    );
    let mut server = serve_again(&t, &endpoint).await;
    assert_eq!(
        event(&mut client, "reconnect").await,
        ClientEvent::Reconnected
    );

    // Reconnected, but the disconnect is not acknowledged yet: as far as the DEALER knows,
    // this payload was sent before its sender failed its requests, so it must not reach the
    // new connection (a serial receiver's reply to it would answer a later request).
    client
        .send(Bytes::from_static(b"stale"))
        .await
        .expect("send");
    client.send(DISCONNECT_ACK).await.expect("ack");
    client
        .send(Bytes::from_static(b"after"))
        .await
        .expect("send");
    let (again, payload) = step("request", server.recv()).await.expect("open");
    assert_eq!(
        payload,
        Bytes::from_static(b"after"),
        "only what follows the acknowledgement is delivered"
    );
    assert_eq!(
        again, peer,
        "the sender keeps its PeerId across the reconnect"
    );
    server
        .send(again, Bytes::from_static(b"re:after"))
        .await
        .expect("reply");
    assert_eq!(
        event(&mut client, "reply").await,
        ClientEvent::Message(Bytes::from_static(b"re:after"))
    );
    let stats = t.stats();
    assert_eq!((stats.disconnects, stats.reconnects), (1, 1), "{stats:?}");
    assert_eq!(stats.dropped_while_down, 1, "{stats:?}");
}

/// The receiver stays away for several connect timeouts: the DEALER keeps trying, with
/// backoff, and comes back when the receiver does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dealer_outlasts_an_outage_longer_than_the_connect_timeout() {
    let config = ZmqConfig {
        connect_timeout: Duration::from_millis(200),
        ..quick()
    };
    let t = transport(config);
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    let mut client = t.connect(&endpoint, "sender-b").await.expect("connect");
    round_trip(&mut client, &mut server, "one").await;
    drop(server);
    assert_eq!(
        event(&mut client, "disconnect").await,
        ClientEvent::Disconnected
    );
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    // Sent while down: dropped, counted, never delivered later.
    client
        .send(Bytes::from_static(b"lost"))
        .await
        .expect("send");
    client.send(DISCONNECT_ACK).await.expect("ack");
    let mut server = serve_again(&t, &endpoint).await;
    assert_eq!(
        event(&mut client, "reconnect").await,
        ClientEvent::Reconnected
    );
    round_trip(&mut client, &mut server, "two").await;
    assert!(t.stats().dropped_while_down >= 1, "{:?}", t.stats());
}

/// A receiver that accepts, handshakes and then never answers (as a half-open connection
/// would look): after `recv_timeout` the DEALER gives the connection up and opens a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_receiver_is_given_up_after_the_recv_timeout() {
    let s2c = hex::decode(
        fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/golden/zmtp_alloc_conn0_s2c.hex"
        ))
        .expect("golden s2c stream (is shared/ beside the checkout?)")
        .trim(),
    )
    .expect("hex");
    // The captured ROUTER's greeting and READY, without its messages.
    let handshake = s2c[..64 + 2 + usize::from(s2c[65])].to_vec();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("tcp://{}", listener.local_addr().expect("addr"));
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        for _ in 0..2 {
            let (mut tcp, _) = listener.accept().await.expect("accept");
            tcp.write_all(&handshake).await.expect("handshake");
            held.push(tcp);
        }
        // Hold both connections open, reading nothing, until the test ends.
        std::future::pending::<()>().await;
        drop(held);
    });

    let recv_timeout = Duration::from_millis(300);
    let t = transport(ZmqConfig {
        recv_timeout,
        ..quick()
    });
    let mut client = t.connect(&endpoint, "sender-c").await.expect("connect");
    let start = Instant::now();
    client
        .send(Bytes::from_static(b"anyone?"))
        .await
        .expect("send");
    assert_eq!(
        event(&mut client, "give up").await,
        ClientEvent::Disconnected
    );
    assert!(
        start.elapsed() >= recv_timeout,
        "gave up after {:?}",
        start.elapsed()
    );
    assert_eq!(
        event(&mut client, "reconnect").await,
        ClientEvent::Reconnected
    );
    silent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_is_bounded() {
    let connect_timeout = Duration::from_millis(300);
    let t = transport(ZmqConfig {
        connect_timeout,
        ..quick()
    });
    // A listener that never accepts: TCP connects (the kernel's backlog), ZMTP never starts.
    let mute = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("tcp://{}", mute.local_addr().expect("addr"));
    let start = Instant::now();
    let result = step("connect to a mute peer", t.connect(&endpoint, "sender-d")).await;
    assert!(
        matches!(
            result,
            Err(TransportError::Timeout {
                what: "connect",
                ..
            })
        ),
        "{result:?}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    let result = step("PUSH to a mute peer", t.notify_sink(&endpoint)).await;
    assert!(
        matches!(result, Err(TransportError::Timeout { .. })),
        "{result:?}"
    );

    // Nothing listening: refused connects are retried until the timeout, then it fails.
    let port = {
        let gone = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        gone.local_addr().expect("addr").port()
    };
    let result = step(
        "connect to nobody",
        t.connect(&format!("tcp://127.0.0.1:{port}"), "sender-d"),
    )
    .await;
    assert!(result.is_err(), "{result:?}");

    let bad = t.connect("tcp://127.0.0.1:1", "").await;
    assert!(
        matches!(bad, Err(TransportError::Refused { .. })),
        "{bad:?}"
    );
    let bad = t.serve("udp://127.0.0.1:0").await;
    assert!(
        matches!(bad, Err(TransportError::Endpoint { .. })),
        "{bad:?}"
    );
}

/// A frame over the limit is dropped where it arrives, in either direction; the connection
/// and everyone else carry on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_frames_are_dropped_and_serving_continues() {
    let server_side = ZmqTransport::default();
    let client_side = transport(ZmqConfig {
        frame_max_bytes: 1024,
        ..quick()
    });
    let mut server = server_side.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    let mut big_sender = client_side
        .connect(&endpoint, "big")
        .await
        .expect("connect");
    let mut other = client_side
        .connect(&endpoint, "other")
        .await
        .expect("connect");

    let too_big = Bytes::from(vec![0x42; DEFAULT_FRAME_MAX_BYTES + 1]);
    big_sender.send(too_big).await.expect("send");
    round_trip(&mut other, &mut server, "still served").await;
    round_trip(&mut big_sender, &mut server, "and so is the big sender").await;
    assert_eq!(server_side.stats().oversize_dropped, 1);

    // A reply over the client's 1 KiB limit is dropped by the DEALER, which carries on.
    other.send(Bytes::from_static(b"q")).await.expect("send");
    let (peer, _) = step("request", server.recv()).await.expect("open");
    server
        .send(peer, Bytes::from(vec![0x43; 1025]))
        .await
        .expect("reply");
    server
        .send(peer, Bytes::from_static(b"small"))
        .await
        .expect("reply");
    assert_eq!(
        event(&mut other, "small reply").await,
        ClientEvent::Message(Bytes::from_static(b"small"))
    );
    assert_eq!(client_side.stats().oversize_dropped, 1);
    assert_eq!(server_side.stats().disconnects, 0);
}

/// Multipart shapes no LMCache or kvx peer sends are dropped; the connection carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_multipart_messages_are_dropped() {
    let t = ZmqTransport::default();
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let mut raw = zeromq::DealerSocket::new();
    step("raw connect", raw.connect(server.local_endpoint()))
        .await
        .expect("raw connect");
    let message = |frames: &[&'static [u8]]| {
        let frames: Vec<Bytes> = frames.iter().map(|f| Bytes::from_static(f)).collect();
        ZmqMessage::try_from(frames).expect("frames")
    };
    for frames in [
        &[&b"x"[..], b"payload"][..],
        &[b"", b"", b"payload"],
        &[b"", b"ok"],
    ] {
        step("raw send", raw.send(message(frames)))
            .await
            .expect("raw send");
    }
    let (_, payload) = step("request", server.recv()).await.expect("open");
    assert_eq!(payload, Bytes::from_static(b"ok"));
    assert_eq!(t.stats().malformed_dropped, 2);
}

/// The PUSH side comes back too when the proxy's PULL restarts, and notices the restart by
/// itself: once it has reconnected, the very next notice arrives. (zeromq 0.7's PUSH never
/// read its connection and noticed only on a failed write, losing the notices before it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_reconnects_after_the_pull_restarts() {
    let t = transport(quick());
    let mut source = t.notify_source("tcp://127.0.0.1:0").await.expect("bind");
    let endpoint = source.local_endpoint().to_owned();
    let sink = t.notify_sink(&endpoint).await.expect("sink");
    sink.send(Bytes::from_static(b"n0")).await.expect("send");
    assert_eq!(
        step("notice", source.recv()).await,
        Some(Bytes::from_static(b"n0"))
    );
    drop(source);
    let mut source = None;
    for _ in 0..100 {
        match t.notify_source(&endpoint).await {
            Ok(s) => {
                source = Some(s);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let mut source = source.expect("PULL bound again");
    // No notice is sent until the PUSH has found the new PULL on its own.
    step("PUSH reconnect", async {
        while t.stats().reconnects == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    sink.send(Bytes::from_static(b"n1")).await.expect("send");
    assert_eq!(
        step("notice after the restart", source.recv()).await,
        Some(Bytes::from_static(b"n1"))
    );
    assert_eq!(t.stats().dropped_while_down, 0, "{:?}", t.stats());
}

/// Replies to a peer that is not reading pile up behind its socket (the ROUTER's writer task
/// takes over from the direct writes); once it reads, every reply arrives, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_to_a_slow_reader_arrive_in_order() {
    let t = transport(quick());
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let mut client = t
        .connect(server.local_endpoint(), "slow")
        .await
        .expect("connect");
    client.send(Bytes::from_static(b"hi")).await.expect("send");
    let (peer, _) = step("request", server.recv()).await.expect("open");
    // More than the client's event channel (1024) and its socket buffers hold.
    const REPLIES: u32 = 1500;
    let reply = |i: u32| {
        let mut r = vec![(i % 251) as u8; 64 << 10];
        r[..4].copy_from_slice(&i.to_be_bytes());
        Bytes::from(r)
    };
    for i in 0..REPLIES {
        step("queue a reply", server.send(peer, reply(i)))
            .await
            .expect("reply");
    }
    for i in 0..REPLIES {
        assert_eq!(
            event(&mut client, "reply").await,
            ClientEvent::Message(reply(i)),
            "reply {i}"
        );
    }
    assert_eq!(t.stats().send_timeouts, 0);
    assert_eq!(t.stats().disconnects, 0);
}

/// Silence is counted from when a request went out, not from an earlier reply: a request
/// sent after a quiet spell and answered within `recv_timeout` keeps the connection (it once
/// broke it, `recv_timeout` after the previous request, because the writer had not noticed
/// that reply).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_answered_within_the_recv_timeout_keeps_the_connection() {
    let recv_timeout = Duration::from_millis(300);
    let t = transport(ZmqConfig {
        recv_timeout,
        ..quick()
    });
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let mut client = t
        .connect(server.local_endpoint(), "sender-d")
        .await
        .expect("connect");
    round_trip(&mut client, &mut server, "a").await;
    tokio::time::sleep(recv_timeout / 3).await;
    client.send(Bytes::from_static(b"b")).await.expect("send");
    let (peer, b) = step("b", server.recv()).await.expect("open");
    assert_eq!(b, Bytes::from_static(b"b"));
    // Answered 5/6 of the timeout after it was sent: 7/6 after "a".
    tokio::time::sleep(recv_timeout * 5 / 6).await;
    server
        .send(peer, Bytes::from_static(b"re:b"))
        .await
        .expect("reply");
    assert_eq!(
        event(&mut client, "reply b").await,
        ClientEvent::Message(Bytes::from_static(b"re:b"))
    );
    assert_eq!(t.stats().disconnects, 0, "{:?}", t.stats());
}

/// One acknowledgement lifts one disconnect: a caller that lags two breaks behind (a receiver
/// in a crash loop) and acknowledges the first is still fenced for the second, so nothing it
/// sent before processing that one reaches the newest connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_disconnect_needs_its_own_acknowledgement() {
    let t = transport(quick());
    let server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    let mut client = t.connect(&endpoint, "sender-e").await.expect("connect");
    drop(server);
    assert_eq!(event(&mut client, "D1").await, ClientEvent::Disconnected);
    let server = serve_again(&t, &endpoint).await;
    assert_eq!(event(&mut client, "R1").await, ClientEvent::Reconnected);
    drop(server);
    assert_eq!(event(&mut client, "D2").await, ClientEvent::Disconnected);
    let mut server = serve_again(&t, &endpoint).await;
    assert_eq!(event(&mut client, "R2").await, ClientEvent::Reconnected);
    // The caller catches up with D1 only.
    client.send(DISCONNECT_ACK).await.expect("ack 1");
    client
        .send(Bytes::from_static(b"stale"))
        .await
        .expect("send");
    // Now with D2.
    client.send(DISCONNECT_ACK).await.expect("ack 2");
    client
        .send(Bytes::from_static(b"fresh"))
        .await
        .expect("send");
    let (_, payload) = step("request", server.recv()).await.expect("open");
    assert_eq!(payload, Bytes::from_static(b"fresh"));
}

/// A peer that stops reading its replies is cut off after `send_timeout`: by the connection
/// writer's timeout or by the TCP user timeout on the stalled window, whichever comes first
/// (with neither, this test fails). The DEALER notices, reconnects, and is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_closes_a_connection_whose_replies_stall() {
    let server_side = transport(ZmqConfig {
        send_timeout: Duration::from_millis(200),
        ..quick()
    });
    let client_side = transport(quick());
    let mut server = server_side.serve("tcp://127.0.0.1:0").await.expect("serve");
    let mut client = client_side
        .connect(server.local_endpoint(), "stalled")
        .await
        .expect("connect");
    client.send(Bytes::from_static(b"hi")).await.expect("send");
    let (peer, _) = step("request", server.recv()).await.expect("open");
    // The client reads nothing meanwhile: its event channel (1024) fills, then its socket.
    let big = Bytes::from(vec![0x5a; 64 << 10]);
    for _ in 0..1500 {
        server.send(peer, big.clone()).await.expect("queue");
    }
    // Longer than the server's send_timeout: its connection writer is stuck that long.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        server_side.stats().send_timeouts >= 1,
        "{:?}",
        server_side.stats()
    );
    // Drain: what arrived before the cut, then the disconnect.
    loop {
        match event(&mut client, "drain").await {
            ClientEvent::Message(_) => {}
            ClientEvent::Disconnected => break,
            ClientEvent::Reconnected => panic!("reconnected before the disconnect"),
        }
    }
    client.send(DISCONNECT_ACK).await.expect("ack");
    assert_eq!(
        event(&mut client, "reconnect").await,
        ClientEvent::Reconnected
    );
    round_trip(&mut client, &mut server, "again").await;
}

/// `NotifySink::close` returns once every notice queued before it is written: a process that
/// exits right after (its runtime's tasks stopped, as here) loses none of them. Without the
/// wait, the notices still queued behind the PUSH's writer went with its task.
#[test]
fn a_closed_push_has_written_every_queued_notice_before_its_runtime_stops() {
    const NOTICES: usize = 2000;
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime")
    };
    let proxy_side = runtime();
    let (mut source, endpoint) = proxy_side.block_on(async {
        let t = transport(quick());
        let source = t.notify_source("tcp://127.0.0.1:0").await.expect("bind");
        let endpoint = source.local_endpoint().to_owned();
        (source, endpoint)
    });
    let sender_side = runtime();
    sender_side.block_on(async {
        let t = transport(quick());
        let sink = step("connect", t.notify_sink(&endpoint))
            .await
            .expect("sink");
        for i in 0..NOTICES {
            let notice = Bytes::from(format!("n{i}"));
            step("queue", sink.send(notice)).await.expect("send");
        }
        step("close", sink.close()).await;
    });
    sender_side.shutdown_background();
    proxy_side.block_on(async {
        for i in 0..NOTICES {
            assert_eq!(
                step("notice", source.recv()).await,
                Some(Bytes::from(format!("n{i}"))),
                "notice {i} of {NOTICES}"
            );
        }
    });
}
