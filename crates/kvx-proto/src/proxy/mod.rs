//! The proxy's side: aggregates `ProxyNotif` per request across TP ranks and learns of
//! failures, so no client waits forever (LMCache's `wait_decode_kv_ready` has no timeout
//! and no failure signal, W9).
//!
//! A request is awaited with `handle_expect(req_id, tp_ranks)`; it becomes ready after
//! `tp_ranks` notices, or fails on a `FailNotif` or after `kv_ready_timeout`. Notices
//! that arrive before `handle_expect` are kept (bounded, with a TTL) and counted then. A
//! proxy that nobody tells of requests (`kvx proxy` on its own) sets
//! `ProxyConfig::await_on_first_notice`: each id is then awaited from its first notice.
//!
//! Notices count only from the senders a request is bound to (`docs/spec/protocol.md`
//! §Proxy): each notice comes with who sent it (`NoticeFrom`: its connection and, under
//! CURVE, its key's principal). A request binds to the principal of its first notice, so
//! another key's notices for it are refused; and one connection speaks for at most
//! `ProxyConfig::ranks_per_connection` ranks of it, so a repeated notice is refused rather
//! than counted as another rank. Refusals are counted (`refused_notices`) and returned to
//! the driver, which logs them. Nothing else tells a forged notice from a real one: the wire
//! carries no rank and no proof, so the binding is all a proxy can hold a sender to.
//!
//! `binding.rs` holds who a notice comes from (`NoticeFrom`) and the binding rules;
//! `early.rs` what a notice kept for an id not awaited yet holds.
//!
//! Contract: a driver feeds `handle_expect`, `handle_message` (every decoded notice, with
//! its sender) and `handle_timeout` (at `poll_timeout`), and after each call drains
//! `poll_event`; each awaited request ends in exactly one event.

mod binding;
mod early;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::config::{Checked, ConfigError, ProxyConfig};
use crate::ids::{Principal, ReqId};
use crate::time::{earliest, Instant};
use crate::wire::Message;

/// How an awaited request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxyEvent {
    /// Every TP rank's KV is in the decoder's buffer: dispatch the decode.
    Ready {
        /// The request.
        req_id: ReqId,
    },
    /// A sender reported failure, or `kv_ready_timeout` passed.
    Failed {
        /// The request.
        req_id: ReqId,
        /// Why.
        failure: ProxyFailure,
    },
}

/// Why an awaited request failed at the proxy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyFailure {
    /// A sender's `FailNotif`, with its reason (cut to `reason_bytes_max`).
    #[error("a sender reported failure: {0}")]
    Reported(String),
    /// Not every TP rank reported within `kv_ready_timeout`.
    #[error("kv_ready_timeout passed before every TP rank reported ({seen} of {ranks})")]
    TimedOut {
        /// Notices counted.
        seen: u32,
        /// Notices awaited (the request's TP ranks).
        ranks: u32,
    },
    /// The proxy's driver is gone (shut down, or its notice channel closed).
    #[error("the proxy is gone")]
    ProxyGone,
}

impl ProxyFailure {
    /// A short name of the kind of failure, without its details: a metric's label.
    pub fn kind(&self) -> &'static str {
        match self {
            ProxyFailure::Reported(_) => "reported",
            ProxyFailure::TimedOut { .. } => "kv_ready_timeout",
            ProxyFailure::ProxyGone => "proxy_gone",
        }
    }
}

/// Why `handle_expect` did not start a wait; nothing changed, and no event will come for
/// this call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExpectError {
    /// The id is awaited already; that wait goes on. Request ids must be unique among the
    /// requests in flight.
    #[error("request {0} is already awaited")]
    Duplicate(ReqId),
    /// `requests_max` requests are awaited; retry once some have ended.
    #[error("{0} requests are awaited already; retry later")]
    TooMany(usize),
    /// `tp_ranks` was 0.
    #[error("tp_ranks must be at least 1")]
    ZeroRanks,
    /// No notice can carry an id this long (`req_id_bytes_max`), so it could never be ready:
    /// shorten the ids or raise the bound.
    #[error("a request id of {len} bytes exceeds req_id_bytes_max {max}")]
    IdTooLong {
        /// The id's length in bytes.
        len: usize,
        /// `req_id_bytes_max`.
        max: usize,
    },
    /// The proxy's driver is gone (shut down, or its notice channel closed).
    #[error("the proxy is gone")]
    ProxyGone,
}

