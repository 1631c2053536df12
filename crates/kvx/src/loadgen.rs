//! The prefill side of the synthetic workload, shared by `kvx demo` and `kvx sender`: worker
//! tasks that take planned requests from a queue and prefill each on every TP rank at once
//! (as vLLM's TP workers each store their rank's KV), with optional cancels, and tally the
//! outcomes.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use indicatif::ProgressBar;
use kvx_io::Env;
use kvx_node::synthetic::{self, SyntheticRequest};
use kvx_node::{ProxyHandle, SenderHandle};
use kvx_proto::sender::SendFailure;
use kvx_proto::{PeerId, ReqId};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::workload::Planned;

/// Outcomes of the requests so far.
#[derive(Debug, Default)]
pub struct Tally {
    pub completed: u64,
    pub failed: u64,
    /// Failed because `--cancel-fraction` cancelled them.
    pub cancelled: u64,
    /// Of each completed request: from its beginning (before its admission probe) to its
    /// ProxyNotif at the proxy (demo), or to delivery on every rank (sender). What a user
    /// waits, admission included.
    pub request_latencies: Vec<Duration>,
    /// Of each completed request: from its first batch submitted (on any rank) to the same
    /// end. The transfer alone, admission and staging waits before the first batch excluded.
    pub transfer_latencies: Vec<Duration>,
    pub admission_waits: Vec<Duration>,
    pub bytes_sent: u64,
}

pub type SharedTally = Arc<Mutex<Tally>>;

pub fn lock(t: &SharedTally) -> MutexGuard<'_, Tally> {
    t.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// One prefill worker process: a sender per TP rank, each connected to that rank's receiver.
pub struct Worker<E: Env> {
    pub ranks: Vec<(SenderHandle<E>, PeerId)>,
    pub proxy: Option<ProxyHandle>,
    pub batch_chunks: u32,
    pub chunk_bytes: usize,
}

impl<E: Env> Clone for Worker<E> {
    fn clone(&self) -> Self {
        Self {
            ranks: self.ranks.clone(),
            proxy: self.proxy.clone(),
            batch_chunks: self.batch_chunks,
            chunk_bytes: self.chunk_bytes,
        }
    }
}

/// Stops a running plan: no request begins after `stop`, and those under way are cancelled
/// on every rank (their CancelNotif goes out; each ends as cancelled, or as it was ending).
pub struct Control<E: Env> {
    queue: Arc<Mutex<VecDeque<Planned>>>,
    in_flight: Arc<Mutex<BTreeSet<ReqId>>>,
    ranks: Vec<SenderHandle<E>>,
}

impl<E: Env> Control<E> {
    /// Returns how many requests were under way (and cancelled) and how many never began.
    pub fn stop(&self) -> (usize, usize) {
        let never_began = {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            let n = q.len();
            q.clear();
            n
        };
        let under_way: Vec<ReqId> = self
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect();
        for id in &under_way {
            for s in &self.ranks {
                // Already ended is fine: the cancel raced the delivery.
                let _ = s.cancel(id);
            }
        }
        (under_way.len(), never_began)
    }
}

/// Starts `interleave` tasks that prefill `plan` concurrently.
pub fn spawn<E: Env>(
    worker: Worker<E>,
    plan: Vec<Planned>,
    interleave: u32,
    tally: SharedTally,
    bar: ProgressBar,
) -> (Vec<JoinHandle<()>>, Control<E>) {
    let queue = Arc::new(Mutex::new(plan.into_iter().collect::<VecDeque<_>>()));
    let in_flight: Arc<Mutex<BTreeSet<ReqId>>> = Arc::default();
    let control = Control {
        queue: queue.clone(),
        in_flight: in_flight.clone(),
        ranks: worker.ranks.iter().map(|(s, _)| s.clone()).collect(),
    };
    let tasks = (0..interleave)
        .map(|_| {
            let (worker, queue, tally, bar, in_flight) = (
                worker.clone(),
                queue.clone(),
                tally.clone(),
                bar.clone(),
                in_flight.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                    let Some(p) = next else { return };
                    let id = ReqId(p.req_id.clone());
                    in_flight
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(id.clone());
                    one(&worker, &p, &tally).await;
                    in_flight
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&id);
                    bar.inc(1);
                }
            })
        })
        .collect();
    (tasks, control)
}

