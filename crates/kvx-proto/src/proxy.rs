//! The proxy's side: aggregates `ProxyNotif` per request across TP ranks and learns of
//! failures, so no client waits forever (LMCache's `wait_decode_kv_ready` has no timeout
//! and no failure signal, W9).
//!
//! A request is awaited with `handle_expect(req_id, tp_ranks)`; it becomes ready after
//! `tp_ranks` notices, or fails on a `FailNotif` or after `kv_ready_timeout`. Notices
//! that arrive before `handle_expect` are kept (bounded, with a TTL) and counted then.

use std::collections::{BTreeMap, VecDeque};

use crate::config::{ConfigError, ProxyConfig};
use crate::ids::ReqId;
use crate::time::{earliest, Instant};
use crate::wire::Message;

/// How an awaited request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxyEvent {
    /// Every TP rank's KV is in the decoder's buffer: dispatch the decode.
    Ready { req_id: ReqId },
    /// A sender reported failure, or `kv_ready_timeout` passed.
    Failed { req_id: ReqId, reason: String },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExpectError {
    #[error("request {0} is already awaited")]
    Duplicate(ReqId),
    #[error("{0} requests are awaited already; retry later")]
    TooMany(usize),
    #[error("tp_ranks must be at least 1")]
    ZeroRanks,
}

#[derive(Debug, Clone)]
struct Awaited {
    ranks: u32,
    seen: u32,
    deadline: Instant,
}

#[derive(Debug, Clone, Copy, Default)]
struct Early {
    notices: u32,
    failed: bool,
    at: Instant,
}

#[derive(Debug)]
pub struct ProxyTracker {
    cfg: ProxyConfig,
    awaited: BTreeMap<ReqId, Awaited>,
    early: BTreeMap<ReqId, (Early, Option<String>)>,
    early_order: VecDeque<(Instant, ReqId)>,
    events: VecDeque<ProxyEvent>,
    /// Notices or failures for ids neither awaited nor kept (counted for metrics).
    pub dropped_notices: u64,
}

