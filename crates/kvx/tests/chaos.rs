//! Chaos with real processes on loopback: a proxy, a receiver and two senders as separate
//! `kvx` processes. During a run one sender hangs (SIGSTOP) and is then killed (SIGKILL), the
//! receiver is killed and restarted on the same ports, and the proxy is frozen (SIGSTOP) and
//! thawed (SIGCONT). The receiver must reclaim the hung sender's slots, whose connections stay
//! up, by either of the two rules that find it: their lease ends (`--request-idle-timeout-s`),
//! or its heartbeats stop (`--heartbeat-timeout-s`). The other sender must keep going through
//! all of it and end every request exactly once, and once the run stops no slot stays held.
//! Bounded: every wait has a deadline. Three runs: both rules on; the lease as good as off
//! (the heartbeats alone find the hung sender); both as good as off, which must fail: the hung
//! sender's slots are never reclaimed. (A sender that is killed outright is reclaimed at once,
//! its control connection closed: `python/tests/test_lost_sender.py`, `kvx-proto`
//! `tests/lost_senders.rs`.)

mod processes;

use processes::{free_port, get, kvx, value};

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BUFFER: u32 = 32;

/// The sum of a metric's samples, when present.
fn metric(port: u16, name: &str) -> Option<f64> {
    value(&get(port, "/metrics")?.1, name)
}

