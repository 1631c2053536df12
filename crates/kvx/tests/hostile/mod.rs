//! Helpers for tests that attack real `kvx` processes from the network: start a
//! `kvx receiver` or `kvx proxy` (`Kvx`), speak raw ZMTP to it (`zmtp::Peer`), encode
//! LMCache's messages (`lmcache`), watch its memory (`Kvx::rss_kib`) and its log, and check
//! that it still serves a legitimate peer afterwards (`legit_round_trip`).
//!
//! Everything runs on 127.0.0.1 with ports the OS picks; every wait is bounded.
//!
//! Map: `zmtp` (the raw ZMTP 3 peer), `lmcache` (messages through `kvx_proto::wire`),
//! `fabric` (the raw TCP fabric peer: hellos, write headers, acks).

// Each test binary that includes this module uses a part of it.
#![allow(dead_code)]

pub mod fabric;
pub mod lmcache;
pub mod zmtp;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use zmtp::Peer;

/// How long a `kvx` process may take to start listening (a debug build on a loaded host).
const START_WITHIN: Duration = Duration::from_secs(20);

/// Lines of a process's log kept for inspection (each cut to `LOG_LINE_MAX` bytes); later
/// lines are counted, not kept.
const LOG_LINES_KEPT: usize = 10_000;
const LOG_LINE_MAX: usize = 512;

#[derive(Debug, Default)]
struct Log {
    lines: Vec<String>,
    total: u64,
}

/// A running `kvx` process, killed when dropped. Its stderr (the log) is read continuously
/// by a thread, so a process that logs a lot never blocks on a full pipe.
#[derive(Debug)]
pub struct Kvx {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Log>>,
}

impl Kvx {
    /// `kvx receiver` on 127.0.0.1 with ports the OS picks: a buffer of 1024 chunks of
    /// 4 KiB (room for every request a test makes), the TCP fabric, no verification.
    /// `addr()` is its alloc channel (the ROUTER).
    pub fn receiver() -> Kvx {
        Kvx::receiver_with(1024, 4096, &["--no-verify"])
    }

    /// `kvx receiver` as `receiver()` with `buffer_chunks` chunks of `chunk_bytes` and the
    /// flags `extra` (its decoder verifies the synthetic workload unless `--no-verify` is
    /// among them, and logs every corrupt chunk it reads).
    pub fn receiver_with(buffer_chunks: u32, chunk_bytes: u64, extra: &[&str]) -> Kvx {
        Kvx::receiver_at_log(buffer_chunks, chunk_bytes, extra, "warn")
    }

    /// `receiver_with`, whose decoder also says which requests it read and verified
    /// (`decoder verified a request`, with the request's key): the positive twin of a check
    /// that no corrupt bytes were read.
    pub fn receiver_verifying(buffer_chunks: u32, chunk_bytes: u64) -> Kvx {
        Kvx::receiver_at_log(
            buffer_chunks,
            chunk_bytes,
            &[],
            "warn,kvx_node::synthetic=debug",
        )
    }

    /// Waits (bounded by `within`) until the decoder has verified `n` requests whose log
    /// lines contain `needle`; whether it did.
    pub fn wait_verified(&self, needle: &str, n: usize, within: Duration) -> bool {
        let count = || {
            self.lines()
                .iter()
                .filter(|l| l.contains("decoder verified a request") && l.contains(needle))
                .count()
        };
        let deadline = Instant::now() + within;
        while Instant::now() < deadline && count() < n {
            std::thread::sleep(Duration::from_millis(20));
        }
        count() >= n
    }

    /// `receiver()` logging at `rust_log` (e.g. `debug`, to see everything it could say).
    pub fn receiver_logging(rust_log: &str) -> Kvx {
        Kvx::receiver_at_log(1024, 4096, &["--no-verify"], rust_log)
    }

    fn receiver_at_log(
        buffer_chunks: u32,
        chunk_bytes: u64,
        extra: &[&str],
        rust_log: &str,
    ) -> Kvx {
        let (buffer, chunk) = (buffer_chunks.to_string(), chunk_bytes.to_string());
        let mut args = vec![
            "receiver",
            "--alloc-ports",
            "0",
            "--fabric-ports",
            "0",
            "--buffer-chunks",
            &buffer,
            "--chunk-bytes",
            &chunk,
            "--exit-after-s",
            "120",
        ];
        args.extend_from_slice(extra);
        Kvx::start(&args, rust_log, " alloc tcp://")
    }

    /// A receiver's fabric endpoint (its log's `fabric host:port`).
    pub fn fabric_addr(&self) -> SocketAddr {
        self.lines()
            .iter()
            .find_map(|l| {
                let rest = &l[l.find(" fabric ")? + " fabric ".len()..];
                rest.split_whitespace().next()?.parse().ok()
            })
            .expect("the receiver logged its fabric endpoint")
    }

    /// `kvx proxy` on 127.0.0.1 with a port the OS picks, logging each request that becomes
    /// ready (`RUST_LOG` info). `addr()` is its notice channel (the PULL).
    pub fn proxy() -> Kvx {
        Kvx::start(
            &["proxy", "--port", "0", "--exit-after-s", "120"],
            "warn,kvx=info",
            "notices at tcp://",
        )
    }