impl ProxyTracker {
    pub fn new(cfg: ProxyConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            awaited: BTreeMap::new(),
            early: BTreeMap::new(),
            early_order: VecDeque::new(),
            events: VecDeque::new(),
            dropped_notices: 0,
        })
    }

    /// Starts awaiting `req_id` from `tp_ranks` senders.
    pub fn handle_expect(
        &mut self,
        now: Instant,
        req_id: ReqId,
        tp_ranks: u32,
    ) -> Result<(), ExpectError> {
        if tp_ranks == 0 {
            return Err(ExpectError::ZeroRanks);
        }
        if self.awaited.contains_key(&req_id) {
            return Err(ExpectError::Duplicate(req_id));
        }
        if self.awaited.len() >= self.cfg.requests_max {
            return Err(ExpectError::TooMany(self.cfg.requests_max));
        }
        let deadline = now + self.cfg.kv_ready_timeout;
        let (early, reason) = self.early.remove(&req_id).unwrap_or_default();
        if early.failed {
            let reason = reason.unwrap_or_default();
            self.events.push_back(ProxyEvent::Failed { req_id, reason });
            return Ok(());
        }
        self.awaited.insert(
            req_id.clone(),
            Awaited {
                ranks: tp_ranks,
                seen: 0,
                deadline,
            },
        );
        for _ in 0..early.notices {
            self.count_notice(&req_id);
        }
        Ok(())
    }

    /// A message from the PULL socket (`ProxyNotif`, or kvx's `FailNotif`).
    pub fn handle_message(&mut self, now: Instant, msg: Message) {
        match msg {
            Message::ProxyNotif(n) => {
                let req_id = ReqId(n.req_id);
                if self.awaited.contains_key(&req_id) {
                    self.count_notice(&req_id);
                } else {
                    self.keep_early(now, req_id, None);
                }
            }
            Message::FailNotif(f) => {
                let req_id = ReqId(f.req_id);
                if self.awaited.remove(&req_id).is_some() {
                    self.events.push_back(ProxyEvent::Failed {
                        req_id,
                        reason: f.reason,
                    });
                } else {
                    self.keep_early(now, req_id, Some(f.reason));
                }
            }
            _ => self.dropped_notices += 1,
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        let expired: Vec<ReqId> = self
            .awaited
            .iter()
            .filter(|(_, a)| a.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for req_id in expired {
            self.awaited.remove(&req_id);
            let reason = "kv_ready_timeout passed before every TP rank reported".to_owned();
            self.events.push_back(ProxyEvent::Failed { req_id, reason });
        }
        while let Some((at, _)) = self.early_order.front() {
            if *at + self.cfg.early_notice_ttl > now {
                break;
            }
            self.pop_early();
        }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        let awaited = self.awaited.values().map(|a| a.deadline).min();
        earliest(
            awaited,
            self.early_order
                .front()
                .map(|(at, _)| *at + self.cfg.early_notice_ttl),
        )
    }

    pub fn poll_event(&mut self) -> Option<ProxyEvent> {
        self.events.pop_front()
    }

    pub fn awaited(&self) -> usize {
        self.awaited.len()
    }

    fn count_notice(&mut self, req_id: &ReqId) {
        let a = self
            .awaited
            .get_mut(req_id)
            .expect("invariant: counting an awaited request");
        a.seen += 1;
        if a.seen >= a.ranks {
            self.awaited.remove(req_id);
            self.events.push_back(ProxyEvent::Ready {
                req_id: req_id.clone(),
            });
        }
    }

    fn keep_early(&mut self, now: Instant, req_id: ReqId, failure: Option<String>) {
        if self.cfg.early_notices_max == 0 {
            self.dropped_notices += 1;
            return;
        }
        if !self.early.contains_key(&req_id) {
            while self.early.len() >= self.cfg.early_notices_max {
                self.pop_early();
                self.dropped_notices += 1;
            }
            self.early_order.push_back((now, req_id.clone()));
        }
        let entry = self.early.entry(req_id).or_insert((
            Early {
                at: now,
                ..Early::default()
            },
            None,
        ));
        match failure {
            Some(reason) => {
                entry.0.failed = true;
                entry.1 = Some(reason);
            }
            None => entry.0.notices += 1,
        }
    }

    fn pop_early(&mut self) {
        if let Some((at, id)) = self.early_order.pop_front() {
            if self.early.get(&id).is_some_and(|(e, _)| e.at == at) {
                self.early.remove(&id);
            }
        }
    }

    pub fn check_invariants(&self) {
        assert!(
            self.awaited.len() <= self.cfg.requests_max,
            "invariant: awaited table bound"
        );
        assert!(
            self.early.len() <= self.cfg.early_notices_max,
            "invariant: early table bound"
        );
        for (id, a) in &self.awaited {
            assert!(
                a.seen < a.ranks,
                "invariant: {id} should have been reported ready"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{FailNotif, ProxyNotif};

    fn notif(id: &str) -> Message {
        Message::ProxyNotif(ProxyNotif { req_id: id.into() })
    }

    #[test]
    fn ready_after_every_rank_and_not_before() {
        let mut p = ProxyTracker::new(ProxyConfig::default()).expect("valid config");
        p.handle_expect(Instant::ZERO, "r1".into(), 2)
            .expect("fresh id");
        p.handle_message(Instant::ZERO, notif("r1"));
        assert_eq!(p.poll_event(), None);
        p.handle_message(Instant::ZERO, notif("r1"));
        assert_eq!(
            p.poll_event(),
            Some(ProxyEvent::Ready {
                req_id: "r1".into()
            })
        );
        p.check_invariants();
    }

    #[test]
    fn early_notice_and_failure_and_timeout() {
        let mut p = ProxyTracker::new(ProxyConfig::default()).expect("valid config");
        p.handle_message(Instant::ZERO, notif("early"));
        p.handle_expect(Instant::ZERO, "early".into(), 1)
            .expect("fresh id");
        assert_eq!(
            p.poll_event(),
            Some(ProxyEvent::Ready {
                req_id: "early".into()
            })
        );
        p.handle_expect(Instant::ZERO, "bad".into(), 1)
            .expect("fresh id");
        p.handle_message(
            Instant::ZERO,
            Message::FailNotif(FailNotif {
                req_id: "bad".into(),
                reason: "x".into(),
            }),
        );
        assert!(matches!(p.poll_event(), Some(ProxyEvent::Failed { .. })));
        p.handle_expect(Instant::ZERO, "slow".into(), 1)
            .expect("fresh id");
        // Drive timers as a driver does (a stale early-notice entry may fire first).
        let mut event = None;
        for _ in 0..10 {
            let t = p.poll_timeout().expect("a deadline");
            p.handle_timeout(t);
            event = p.poll_event();
            if event.is_some() {
                break;
            }
        }
        assert!(matches!(event, Some(ProxyEvent::Failed { req_id, .. }) if req_id.0 == "slow"));
    }
}
