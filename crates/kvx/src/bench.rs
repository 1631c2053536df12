//! `kvx bench`: fabric throughput from one process's registered memory into another's, with a
//! baseline measured in the same run (the machine may be shared and noisy: the ratio is what
//! to compare). The exposing side is a child process (`kvx bench-serve`, hidden).
//!
//! Baselines: for `tcp` and `rdma`, one plain TCP stream on loopback moving the same bytes in
//! chunk-sized writes; for `shm`, a `memcpy` of the same chunks between two buffers of the same
//! size in this process. For `rdma` both processes use the same device, so the writes loop
//! through the NIC (its PCIe and DMA engines, not the wire): a check that the device, its
//! memory registration and queue pairs work, and an upper bound for one host
//! (docs/operations.md §Checking a setup).

use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvx_io::{Fabric, PostWrite, SlotGeometry, SlotMemory};
use kvx_proto::{SlotIndex, StagingSlot, WriteId};
use kvx_transport::shm_fabric::ShmFabric;
use kvx_transport::tcp_fabric::TcpFabric;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::cli::{BenchArgs, BenchServeArgs, FabricKind};

#[derive(Debug, Serialize)]
pub struct BenchSummary {
    pub fabric: String,
    pub chunk_bytes: u64,
    pub total_bytes: u64,
    pub window: u32,
    /// Whether each write carried its checksum (`--checksums`).
    pub checksums: bool,
    pub seconds: f64,
    pub bytes_per_sec: f64,
    pub baseline: String,
    pub baseline_bytes_per_sec: f64,
    /// bytes_per_sec / baseline_bytes_per_sec.
    pub ratio: f64,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let chunk = usize::try_from(args.chunk_bytes)?;
    let writes = args.total_bytes.div_ceil(args.chunk_bytes);
    let fabric_name = match args.fabric {
        FabricKind::Tcp => "tcp",
        FabricKind::Shm => "shm",
        FabricKind::Rdma => "rdma",
        FabricKind::Mem => {
            bail!("--fabric mem moves nothing between processes; use tcp, shm or rdma")
        }
    };
    // Open the device before starting the other side: no device is a plain error.
    #[cfg(feature = "rdma")]
    let rdma = match args.fabric {
        FabricKind::Rdma => Some(crate::envs::rdma(&args.rdma)?),
        _ => None,
    };
    #[cfg(not(feature = "rdma"))]
    if args.fabric == FabricKind::Rdma {
        match crate::envs::rdma(&args.rdma)? {}
    }
    let rdma_flags = match args.fabric {
        FabricKind::Rdma => args.rdma.to_flags(),
        _ => Vec::new(),
    };
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args([
            "bench-serve",
            "--fabric",
            fabric_name,
            "--chunk-bytes",
            &args.chunk_bytes.to_string(),
        ])
        .args(["--slots", &args.window.to_string()])
        .args(rdma_flags)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the exposing side (kvx bench-serve)")?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(20),
        BufReader::new(stdout).read_line(&mut line),
    )
    .await
    .context("the exposing side did not start within 20 s")??;
    let mut parts = line.split_whitespace();
    let (Some("ENDPOINTS"), Some(endpoint), Some(baseline_port), Some(credential)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        bail!("unexpected line from kvx bench-serve: {line:?}");
    };
    let credential = kvx_io::FabricCredential::from_text(credential)
        .with_context(|| format!("bad credential from kvx bench-serve: {line:?}"))?;
    let (baseline, baseline_rate) = match args.fabric {
        FabricKind::Tcp | FabricKind::Rdma => (
            "single-stream loopback TCP".to_owned(),
            tcp_baseline(baseline_port, chunk, args.window, writes).await?,
        ),
        _ => (
            "memcpy between two buffers".to_owned(),
            memcpy_baseline(chunk, args.window, writes),
        ),
    };
    let sums = args.checksums.computed();
    let (seconds, rate) = match args.fabric {
        FabricKind::Tcp => {
            fabric_rate(
                TcpFabric::new(),
                endpoint,
                credential,
                chunk,
                args.window,
                writes,
                sums,
            )
            .await?
        }
        #[cfg(feature = "rdma")]
        FabricKind::Rdma => {
            let fabric = rdma.context("invariant: the RDMA device was opened above")?;
            fabric_rate(
                fabric,
                endpoint,
                credential,
                chunk,
                args.window,
                writes,
                sums,
            )
            .await?
        }
        _ => {
            let fabric = ShmFabric::new();
            fabric_rate(
                fabric,
                endpoint,
                credential,
                chunk,
                args.window,
                writes,
                sums,
            )
            .await?
        }
    };
    drop(child.stdin.take()); // tells the child to exit
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    let s = BenchSummary {
        fabric: fabric_name.into(),
        chunk_bytes: args.chunk_bytes,
        total_bytes: writes * args.chunk_bytes,
        window: args.window,
        checksums: sums,
        seconds,
        bytes_per_sec: rate,
        baseline,
        baseline_bytes_per_sec: baseline_rate,
        ratio: rate / baseline_rate.max(1.0),
    };
    if args.json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        println!(
            "kvx bench — {} fabric: {:.2} GB/s ({} × {} B in {:.3} s, {} in flight, checksums {}); baseline ({}): {:.2} GB/s; ratio {:.2}",
            s.fabric,
            s.bytes_per_sec / 1e9,
            writes,
            s.chunk_bytes,
            s.seconds,
            s.window,
            if s.checksums { "on" } else { "off" },
            s.baseline,
            s.baseline_bytes_per_sec / 1e9,
            s.ratio
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `writes` chunks, at most `window` in flight, each with its checksum when `sums` (as
/// a kvx sender sends them; computed once per staging slot, so the sender's cost of taking
/// them is not measured, the receiver's check is), and returns (seconds, bytes/s).
async fn fabric_rate<F: Fabric>(
    fabric: F,
    endpoint: &str,
    credential: kvx_io::FabricCredential,
    chunk: usize,
    window: u32,
    writes: u64,
    sums: bool,
) -> anyhow::Result<(f64, f64)> {
    let staging = fabric.allocate_staging(SlotGeometry::new(window, chunk)?)?;
    let mut checksums = Vec::new();
    for s in 0..window {
        staging.fill_slot(s, chunk, &mut |b| b.fill(s as u8));
        checksums.push(kvx_io::chunk_checksum(&vec![s as u8; chunk]));
    }
    let mut conn = fabric
        .connect(endpoint, staging.clone(), credential)
        .await
        .context("connecting to the exposed buffer")?;
    let started = Instant::now();
    let (mut posted, mut done) = (0u64, 0u64);
    while done < writes {
        while posted < writes && posted - done < u64::from(window) {
            let slot = (posted % u64::from(window)) as u32;
            // The bench's buffer holds standing grants: any generation is admitted.
            let tag = kvx_proto::WriteTag {
                slot: SlotIndex(slot),
                generation: 0,
            };
            conn.post(PostWrite {
                id: WriteId(posted),
                local: StagingSlot(slot),
                remote: SlotIndex(slot),
                len: chunk,
                imm: Some(tag.to_imm()),
                checksum: sums.then(|| checksums[slot as usize]),
            })?;
            posted += 1;
        }
        let c = tokio::time::timeout(Duration::from_secs(30), conn.next_completion())
            .await
            .context("a write did not complete within 30 s")?
            .context("the connection closed")?;
        c.result
            .with_context(|| format!("write {} failed", c.id.0))?;
        done += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    drop(staging);
    Ok((secs, (writes * chunk as u64) as f64 / secs))
}

async fn tcp_baseline(port: &str, chunk: usize, window: u32, writes: u64) -> anyhow::Result<f64> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port.parse::<u16>()?)).await?;
    stream.set_nodelay(true)?;
    let bufs: Vec<Vec<u8>> = (0..window).map(|i| vec![i as u8; chunk]).collect();
    let started = Instant::now();
    for i in 0..writes {
        stream
            .write_all(&bufs[(i % u64::from(window)) as usize])
            .await?;
    }
    stream.shutdown().await?;
    // The child acknowledges with one byte once it has read everything.
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).await?;
    Ok((writes * chunk as u64) as f64 / started.elapsed().as_secs_f64())
}