/// Polls `check` every 50 ms until it holds; Err naming `what` after `limit`.
fn wait_until(what: &str, limit: Duration, mut check: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    while !check() {
        if Instant::now() > deadline {
            return Err(format!("{what}: not after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A process of the run; one still running when this is dropped (a check failed early) is
/// killed and reaped, so no test leaves processes behind.
struct Proc(Option<Child>);

impl Proc {
    fn signal(&self, sig: &str) {
        if let Some(child) = &self.0 {
            let _ = Command::new("kill")
                .args([sig, &child.id().to_string()])
                .status();
        }
    }

    /// Ends the process (SIGKILL if it is still running after `limit`): its output.
    fn end(mut self, limit: Duration) -> std::process::Output {
        let mut child = self.0.take().expect("a process");
        let deadline = Instant::now() + limit;
        while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        child.wait_with_output().expect("output")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct Ports {
    alloc: u16,
    fabric: u16,
    proxy: u16,
    m_receiver: u16,
    m_proxy: u16,
}

/// Where a receiver's log goes, for the message of a check that fails.
fn receiver_log(p: &Ports) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("kvx-chaos-receiver-{}.log", p.alloc))
}

fn tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

fn receiver(p: &Ports, idle_s: &str, heartbeat_s: &str) -> Proc {
    let log = std::fs::File::create(receiver_log(p)).expect("a log file");
    Proc(Some(
        kvx()
            .args(["receiver", "--chunk-bytes", "65536", "--buffer-chunks"])
            .arg(BUFFER.to_string())
            .args(["--alloc-ports", &p.alloc.to_string()])
            .args(["--fabric-ports", &p.fabric.to_string()])
            .args(["--metrics", &format!("127.0.0.1:{}", p.m_receiver)])
            .args(["--heartbeat-timeout-s", heartbeat_s])
            .args([
                "--request-idle-timeout-s",
                idle_s,
                "--write-quarantine-s",
                "3",
            ])
            .args(["--unconsumed-ttl-s", "20", "--peer-share-percent", "50"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("kvx receiver starts"),
    ))
}

fn sender(p: &Ports, index: u32) -> Proc {
    Proc(Some(
        kvx()
            .args([
                "sender",
                "--json",
                "--chunk-bytes",
                "65536",
                "--timeout-s",
                "120",
            ])
            .args(["--sender-index", &index.to_string()])
            .args(["--alloc-ports", &p.alloc.to_string()])
            .args(["--fabric-ports", &p.fabric.to_string()])
            .args(["--proxy", &format!("127.0.0.1:{}", p.proxy)])
            .args(["--requests", "100000", "--chunks", "2..8"])
            .args(["--write-timeout-s", "1", "--reply-timeout-s", "1.5"])
            .args([
                "--admission-reply-timeout-s",
                "5",
                "--staging-timeout-s",
                "5",
            ])
            .stdout(Stdio::piped())
            // Each failed request logs a line: a pipe nobody reads would fill and stall it.
            .stderr(Stdio::null())
            .spawn()
            .expect("kvx sender starts"),
    ))
}

/// The run; Err says which expectation failed.
fn chaos(idle_s: &str, heartbeat_s: &str) -> Result<(), String> {
    let p = Ports {
        alloc: free_port(),
        fabric: free_port(),
        proxy: free_port(),
        m_receiver: free_port(),
        m_proxy: free_port(),
    };
    let proxy = Proc(Some(
        kvx()
            .args([
                "proxy",
                "--port",
                &p.proxy.to_string(),
                "--kv-ready-timeout-s",
                "10",
            ])
            .args(["--metrics", &format!("127.0.0.1:{}", p.m_proxy)])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("kvx proxy starts"),
    ));
    let mut rx = Some(receiver(&p, idle_s, heartbeat_s));
    let ready = |port| move || matches!(get(port, "/ready"), Some((200, _)));
    let result = (|| {
        wait_until("the proxy ready", Duration::from_secs(20), ready(p.m_proxy))?;
        wait_until(
            "the receiver ready",
            Duration::from_secs(20),
            ready(p.m_receiver),
        )
        .map_err(|e| format!("{e}; its log: {}", tail(&receiver_log(&p))))?;
        let victim = sender(&p, 0);
        let survivor = sender(&p, 1);
        let admitted = || metric(p.m_receiver, "kvx_receiver_admitted_total").unwrap_or(0.0);
        wait_until("requests admitted", Duration::from_secs(20), || {
            admitted() > 20.0
        })?;

        // 1. A sender hangs mid-transfer: its slots come back when their lease ends or its
        //    heartbeats stop. Then it is killed (its connections close: nothing of it is left
        //    open).
        victim.signal("-STOP");
        let rolled_back = || metric(p.m_receiver, "kvx_receiver_rolled_back_total").unwrap_or(0.0);
        let leased = wait_until(
            "the hung sender's requests rolled back (lease, heartbeats)",
            Duration::from_secs(15),
            || rolled_back() > 0.0,
        );
        victim.signal("-KILL");
        let _ = victim.end(Duration::from_secs(5));
        leased?;

        // 2. The receiver dies and comes back on the same ports.
        if let Some(old) = rx.take() {
            old.signal("-KILL");
            let _ = old.end(Duration::from_secs(5));
        }
        rx = Some(receiver(&p, idle_s, heartbeat_s));
        wait_until(
            "the receiver back",
            Duration::from_secs(20),
            ready(p.m_receiver),
        )
        .map_err(|e| format!("{e}; its log: {}", tail(&receiver_log(&p))))?;
        wait_until(
            "the surviving sender admitted by the new receiver",
            Duration::from_secs(30),
            || admitted() > 5.0,
        )?;

        // 3. The proxy freezes and thaws.
        proxy.signal("-STOP");
        std::thread::sleep(Duration::from_millis(1000));
        proxy.signal("-CONT");
        let ready_at_proxy = || metric(p.m_proxy, "kvx_proxy_ready_total").unwrap_or(0.0);
        let seen = ready_at_proxy();
        wait_until("the proxy counting again", Duration::from_secs(20), || {
            ready_at_proxy() > seen
        })?;

        // 4. The survivor stops cleanly; every request it began ended exactly once.
        survivor.signal("-TERM");
        let out = survivor.end(Duration::from_secs(30));
        let s: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
            format!(
                "the survivor's JSON: {e}: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        let n = |k: &str| s[k].as_u64().unwrap_or(u64::MAX);
        if n("requests_lost") != 0
            || n("requests_completed") + n("requests_failed") + n("requests_not_begun")
                != n("requests_total")
            || n("requests_completed") == 0
        {
            return Err(format!(
                "the survivor's requests did not each end once: {s}"
            ));
        }

        // 5. Nothing stays held once the leases and quarantines ran out.
        wait_until("every receiver slot free", Duration::from_secs(20), || {
            metric(p.m_receiver, "kvx_receiver_slots_free") == Some(f64::from(BUFFER))
        })
    })();
    proxy.signal("-TERM");
    if let Some(rx) = rx {
        rx.signal("-TERM");
        let _ = rx.end(Duration::from_secs(15));
    }
    let _ = proxy.end(Duration::from_secs(15));
    let _ = std::fs::remove_file(receiver_log(&p));
    result
}

/// One test, the runs one after the other: run in parallel, each run's processes open
/// outgoing connections whose ephemeral ports can take a port the other has just picked.
#[test]
fn a_cluster_of_processes_survives_kills_restarts_and_a_frozen_proxy_and_needs_a_liveness_rule() {
    chaos("2", "4").expect("the cluster recovers");
    chaos("1000", "4").expect("the heartbeats alone find the hung sender");
    let err =
        chaos("1000", "1000").expect_err("with leases and heartbeats off the check must fail");
    assert!(err.contains("lease, heartbeats"), "{err}");
}
