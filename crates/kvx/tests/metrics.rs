//! `--metrics` on every role: a proxy, a receiver and a sender as separate processes on
//! loopback, each scraped over HTTP while the sender's run proceeds and after it.

mod processes;

use processes::{free_port, get, kvx, value};

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn wait_ready(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((200, _)) = get(port, "/ready") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "/ready on {port} not 200 after 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn interrupt(mut child: Child) -> Output {
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

#[test]
fn every_role_serves_metrics_that_move_as_a_run_proceeds_and_readiness() {
    let (alloc, fabric, proxy) = (free_port(), free_port(), free_port());
    let (m_proxy, m_receiver, m_sender) = (free_port(), free_port(), free_port());
    let spawn = |cmd: &mut Command| {
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvx starts")
    };
    let proxy_process = spawn(kvx().args(["proxy", "--host", "127.0.0.1"]).args([
        "--port",
        &proxy.to_string(),
        "--metrics",
        &format!("127.0.0.1:{m_proxy}"),
        "--exit-after-s",
        "120",
    ]));
    let receiver = spawn(kvx().args(["receiver", "--buffer-chunks", "32"]).args([
        "--chunk-bytes",
        "262144",
        "--alloc-ports",
        &alloc.to_string(),
        "--fabric-ports",
        &fabric.to_string(),
        "--metrics",
        &format!("127.0.0.1:{m_receiver}"),
        "--exit-after-s",
        "120",
    ]));
    wait_ready(m_proxy);
    wait_ready(m_receiver);
    let requests = 150;
    let sender = spawn(
        kvx()
            .args(["sender", "--json", "--timeout-s", "100"])
            .args([
                "--alloc-ports",
                &alloc.to_string(),
                "--fabric-ports",
                &fabric.to_string(),
                "--proxy",
                &format!("127.0.0.1:{proxy}"),
                "--requests",
                &requests.to_string(),
                "--chunks",
                "1..8",
                "--chunk-bytes",
                "262144",
                "--metrics",
                &format!("127.0.0.1:{m_sender}"),
            ]),
    );
    // Scrape the sender while it runs: its delivered count must be seen growing.
    let mut delivered_seen = Vec::new();
    let mut sender = sender;
    let deadline = Instant::now() + Duration::from_secs(100);
    while sender.try_wait().expect("wait").is_none() && Instant::now() < deadline {
        if let Some((200, text)) = get(m_sender, "/metrics") {
            if let Some(d) = value(&text, "kvx_sender_delivered_total") {
                if delivered_seen.last() != Some(&d) {
                    delivered_seen.push(d);
                }
            }
            if value(&text, "kvx_sender_staging_free").is_some() {
                assert!(value(&text, "kvx_sender_staging_held").is_some(), "{text}");
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let sender = sender.wait_with_output().expect("sender output");
    let summary: serde_json::Value = serde_json::from_slice(&sender.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&sender.stderr)));
    assert_eq!(summary["requests_completed"], requests, "{summary}");
    assert!(
        delivered_seen.len() >= 2 && delivered_seen.windows(2).all(|w| w[0] < w[1]),
        "the sender's delivered count, scraped during the run: {delivered_seen:?}"
    );
    // The receiver and the proxy, after the run.
    let (status, rx) = get(m_receiver, "/metrics").expect("receiver metrics");
    assert_eq!(status, 200);
    assert_eq!(
        value(&rx, "kvx_receiver_admitted_total"),
        Some(requests as f64),
        "{rx}"
    );
    // The decoder consumes the last request after its sender heard it delivered: every slot
    // is free soon after, not necessarily at once.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut rx = rx;
    while value(&rx, "kvx_receiver_slots_free") != Some(32.0) {
        assert!(Instant::now() < deadline, "receiver: {rx}");
        std::thread::sleep(Duration::from_millis(50));
        rx = get(m_receiver, "/metrics").expect("receiver metrics").1;
    }
    let (_, px) = get(m_proxy, "/metrics").expect("proxy metrics");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut px = px;
    while value(&px, "kvx_proxy_ready_total") != Some(requests as f64) {
        assert!(Instant::now() < deadline, "proxy: {px}");
        std::thread::sleep(Duration::from_millis(50));
        px = get(m_proxy, "/metrics").expect("proxy metrics").1;
    }
    assert_eq!(get(m_proxy, "/nothing").map(|r| r.0), Some(404));
    let proxy_out = interrupt(proxy_process);
    let _ = interrupt(receiver);
    assert!(
        String::from_utf8_lossy(&proxy_out.stdout).contains(&format!("{requests} ready")),
        "{}",
        String::from_utf8_lossy(&proxy_out.stdout)
    );
}

/// Every series `crates/kvx-node/src/metrics.rs` defines for `role` (`kvx_{role}_…`, and the
/// decode errors every role counts), each with every label value it is recorded with.
fn series_of(role: &str) -> Vec<String> {
    use kvx_node::metrics as m;
    let source = include_str!("../../kvx-node/src/metrics.rs");
    let source = source
        .split("#[cfg(test)]")
        .next()
        .expect("the definitions");
    let names = source
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| s.starts_with("kvx_") && !s.contains(' '))
        .filter(|s| s.starts_with(&format!("kvx_{role}_")) || *s == m::DECODE_ERRORS);
    let labelled = |name: &str, label: &str, values: &[&str]| -> Vec<String> {
        values
            .iter()
            .map(|v| format!("{name}{{{label}=\"{v}\""))
            .collect()
    };
    let mut out = Vec::new();
    for name in names {
        match name {
            n if n == m::SENDER_FAILED => {
                out.extend(labelled(n, "reason", m::SENDER_FAILED_REASONS))
            }
            n if n == m::SENDER_REQUESTS => {
                out.extend(labelled(n, "state", m::SENDER_REQUEST_STATES))
            }
            n if n == m::SENDER_RECONNECTS => {
                out.extend(labelled(n, "channel", m::SENDER_RECONNECT_CHANNELS))
            }
            n if n == m::PROXY_FAILED => out.extend(labelled(n, "reason", m::PROXY_FAILED_REASONS)),
            n => out.push(n.to_owned()),
        }
    }
    out
}

/// The series of `expected` that the page `text` lacks. A series is present when a sample
/// line starts with it (a histogram's `_count` counts for the histogram).
fn missing(text: &str, expected: &[String]) -> Vec<String> {
    let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    expected
        .iter()
        .filter(|name| {
            let count = format!("{name}_count");
            !samples.iter().any(|l| {
                [name.as_str(), count.as_str()].iter().any(|n| {
                    l.strip_prefix(n)
                        .is_some_and(|rest| rest.starts_with([' ', '{']) || n.ends_with('"'))
                })
            })
        })
        .cloned()
        .collect()
}

/// Each role serves every one of its series on its first scrape, before any traffic: the
/// proxy and the receiver once ready, the sender while it is still connecting (its receiver
/// is not there, so it never sends a request).
#[test]
fn every_role_serves_all_its_series_before_any_traffic() {
    let (proxy, absent_alloc, absent_fabric) = (free_port(), free_port(), free_port());
    let (alloc, fabric) = (free_port(), free_port());
    let (m_proxy, m_receiver, m_sender) = (free_port(), free_port(), free_port());
    let spawn = |cmd: &mut Command| {
        cmd.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("kvx starts")
    };
    let proxy_process = spawn(kvx().args(["proxy", "--host", "127.0.0.1"]).args([
        "--port",
        &proxy.to_string(),
        "--metrics",
        &format!("127.0.0.1:{m_proxy}"),
        "--exit-after-s",
        "60",
    ]));
    let receiver = spawn(kvx().args(["receiver", "--buffer-chunks", "8"]).args([
        "--alloc-ports",
        &alloc.to_string(),
        "--fabric-ports",
        &fabric.to_string(),
        "--metrics",
        &format!("127.0.0.1:{m_receiver}"),
        "--exit-after-s",
        "60",
    ]));
    wait_ready(m_proxy);
    wait_ready(m_receiver);
    let (_, px) = get(m_proxy, "/metrics").expect("proxy metrics");
    let (_, rx) = get(m_receiver, "/metrics").expect("receiver metrics");
    let sender = spawn(kvx().args(["sender", "--timeout-s", "30"]).args([
        "--alloc-ports",
        &absent_alloc.to_string(),
        "--fabric-ports",
        &absent_fabric.to_string(),
        "--proxy",
        &format!("127.0.0.1:{proxy}"),
        "--requests",
        "1",
        "--metrics",
        &format!("127.0.0.1:{m_sender}"),
    ]));
    // The sender has no readiness before it connects: its free staging, the last series it
    // registers, says it has started. The page that shows it may have read the counters
    // before the gauge (a page is not one snapshot of every series), so the next page is the
    // one checked: everything was registered before that gauge was set.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((200, text)) = get(m_sender, "/metrics") {
            if value(&text, "kvx_sender_staging_free").is_some() {
                break;
            }
        }
        if Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let tx = get(m_sender, "/metrics").map(|r| r.1).unwrap_or_default();
    let _ = interrupt(sender);
    let _ = interrupt(proxy_process);
    let _ = interrupt(receiver);
    for (role, text) in [("proxy", &px), ("receiver", &rx), ("sender", &tx)] {
        let expected = series_of(role);
        assert!(expected.len() >= 4, "{role}: {expected:?}");
        let lacking = missing(text, &expected);
        assert!(
            lacking.is_empty(),
            "{role} lacks {lacking:?} on its first scrape:\n{text}"
        );
    }
    assert_eq!(value(&rx, "kvx_receiver_slots_free"), Some(8.0), "{rx}");
    // Registered at its 4 free slots; its workload may already hold some of them for the
    // request that waits for the absent receiver (a request may fill staging before its
    // admission), so anything from 0 to 4 is right here.
    let staging_free = value(&tx, "kvx_sender_staging_free");
    assert!(
        matches!(staging_free, Some(v) if (0.0..=4.0).contains(&v)),
        "{staging_free:?}: {tx}"
    );
    assert_eq!(value(&px, "kvx_proxy_ready_total"), Some(0.0), "{px}");
}