fn memcpy_baseline(chunk: usize, window: u32, writes: u64) -> f64 {
    let src: Vec<Vec<u8>> = (0..window).map(|i| vec![i as u8; chunk]).collect();
    let mut dst: Vec<Vec<u8>> = (0..window).map(|_| vec![0u8; chunk]).collect();
    let started = Instant::now();
    for i in 0..writes {
        let k = (i % u64::from(window)) as usize;
        dst[k].copy_from_slice(&src[k]);
        std::hint::black_box(&dst[k]);
    }
    (writes * chunk as u64) as f64 / started.elapsed().as_secs_f64()
}

/// The hidden child: exposes a buffer, serves the TCP baseline, and exits when stdin closes.
pub async fn serve(args: BenchServeArgs) -> anyhow::Result<ExitCode> {
    let chunk = usize::try_from(args.chunk_bytes)?;
    let geometry = SlotGeometry::new(args.slots, chunk)?;
    let (endpoint, credential) = match args.fabric {
        FabricKind::Shm => {
            let l = ShmFabric::new().expose("127.0.0.1:0", geometry).await?;
            let e = open_to_the_bench(&l);
            tokio::spawn(async move { hold(l).await });
            e
        }
        #[cfg(feature = "rdma")]
        FabricKind::Rdma => {
            let l = crate::envs::rdma(&args.rdma)?
                .expose("127.0.0.1:0", geometry)
                .await?;
            let e = open_to_the_bench(&l);
            tokio::spawn(async move { hold(l).await });
            e
        }
        #[cfg(not(feature = "rdma"))]
        FabricKind::Rdma => match crate::envs::rdma(&args.rdma)? {},
        _ => {
            let l = TcpFabric::new().expose("127.0.0.1:0", geometry).await?;
            let e = open_to_the_bench(&l);
            tokio::spawn(async move { hold(l).await });
            e
        }
    };
    let baseline = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = baseline.local_addr()?.port();
    let slots = args.slots;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = baseline.accept().await {
            let mut bufs: Vec<Vec<u8>> = (0..slots).map(|_| vec![0u8; chunk]).collect();
            tokio::spawn(async move {
                let mut i = 0usize;
                loop {
                    let n = bufs.len();
                    let b = &mut bufs[i % n];
                    match s.read_exact(b).await {
                        Ok(_) => i += 1,
                        Err(_) => break,
                    }
                }
                let _ = s.write_all(&[1]).await;
            });
        }
    });
    println!("ENDPOINTS {endpoint} {port} {credential}");
    let mut stdin = tokio::io::stdin();
    let mut sink = [0u8; 64];
    while matches!(stdin.read(&mut sink).await, Ok(n) if n > 0) {}
    Ok(ExitCode::SUCCESS)
}

/// Gives the bench's sender (peer 1) standing grants on every slot: it streams writes with
/// no ledger to re-grant each one. Returns the endpoint and the sender's credential.
fn open_to_the_bench<M>(l: &kvx_io::FabricListener<M>) -> (String, String) {
    let peer = kvx_proto::PeerId(1);
    for slot in 0..l.access.slots() {
        l.access.grant_standing(slot, peer);
    }
    (
        l.local_endpoint.clone(),
        l.access.credential_for(peer).to_text(),
    )
}

/// Keeps an exposed buffer alive, draining landed notices.
async fn hold<M: SlotMemory>(mut l: kvx_io::FabricListener<M>) {
    let _keep: Arc<M> = l.memory.clone();
    while l.landed.recv().await.is_some() {}
}
