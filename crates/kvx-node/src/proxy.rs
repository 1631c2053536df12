//! The proxy driver: binds the notice channel, aggregates notices per request across TP
//! ranks (`ProxyTracker`, each notice with who sent it), and answers `ProxyHandle::expect`.
//! Outcomes nobody awaits through `expect` (a proxy with
//! `ProxyConfig::await_on_first_notice`, as `kvx proxy` runs) go to `ProxyEvents`, when the
//! caller asked for them. Notices the tracker refuses (a sender the request is not bound to)
//! are counted in `kvx_proxy_notices_refused_total` and logged once per sender
//! (`RefusalLog`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use kvx_io::{Env, Notice, NotifySource, Transport};
use kvx_proto::proxy::{
    ExpectError, NoticeFrom, NoticeRefusal, ProxyEvent, ProxyFailure, ProxyTracker, Refused,
};
use kvx_proto::wire;
use kvx_proto::{IntoChecked, Principal, ProxyConfig, ReqId};
use tokio::sync::{mpsc, oneshot};

use crate::start::StartError;

/// How an awaited request ended at the proxy.
pub type ProxyOutcome = Result<(), ProxyFailure>;

#[derive(Debug)]
enum Cmd {
    Expect(
        ReqId,
        u32,
        oneshot::Sender<ProxyOutcome>,
        oneshot::Sender<Result<(), ExpectError>>,
    ),
}

/// Handle to a running proxy.
#[derive(Debug, Clone)]
pub struct ProxyHandle {
    cmds: mpsc::Sender<Cmd>,
    endpoint: String,
    /// Requests awaited now (`ProxyTracker::awaited`), as the driver last saw it.
    awaited: Arc<AtomicUsize>,
    /// Notices refused so far, every reason together.
    refused: Arc<AtomicU64>,
}

/// The outcomes of requests that no `ProxyHandle::expect` awaits, in the order they ended.
/// Outcomes that find it full (`CHANNEL_DEPTH` unread) are dropped and counted.
#[derive(Debug)]
pub struct ProxyEvents(mpsc::Receiver<ProxyEvent>);

impl ProxyEvents {
    /// The next outcome; `None` once the proxy is gone.
    pub async fn next(&mut self) -> Option<ProxyEvent> {
        self.0.recv().await
    }
}

/// Starts proxies.
#[derive(Debug)]
pub struct ProxyNode;

impl ProxyNode {
    /// Starts a proxy on `endpoint`; outcomes are delivered through `ProxyHandle::expect`
    /// alone.
    pub async fn start<E: Env>(
        env: E,
        cfg: impl IntoChecked<ProxyConfig>,
        endpoint: &str,
    ) -> Result<ProxyHandle, StartError> {
        Ok(Self::start_with_events(env, cfg, endpoint).await?.0)
    }

    /// Starts a proxy on `endpoint`, and returns the outcomes no `expect` awaits as well.
    pub async fn start_with_events<E: Env>(
        env: E,
        cfg: impl IntoChecked<ProxyConfig>,
        endpoint: &str,
    ) -> Result<(ProxyHandle, ProxyEvents), StartError> {
        let tracker = ProxyTracker::from_checked(cfg.into_checked()?);
        let source = env.transport().notify_source(endpoint).await?;
        crate::metrics::register_proxy();
        let (tx, rx) = mpsc::channel(kvx_io::transport::CHANNEL_DEPTH);
        let (events_tx, events_rx) = mpsc::channel(kvx_io::transport::CHANNEL_DEPTH);
        let awaited = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        let handle = ProxyHandle {
            cmds: tx,
            endpoint: source.local_endpoint().to_owned(),
            awaited: awaited.clone(),
            refused: refused.clone(),
        };
        env.spawn(
            Driver {
                env: env.clone(),
                tracker,
                source,
                cmds: rx,
                waiting: BTreeMap::new(),
                unclaimed: events_tx,
                undecodable_logged: kvx_io::LogLimiter::default(),
                refusals: RefusalLog::default(),
                awaited,
                refused,
            }
            .run(),
        );
        Ok((handle, ProxyEvents(events_rx)))
    }
}

impl ProxyHandle {
    /// Requests awaited now: some TP rank's notice (or an `expect`) came, no outcome yet.
    pub fn awaited(&self) -> usize {
        self.awaited.load(Ordering::Acquire)
    }

    /// Notices refused so far because their sender is not one the request is bound to
    /// (`kvx_proto::proxy`; by reason in `kvx_proxy_notices_refused_total`).
    pub fn notices_refused(&self) -> u64 {
        self.refused.load(Ordering::Acquire)
    }