/// 200 idle connections to `--metrics` (from the prober's own address and from another
/// loopback address), some that never send a request, some that send half of one: `/ready`
/// still answers at once, and keeps answering while they are held (the listener closes the
/// quietest connection for each new one past its caps; a request line must come within a
/// few seconds).
#[test]
fn idle_connections_never_lock_a_probe_out_of_metrics() {
    use std::io::Write;
    use std::net::{SocketAddr, TcpStream};
    let port = free_port();
    let proxy_port = free_port();
    let mut proxy = kvx()
        .args([
            "proxy",
            "--host",
            "127.0.0.1",
            "--port",
            &proxy_port.to_string(),
        ])
        .args([
            "--metrics",
            &format!("127.0.0.1:{port}"),
            "--exit-after-s",
            "60",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvx starts");
    wait_ready(port);
    let mut idle = Vec::new();
    for i in 0..200u32 {
        // Half from 127.0.0.2: a cap per source address must not make one address's flood
        // everyone's problem.
        let from: SocketAddr = if i % 2 == 0 {
            "127.0.0.2:0"
        } else {
            "127.0.0.1:0"
        }
        .parse()
        .expect("address");
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        socket.bind(&from.into()).expect("bind a loopback source");
        let to: SocketAddr = ([127, 0, 0, 1], port).into();
        if socket.connect(&to.into()).is_err() {
            continue;
        }
        let mut s: TcpStream = socket.into();
        if i % 3 == 0 {
            let _ = s.write_all(b"GET /metr");
        }
        idle.push(s);
    }
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let asked = Instant::now();
        let (status, _) = get(port, "/ready").expect("/ready answers within 5 s");
        slowest = slowest.max(asked.elapsed());
        assert_eq!(status, 200);
    }
    drop(idle);
    let _ = proxy.kill();
    let _ = proxy.wait();
    // Answered at all (`get` waits 5 s) is what a locked-out probe never is; how fast is a
    // figure, printed, not a bound (the goal is under 100 ms: milliseconds here when idle).
    eprintln!("/ready with 200 idle connections held: slowest of 5 answers {slowest:?}");
}
