//! kvx's DEALER and PUSH against libzmq's ROUTER and PULL (pyzmq), live on loopback: what an
//! LMCache receiver and proxy bind. Skipped, with a message, where python3 lacks pyzmq,
//! unless KVX_REQUIRE_PYTHON=1 (CI sets it, after installing it).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::ClientEvent;
use kvx_io::Transport;
use kvx_transport::zmq::ZmqTransport;

const STEP: Duration = Duration::from_secs(20);

/// Binds a ROUTER and a PULL on ports the OS picks, prints them, answers one request with
/// `re:<payload>:<identity>`, then prints the one notice it receives.
const LIBZMQ_PEER: &str = r#"
import sys, zmq
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
pull = ctx.socket(zmq.PULL)
rport = router.bind_to_random_port("tcp://127.0.0.1")
pport = pull.bind_to_random_port("tcp://127.0.0.1")
print(rport, pport, flush=True)
router.RCVTIMEO = pull.RCVTIMEO = 15000
ident, delim, payload = router.recv_multipart()
router.send_multipart([ident, b"", b"re:" + payload + b":" + ident + b"x" * 300])
print("notice", pull.recv().decode(), flush=True)
"#;

fn pyzmq_ready() -> bool {
    Command::new("python3")
        .args(["-c", "import zmq"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvx_dealer_and_push_to_libzmq_router_and_pull() {
    if !pyzmq_ready() {
        assert!(
            std::env::var_os("KVX_REQUIRE_PYTHON").is_none(),
            "KVX_REQUIRE_PYTHON is set but python3 lacks pyzmq"
        );
        eprintln!("skipped: python3 with pyzmq is not available (pip install pyzmq)");
        return;
    }
    let mut peer = Command::new("python3")
        .args(["-c", LIBZMQ_PEER])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut lines = BufReader::new(peer.stdout.take().expect("stdout")).lines();
    let ports = lines.next().expect("ports line").expect("read");
    let (rport, pport) = ports.split_once(' ').expect("two ports");

    let t = ZmqTransport::default();
    let run = async {
        let mut client = t
            .connect(&format!("tcp://127.0.0.1:{rport}"), "s0-to-r0")
            .await
            .expect("connect");
        client
            .send(Bytes::from_static(b"request"))
            .await
            .expect("send");
        let want = format!("re:request:s0-to-r0{}", "x".repeat(300));
        assert_eq!(
            client.recv().await,
            Some(ClientEvent::Message(Bytes::from(want)))
        );
        let sink = t
            .notify_sink(&format!("tcp://127.0.0.1:{pport}"))
            .await
            .expect("connect");
        sink.send(Bytes::from_static(b"ready")).await.expect("send");
    };
    tokio::time::timeout(STEP, run).await.expect("bounded");
    let notice = tokio::task::spawn_blocking(move || lines.next())
        .await
        .expect("reader");
    let _ = peer.kill();
    let _ = peer.wait();
    assert_eq!(
        notice.map(|l| l.expect("read")).as_deref(),
        Some("notice ready")
    );
}
