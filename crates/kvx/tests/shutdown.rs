//! Stopping kvx's processes with signals, as an operator or an orchestrator does: SIGTERM
//! stops a role cleanly (exit 0, with a summary).

mod processes;

use processes::{free_port, kvx};

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("kill runs")
        .success();
    assert!(ok, "kill {sig} {}", child.id());
}

/// Waits at most `limit` for the process to exit; its output, and how long it took.
fn exit_within(mut child: Child, limit: Duration) -> (std::process::Output, Duration) {
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "still running after {limit:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (child.wait_with_output().expect("output"), start.elapsed())
}

struct Cluster {
    proxy: Child,
    receiver: Child,
    ports: (u16, u16, u16),
}

fn cluster() -> Cluster {
    let (alloc, fabric, proxy) = (free_port(), free_port(), free_port());
    let spawn = |cmd: &mut Command| {
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvx starts")
    };
    let proxy_process = spawn(kvx().args(["proxy", "--port", &proxy.to_string()]));
    let receiver = spawn(kvx().args([
        "receiver",
        "--alloc-ports",
        &alloc.to_string(),
        "--fabric-ports",
        &fabric.to_string(),
        "--chunk-bytes",
        "65536",
    ]));
    // Listening once they accept a connection.
    for port in [alloc, proxy] {
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nothing listens on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Cluster {
        proxy: proxy_process,
        receiver,
        ports: (alloc, fabric, proxy),
    }
}

fn sender(c: &Cluster, requests: u32) -> Child {
    let (alloc, fabric, proxy) = c.ports;
    kvx()
        .args([
            "sender",
            "--json",
            "--chunk-bytes",
            "65536",
            "--timeout-s",
            "120",
        ])
        .args(["--alloc-ports", &alloc.to_string()])
        .args(["--fabric-ports", &fabric.to_string()])
        .args(["--proxy", &format!("127.0.0.1:{proxy}")])
        .args(["--requests", &requests.to_string(), "--chunks", "2..8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvx sender starts")
}

#[test]
fn sigterm_stops_each_role_cleanly_with_a_summary() {
    let c = cluster();
    let requests = 100_000;
    let tx = sender(&c, requests);
    std::thread::sleep(Duration::from_millis(1500));
    signal(&tx, "-TERM");
    let (out, took) = exit_within(tx, Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "sender: {err}");
    assert!(
        took < Duration::from_secs(12),
        "the sender took {took:?} to stop"
    );
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the sender's JSON");
    assert_eq!(s["stopped_by"], "SIGTERM", "{s}");
    assert_eq!(s["requests_lost"], 0, "{s}");
    let (done, failed, never) = (
        s["requests_completed"].as_u64().expect("a count"),
        s["requests_failed"].as_u64().expect("a count"),
        s["requests_not_begun"].as_u64().expect("a count"),
    );
    assert!(done > 0 && never > 0, "{s}");
    assert_eq!(done + failed + never, u64::from(requests), "{s}");
    assert_eq!(
        failed,
        s["requests_cancelled"].as_u64().expect("a count"),
        "{s}"
    );
    for (role, child) in [("receiver", c.receiver), ("proxy", c.proxy)] {
        signal(&child, "-TERM");
        let (out, _) = exit_within(child, Duration::from_secs(15));
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{role}: {said}");
        assert!(said.contains("stopped"), "{role}: {said}");
    }
}
