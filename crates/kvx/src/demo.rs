//! `kvx demo`: a proxy, one receiver (with a verifying decoder) and `--senders` senders in one
//! process, over the chosen transport and fabric on loopback; prints a summary table or JSON
//! and exits non-zero when a request is lost, corrupted or stuck, or a slot leaks.

use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use kvx_io::Env;
use kvx_node::{ProxyNode, ReceiverAddr, ReceiverNode, ReceiverNotice, SenderNode};
use kvx_proto::{ProxyConfig, SenderConfig};
use serde::Serialize;
use tokio::time::Instant;

use crate::cli::DemoArgs;
use crate::decoder::{self, DecodeTally};
use crate::knobs::ReceiverFlags;
use crate::loadgen::{self, SharedTally, Worker};
use crate::workload::{self, Rng};

/// Where the demo's parts listen (port 0: the OS picks).
#[derive(Debug, Clone)]
pub struct Endpoints {
    pub transport_name: String,
    pub fabric_name: String,
    pub alloc: String,
    pub proxy: String,
    pub fabric: String,
}

/// The demo's result; `--json` prints exactly this.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub transport: String,
    pub fabric: String,
    pub requests_total: u64,
    pub requests_completed: u64,
    pub requests_failed: u64,
    /// Of the failed: cancelled on purpose (`--cancel-fraction`).
    pub requests_cancelled: u64,
    /// Requests that neither completed nor failed before the timeout.
    pub requests_lost: u64,
    pub chunks_corrupted: u64,
    pub bytes_verified: u64,
    pub makespan_s: f64,
    pub bytes_per_sec: f64,
    /// From a request's beginning (before its admission probe) to its ProxyNotif at the
    /// proxy: what a user waits.
    pub request_latency_ms_p50: f64,
    pub request_latency_ms_p99: f64,
    /// From a request's first batch submitted to its ProxyNotif at the proxy: the transfer
    /// alone.
    pub transfer_ms_p50: f64,
    pub transfer_ms_p99: f64,
    pub admission_wait_ms_p50: f64,
    pub admission_wait_ms_p99: f64,
    /// Receiver slots not free after the run settled.
    pub slots_leaked: u64,
}

impl Summary {
    pub fn ok(&self) -> bool {
        self.requests_lost == 0
            && self.chunks_corrupted == 0
            && self.slots_leaked == 0
            && self.requests_failed == self.requests_cancelled
    }
}