    /// The bound notice endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Starts awaiting `req_id` from `tp_ranks` senders; the returned receiver resolves when
    /// every rank reported, a sender reported failure, or `kv_ready_timeout` passed. Call it
    /// before dispatching the prefill, as LMCache's proxy does. `ExpectError::ProxyGone`
    /// when the proxy's driver has stopped.
    pub async fn expect(
        &self,
        req_id: ReqId,
        tp_ranks: u32,
    ) -> Result<oneshot::Receiver<ProxyOutcome>, ExpectError> {
        let (done_tx, done_rx) = oneshot::channel();
        let (ack_tx, ack_rx) = oneshot::channel();
        self.cmds
            .send(Cmd::Expect(req_id, tp_ranks, done_tx, ack_tx))
            .await
            .map_err(|_| ExpectError::ProxyGone)?;
        ack_rx.await.map_err(|_| ExpectError::ProxyGone)??;
        Ok(done_rx)
    }
}

struct Driver<E: Env> {
    env: E,
    tracker: ProxyTracker,
    source: NotifySource,
    cmds: mpsc::Receiver<Cmd>,
    waiting: BTreeMap<ReqId, oneshot::Sender<ProxyOutcome>>,
    /// Outcomes no `expect` awaits (`ProxyEvents`; closed when the caller did not ask).
    unclaimed: mpsc::Sender<ProxyEvent>,
    /// Undecodable notices are logged at most once a second: a peer can send them at will.
    undecodable_logged: kvx_io::LogLimiter,
    /// Which refused notices are logged.
    refusals: RefusalLog,
    /// Shared with the handles: requests awaited now.
    awaited: Arc<AtomicUsize>,
    /// Shared with the handles: notices refused so far.
    refused: Arc<AtomicU64>,
}

/// Who a refused notice's log line is kept for: under CURVE its key, else its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Speaker {
    Key(Principal),
    Connection(u64),
}

impl From<NoticeFrom> for Speaker {
    fn from(from: NoticeFrom) -> Self {
        match from.principal {
            Some(key) => Speaker::Key(key),
            None => Speaker::Connection(from.connection),
        }
    }
}

/// Senders whose first refusal is logged; past them, refusals are logged once a second.
const SPEAKERS_LOGGED_MAX: usize = 1024;
/// Keys whose log label is remembered, to name the key a request is bound to.
const LABELS_MAX: usize = 4096;

/// Which refused notices are logged: the first of each sender (under CURVE its key, else its
/// connection), for up to `SPEAKERS_LOGGED_MAX` senders, then one a second. A sender can send
/// refused notices at will, so it must not flood the log; yet an operator sees each sender
/// that had one refused, by its key's fingerprint, and the metric counts every one.
#[derive(Debug, Default)]
struct RefusalLog {
    logged: BTreeSet<Speaker>,
    past_max: kvx_io::LogLimiter,
    /// The label of each key heard (up to `LABELS_MAX`), by its principal.
    labels: BTreeMap<Principal, Arc<str>>,
}

impl RefusalLog {
    /// Remembers how a notice's key is named, for a later refusal that names it as the key a
    /// request is bound to.
    fn learn(&mut self, notice: &Notice) {
        if let Some(key) = notice.from.principal {
            if self.labels.len() < LABELS_MAX && !self.labels.contains_key(&key) {
                self.labels.insert(key, notice.label.clone());
            }
        }
    }

    /// `Some(left_out)` when this refusal is to be logged (`left_out`: refusals past
    /// `SPEAKERS_LOGGED_MAX` senders not logged since the last line); `None` when not.
    fn allow(&mut self, from: NoticeFrom) -> Option<u64> {
        let speaker = Speaker::from(from);
        if self.logged.contains(&speaker) {
            return None;
        }
        if self.logged.len() < SPEAKERS_LOGGED_MAX {
            self.logged.insert(speaker);
            return Some(0);
        }
        self.past_max.allow()
    }

    fn log(&mut self, notice: &Notice, refused: &Refused) {
        let Some(left_out) = self.allow(notice.from) else {
            return;
        };
        // A request id is the peer's choice: shown escaped and cut.
        let req_id: String = refused.req_id.0.chars().take(64).collect();
        let from = &notice.label;
        let connection = notice.from.connection;
        match refused.why {
            NoticeRefusal::OtherPrincipal => {
                let bound_to = refused
                    .bound_to
                    .and_then(|p| self.labels.get(&p))
                    .map_or("another key", |l| &**l);
                tracing::warn!(%from, connection, ?req_id, %bound_to, left_out,
                    "notice refused: its request is bound to the CURVE key of its first \
                     notice; this sender's further refusals are counted in \
                     kvx_proxy_notices_refused_total, not logged");
            }
            _ => {
                tracing::warn!(%from, connection, ?req_id, left_out,
                    "notice refused: this connection has spoken for ranks_per_connection \
                     rank(s) of the request already (a repeated notice; or one process \
                     sending several ranks' notices over one connection: raise \
                     ranks_per_connection); this sender's further refusals are counted in \
                     kvx_proxy_notices_refused_total, not logged");
            }
        }
    }
}