    /// Starts `kvx args` and waits (bounded) for the stderr line that names its endpoint:
    /// `marker` followed by `host:port`.
    fn start(args: &[&str], rust_log: &str, marker: &str) -> Kvx {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvx"))
            .args(args)
            .env("RUST_LOG", rust_log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvx starts");
        let stderr = child.stderr.take().expect("stderr is piped");
        let log = Arc::new(Mutex::new(Log::default()));
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(mut line) = line else { return };
                let mut log = kept.lock().unwrap_or_else(|p| p.into_inner());
                log.total += 1;
                if log.lines.len() < LOG_LINES_KEPT {
                    let mut cut = line.len().min(LOG_LINE_MAX);
                    while !line.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    line.truncate(cut);
                    log.lines.push(line);
                }
            }
        });
        let mut kvx = Kvx {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            log,
        };
        let started = Instant::now();
        let addr = loop {
            let found = kvx.lines().iter().find_map(|l| {
                let rest = &l[l.find(marker)? + marker.len()..];
                rest.split_whitespace().next()?.parse::<SocketAddr>().ok()
            });
            if let Some(addr) = found {
                break addr;
            }
            if let Ok(Some(status)) = kvx.child.try_wait() {
                panic!("kvx {args:?} exited with {status}: {:?}", kvx.lines());
            }
            assert!(
                started.elapsed() < START_WITHIN,
                "kvx {args:?} did not report its endpoint within {START_WITHIN:?}: {:?}",
                kvx.lines()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        kvx.addr = addr;
        kvx
    }

    /// The endpoint under attack: the receiver's alloc channel or the proxy's notice channel.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Panics, with the log, if the process has exited.
    pub fn assert_alive(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("kvx exited with {status}; its log: {:?}", self.lines());
        }
    }

    /// The process's resident set size (`VmRSS` in `/proc/<pid>/status`), in KiB.
    pub fn rss_kib(&self) -> u64 {
        rss_kib(self.pid())
    }

    /// The log lines kept so far.
    pub fn lines(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .lines
            .clone()
    }

    /// Every log line so far, kept or not.
    pub fn lines_total(&self) -> u64 {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).total
    }

    /// Kept log lines containing `needle`.
    pub fn log_count(&self, needle: &str) -> usize {
        self.lines().iter().filter(|l| l.contains(needle)).count()
    }

    /// Waits (bounded by `within`) for a log line containing `needle`.
    pub fn wait_for_log(&self, needle: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.log_count(needle) > 0 {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.log_count(needle) > 0
    }
}

impl Drop for Kvx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Raises this process's soft limit on open files to at least `needed` (up to the hard
/// limit), before a flood test opens more connections than a 1024 soft limit allows. The
/// `kvx` processes started afterwards inherit it. Panics, saying why, if the hard limit is
/// lower.
pub fn raise_open_files_limit(needed: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current.is_none_or(|soft| soft >= needed) {
        return;
    }
    assert!(
        limit.maximum.is_none_or(|hard| hard >= needed),
        "this test needs {needed} open files; the hard limit is {:?}",
        limit.maximum
    );
    limit.current = Some(needed);
    setrlimit(Resource::Nofile, limit).expect("raise the soft limit on open files");
}

/// `VmRSS` of process `pid`, in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("a VmRSS line")
}

/// A fresh identity for a legitimate test sender: readable, unique within the test run.
pub fn fresh_identity(role: &str) -> Vec<u8> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{role}-{}-{n}-to-receiver", std::process::id()).into_bytes()
}

/// A fresh request id, unique within the test run.
pub fn fresh_req_id(role: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{role}-r{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// What a legitimate LMCache sender does, on a connection of its own: an `AllocRequest`
/// that the receiver grants, then a `CancelNotif` that it acknowledges. Panics, with the
/// receiver's log, if either round trip fails.
pub fn legit_round_trip(kvx: &mut Kvx) {
    kvx.assert_alive();
    let mut peer = Peer::dealer(kvx.addr(), Some(&fresh_identity("legit")))
        .unwrap_or_else(|e| panic!("a legitimate sender connects: {e}; log: {:?}", kvx.lines()));
    legit_round_trip_on(&mut peer, kvx);
}

/// `legit_round_trip` on an open DEALER connection.
pub fn legit_round_trip_on(peer: &mut Peer, kvx: &mut Kvx) {
    let req = fresh_req_id("legit");
    let reply = peer
        .request(&lmcache::alloc_request(&req, 0..2, 2))
        .unwrap_or_else(|e| panic!("AllocRequest answered: {e}; log: {:?}", kvx.lines()));
    assert!(
        lmcache::granted(&reply, 2),
        "granted: {:?}",
        lmcache::alloc_response(&reply)
    );
    let ack = peer
        .request(&lmcache::cancel(&req, 0..2))
        .unwrap_or_else(|e| panic!("CancelNotif answered: {e}; log: {:?}", kvx.lines()));
    assert!(lmcache::alloc_response(&ack).remote_indexes.is_empty());
    kvx.assert_alive();
}

/// A legitimate PUSH sends a `ProxyNotif`; the proxy logs the request ready.
pub fn legit_notice(kvx: &mut Kvx) {
    kvx.assert_alive();
    let req = fresh_req_id("notice");
    let mut peer = Peer::push(kvx.addr())
        .unwrap_or_else(|e| panic!("a legitimate PUSH connects: {e}; log: {:?}", kvx.lines()));
    peer.send(&zmtp::message(&[&lmcache::proxy_notif(&req)]))
        .expect("notice sent");
    assert!(
        kvx.wait_for_log(&req, zmtp::WAIT),
        "the proxy reported {req} ready: {:?}",
        kvx.lines()
    );
    kvx.assert_alive();
}