async fn one<E: Env>(w: &Worker<E>, p: &Planned, tally: &SharedTally) {
    let req_id = ReqId(p.req_id.clone());
    let begun = Instant::now();
    let at_proxy = match &w.proxy {
        Some(proxy) => match proxy.expect(req_id.clone(), w.ranks.len() as u32).await {
            Ok(rx) => Some(rx),
            Err(e) => {
                tracing::error!(req = %p.req_id, error = %e, "proxy refused to await the request");
                lock(tally).failed += 1;
                return;
            }
        },
        None => None,
    };
    if let Some(after) = p.cancel_after {
        let handles: Vec<_> = w.ranks.iter().map(|(s, _)| s.clone()).collect();
        let id = req_id.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            for s in handles {
                // Already ended is fine: the cancel raced the delivery.
                let _ = s.cancel(&id);
            }
        });
    }
    // Ranks are admitted one after another, in rank order, before any transfers: the
    // protocol's rule for TP (docs/spec/protocol.md §Tensor parallelism). Then every rank
    // transfers at once, as vLLM's TP workers each store their own rank's KV.
    let reqs: Vec<_> = w
        .ranks
        .iter()
        .map(|(_, peer)| SyntheticRequest {
            req_id: req_id.clone(),
            receiver: *peer,
            chunks: p.chunks,
            batch_chunks: w.batch_chunks,
            chunk_bytes: w.chunk_bytes,
        })
        .collect();
    let mut waits = Vec::with_capacity(reqs.len());
    for ((sender, _), req) in w.ranks.iter().zip(&reqs) {
        match synthetic::admit(sender, req).await {
            Ok(wait) => waits.push(wait),
            Err(failure) => {
                for (s, _) in &w.ranks {
                    let _ = s.cancel(&req_id);
                }
                waits.clear();
                tracing::debug!(req = %p.req_id, %failure, "admission failed on a rank");
                break;
            }
        }
    }
    let mut results = Vec::with_capacity(reqs.len());
    if waits.len() == reqs.len() {
        let tasks: Vec<_> = w
            .ranks
            .iter()
            .zip(reqs)
            .zip(waits)
            .map(|(((sender, _), req), wait)| {
                let sender = sender.clone();
                tokio::spawn(async move { synthetic::transfer(&sender, &req, wait).await })
            })
            .collect();
        for t in tasks {
            results.push(t.await.unwrap_or_else(|e| {
                Err(SendFailure::Misuse(format!("prefill task panicked: {e}")))
            }));
        }
    } else {
        // A rank was refused and every rank's request cancelled: collect how each ended.
        for (sender, _) in &w.ranks {
            let failure = sender
                .outcome(&req_id)
                .await
                .err()
                .unwrap_or(SendFailure::Cancelled);
            results.push(Err(failure));
        }
    }
    let proxy_result = match at_proxy {
        Some(rx) => rx
            .await
            .unwrap_or(Err(kvx_proto::proxy::ProxyFailure::ProxyGone)),
        None => Ok(()),
    };
    let ended = Instant::now();
    let mut t = lock(tally);
    let all_ok = results.iter().all(Result::is_ok) && proxy_result.is_ok();
    if all_ok {
        t.completed += 1;
        t.request_latencies
            .push(ended.saturating_duration_since(begun));
        let first = results
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .map(|r| r.first_submit)
            .min()
            .unwrap_or(begun);
        t.transfer_latencies
            .push(ended.saturating_duration_since(first));
        let wait = results
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .map(|r| r.admission_wait)
            .max()
            .unwrap_or_default();
        t.admission_waits.push(wait);
        t.bytes_sent += u64::from(p.chunks) * w.chunk_bytes as u64 * w.ranks.len() as u64;
    } else {
        t.failed += 1;
        // Cancelled on purpose: by --cancel-fraction, or by a stopping sender (`Control`).
        let cancelled = results
            .iter()
            .all(|r| matches!(r, Ok(_) | Err(SendFailure::Cancelled)));
        if p.cancel_after.is_some() || cancelled {
            t.cancelled += 1;
        } else {
            tracing::warn!(req = %p.req_id, ?results, ?proxy_result, "request failed");
        }
    }
}

/// Waits for every worker, at most `deadline`. False when the deadline passed first.
pub async fn finish(workers: Vec<JoinHandle<()>>, deadline: Duration) -> bool {
    let all = async {
        for h in workers {
            if let Err(e) = h.await {
                tracing::error!(error = %e, "a prefill worker panicked");
            }
        }
    };
    tokio::time::timeout(deadline, all).await.is_ok()
}

pub fn percentile_ms(samples: &[Duration], q: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut v: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v[i.min(v.len() - 1)]
}
