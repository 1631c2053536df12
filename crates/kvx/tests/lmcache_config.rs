//! `--lmcache-config`: kvx's receiver, sender and proxy processes started from LMCache YAML
//! files, as the LMCache processes they replace would be, on loopback.

mod processes;

use processes::{free_port, kvx};

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn write(dir: &std::path::Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write the YAML file");
    path
}

/// Waits (at most 20 s) until something accepts on `port`.
fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nothing listens on {port} after 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Ctrl-C (SIGINT) to a service, then its output; killed if it has not exited in 20 s.
fn interrupt(child: Child) -> Output {
    let pid = child.id().to_string();
    let _ = Command::new("kill").args(["-INT", &pid]).status();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut child = child;
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
fn processes_started_from_lmcache_files_move_every_request() {
    let dir = std::env::temp_dir().join(format!("kvx-lmcache-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let (init, alloc, proxy) = (free_port(), free_port(), free_port());
    let decode = write(
        &dir,
        "decode.yaml",
        &format!(
            "chunk_size: 256\nlocal_cpu: false\nenable_pd: true\npd_backend_mode: async\n\
             pd_role: receiver\npd_buffer_size: 16777216\npd_buffer_device: cpu\n\
             pd_peer_host: 127.0.0.1\npd_peer_init_port: [{init}]\npd_peer_alloc_port: [{alloc}]\n\
             pd_proxy_host: 127.0.0.1\npd_proxy_port: {proxy}\npd_allocation_timeout_sec: 30\n"
        ),
    );
    let prefill = write(
        &dir,
        "prefill.yaml",
        &format!(
            "chunk_size: 256\nenable_pd: true\npd_role: sender\npd_buffer_size: 4194304\n\
             pd_buffer_device: cpu\npd_proxy_host: 127.0.0.1\npd_proxy_port: {proxy}\n"
        ),
    );
    let service = |role: &str| {
        kvx()
            .args([role, "--lmcache-config"])
            .arg(&decode)
            .args(["--exit-after-s", "120"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvx starts")
    };
    let proxy_process = service("proxy");
    let receiver = service("receiver");
    wait_listening(proxy);
    wait_listening(alloc);
    let sender = kvx()
        .args(["sender", "--lmcache-config"])
        .arg(&prefill)
        .args(["--receiver-host", "127.0.0.1"])
        .args(["--alloc-ports", &alloc.to_string()])
        .args(["--fabric-ports", &init.to_string()])
        .args([
            "--requests",
            "6",
            "--chunks",
            "2..6",
            "--json",
            "--timeout-s",
            "60",
        ])
        .output()
        .expect("kvx sender runs");
    let receiver = interrupt(receiver);
    let proxy_out = interrupt(proxy_process);
    let _ = std::fs::remove_dir_all(&dir);
    let sender_err = String::from_utf8_lossy(&sender.stderr);
    assert!(sender.status.success(), "sender: {sender_err}");
    let summary: serde_json::Value =
        serde_json::from_slice(&sender.stdout).expect("the sender's JSON");
    assert_eq!(summary["requests_completed"], 6, "{summary}");
    // The proxy, from the same file, heard every request's ProxyNotif.
    let proxy_said = String::from_utf8_lossy(&proxy_out.stdout);
    assert!(proxy_said.contains("6 ready"), "proxy: {proxy_said}");
    // The receiver named the keys it does not use, once; the sender likewise.
    let receiver_err = String::from_utf8_lossy(&receiver.stderr);
    let warned = receiver_err
        .lines()
        .filter(|l| l.contains("does not use"))
        .collect::<Vec<_>>();
    assert_eq!(warned.len(), 1, "receiver: {receiver_err}");
    assert!(
        warned[0].contains("chunk_size") && warned[0].contains("local_cpu"),
        "{}",
        warned[0]
    );
    assert!(sender_err.contains("enable_pd"), "sender: {sender_err}");
}

#[test]
fn a_file_for_another_role_or_with_an_unknown_pd_key_is_refused_at_start() {
    let dir = std::env::temp_dir().join(format!("kvx-lmcache-refuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let cases = [
        (
            "receiver",
            "pd_role: sender\npd_buffer_size: 4194304\n",
            "pd_role: sender",
        ),
        (
            "receiver",
            "pd_role: receiver\npd_peer_alloc_prot: [8400]\n",
            "pd_peer_alloc_prot",
        ),
        (
            "sender",
            "pd_role: sender\npd_buffer_device: cuda\n",
            "pd_buffer_device",
        ),
    ];
    for (role, text, names) in cases {
        let path = write(&dir, "bad.yaml", text);
        let bound = if role == "sender" {
            ["--timeout-s", "5"]
        } else {
            ["--exit-after-s", "5"]
        };
        let out = kvx()
            .args([role, "--lmcache-config"])
            .arg(&path)
            .args(bound)
            .output()
            .expect("kvx runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{role} {text:?}: {err}");
        assert!(err.contains(names), "{role} {text:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
