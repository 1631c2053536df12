//! An LMCache sender (pyzmq + msgspec with LMCache's message definitions) against a real
//! `kvx receiver` process. Skipped, with a message, where Python lacks pyzmq or msgspec,
//! unless KVX_REQUIRE_PYTHON=1 (CI sets it, after installing them).

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn python_ready() -> bool {
    Command::new("python3")
        .args(["-c", "import zmq, msgspec"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn an_lmcache_sender_talks_to_kvx_receiver() {
    lmcache_sender_against_kvx_receiver(&["--legacy-senders", "after-proxy"], None);
}

/// By default a receiver refuses senders without `seq`: nothing would tell it when their
/// bytes are in (before, their requests were read the moment they were allocated).
#[test]
fn an_lmcache_sender_is_refused_by_default() {
    lmcache_sender_against_kvx_receiver(&[], Some("expect-refusal"));
}

fn lmcache_sender_against_kvx_receiver(receiver_args: &[&str], mode: Option<&str>) {
    if !python_ready() {
        assert!(
            std::env::var_os("KVX_REQUIRE_PYTHON").is_none(),
            "KVX_REQUIRE_PYTHON is set but python3 lacks pyzmq or msgspec"
        );
        eprintln!(
            "skipped: python3 with pyzmq and msgspec is not available (pip install pyzmq msgspec)"
        );
        return;
    }
    let (alloc, fabric) = (free_port(), free_port());
    let mut receiver = Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args([
            "receiver",
            "--no-verify",
            // Legacy requests hold their slots until marked ready (never, here): room for
            // R1's 5 and R2's 4 within one sender's share (75 %).
            "--buffer-chunks",
            "16",
            "--chunk-bytes",
            "4096",
            "--exit-after-s",
            "60",
        ])
        .args(receiver_args)
        .args([
            "--alloc-ports",
            &alloc.to_string(),
            "--fabric-ports",
            &fabric.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvx receiver starts");
    // Wait (bounded) until the alloc port accepts connections.
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", alloc)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "kvx receiver did not start listening"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/lmcache_sender.py"
    );
    let golden = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/golden");
    let out = Command::new("python3")
        .args([script, &format!("tcp://127.0.0.1:{alloc}"), golden])
        .args(mode)
        .output()
        .expect("python3 runs");
    let _ = receiver.kill();
    let _ = receiver.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("0 failed"), "{stdout}");
}