pub async fn run_on<E: Env>(
    env: E,
    endpoints: Endpoints,
    args: DemoArgs,
) -> anyhow::Result<(Summary, ExitCode)> {
    let chunk_bytes = usize::try_from(args.chunk_bytes).context("chunk size")?;
    crate::memory_check::check(&[
        crate::memory_check::Need {
            what: "the receive buffer",
            slots: u64::from(args.buffer_chunks),
            slot_bytes: args.chunk_bytes,
            count: 1,
        },
        crate::memory_check::Need {
            what: "the staging pools",
            slots: u64::from(args.staging_chunks),
            slot_bytes: args.chunk_bytes,
            count: u64::from(args.senders),
        },
    ])?;
    let receiver_cfg = args.receiver.apply(ReceiverFlags {
        buffer_slots: args.buffer_chunks,
        require_checksums: args.checksums.required(),
        lmcache_allocation_timeout: None,
    })?;
    let sender_cfg = SenderConfig {
        staging_slots: args.staging_chunks,
        checksums: args.checksums.computed(),
        ..SenderConfig::default()
    };
    // The demo's own senders and proxy must keep the rules between processes with the
    // receiver it was given; refused here, naming the rule, rather than as failed writes.
    receiver_cfg.check_sender(&sender_cfg)?;
    receiver_cfg.check_proxy(&ProxyConfig::default())?;
    let proxy = ProxyNode::start(env.clone(), ProxyConfig::default(), &endpoints.proxy)
        .await
        .context("starting the proxy")?;
    let mut receiver = ReceiverNode::start(
        env.clone(),
        receiver_cfg,
        chunk_bytes,
        &endpoints.alloc,
        &endpoints.fabric,
    )
    .await
    .context("starting the receiver")?;
    let addr = ReceiverAddr {
        alloc: receiver.alloc_endpoint().to_owned(),
        fabric: receiver.fabric_endpoint().to_owned(),
    };

    let decode_tally = Arc::new(DecodeTally::default());
    let decoded = decode_tally.clone();
    let (snap_tx, mut snap_rx) = tokio::sync::mpsc::channel::<
        tokio::sync::oneshot::Sender<Option<kvx_node::BufferSnapshot>>,
    >(4);
    // The decoder: reads every ready request, checks each byte, and releases it.
    tokio::spawn(async move {
        loop {
            tokio::select! {
                notice = receiver.next_notice() => match notice {
                    Some(ReceiverNotice::Ready(ready)) => {
                        decoder::spawn(receiver.reader(), ready, chunk_bytes, true, &decoded);
                    }
                    Some(ReceiverNotice::Ended { .. }) => {}
                    None => return,
                },
                Some(reply) = snap_rx.recv() => { let _ = reply.send(receiver.reader().snapshot().await.ok()); }
            }
        }
    });

    let total = u64::from(args.senders) * u64::from(args.workload.requests);
    let bar = if args.workload.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
            .expect("invariant: the template is valid")
            .progress_chars("=> "),
    );
    let tally: SharedTally = Arc::default();
    let started = Instant::now();
    let mut rng = Rng::new(args.workload.seed);
    let mut workers = Vec::new();
    for s in 0..args.senders {
        let cfg = sender_cfg.clone();
        let sender = SenderNode::start(
            env.clone(),
            cfg,
            chunk_bytes,
            crate::roles::sender_id(&format!("demo-sender-{s}"))?,
            Some(proxy.endpoint().to_owned()),
        )
        .await
        .with_context(|| format!("starting sender {s}"))?;
        let peer = sender
            .add_receiver(addr.clone())
            .await
            .with_context(|| format!("sender {s} connecting"))?;
        let plan = workload::plan(
            s,
            args.workload.requests,
            &args.workload.chunks,
            args.workload.cancel_fraction,
            &mut rng,
        );
        let worker = Worker {
            ranks: vec![(sender, peer)],
            proxy: Some(proxy.clone()),
            batch_chunks: args.workload.batch_chunks,
            chunk_bytes,
        };
        workers.extend(
            loadgen::spawn(
                worker,
                plan,
                args.workload.interleave,
                tally.clone(),
                bar.clone(),
            )
            .0,
        );
    }
    let finished = loadgen::finish(workers, Duration::from_secs(args.workload.timeout_s)).await;
    let makespan = started.elapsed();
    bar.finish_and_clear();

    // Let the decoder consume the last requests, then check that nothing is left behind.
    let mut snapshot = None;
    for _ in 0..200 {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if snap_tx.send(tx).await.is_err() {
            break;
        }
        snapshot = rx.await.ok().flatten();
        let settled = snapshot.is_some_and(|s| s.tracked_requests == 0 && s.quarantined == 0);
        if settled && decode_tally.in_progress.load(Ordering::Acquire) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let t = loadgen::lock(&tally);
    let bytes_verified = decode_tally.verified.load(Ordering::Relaxed);
    let ended = t.completed + t.failed;
    let summary = Summary {
        transport: endpoints.transport_name.clone(),
        fabric: endpoints.fabric_name.clone(),
        requests_total: total,
        requests_completed: t.completed,
        requests_failed: t.failed,
        requests_cancelled: t.cancelled,
        requests_lost: if finished {
            total - ended
        } else {
            total.saturating_sub(ended)
        },
        chunks_corrupted: decode_tally.corrupted.load(Ordering::Relaxed),
        bytes_verified,
        makespan_s: makespan.as_secs_f64(),
        bytes_per_sec: bytes_verified as f64 / makespan.as_secs_f64().max(1e-9),
        request_latency_ms_p50: loadgen::percentile_ms(&t.request_latencies, 0.50),
        request_latency_ms_p99: loadgen::percentile_ms(&t.request_latencies, 0.99),
        transfer_ms_p50: loadgen::percentile_ms(&t.transfer_latencies, 0.50),
        transfer_ms_p99: loadgen::percentile_ms(&t.transfer_latencies, 0.99),
        admission_wait_ms_p50: loadgen::percentile_ms(&t.admission_waits, 0.50),
        admission_wait_ms_p99: loadgen::percentile_ms(&t.admission_waits, 0.99),
        slots_leaked: snapshot.map_or(u64::from(args.buffer_chunks), |s| {
            u64::from(s.capacity - s.free)
        }),
    };
    let code = if summary.ok() && finished {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    Ok((summary, code))
}

/// The human-readable summary.
pub fn print_table(s: &Summary) {
    let gb = |b: f64| b / 1e9;
    println!("kvx demo — {} control, {} fabric", s.transport, s.fabric);
    println!("  requests        {:>10} total, {} completed, {} failed ({} cancelled on purpose), {} lost", s.requests_total, s.requests_completed, s.requests_failed, s.requests_cancelled, s.requests_lost);
    println!(
        "  bytes verified  {:>10.3} GB   corrupted chunks: {}",
        gb(s.bytes_verified as f64),
        s.chunks_corrupted
    );
    println!(
        "  makespan        {:>10.3} s     throughput: {:.2} GB/s",
        s.makespan_s,
        gb(s.bytes_per_sec)
    );
    println!(
        "  request latency {:>10.2} ms p50, {:.2} ms p99 (request begun, before admission → ProxyNotif at the proxy)",
        s.request_latency_ms_p50, s.request_latency_ms_p99
    );
    println!(
        "  transfer        {:>10.2} ms p50, {:.2} ms p99 (first batch submitted → ProxyNotif at the proxy)",
        s.transfer_ms_p50, s.transfer_ms_p99
    );
    println!(
        "  admission wait  {:>10.2} ms p50, {:.2} ms p99",
        s.admission_wait_ms_p50, s.admission_wait_ms_p99
    );
    println!("  slots leaked    {:>10}", s.slots_leaked);
    println!(
        "  result          {}",
        if s.ok() {
            "OK"
        } else {
            "FAILED: lost, corrupted, leaked or unexpectedly failed requests"
        }
    );
}