use binding::Binding;
pub use binding::{NoticeFrom, NoticeRefusal, Refused};
use early::{early_bytes, Early};

#[derive(Debug, Clone)]
struct Awaited {
    ranks: u32,
    seen: u32,
    deadline: Instant,
    binding: Binding,
}

/// The proxy's state machine: the awaited requests with their deadlines, and the notices
/// kept for ids not awaited yet. Its contract is in the module documentation: feed
/// `handle_expect`, `handle_message` and `handle_timeout` (at `poll_timeout`), drain
/// `poll_event` after each; each awaited request ends in exactly one event.
#[derive(Debug)]
pub struct ProxyTracker {
    cfg: ProxyConfig,
    awaited: BTreeMap<ReqId, Awaited>,
    /// `awaited`'s deadlines in order, so a notice or a timer costs O(log n), not a scan of
    /// every pending request.
    deadlines: BTreeSet<(Instant, ReqId)>,
    early: BTreeMap<ReqId, (Early, Option<String>)>,
    /// `early`'s entries oldest first, one per id: a repeated notice moves its id's entry to
    /// the back rather than adding one, so this is bounded by the table, not by how many
    /// messages arrive within `early_notice_ttl`.
    early_order: BTreeMap<(Instant, u64), ReqId>,
    /// The sequence number of the next entry kept (`Early::order`).
    next_early: u64,
    /// What `early` holds, about (`early_bytes`).
    early_bytes: usize,
    events: VecDeque<ProxyEvent>,
    /// Notices or failures for ids neither awaited nor kept, or too large to keep (counted
    /// for metrics).
    pub dropped_notices: u64,
    /// Notices refused, per `NoticeRefusal` in `NoticeRefusal::ALL`'s order.
    refused: [u64; NoticeRefusal::ALL.len()],
}

impl ProxyTracker {
    /// Nothing awaited or kept; refuses what `ProxyConfig::validate` refuses.
    pub fn new(cfg: ProxyConfig) -> Result<Self, ConfigError> {
        Ok(Self::from_checked(cfg.validate()?))
    }

    /// `new`, with a configuration checked already (a driver's): not checked again.
    pub fn from_checked(cfg: Checked<ProxyConfig>) -> Self {
        Self {
            cfg: cfg.into_inner(),
            awaited: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            early: BTreeMap::new(),
            early_order: BTreeMap::new(),
            next_early: 0,
            early_bytes: 0,
            events: VecDeque::new(),
            dropped_notices: 0,
            refused: [0; NoticeRefusal::ALL.len()],
        }
    }

    /// Notices refused so far for `why`.
    pub fn refused_notices(&self, why: NoticeRefusal) -> u64 {
        self.refused[why as usize]
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
        // No notice can name a longer id, so awaiting one would only hold its bytes until
        // `kv_ready_timeout`.
        if req_id.0.len() > self.cfg.req_id_bytes_max {
            return Err(ExpectError::IdTooLong {
                len: req_id.0.len(),
                max: self.cfg.req_id_bytes_max,
            });
        }
        if self.awaited.contains_key(&req_id) {
            return Err(ExpectError::Duplicate(req_id));
        }
        if self.awaited.len() >= self.cfg.requests_max {
            return Err(ExpectError::TooMany(self.cfg.requests_max));
        }
        let deadline = now + self.cfg.kv_ready_timeout;
        let (early, reason) = self.take_early(&req_id);
        if early.failed {
            let failure = ProxyFailure::Reported(reason.unwrap_or_default());
            self.events
                .push_back(ProxyEvent::Failed { req_id, failure });
            return Ok(());
        }
        self.awaited.insert(
            req_id.clone(),
            Awaited {
                ranks: tp_ranks,
                seen: 0,
                deadline,
                binding: early.binding,
            },
        );
        self.deadlines.insert((deadline, req_id.clone()));
        // More early notices than ranks (more connections than ranks, a reused id): ready
        // once.
        for _ in 0..early.notices.min(tp_ranks) {
            self.count_notice(&req_id);
        }
        Ok(())
    }

