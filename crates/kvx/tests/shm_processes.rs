//! The shm fabric between separate `kvx` processes on loopback: a proxy, a receiver and a
//! sender, the sender's staging reaching the receiver as a sealed memfd over the handoff
//! socket (`docs/spec/fabrics.md` §4). Every request completes, and nothing is created in
//! `/dev/shm`. Bounded: every wait has a deadline, and processes still running at the end
//! (or after a failed check) are killed and reaped.

mod processes;

use processes::{free_port, get, kvx};

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Kills and reaps its process when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn kvx_entries_in_dev_shm() -> usize {
    std::fs::read_dir("/dev/shm").map_or(0, |d| {
        d.filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().contains("kvx"))
            .count()
    })
}

#[test]
fn a_sender_process_writes_through_sealed_shared_memory() {
    let before = kvx_entries_in_dev_shm();
    let (proxy_port, alloc, fabric, metrics) = (free_port(), free_port(), free_port(), free_port());
    let _proxy = Proc(
        kvx()
            .args(["proxy", "--port", &proxy_port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("kvx proxy starts"),
    );
    let _receiver = Proc(
        kvx()
            .args(["receiver", "--fabric", "shm", "--chunk-bytes", "65536"])
            .args(["--buffer-chunks", "16"])
            .args(["--alloc-ports", &alloc.to_string()])
            .args(["--fabric-ports", &fabric.to_string()])
            .args(["--metrics", &format!("127.0.0.1:{metrics}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("kvx receiver starts"),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !matches!(get(metrics, "/ready"), Some((200, _))) {
        assert!(Instant::now() < deadline, "the receiver ready within 20 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut sender = Proc(
        kvx()
            .args([
                "sender",
                "--json",
                "--fabric",
                "shm",
                "--chunk-bytes",
                "65536",
            ])
            .args(["--alloc-ports", &alloc.to_string()])
            .args(["--fabric-ports", &fabric.to_string()])
            .args(["--proxy", &format!("127.0.0.1:{proxy_port}")])
            .args(["--requests", "20", "--chunks", "2..5", "--timeout-s", "60"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("kvx sender starts"),
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = sender.0.try_wait().expect("wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "the sender done within 90 s");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    std::io::Read::read_to_string(sender.0.stdout.as_mut().expect("piped"), &mut out)
        .expect("the sender's report");
    assert!(status.success(), "the sender succeeds: {status}; {out}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("a JSON report");
    assert_eq!(report["requests_completed"], 20, "{report}");
    assert_eq!(report["requests_failed"], 0, "{report}");
    assert_eq!(
        kvx_entries_in_dev_shm(),
        before,
        "nothing of kvx in /dev/shm"
    );
}
