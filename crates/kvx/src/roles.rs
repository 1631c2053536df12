//! `kvx receiver`, `kvx sender` and `kvx proxy`: the parts of a cluster as separate
//! processes, generic over the `Env` that `envs` picks.

use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use indicatif::ProgressBar;
use kvx_embed::defaults;
use kvx_io::Env;
use kvx_node::{ProxyNode, ReceiverAddr, ReceiverNode, ReceiverNotice, SenderNode, NOTICE_LINGER};
use kvx_proto::proxy::ProxyEvent;
use kvx_proto::{ReceiverConfig, SenderConfig};
use serde::Serialize;
use tokio::time::Instant;

use crate::cli::{ProxyArgs, ReceiverArgs, SenderArgs};
use crate::decoder::{self, DecodeTally};
use crate::health::{self, Readiness};
use crate::knobs::{ReceiverFlags, SenderFlags};
use crate::lmcache_config::{self, Role};
use crate::loadgen::{self, SharedTally, Worker};
use crate::signals;
use crate::workload::{self, Rng};

/// How endpoint strings look for the chosen transport and fabric.
#[derive(Debug, Clone, Copy)]
pub struct Style {
    /// e.g. `tcp://{host}:{port}` for ZMQ.
    pub control: fn(&str, u16) -> String,
    /// e.g. `{host}:{port}` for the TCP fabric.
    pub fabric: fn(&str, u16) -> String,
}

/// A sender's id, the start of its ZMQ routing identity (`{id}-to-{alloc endpoint}`):
/// `prefix` for whoever reads the logs, then 128 random bits from the OS. An identity a peer
/// can guess (a pid, an index) is one it can claim while the sender is reconnecting, and then
/// act under the sender's `PeerId` (cancel its requests, take its replies) and keep it out
/// (`docs/spec/zmq.md` §3). 32 hex digits keep the identity far below libzmq's 255 bytes.
pub fn sender_id(prefix: &str) -> anyhow::Result<String> {
    let mut bits = [0u8; 16];
    getrandom::fill(&mut bits).map_err(|e| anyhow::anyhow!("the OS random source failed: {e}"))?;
    Ok(format!("{prefix}-{}", hex::encode(bits)))
}

/// The (alloc, fabric) port of each TP rank, LMCache's layout; defaults to one rank on
/// 8400 / 8300.
fn ports(alloc: Option<Vec<u16>>, fabric: Option<Vec<u16>>) -> anyhow::Result<Vec<(u16, u16)>> {
    let (alloc, fabric) = (
        alloc.unwrap_or_else(|| vec![8400]),
        fabric.unwrap_or_else(|| vec![8300]),
    );
    if alloc.is_empty() || alloc.len() != fabric.len() {
        bail!(
            "need one alloc port and one fabric port per TP rank: got {} alloc and {} fabric ports",
            alloc.len(),
            fabric.len()
        );
    }
    Ok(alloc.into_iter().zip(fabric).collect())
}