    /// A message from the PULL socket (`ProxyNotif`, or kvx's `FailNotif`) and who sent it.
    /// An id longer than `req_id_bytes_max` can name no awaited request and is dropped
    /// (counted); a failure's reason is cut to `reason_bytes_max`. A notice from a sender the
    /// request is not bound to is refused (module documentation): counted, and returned so
    /// that the driver can log it.
    pub fn handle_message(
        &mut self,
        now: Instant,
        from: NoticeFrom,
        msg: Message,
    ) -> Option<Refused> {
        if let Some(ranks) = self.cfg.await_on_first_notice {
            let id = match &msg {
                Message::ProxyNotif(n) => Some(&n.req_id),
                Message::FailNotif(f) => Some(&f.req_id),
                _ => None,
            };
            if let Some(id) = id.map(|id| ReqId(id.clone())) {
                if !self.awaited.contains_key(&id) {
                    // Refused (too long, too many awaited): the notice is dropped or kept
                    // early below, as for any unawaited id.
                    let _ = self.handle_expect(now, id, ranks);
                }
            }
        }
        let per_connection = self.cfg.ranks_per_connection;
        match msg {
            Message::ProxyNotif(n) if n.req_id.len() <= self.cfg.req_id_bytes_max => {
                let req_id = ReqId(n.req_id);
                if let Some(a) = self.awaited.get_mut(&req_id) {
                    if let Err(why) = a.binding.admits(from, true, per_connection) {
                        let bound_to = a.binding.principal;
                        return Some(self.refuse(why, req_id, bound_to));
                    }
                    a.binding.record(from, true);
                    self.count_notice(&req_id);
                } else {
                    return self.keep_early(now, req_id, from, None);
                }
            }
            Message::FailNotif(f) if f.req_id.len() <= self.cfg.req_id_bytes_max => {
                let req_id = ReqId(f.req_id);
                let reason = cut(f.reason, self.cfg.reason_bytes_max);
                if let Some(a) = self.awaited.get(&req_id) {
                    if let Err(why) = a.binding.admits(from, false, per_connection) {
                        let bound_to = a.binding.principal;
                        return Some(self.refuse(why, req_id, bound_to));
                    }
                    let deadline = a.deadline;
                    self.awaited.remove(&req_id);
                    self.deadlines.remove(&(deadline, req_id.clone()));
                    let failure = ProxyFailure::Reported(reason);
                    self.events
                        .push_back(ProxyEvent::Failed { req_id, failure });
                } else {
                    return self.keep_early(now, req_id, from, Some(reason));
                }
            }
            _ => self.dropped_notices += 1,
        }
        None
    }

    /// Counts a refusal and says what it was.
    fn refuse(
        &mut self,
        why: NoticeRefusal,
        req_id: ReqId,
        bound_to: Option<Principal>,
    ) -> Refused {
        self.refused[why as usize] += 1;
        Refused {
            why,
            req_id,
            bound_to,
        }
    }

