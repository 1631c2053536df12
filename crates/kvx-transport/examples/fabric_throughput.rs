//! Throughput of `TcpFabric` and `ShmFabric`, each against a baseline measured in the same
//! run (the machine is shared and noisy, so the ratios are what to compare):
//! - TCP: a plain single-stream tokio `TcpStream` moving the same bytes on loopback in
//!   chunk-sized `write_all`s, twice: reusing one cache-hot buffer on each side, and cycling
//!   through `window` distinct buffers on each side like the fabric's staging and receive
//!   slots (past the L3 cache, memory bandwidth is what both pay for);
//! - shm: a plain `memcpy` of the same chunks from anonymous staging into a shared mapping
//!   of the same size.
//!
//! Rounds interleave baseline and fabric so drift hits both alike; the summary gives the
//! median rate of each and the median of the per-round ratios.
//!
//! With `--runs N`, TCP instead compares the fabric posting runs of `N` consecutive slots
//! (`kvx_io::WriteRun`, one write each) against the same fabric posting every chunk alone:
//! a run of a layer's KV blocks, where a block is a small chunk.
//!
//! ```text
//! cargo run --release -p kvx-transport --example fabric_throughput -- \
//!     [--gib 2] [--chunk-kib 1024] [--window 16] [--rounds 3] [--only tcp|shm] \
//!     [--sockbuf-kib N] [--workers 2] [--runs N]
//! ```

use std::time::{Duration, Instant};

use kvx_io::SlotGeometry;
use kvx_io::{Fabric, SlotMemory};
use kvx_io::{FabricConn, PostWrite, WriteRun};
use kvx_proto::{SlotIndex, StagingSlot, WriteId};
use kvx_transport::shm_fabric::ShmFabric;
use kvx_transport::tcp_fabric::{TcpFabric, TcpFabricConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, Clone)]
struct Args {
    total: usize,
    chunk: usize,
    window: u32,
    rounds: usize,
    only: Option<String>,
    sockbuf: Option<u32>,
    workers: usize,
    runs: u32,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        total: 2 << 30,
        chunk: 1 << 20,
        window: 16,
        rounds: 3,
        only: None,
        sockbuf: None,
        workers: 2,
        runs: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |v: String| v.parse::<f64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--gib" => a.total = (number(value()?)? * f64::from(1u32 << 30)) as usize,
            "--chunk-kib" => a.chunk = number(value()?)? as usize * 1024,
            "--window" => a.window = number(value()?)? as u32,
            "--rounds" => a.rounds = number(value()?)? as usize,
            "--only" => a.only = Some(value()?),
            "--sockbuf-kib" => a.sockbuf = Some(number(value()?)? as u32 * 1024),
            "--workers" => a.workers = number(value()?)? as usize,
            "--runs" => a.runs = number(value()?)? as u32,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.chunk == 0 || a.window == 0 || a.total < a.chunk || a.rounds == 0 || a.runs == 0 {
        return Err("sizes must be positive and --gib at least one chunk".into());
    }
    if !a.window.is_multiple_of(a.runs) || a.runs as usize > kvx_io::WriteRun::MAX_PIECES {
        return Err(format!(
            "--runs must divide --window and be at most {}",
            kvx_io::WriteRun::MAX_PIECES
        ));
    }
    Ok(a)
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// On-CPU time of every thread of this process so far (`/proc/self/task/*/schedstat`, in ns):
/// the cost of a run, which other tenants of the machine disturb far less than its rate.
fn cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| t.ok())
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Runs `f`, returning its rate in GB/s and its CPU time in ms per GiB.
async fn measure<Fut: std::future::Future<Output = Duration>>(total: usize, f: Fut) -> (f64, f64) {
    let before = cpu_ns();
    let elapsed = f.await;
    let cpu = cpu_ns().saturating_sub(before) as f64 / 1e6;
    (
        gbps(total, elapsed),
        cpu / (total as f64 / f64::from(1u32 << 30)),
    )
}

/// A plain TCP stream on loopback: the writer sends `total` bytes in chunk-sized
/// `write_all`s, the reader reads each chunk in full (`read_exact`). With `buffers == 1` both
/// sides reuse one cache-hot buffer; with `buffers == window` they cycle through as many
/// distinct chunk buffers as the fabric's staging and receive slots, i.e. the same bytes
/// between the same amount of memory.
async fn tcp_baseline(total: usize, chunk: usize, buffers: usize) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let n = total / chunk;
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        let mut bufs = vec![vec![0u8; chunk]; buffers];
        for i in 0..n {
            s.read_exact(&mut bufs[i % buffers]).await.expect("read");
        }
    });
    let mut w = TcpStream::connect(addr).await.expect("connect");
    let srcs: Vec<Vec<u8>> = (0..buffers).map(|k| vec![k as u8; chunk]).collect();
    let start = Instant::now();
    for i in 0..n {
        w.write_all(&srcs[i % buffers]).await.expect("write");
    }
    reader.await.expect("reader");
    start.elapsed()
}

