//! End-to-end bookkeeping of every request: what its senders (one per TP rank), the proxy and
//! the decoders learned, and the verdicts at the end of a run:
//! - G2: every request ends exactly once at the proxy, and at each rank's sender unless that
//!   sender crashed; the proxy says ready only if no rank failed;
//! - G1: a request the proxy said was ready is read back byte for byte by every rank's
//!   decoder (unless that receiver crashed meanwhile);
//! - G4 (liveness): a request no fault touched (one begun after the faults healed, or any in
//!   a run without faults) is delivered, ready at the proxy and verified by every decoder —
//!   or, when larger than the buffer, refused at once. Under faults a ready request may
//!   still go unread (its receiver crashed, or reclaimed it after `unconsumed_ttl` while
//!   another rank was late); that is allowed there and only there.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::config::RequestPlan;

#[derive(Debug, Clone, Default)]
pub struct RankRecord {
    pub dispatched: bool,
    /// The sender's outcome: Ok when delivered, Err(reason) when failed.
    pub sender: Option<Result<(), String>>,
    /// The sender crashed before it could say.
    pub lost: bool,
    /// The decoder read every chunk (true) or found one that differs (false).
    pub verified: Option<bool>,
    /// How the request ended at this rank's receiver, as its decoder heard.
    pub receiver_end: Option<String>,
    /// When the engine learned the receiver admitted it (engines that await admission).
    pub admitted_at: Option<Duration>,
    /// When the decoder read (or discarded) it.
    pub read_at: Option<Duration>,
}

#[derive(Debug, Clone)]
pub struct ReqRecord {
    pub plan: RequestPlan,
    pub begun_at: Duration,
    pub proxy: Option<Result<(), String>>,
    pub proxy_at: Option<Duration>,
    pub ranks: Vec<RankRecord>,
}

#[derive(Debug, Default)]
pub struct Outcomes {
    pub reqs: BTreeMap<String, ReqRecord>,
    crashes: BTreeMap<String, Vec<Duration>>,
}

impl Outcomes {
    pub fn on_begin(&mut self, plan: &RequestPlan, tp: usize, now: Duration) {
        let rec = ReqRecord {
            plan: plan.clone(),
            begun_at: now,
            proxy: None,
            proxy_at: None,
            ranks: vec![RankRecord::default(); tp],
        };
        self.reqs.insert(plan.id.clone(), rec);
    }

    fn rank(&mut self, req: &str, rank: usize) -> Option<&mut RankRecord> {
        self.reqs.get_mut(req)?.ranks.get_mut(rank)
    }

    pub fn on_dispatch(&mut self, req: &str, rank: usize) {
        if let Some(r) = self.rank(req, rank) {
            r.dispatched = true;
        }
    }

    /// Returns false when the rank had already ended (a double end).
    pub fn on_sender(&mut self, req: &str, rank: usize, outcome: Result<(), String>) -> bool {
        match self.rank(req, rank) {
            Some(r) if r.sender.is_none() => {
                r.sender = Some(outcome);
                true
            }
            _ => false,
        }
    }

    pub fn on_sender_lost(&mut self, req: &str, rank: usize) {
        if let Some(r) = self.rank(req, rank) {
            r.lost = true;
        }
    }

    pub fn on_proxy(&mut self, req: &str, outcome: Result<(), String>, now: Duration) -> bool {
        match self.reqs.get_mut(req) {
            Some(rec) if rec.proxy.is_none() => {
                rec.proxy = Some(outcome);
                rec.proxy_at = Some(now);
                true
            }
            _ => false,
        }
    }

    pub fn on_verified(&mut self, req: &str, rank: usize, ok: bool) {
        if let Some(r) = self.rank(req, rank) {
            r.verified = Some(ok);
        }
    }

    pub fn on_admitted(&mut self, req: &str, rank: usize, now: Duration) {
        if let Some(r) = self.rank(req, rank) {
            r.admitted_at = Some(now);
        }
    }

    pub fn on_read(&mut self, req: &str, rank: usize, now: Duration) {
        if let Some(r) = self.rank(req, rank) {
            r.read_at = Some(now);
        }
    }

    pub fn on_receiver_end(&mut self, req: &str, rank: usize, outcome: String) {
        if let Some(r) = self.rank(req, rank) {
            r.receiver_end = Some(outcome);
        }
    }

    pub fn on_crash(&mut self, node: &str, now: Duration) {
        self.crashes.entry(node.to_owned()).or_default().push(now);
    }

    fn crashed_since(&self, node: &str, since: Duration) -> bool {
        self.crashes
            .get(node)
            .is_some_and(|c| c.iter().any(|&t| t >= since))
    }

    /// The verdicts; `receivers(req, rank)` names the receiver node of a rank.
    pub fn check(
        &self,
        decoder_consumes: bool,
        receiver_of: impl Fn(&RequestPlan, usize) -> String,
    ) -> Vec<String> {
        let mut out = Vec::new();
        let mut failed_ranks = BTreeSet::new();
        for (id, rec) in &self.reqs {
            let proxy_ready = matches!(rec.proxy, Some(Ok(())));
            if rec.proxy.is_none() {
                out.push(format!("G2: the proxy never learned how {id} ended"));
            }
            for (rank, r) in rec.ranks.iter().enumerate() {
                if r.dispatched && r.sender.is_none() && !r.lost {
                    out.push(format!("G2: {id} rank {rank} never ended at its sender"));
                }
                if matches!(r.sender, Some(Err(_))) {
                    failed_ranks.insert((id.clone(), rank));
                    if proxy_ready {
                        out.push(format!(
                            "G2: the proxy said {id} was ready though rank {rank} failed"
                        ));
                    }
                }
                if r.verified == Some(false) {
                    out.push(format!(
                        "G1: the decoder read wrong bytes for {id} rank {rank}"
                    ));
                }
                let receiver = receiver_of(&rec.plan, rank);
                let exempt = !decoder_consumes
                    || !rec.plan.fault_free
                    || self.crashed_since(&receiver, rec.begun_at);
                if proxy_ready && r.verified.is_none() && !exempt {
                    out.push(format!(
                        "G1: {id} was ready but rank {rank}'s decoder never read it"
                    ));
                }
            }
            out.extend(self.liveness(id, rec, decoder_consumes));
        }
        out
    }

    fn liveness(&self, id: &str, rec: &ReqRecord, decoder_consumes: bool) -> Option<String> {
        let plan = &rec.plan;
        if !plan.fault_free {
            return None;
        }
        if plan.oversized {
            // Rank 0 is refused; later ranks are aborted before they begin or refused too.
            let refused = matches!(&rec.proxy, Some(Err(_)))
                && matches!(&rec.ranks[0].sender, Some(Err(why)) if why.contains("needs"))
                && rec
                    .ranks
                    .iter()
                    .all(|r| !r.dispatched || matches!(r.sender, Some(Err(_))));
            return (!refused).then(|| {
                format!(
                    "W3: oversized {id} was not refused: proxy {:?}, ranks {:?}",
                    rec.proxy, rec.ranks
                )
            });
        }
        let delivered = rec.ranks.iter().all(|r| matches!(r.sender, Some(Ok(()))));
        let read = !decoder_consumes || rec.ranks.iter().all(|r| r.verified == Some(true));
        let ready = matches!(rec.proxy, Some(Ok(())));
        (!(delivered && read && ready)).then(|| {
            format!(
                "G4 liveness: {id} (no fault on it) was not delivered: proxy {:?}, ranks {:?}",
                rec.proxy, rec.ranks
            )
        })
    }
}