impl<E: Env> Driver<E> {
    async fn run(mut self) {
        loop {
            self.deliver();
            let deadline = self.tracker.poll_timeout();
            let sleep = crate::deadline::sleep_until_deadline(&self.env, deadline);
            tokio::select! {
                notice = self.source.recv_notice() => {
                    let Some(notice) = notice else { break };
                    self.on_notice(&notice);
                }
                cmd = self.cmds.recv() => {
                    let Some(Cmd::Expect(req_id, ranks, done, ack)) = cmd else { break };
                    let now = self.env.now();
                    let result = self.tracker.handle_expect(now, req_id.clone(), ranks);
                    if result.is_ok() {
                        self.waiting.insert(req_id, done);
                    }
                    let _ = ack.send(result);
                }
                _ = sleep => {
                    let now = self.env.now();
                    self.tracker.handle_timeout(now);
                }
            }
        }
        self.deliver();
        // Whoever still waits learns why no outcome will come.
        for (_, done) in std::mem::take(&mut self.waiting) {
            let _ = done.send(Err(ProxyFailure::ProxyGone));
        }
    }

    fn on_notice(&mut self, notice: &Notice) {
        match wire::decode(&notice.payload) {
            Ok(msg) => {
                let now = self.env.now();
                self.refusals.learn(notice);
                if let Some(refused) = self.tracker.handle_message(now, notice.from, msg) {
                    let reason = refused.why.kind();
                    metrics::counter!(crate::metrics::PROXY_NOTICES_REFUSED, "reason" => reason)
                        .increment(1);
                    self.refused.fetch_add(1, Ordering::Release);
                    self.refusals.log(notice, &refused);
                }
                metrics::counter!(crate::metrics::PROXY_NOTICES_DROPPED)
                    .absolute(self.tracker.dropped_notices);
            }
            Err(e) => {
                metrics::counter!(crate::metrics::DECODE_ERRORS).increment(1);
                if let Some(left_out) = self.undecodable_logged.allow() {
                    tracing::warn!(error = %e, left_out, "undecodable notice");
                }
            }
        }
    }

    /// Hands each outcome to whoever awaits it.
    fn deliver(&mut self) {
        while let Some(ev) = self.tracker.poll_event() {
            let (req_id, outcome) = match &ev {
                ProxyEvent::Ready { req_id } => {
                    metrics::counter!(crate::metrics::PROXY_READY).increment(1);
                    (req_id, Ok(()))
                }
                ProxyEvent::Failed { req_id, failure } => {
                    metrics::counter!(crate::metrics::PROXY_FAILED, "reason" => failure.kind())
                        .increment(1);
                    (req_id, Err(failure.clone()))
                }
            };
            if let Some(tx) = self.waiting.remove(req_id) {
                let _ = tx.send(outcome);
            } else if let Err(mpsc::error::TrySendError::Full(_)) = self.unclaimed.try_send(ev) {
                metrics::counter!(crate::metrics::PROXY_EVENTS_DROPPED).increment(1);
            }
        }
        self.awaited
            .store(self.tracker.awaited(), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first refusal of each sender is logged and its later ones are not, a key being one
    /// sender over all its connections; past `SPEAKERS_LOGGED_MAX` senders, one line a second.
    #[test]
    fn each_senders_first_refusal_is_logged_once() {
        let mut log = RefusalLog::default();
        let key = |connection| NoticeFrom {
            connection,
            principal: Some(Principal::new(7)),
        };
        assert_eq!(log.allow(key(1)), Some(0));
        assert_eq!(
            log.allow(key(2)),
            None,
            "the same key on another connection"
        );
        assert_eq!(
            log.allow(NoticeFrom::connection(1)),
            Some(0),
            "a NULL connection"
        );
        assert_eq!(log.allow(NoticeFrom::connection(1)), None);
        for c in 2..SPEAKERS_LOGGED_MAX as u64 {
            assert_eq!(log.allow(NoticeFrom::connection(c)), Some(0));
        }
        assert_eq!(log.logged.len(), SPEAKERS_LOGGED_MAX);
        let first = log.allow(NoticeFrom::connection(1 << 40));
        let second = log.allow(NoticeFrom::connection(1 << 41));
        assert_eq!((first.is_some(), second), (true, None), "one a second");
        assert_eq!(log.logged.len(), SPEAKERS_LOGGED_MAX, "bounded");
    }
}