    /// Fails every awaited request whose `kv_ready_timeout` has passed (`TimedOut`), and
    /// forgets early notices older than `early_notice_ttl`.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some((deadline, _)) = self.deadlines.first() {
            if *deadline > now {
                break;
            }
            let Some((_, req_id)) = self.deadlines.pop_first() else {
                break;
            };
            let Some(a) = self.awaited.remove(&req_id) else {
                continue;
            };
            let failure = ProxyFailure::TimedOut {
                seen: a.seen,
                ranks: a.ranks,
            };
            self.events
                .push_back(ProxyEvent::Failed { req_id, failure });
        }
        while let Some((&(at, _), _)) = self.early_order.first_key_value() {
            if at + self.cfg.early_notice_ttl > now {
                break;
            }
            self.pop_early();
        }
    }

    /// When `handle_timeout` next has work: the first awaited request's deadline, or the
    /// oldest early notice's TTL.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let awaited = self.deadlines.first().map(|(at, _)| *at);
        earliest(
            awaited,
            self.early_order
                .first_key_value()
                .map(|(&(at, _), _)| at + self.cfg.early_notice_ttl),
        )
    }

    /// The next request that ended, in the order they ended.
    pub fn poll_event(&mut self) -> Option<ProxyEvent> {
        self.events.pop_front()
    }

    /// Requests awaited now.
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
            let deadline = a.deadline;
            self.awaited.remove(req_id);
            self.deadlines.remove(&(deadline, req_id.clone()));
            self.events.push_back(ProxyEvent::Ready {
                req_id: req_id.clone(),
            });
        }
    }

    /// Keeps a notice (`failure`: None) or a failure for an id not awaited yet, bound as an
    /// awaited request's would be (a notice its binding refuses is refused here too, and
    /// the entry stays as it was). An id kept already is taken out and kept afresh with what
    /// it had (one entry per id, as of its last message), so the bounds are enforced the
    /// same way for both. Every message lost on the way, this one's or an entry's pushed
    /// out, is counted in `dropped_notices` once.
    fn keep_early(
        &mut self,
        now: Instant,
        req_id: ReqId,
        from: NoticeFrom,
        failure: Option<String>,
    ) -> Option<Refused> {
        let is_failure = failure.is_some();
        if let Some((kept, _)) = self.early.get(&req_id) {
            let binding = &kept.binding;
            if let Err(why) = binding.admits(from, !is_failure, self.cfg.ranks_per_connection) {
                let bound_to = binding.principal;
                return Some(self.refuse(why, req_id, bound_to));
            }
        }
        let (prior, prior_reason) = self.take_early(&req_id);
        let reason = failure.or(prior_reason);
        let mut binding = prior.binding;
        binding.record(from, !is_failure);
        let early = Early {
            notices: prior.notices.saturating_add(u32::from(!is_failure)),
            failed: prior.failed || is_failure,
            order: (now, self.next_early),
            binding,
        };
        let size = early_bytes(&req_id, &early, reason.as_ref());
        if self.cfg.early_notices_max == 0 || size > self.cfg.early_notices_bytes_max {
            self.dropped_notices += early.messages();
            return None;
        }
        while self.early.len() >= self.cfg.early_notices_max
            || self.early_bytes + size > self.cfg.early_notices_bytes_max
        {
            let Some(lost) = self.pop_early() else { break };
            self.dropped_notices += lost;
        }
        self.next_early += 1;
        self.early_order.insert(early.order, req_id.clone());
        self.early.insert(req_id, (early, reason));
        self.early_bytes += size;
        None
    }

    /// Removes `req_id`'s early notices and its order entry (it is awaited now, or kept
    /// afresh); nothing kept gives an empty entry.
    fn take_early(&mut self, req_id: &ReqId) -> (Early, Option<String>) {
        match self.early.remove(req_id) {
            Some((early, reason)) => {
                self.early_bytes -= early_bytes(req_id, &early, reason.as_ref());
                self.early_order.remove(&early.order);
                (early, reason)
            }
            None => Default::default(),
        }
    }

    /// Forgets the oldest early entry; the messages it stood for, or None when none is kept.
    /// An order entry that is not its id's (none should be: `check_invariants`) is removed
    /// and stands for nothing, so no loop over the order can spin on it.
    fn pop_early(&mut self) -> Option<u64> {
        let (key, id) = self.early_order.pop_first()?;
        let current = self.early.get(&id).is_some_and(|(e, _)| e.order == key);
        Some(if current {
            self.take_early(&id).0.messages()
        } else {
            0
        })
    }

    /// Panics if a table exceeds its bound, the kept bytes are miscounted, an awaited
    /// request has every notice but was not reported, or a request counted notices its
    /// binding does not account for (or more from one connection than it may).
    pub fn check_invariants(&self) {
        assert!(
            self.awaited.len() <= self.cfg.requests_max,
            "invariant: awaited table bound"
        );
        assert!(
            self.early.len() <= self.cfg.early_notices_max,
            "invariant: early table bound"
        );
        assert_eq!(
            self.early_order.len(),
            self.early.len(),
            "invariant: one order entry per early id"
        );
        for (id, (e, _)) in &self.early {
            assert_eq!(
                self.early_order.get(&e.order),
                Some(id),
                "invariant: {id}'s order entry"
            );
        }
        let bytes: usize = self
            .early
            .iter()
            .map(|(id, (e, reason))| early_bytes(id, e, reason.as_ref()))
            .sum();
        assert_eq!(bytes, self.early_bytes, "invariant: early bytes counted");
        assert!(
            self.early_bytes <= self.cfg.early_notices_bytes_max,
            "invariant: early bytes bound"
        );
        assert_eq!(
            self.deadlines.len(),
            self.awaited.len(),
            "invariant: one deadline per awaited request"
        );
        for (id, a) in &self.awaited {
            assert!(
                a.seen < a.ranks,
                "invariant: {id} should have been reported ready"
            );
        }
        let per_connection = self.cfg.ranks_per_connection;
        let bindings = self
            .awaited
            .iter()
            .map(|(id, a)| (id, &a.binding, u64::from(a.seen)))
            .chain(
                self.early
                    .iter()
                    .map(|(id, (e, _))| (id, &e.binding, u64::from(e.notices))),
            );
        for (id, binding, counted) in bindings {
            assert_eq!(
                binding.ranks(),
                counted,
                "invariant: {id}'s counted notices are its connections'"
            );
            assert!(
                binding
                    .connections
                    .iter()
                    .all(|(_, r)| *r <= per_connection),
                "invariant: no connection of {id} counted past ranks_per_connection"
            );
        }
    }
}

