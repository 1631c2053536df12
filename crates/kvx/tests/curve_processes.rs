//! CURVE between `kvx` processes: `kvx keygen`'s certificates, a receiver and a proxy with
//! `--curve-secret-key` and `--curve-allow`, a sender with `--curve-secret-key` and
//! `--curve-server-key` completing its requests, a NULL sender refused with the reason, and
//! bad key files refused at start naming the file.

mod processes;

use processes::{free_port, kvx};

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Kills its process when dropped, so a failing test leaves none behind.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvx-curve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    dir
}

fn keygen(dir: &Path, name: &str) -> String {
    let out = kvx()
        .args(["keygen", name, "--dir"])
        .arg(dir)
        .output()
        .expect("kvx keygen runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs to its end within `limit` (killed and failed past it).
fn finish(child: Child, limit: Duration) -> std::process::Output {
    let mut child = Running(child);
    let start = Instant::now();
    while child.0.try_wait().expect("wait").is_none() {
        assert!(start.elapsed() < limit, "still running after {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let Running(inner) = &mut child;
    let mut out = std::process::Output {
        status: inner.wait().expect("status"),
        stdout: Vec::new(),
        stderr: Vec::new(),
    };
    use std::io::Read;
    if let Some(mut s) = inner.stdout.take() {
        let _ = s.read_to_end(&mut out.stdout);
    }
    if let Some(mut s) = inner.stderr.take() {
        let _ = s.read_to_end(&mut out.stderr);
    }
    out
}

#[test]
fn a_curve_cluster_serves_its_senders_and_refuses_others() {
    let dir = temp_dir("cluster");
    let said = keygen(&dir, "server");
    assert!(said.contains("server.key_secret"), "{said}");
    keygen(&dir, "prefill-0");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("server.key_secret"))
            .expect("written")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the secret certificate is the owner's");
    }
    let allowed = dir.join("allowed");
    std::fs::create_dir_all(&allowed).expect("mkdir");
    std::fs::copy(dir.join("prefill-0.key"), allowed.join("prefill-0.key")).expect("copy");
    let server_secret = dir.join("server.key_secret");

    let (alloc, fabric, proxy) = (free_port(), free_port(), free_port());
    let spawn = |cmd: &mut std::process::Command| {
        Running(
            cmd.stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("kvx starts"),
        )
    };
    let curve_server = |cmd: &mut std::process::Command| {
        cmd.arg("--curve-secret-key")
            .arg(&server_secret)
            .arg("--curve-allow")
            .arg(&allowed);
    };
    let mut p = kvx();
    p.args(["proxy", "--port", &proxy.to_string()]);
    curve_server(&mut p);
    let _proxy = spawn(&mut p);
    let mut r = kvx();
    r.args(["receiver", "--chunk-bytes", "65536"])
        .args(["--alloc-ports", &alloc.to_string()])
        .args(["--fabric-ports", &fabric.to_string()]);
    curve_server(&mut r);
    let _receiver = spawn(&mut r);
    listening(alloc);
    listening(proxy);

    let sender = |curve: bool| {
        let mut s = kvx();
        s.args(["sender", "--json", "--chunk-bytes", "65536"])
            .args(["--alloc-ports", &alloc.to_string()])
            .args(["--fabric-ports", &fabric.to_string()])
            .args(["--proxy", &format!("127.0.0.1:{proxy}")])
            .args(["--requests", "5", "--chunks", "2..4", "--timeout-s", "20"]);
        if curve {
            s.arg("--curve-secret-key")
                .arg(dir.join("prefill-0.key_secret"))
                .arg("--curve-server-key")
                .arg(dir.join("server.key"));
        }
        s.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvx sender starts")
    };
    let out = finish(sender(true), Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the CURVE sender: {err}");
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the sender's JSON");
    assert_eq!(s["requests_completed"], 5, "{s}");

    // A sender without keys speaks NULL: refused, and told why.
    let out = finish(sender(false), Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("the NULL sender: {err}");
    assert!(!out.status.success(), "a NULL sender is refused");
    assert!(err.contains("CURVE"), "the reason names CURVE: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_key_files_are_refused_at_start_naming_the_file() {
    let dir = temp_dir("bad-files");
    keygen(&dir, "server");
    let port = free_port().to_string();
    let start = |secret: &Path, allow: &Path| {
        kvx()
            .args(["proxy", "--port", &port, "--exit-after-s", "5"])
            .arg("--curve-secret-key")
            .arg(secret)
            .arg("--curve-allow")
            .arg(allow)
            .output()
            .expect("kvx runs")
    };
    // The public certificate where the secret one belongs.
    let out = start(&dir.join("server.key"), &dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("server.key") && err.contains("no secret-key"),
        "{err}"
    );
    // A missing allow-list directory.
    let out = start(&dir.join("server.key_secret"), &dir.join("missing"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("missing"), "{err}");
    // A key that is not 40 Z85 characters.
    let short = dir.join("short.key_secret");
    std::fs::write(
        &short,
        "curve\n    public-key = \"abcde\"\n    secret-key = \"abcde\"\n",
    )
    .expect("write");
    let out = start(&short, &dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("32 bytes"), "{err}");
    // One flag of the pair alone.
    let out = kvx()
        .args(["proxy", "--port", &port, "--curve-allow"])
        .arg(&dir)
        .output()
        .expect("kvx runs");
    assert!(!out.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}