/// A plain memcpy of every chunk from anonymous staging into a shared mapping of the same
/// geometry (an `ShmFabric` buffer, without the fabric).
async fn shm_baseline(total: usize, chunk: usize, window: u32) -> Duration {
    let f = ShmFabric::new();
    let listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(window, chunk).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(window, chunk).expect("a geometry"))
        .expect("staging");
    for k in 0..window {
        staging.write_slot(k, &vec![k as u8; chunk]);
    }
    let n = total / chunk;
    let start = Instant::now();
    for i in 0..n {
        let k = (i % window as usize) as u32;
        staging.with_slot(k, &mut |src| listener.memory.write_slot(k, src));
    }
    start.elapsed()
}

/// `total` bytes through a fabric in chunk-sized writes, `window` in flight, each carrying an
/// immediate, posted `run` consecutive slots at a time as one `WriteRun` (1: each alone);
/// timed until every completion and every landed notice is in.
async fn fabric_run<F: Fabric>(
    f: &F,
    total: usize,
    chunk: usize,
    window: u32,
    run: u32,
) -> Duration {
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(window, chunk).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(window, chunk).expect("a geometry"))
        .expect("staging");
    let mut checksums = Vec::new();
    for k in 0..window {
        let bytes = vec![k as u8 ^ 0x5A; chunk];
        staging.write_slot(k, &bytes);
        checksums.push(kvx_io::chunk_checksum(&bytes));
    }
    // As a receiver's ledger would: this sender is peer 1, and each write's slot is granted
    // to it (a new generation per round) before the write goes out.
    let peer = kvx_proto::PeerId(1);
    let access = listener.access.clone();
    let mut conn: FabricConn = f
        .connect(
            &listener.local_endpoint,
            staging.clone(),
            access.credential_for(peer),
        )
        .await
        .expect("connect");
    let n = total / chunk;
    // As a receiver's ledger does, a slot is granted again only once the notice of its last
    // write was handled (else a reader that falls behind on a busy host fills the notice
    // channel, and a fabric drops what does not fit).
    let handled = std::sync::Arc::new(tokio::sync::Semaphore::new(window as usize));
    let handled_by_reader = handled.clone();
    let notices = tokio::spawn(async move {
        for _ in 0..n {
            listener.landed.recv().await.expect("landed");
            handled_by_reader.add_permits(1);
        }
        listener
    });
    let start = Instant::now();
    let mut done = 0usize;
    let run = run as usize;
    for first in (0..n).step_by(run) {
        let pieces = run.min(n - first);
        while first + pieces > done + window as usize {
            let c = conn.next_completion().await.expect("completion");
            assert_eq!(c.id, WriteId(done as u64));
            assert_eq!(c.result, Ok(()));
            done += 1;
        }
        handled
            .acquire_many(pieces as u32)
            .await
            .expect("the reader holds the semaphore")
            .forget();
        let mut writes = (first..first + pieces).map(|i| {
            let k = (i % window as usize) as u32;
            let generation = (i / window as usize) as u32 + 1;
            access.grant(k, peer, generation);
            let tag = kvx_proto::WriteTag {
                slot: SlotIndex(k),
                generation,
            };
            PostWrite {
                id: WriteId(i as u64),
                local: StagingSlot(k),
                remote: SlotIndex(k),
                len: chunk,
                imm: Some(tag.to_imm()),
                checksum: Some(checksums[k as usize]),
            }
        });
        let mut joined = WriteRun::new(writes.next().expect("a piece"));
        for w in writes {
            joined.push(w, chunk).expect("consecutive slots");
        }
        conn.post_run(joined).map_err(|(e, _)| e).expect("post");
    }
    while done < n {
        let c = conn.next_completion().await.expect("completion");
        assert_eq!(c.result, Ok(()));
        done += 1;
    }
    let listener = notices.await.expect("notices");
    let elapsed = start.elapsed();
    // Outside the timing: the bytes are right.
    let mut got = vec![0u8; chunk];
    for k in 0..window.min(n as u32) {
        listener.memory.read_slot(k, &mut got);
        assert!(got.iter().all(|b| *b == k as u8 ^ 0x5A), "slot {k} intact");
    }
    elapsed
}

