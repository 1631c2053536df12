//! Round-trip latency of the alloc channel on loopback: an `AllocRequest` (the 181-byte
//! golden first batch) out, an `AllocResponse` (the 60-byte golden reply) back. The goal
//! (issue: ZMQ transport) is p50 ≤ 40 µs through `ZmqTransport`.
//!
//! Measured in the same run, on the same runtime, for comparison:
//! - raw TCP: a tokio `TcpStream` ping-pong of the same sizes (the floor);
//! - raw zeromq: the crate's DEALER/ROUTER used directly (what kvx's tasks and channels add
//!   on top of it is the difference to `ZmqTransport`).
//!
//! Ignored by default (timing on a shared machine is not a pass/fail matter); run with
//! `cargo test --release -p kvx-transport --test zmq_rtt -- --ignored --nocapture`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvx_io::transport::ClientEvent;
use kvx_io::Transport;
use kvx_transport::zmq::ZmqTransport;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const REQUEST_HEX: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/golden/alloc_request_first_batch.hex"
));
const REPLY_HEX: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/golden/alloc_response_ok.hex"
));
const WARMUP: usize = 200;
const ROUNDS: usize = 2_000;
const STEP: Duration = Duration::from_secs(10);

fn payloads() -> (Bytes, Bytes) {
    let request = hex::decode(REQUEST_HEX.trim()).expect("hex");
    let reply = hex::decode(REPLY_HEX.trim()).expect("hex");
    (Bytes::from(request), Bytes::from(reply))
}

async fn bounded<F: std::future::Future>(fut: F) -> F::Output {
    tokio::time::timeout(STEP, fut)
        .await
        .expect("a round trip took over 10 s")
}

#[derive(Debug)]
struct Summary {
    p50: Duration,
    p99: Duration,
    mean: Duration,
}

fn summarize(mut samples: Vec<Duration>) -> Summary {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    let total: Duration = samples.iter().sum();
    Summary {
        p50: at(0.50),
        p99: at(0.99),
        mean: total / samples.len() as u32,
    }
}

async fn raw_tcp(request: Bytes, reply: Bytes) -> Summary {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let request_len = request.len();
    let server = tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.expect("accept");
        tcp.set_nodelay(true).expect("nodelay");
        let mut buf = vec![0u8; request_len];
        for _ in 0..WARMUP + ROUNDS {
            tcp.read_exact(&mut buf).await.expect("read request");
            tcp.write_all(&reply).await.expect("write reply");
        }
    });
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    let reply_len = payloads().1.len();
    let mut buf = vec![0u8; reply_len];
    let tcp = &mut tcp;
    let buf = &mut buf;
    let mut samples = Vec::with_capacity(ROUNDS);
    for i in 0..WARMUP + ROUNDS {
        let start = Instant::now();
        bounded(async {
            tcp.write_all(&request).await.expect("write request");
            tcp.read_exact(buf).await.expect("read reply");
        })
        .await;
        if i >= WARMUP {
            samples.push(start.elapsed());
        }
    }
    bounded(server).await.expect("server task");
    summarize(samples)
}

async fn raw_zeromq(request: Bytes, reply: Bytes) -> Summary {
    let mut router = zeromq::RouterSocket::new();
    let endpoint = router.bind("tcp://127.0.0.1:0").await.expect("bind");
    let server = tokio::spawn(async move {
        for _ in 0..WARMUP + ROUNDS {
            let message = router.recv().await.expect("recv");
            let identity = message.get(0).expect("identity").clone();
            let mut out = ZmqMessage::from(identity);
            out.push_back(Bytes::new());
            out.push_back(reply.clone());
            router.send(out).await.expect("reply");
        }
    });
    let mut dealer = zeromq::DealerSocket::new();
    dealer
        .connect(&endpoint.to_string())
        .await
        .expect("connect");
    let mut samples = Vec::with_capacity(ROUNDS);
    for i in 0..WARMUP + ROUNDS {
        let start = Instant::now();
        let mut out = ZmqMessage::from(Bytes::new());
        out.push_back(request.clone());
        bounded(async {
            dealer.send(out).await.expect("send");
            dealer.recv().await.expect("recv");
        })
        .await;
        if i >= WARMUP {
            samples.push(start.elapsed());
        }
    }
    bounded(server).await.expect("server task");
    summarize(samples)
}

async fn kvx_zmq(request: Bytes, reply: Bytes) -> Summary {
    let t = ZmqTransport::default();
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let endpoint = server.local_endpoint().to_owned();
    let echo = tokio::spawn(async move {
        while let Some((peer, _)) = server.recv().await {
            if server.send(peer, reply.clone()).await.is_err() {
                break;
            }
        }
    });
    let mut client = t.connect(&endpoint, "rtt-sender").await.expect("connect");
    let mut samples = Vec::with_capacity(ROUNDS);
    for i in 0..WARMUP + ROUNDS {
        let start = Instant::now();
        client.send(request.clone()).await.expect("send");
        match bounded(client.recv()).await {
            Some(ClientEvent::Message(_)) => {}
            other => panic!("expected a reply, got {other:?}"),
        }
        if i >= WARMUP {
            samples.push(start.elapsed());
        }
    }
    echo.abort();
    summarize(samples)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn report(runtime: &str, tcp: &Summary, zmq: &Summary, kvx: &Summary) {
    println!("{runtime}:");
    for (name, s) in [("raw TCP", tcp), ("raw zeromq", zmq), ("ZmqTransport", kvx)] {
        println!(
            "  {name:>13}: p50 {:7.1} µs  p99 {:7.1} µs  mean {:7.1} µs  (p50 {:.1}x raw TCP)",
            us(s.p50),
            us(s.p99),
            us(s.mean),
            us(s.p50) / us(tcp.p50)
        );
    }
}

/// Both ends share one runtime: first a single-threaded one (no cross-thread wake-ups: the
/// cost of the sockets and kvx's tasks alone), then two worker threads (each hand-off between
/// tasks may wake another thread, as between the tasks of a busy process).
#[test]
#[ignore = "timing; run with --release -- --ignored --nocapture"]
fn alloc_round_trip_latency() {
    let (request, reply) = payloads();
    assert_eq!((request.len(), reply.len()), (181, 60));
    println!(
        "round trips: {ROUNDS} after {WARMUP} warm-up, AllocRequest 181 B / AllocResponse 60 B"
    );
    let runtimes = [
        (
            "current-thread runtime",
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build(),
        ),
        (
            "multi-thread runtime, 2 workers",
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build(),
        ),
    ];
    for (name, runtime) in runtimes {
        let runtime = runtime.expect("runtime");
        let (request, reply) = (request.clone(), reply.clone());
        runtime.block_on(async move {
            let tcp = raw_tcp(request.clone(), reply.clone()).await;
            let zmq = raw_zeromq(request.clone(), reply.clone()).await;
            let kvx = kvx_zmq(request, reply).await;
            report(name, &tcp, &zmq, &kvx);
        });
    }
}