pub async fn receiver<E: Env>(
    env: E,
    style: Style,
    args: ReceiverArgs,
) -> anyhow::Result<ExitCode> {
    let lmc =
        lmcache_config::load(args.lmcache_config.as_deref(), Role::Receiver)?.unwrap_or_default();
    let host = args
        .host
        .or(lmc.peer_host.clone())
        .unwrap_or_else(|| "127.0.0.1".into());
    let ranks = ports(
        args.alloc_ports.or(lmc.alloc_ports.clone()),
        args.fabric_ports.or(lmc.init_ports.clone()),
    )?;
    let chunk_bytes = args.chunk_bytes.unwrap_or(defaults::CHUNK_BYTES);
    let buffer_slots = match args.buffer_chunks {
        Some(n) => n,
        None => lmc
            .buffer_chunks(chunk_bytes)?
            .unwrap_or(ReceiverConfig::default().buffer_slots),
    };
    let chunk_bytes = usize::try_from(chunk_bytes)?;
    crate::memory_check::check(&[crate::memory_check::Need {
        what: "the receive buffers",
        slots: u64::from(buffer_slots),
        slot_bytes: chunk_bytes as u64,
        count: ranks.len() as u64,
    }])?;
    let readiness = match &args.metrics {
        Some(addr) => health::serve(addr, "receiver").await?,
        None => Readiness::default(),
    };
    let cfg = args.protocol.apply(ReceiverFlags {
        buffer_slots,
        require_checksums: args.checksums.required(),
        lmcache_allocation_timeout: lmc.allocation_timeout,
    })?;
    let tally = Arc::new(DecodeTally::default());
    let mut readers = Vec::new();
    for (rank, (alloc, fabric)) in ranks.iter().enumerate() {
        let (alloc, fabric) = (
            (style.control)(&host, *alloc),
            (style.fabric)(&host, *fabric),
        );
        let mut node = ReceiverNode::start(env.clone(), cfg.clone(), chunk_bytes, &alloc, &fabric)
            .await
            .with_context(|| format!("starting TP rank {rank} at {alloc} / {fabric}"))?;
        eprintln!(
            "kvx receiver: rank {rank}: alloc {} fabric {}",
            node.alloc_endpoint(),
            node.fabric_endpoint()
        );
        readers.push(node.reader().clone());
        let (tally, verify) = (tally.clone(), !args.no_verify);
        tokio::spawn(async move {
            while let Some(notice) = node.next_notice().await {
                match notice {
                    ReceiverNotice::Ready(ready) => {
                        decoder::spawn(node.reader(), ready, chunk_bytes, verify, &tally);
                    }
                    ReceiverNotice::Ended { key, outcome } => {
                        tracing::info!(%key, %outcome, "request ended")
                    }
                }
            }
        });
    }
    readiness.set(true);
    let why = signals::first_stop(args.exit_after_s.map(Duration::from_secs)).await;
    // Stop: out of rotation first, then the requests being decoded finish (bounded), then
    // the channels close, which tells every sender at once (their requests in flight fail
    // as channel lost rather than at a timeout).
    readiness.set(false);
    let drained = tokio::time::timeout(signals::DRAIN_BOUND, async {
        while tally.in_progress.load(Ordering::Acquire) > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .is_ok();
    for reader in &readers {
        reader.shutdown().await;
    }
    let corrupt = tally.corrupted.load(Ordering::Relaxed);
    println!(
        "kvx receiver: stopped ({why}): {} bytes verified, {corrupt} corrupt chunks{}",
        tally.verified.load(Ordering::Relaxed),
        if drained { "" } else { ", decoding cut short" }
    );
    Ok(if corrupt == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `kvx sender`'s result (`--json` prints exactly this).
#[derive(Debug, Serialize)]
pub struct SenderSummary {
    pub requests_total: u64,
    pub requests_completed: u64,
    pub requests_failed: u64,
    pub requests_cancelled: u64,
    /// Requests a stop (SIGINT, SIGTERM) kept from beginning.
    pub requests_not_begun: u64,
    /// Requests that neither ended nor were kept from beginning.
    pub requests_lost: u64,
    /// The signal that stopped the run early, if one did.
    pub stopped_by: Option<String>,
    pub bytes_sent: u64,
    pub makespan_s: f64,
    pub bytes_per_sec: f64,
    /// From a request's beginning (before its admission probe) to its delivery on every rank.
    pub request_latency_ms_p50: f64,
    pub request_latency_ms_p99: f64,
    /// From a request's first batch submitted to its delivery on every rank.
    pub transfer_ms_p50: f64,
    pub transfer_ms_p99: f64,
    pub admission_wait_ms_p99: f64,
}

pub async fn sender<E: Env>(env: E, style: Style, args: SenderArgs) -> anyhow::Result<ExitCode> {
    let lmc =
        lmcache_config::load(args.lmcache_config.as_deref(), Role::Sender)?.unwrap_or_default();
    let host = args.receiver_host.unwrap_or_else(|| "127.0.0.1".into());
    let ranks = ports(args.alloc_ports, args.fabric_ports)?;
    let proxy = args
        .proxy
        .or(lmc.proxy())
        .unwrap_or_else(|| "127.0.0.1:8500".into());
    let (proxy_host, proxy_port) = split_host_port(&proxy)?;
    let proxy = (style.control)(&proxy_host, proxy_port);
    let chunk_bytes = args.chunk_bytes.unwrap_or(defaults::CHUNK_BYTES);
    let staging_slots = match args.staging_chunks {
        Some(n) => n,
        None => lmc
            .buffer_chunks(chunk_bytes)?
            .unwrap_or(SenderConfig::default().staging_slots),
    };
    let chunk_bytes = usize::try_from(chunk_bytes)?;
    crate::memory_check::check(&[crate::memory_check::Need {
        what: "the staging pools",
        slots: u64::from(staging_slots),
        slot_bytes: chunk_bytes as u64,
        count: ranks.len() as u64,
    }])?;
    let cfg = args.protocol.apply(SenderFlags {
        staging_slots,
        checksums: args.checksums.computed(),
        lmcache_allocation_timeout: lmc.allocation_timeout,
    })?;
    let readiness = match &args.metrics {
        Some(addr) => health::serve(addr, "sender").await?,
        None => Readiness::default(),
    };
    let mut handles = Vec::new();
    for (rank, (alloc, fabric)) in ranks.iter().enumerate() {
        let id = sender_id(&format!("kvx-sender-{}-rank{rank}", args.sender_index))?;
        let node = SenderNode::start(
            env.clone(),
            cfg.clone(),
            chunk_bytes,
            id,
            Some(proxy.clone()),
        )
        .await
        .with_context(|| format!("starting the rank {rank} sender"))?;
        let addr = ReceiverAddr {
            alloc: (style.control)(&host, *alloc),
            fabric: (style.fabric)(&host, *fabric),
        };
        let peer = node
            .add_receiver(addr.clone())
            .await
            .with_context(|| format!("connecting rank {rank} to {addr:?}"))?;
        handles.push((node, peer));
    }
    let mut rng = Rng::new(args.workload.seed);
    let plan = workload::plan(
        args.sender_index,
        args.workload.requests,
        &args.workload.chunks,
        args.workload.cancel_fraction,
        &mut rng,
    );
    let bar = if args.workload.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(u64::from(args.workload.requests))
    };
    let tally: SharedTally = Arc::default();
    let started = Instant::now();
    readiness.set(true);
    let nodes: Vec<_> = handles.iter().map(|(node, _)| node.clone()).collect();
    let worker = Worker {
        ranks: handles,
        proxy: None,
        batch_chunks: args.workload.batch_chunks,
        chunk_bytes,
    };
    let (workers, control) = loadgen::spawn(
        worker,
        plan,
        args.workload.interleave,
        tally.clone(),
        bar.clone(),
    );
    let run = loadgen::finish(workers, Duration::from_secs(args.workload.timeout_s));
    tokio::pin!(run);
    let (finished, stopped_by) = tokio::select! {
        finished = &mut run => (finished, None),
        why = signals::first_stop(None) => {
            // Stop: no request begins any more, those under way are cancelled (their
            // CancelNotif goes out) and end within the bound.
            readiness.set(false);
            let (under_way, never) = control.stop();
            eprintln!(
                "kvx sender: {why}: stopping: {under_way} request(s) under way cancelled, \
                 {never} never begun"
            );
            let ended = tokio::time::timeout(signals::DRAIN_BOUND, &mut run)
                .await
                .unwrap_or(false);
            (ended, Some((why, never as u64)))
        }
    };
    readiness.set(false);
    let makespan = started.elapsed().as_secs_f64();
    // Before exiting: the proxy gets the notices already due (the last delivery's
    // ProxyNotif may still be queued), each rank within the same bound.
    for node in &nodes {
        node.shutdown();
    }
    for node in &nodes {
        node.close(NOTICE_LINGER).await;
    }
    bar.finish_and_clear();
    let t = loadgen::lock(&tally);
    let total = u64::from(args.workload.requests);
    let s = SenderSummary {
        requests_total: total,
        requests_completed: t.completed,
        requests_failed: t.failed,
        requests_cancelled: t.cancelled,
        requests_not_begun: stopped_by.map_or(0, |(_, never)| never),
        requests_lost: total
            - (t.completed + t.failed + stopped_by.map_or(0, |(_, never)| never)).min(total),
        stopped_by: stopped_by.map(|(why, _)| why.to_owned()),
        bytes_sent: t.bytes_sent,
        makespan_s: makespan,
        bytes_per_sec: t.bytes_sent as f64 / makespan.max(1e-9),
        request_latency_ms_p50: loadgen::percentile_ms(&t.request_latencies, 0.5),
        request_latency_ms_p99: loadgen::percentile_ms(&t.request_latencies, 0.99),
        transfer_ms_p50: loadgen::percentile_ms(&t.transfer_latencies, 0.5),
        transfer_ms_p99: loadgen::percentile_ms(&t.transfer_latencies, 0.99),
        admission_wait_ms_p99: loadgen::percentile_ms(&t.admission_waits, 0.99),
    };
    if args.workload.json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        println!("{s:#?}");
    }
    let ok = finished && s.requests_lost == 0 && s.requests_failed == s.requests_cancelled;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn split_host_port(s: &str) -> anyhow::Result<(String, u16)> {
    let (host, port) = s
        .rsplit_once(':')
        .with_context(|| format!("{s:?} is not host:port"))?;
    Ok((
        host.to_owned(),
        port.parse().with_context(|| format!("{s:?}: bad port"))?,
    ))
}

pub async fn proxy<E: Env>(env: E, style: Style, args: ProxyArgs) -> anyhow::Result<ExitCode> {
    let lmc =
        lmcache_config::load(args.lmcache_config.as_deref(), Role::Proxy)?.unwrap_or_default();
    let host = args
        .host
        .or(lmc.proxy_host.clone())
        .unwrap_or_else(|| "127.0.0.1".into());
    let port = args.port.or(lmc.proxy_port).unwrap_or(8500);
    // A decoder's LMCache file lists an alloc port per TP rank: a notice comes from each.
    let lmcache_ranks = lmc.alloc_ports.as_ref().map(|p| p.len() as u32);
    let tp_ranks = args.tp_ranks.or(lmcache_ranks).unwrap_or(1);
    // A standalone proxy learns of requests from their first notice.
    let cfg = args.protocol.apply(tp_ranks)?;
    let readiness = match &args.metrics {
        Some(addr) => health::serve(addr, "proxy").await?,
        None => Readiness::default(),
    };
    let (proxy, mut events) = ProxyNode::start_with_events(env, cfg, &(style.control)(&host, port))
        .await
        .context("binding the notice channel")?;
    eprintln!(
        "kvx proxy: notices at {} ({tp_ranks} TP rank(s) per request)",
        proxy.endpoint()
    );
    readiness.set(true);
    let (mut ready, mut failed) = (0u64, 0u64);
    let stop = signals::first_stop(args.exit_after_s.map(Duration::from_secs));
    tokio::pin!(stop);
    loop {
        let ev = tokio::select! {
            _ = &mut stop => break,
            ev = events.next() => ev,
        };
        match ev {
            Some(ProxyEvent::Ready { req_id }) => {
                tracing::info!(%req_id, "ready: every TP rank reported");
                ready += 1;
            }
            Some(ProxyEvent::Failed { req_id, failure }) => {
                tracing::warn!(%req_id, %failure, "failed");
                failed += 1;
            }
            None => break,
        }
    }
    readiness.set(false);
    println!(
        "kvx proxy: stopped: {ready} ready, {failed} failed, {} still awaited",
        proxy.awaited()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sender_ids_are_readable_and_unguessable() {
        let a = sender_id("kvx-sender-0-rank0").expect("OS randomness");
        let b = sender_id("kvx-sender-0-rank0").expect("OS randomness");
        assert_ne!(a, b, "128 random bits each");
        let random = a
            .strip_prefix("kvx-sender-0-rank0-")
            .expect("the prefix first");
        assert_eq!(random.len(), 32);
        assert!(random.bytes().all(|c| c.is_ascii_hexdigit()));
    }
}