/// At most `max` bytes of `s` (on a character boundary), with a mark when cut.
fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{FailNotif, ProxyNotif};

    /// Two ranks' connections (NULL: no principal).
    const RANK0: NoticeFrom = NoticeFrom {
        connection: 1,
        principal: None,
    };
    const RANK1: NoticeFrom = NoticeFrom {
        connection: 2,
        principal: None,
    };

    fn notif(id: &str) -> Message {
        Message::ProxyNotif(ProxyNotif { req_id: id.into() })
    }

    /// The message `check_invariants` panics with, if it does.
    fn violation(p: &ProxyTracker) -> Option<String> {
        crate::testing::panic_message(|| p.check_invariants())
    }

    /// The checker catches what it is there for: kept bytes miscounted, an order entry
    /// without its id, an awaited request with every notice left unreported.
    #[test]
    fn check_invariants_catches_miscounts_and_an_unreported_request() {
        let mut p = ProxyTracker::new(ProxyConfig::default()).expect("valid config");
        p.handle_message(Instant::ZERO, RANK0, notif("early"));
        p.handle_expect(Instant::ZERO, "awaited".into(), 2)
            .expect("fresh id");
        assert_eq!(violation(&p), None);

        let mut bytes = ProxyTracker::new(ProxyConfig::default()).expect("valid config");
        bytes.handle_message(Instant::ZERO, RANK0, notif("early"));
        bytes.early_bytes += 1;
        let said = violation(&bytes).expect("miscounted bytes are caught");
        assert!(said.contains("early bytes counted"), "{said}");

        let mut order = ProxyTracker::new(ProxyConfig::default()).expect("valid config");
        order.handle_message(Instant::ZERO, RANK0, notif("early"));
        order
            .early_order
            .insert((Instant::ZERO, 99), ReqId::from("ghost"));
        let said = violation(&order).expect("a stray order entry is caught");
        assert!(said.contains("one order entry per early id"), "{said}");

        let mut unreported = ProxyTracker::new(ProxyConfig::default()).expect("valid config");
        unreported
            .handle_expect(Instant::ZERO, "awaited".into(), 2)
            .expect("fresh id");
        if let Some(a) = unreported.awaited.get_mut(&ReqId::from("awaited")) {
            a.seen = a.ranks;
        }
        let said = violation(&unreported).expect("an unreported request is caught");
        assert!(said.contains("should have been reported ready"), "{said}");
    }

    /// A long reason is cut to `reason_bytes_max` on a character boundary (a two-byte
    /// character straddling the bound goes whole), with a mark.
    #[test]
    fn a_long_reason_is_cut_on_a_character_boundary() {
        let cfg = ProxyConfig {
            reason_bytes_max: 7,
            ..ProxyConfig::default()
        };
        let mut p = ProxyTracker::new(cfg).expect("valid config");
        p.handle_expect(Instant::ZERO, "r".into(), 1)
            .expect("fresh id");
        let failed = FailNotif {
            req_id: "r".into(),
            reason: "éééééé".into(),
        };
        p.handle_message(Instant::ZERO, RANK0, Message::FailNotif(failed));
        assert_eq!(
            p.poll_event(),
            Some(ProxyEvent::Failed {
                req_id: "r".into(),
                failure: ProxyFailure::Reported("ééé…".into())
            })
        );
    }

    /// The kinds are metric labels: one per variant, distinct, short snake_case.
    #[test]
    fn every_failure_kind_is_a_distinct_label() {
        let all = [
            ProxyFailure::Reported(String::new()),
            ProxyFailure::TimedOut { seen: 0, ranks: 1 },
            ProxyFailure::ProxyGone,
        ];
        let kinds: std::collections::BTreeSet<_> = all.iter().map(ProxyFailure::kind).collect();
        assert_eq!(kinds.len(), all.len(), "{kinds:?}");
        for kind in kinds {
            assert!(
                !kind.is_empty() && kind.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{kind:?}"
            );
        }
    }

    #[test]
    fn ready_after_every_rank_and_not_before() {
        let mut p = ProxyTracker::new(ProxyConfig::default()).expect("valid config");
        p.handle_expect(Instant::ZERO, "r1".into(), 2)
            .expect("fresh id");
        p.handle_message(Instant::ZERO, RANK0, notif("r1"));
        assert_eq!(p.poll_event(), None);
        p.handle_message(Instant::ZERO, RANK1, notif("r1"));
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
        p.handle_message(Instant::ZERO, RANK0, notif("early"));
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
            RANK0,
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

    /// A flood of notices for ids nobody awaits (huge ids, huge reasons) keeps the early
    /// table within its bounds, and a real request is still reported.
    #[test]
    fn a_flood_of_unknown_notices_stays_bounded() {
        let cfg = ProxyConfig {
            early_notices_bytes_max: 1 << 20,
            ..ProxyConfig::default()
        };
        let mut p = ProxyTracker::new(cfg).expect("valid config");
        p.handle_message(Instant::ZERO, RANK0, notif(&"x".repeat(1 << 20)));
        assert_eq!(p.dropped_notices, 1, "an id longer than req_id_bytes_max");
        // Nor is such an id awaited (a standalone proxy awaits each id it hears of).
        let long = ReqId("x".repeat(1 << 20));
        assert!(matches!(
            p.handle_expect(Instant::ZERO, long, 1),
            Err(ExpectError::IdTooLong {
                len: 1_048_576,
                max: 512
            })
        ));
        assert_eq!(p.awaited(), 0);
        for i in 0..10_000 {
            let fail = FailNotif {
                req_id: format!("{i:0>400}"),
                reason: "r".repeat(1 << 20),
            };
            p.handle_message(Instant::ZERO, RANK0, Message::FailNotif(fail));
        }
        p.check_invariants();
        assert!(p.early_bytes <= 1 << 20);
        p.handle_expect(Instant::ZERO, "real".into(), 1)
            .expect("fresh id");
        p.handle_message(Instant::ZERO, RANK0, notif("real"));
        assert_eq!(
            p.poll_event(),
            Some(ProxyEvent::Ready {
                req_id: "real".into()
            })
        );
    }

    /// A standalone proxy (`await_on_first_notice`) awaits an id from its first notice:
    /// ready after every rank, failed on a `FailNotif`, timed out naming how many reported.
    #[test]
    fn a_standalone_proxy_awaits_each_id_from_its_first_notice() {
        let cfg = ProxyConfig {
            await_on_first_notice: Some(2),
            ..ProxyConfig::default()
        };
        let mut p = ProxyTracker::new(cfg).expect("valid config");
        p.handle_message(Instant::ZERO, RANK0, notif("a"));
        assert_eq!((p.awaited(), p.poll_event()), (1, None), "one of two ranks");
        p.handle_message(Instant::ZERO, RANK1, notif("a"));
        assert_eq!(
            p.poll_event(),
            Some(ProxyEvent::Ready { req_id: "a".into() })
        );
        let fail = FailNotif {
            req_id: "b".into(),
            reason: "receiver refused".into(),
        };
        p.handle_message(Instant::ZERO, RANK0, Message::FailNotif(fail));
        assert_eq!(
            p.poll_event(),
            Some(ProxyEvent::Failed {
                req_id: "b".into(),
                failure: ProxyFailure::Reported("receiver refused".into()),
            })
        );
        p.handle_message(Instant::ZERO, RANK0, notif("c"));
        let at = p.poll_timeout().expect("c's deadline");
        p.handle_timeout(at);
        assert_eq!(
            p.poll_event(),
            Some(ProxyEvent::Failed {
                req_id: "c".into(),
                failure: ProxyFailure::TimedOut { seen: 1, ranks: 2 },
            })
        );
        p.check_invariants();
        let zero = ProxyConfig {
            await_on_first_notice: Some(0),
            ..ProxyConfig::default()
        };
        assert!(ProxyTracker::new(zero).is_err(), "zero ranks is refused");
    }
}