/// Bytes of the warm-up pass before the measured rounds (page faults, socket autotuning).
fn warm_bytes(a: &Args) -> usize {
    (a.chunk * a.window as usize * 4).min(a.total)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// One fabric's rates per round, against one or two baselines.
struct Series {
    name: &'static str,
    /// Baseline names and their (rate, cpu ms/GiB) per round.
    bases: Vec<(&'static str, Vec<(f64, f64)>)>,
    fabric: Vec<(f64, f64)>,
}

impl Series {
    fn new(name: &'static str, bases: &[&'static str]) -> Self {
        Series {
            name,
            bases: bases.iter().map(|b| (*b, Vec::new())).collect(),
            fabric: Vec::new(),
        }
    }

    fn push(&mut self, round: usize, bases: &[(f64, f64)], fabric: (f64, f64)) {
        let mut line = format!(
            "round {round} {:<4} fabric {:6.2} GB/s {:5.0} cpu-ms/GiB",
            self.name, fabric.0, fabric.1
        );
        for ((name, runs), base) in self.bases.iter_mut().zip(bases) {
            line += &format!(
                " | {name} {:6.2} GB/s {:5.0} cpu-ms/GiB, ratio {:.3}",
                base.0,
                base.1,
                fabric.0 / base.0
            );
            runs.push(*base);
        }
        println!("{line}");
        self.fabric.push(fabric);
    }

    fn summary(&self) {
        if self.fabric.is_empty() {
            return;
        }
        let rate = |v: &[(f64, f64)]| median(v.iter().map(|r| r.0).collect());
        let cpu = |v: &[(f64, f64)]| median(v.iter().map(|r| r.1).collect());
        let mut line = format!(
            "{:<4} median: fabric {:.2} GB/s {:.0} cpu-ms/GiB",
            self.name,
            rate(&self.fabric),
            cpu(&self.fabric)
        );
        for (name, runs) in &self.bases {
            let ratios = runs
                .iter()
                .zip(&self.fabric)
                .map(|(b, f)| f.0 / b.0)
                .collect();
            line += &format!(
                " | {name} {:.2} GB/s {:.0} cpu-ms/GiB, median ratio {:.3}",
                rate(runs),
                cpu(runs),
                median(ratios)
            );
        }
        println!("{line}");
    }
}

async fn run(a: Args) {
    let tcp = TcpFabric::with_config(TcpFabricConfig {
        socket_buffer: a.sockbuf,
        ..TcpFabricConfig::default()
    });
    let shm = ShmFabric::new();
    let want = |what: &str| a.only.as_deref().is_none_or(|o| o == what);
    let mut tcp_s = Series::new("tcp", &["stream, hot buffer", "stream, same memory"]);
    let mut shm_s = Series::new("shm", &["memcpy, same memory"]);
    let mut runs_s = Series::new("runs", &["each chunk alone"]);
    if a.runs > 1 {
        fabric_run(&tcp, warm_bytes(&a), a.chunk, a.window, 1).await;
        fabric_run(&tcp, warm_bytes(&a), a.chunk, a.window, a.runs).await;
        for round in 0..a.rounds {
            let alone = measure(a.total, fabric_run(&tcp, a.total, a.chunk, a.window, 1)).await;
            let runs = measure(
                a.total,
                fabric_run(&tcp, a.total, a.chunk, a.window, a.runs),
            )
            .await;
            runs_s.push(round, &[alone], runs);
        }
        runs_s.summary();
        return;
    }
    let w = a.window as usize;
    // One warm-up pass each (page faults, socket autotuning), not reported.
    let warm = warm_bytes(&a);
    if want("tcp") {
        tcp_baseline(warm, a.chunk, w).await;
        fabric_run(&tcp, warm, a.chunk, a.window, 1).await;
    }
    if want("shm") {
        shm_baseline(warm, a.chunk, a.window).await;
        fabric_run(&shm, warm, a.chunk, a.window, 1).await;
    }
    for round in 0..a.rounds {
        if want("tcp") {
            let hot = measure(a.total, tcp_baseline(a.total, a.chunk, 1)).await;
            let fab = measure(a.total, fabric_run(&tcp, a.total, a.chunk, a.window, 1)).await;
            let same = measure(a.total, tcp_baseline(a.total, a.chunk, w)).await;
            tcp_s.push(round, &[hot, same], fab);
        }
        if want("shm") {
            let base = measure(a.total, shm_baseline(a.total, a.chunk, a.window)).await;
            let fab = measure(a.total, fabric_run(&shm, a.total, a.chunk, a.window, 1)).await;
            shm_s.push(round, &[base], fab);
        }
    }
    tcp_s.summary();
    shm_s.summary();
}

fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("fabric_throughput: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "moving {:.2} GiB in {} KiB chunks, window {}, runs of {}, {} rounds, {} workers, socket buffers {}",
        a.total as f64 / f64::from(1u32 << 30),
        a.chunk / 1024,
        a.window,
        a.runs,
        a.rounds,
        a.workers,
        a.sockbuf
            .map_or("autotuned".to_owned(), |b| format!("{} KiB", b / 1024))
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(a.workers)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run(a));
}
