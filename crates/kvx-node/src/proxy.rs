//! The proxy driver: binds the notice channel, aggregates notices per request across TP
//! ranks (`ProxyTracker`), and answers `ProxyHandle::expect`. Outcomes nobody awaits through
//! `expect` (a proxy with `ProxyConfig::await_on_first_notice`, as `kvx proxy` runs) go to
//! `ProxyEvents`, when the caller asked for them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvx_io::{Env, NotifySource, Transport};
use kvx_proto::proxy::{ExpectError, ProxyEvent, ProxyFailure, ProxyTracker};
use kvx_proto::wire;
use kvx_proto::{ProxyConfig, ReqId};
use tokio::sync::{mpsc, oneshot};

use crate::StartError;

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
        cfg: ProxyConfig,
        endpoint: &str,
    ) -> Result<ProxyHandle, StartError> {
        Ok(Self::start_with_events(env, cfg, endpoint).await?.0)
    }

    /// Starts a proxy on `endpoint`, and returns the outcomes no `expect` awaits as well.
    pub async fn start_with_events<E: Env>(
        env: E,
        cfg: ProxyConfig,
        endpoint: &str,
    ) -> Result<(ProxyHandle, ProxyEvents), StartError> {
        let tracker = ProxyTracker::new(cfg)?;
        let source = env.transport().notify_source(endpoint).await?;
        crate::metrics::register_proxy();
        let (tx, rx) = mpsc::channel(kvx_io::transport::CHANNEL_DEPTH);
        let (events_tx, events_rx) = mpsc::channel(kvx_io::transport::CHANNEL_DEPTH);
        let awaited = Arc::new(AtomicUsize::new(0));
        let handle = ProxyHandle {
            cmds: tx,
            endpoint: source.local_endpoint().to_owned(),
            awaited: awaited.clone(),
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
                awaited,
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
    /// Shared with the handles: requests awaited now.
    awaited: Arc<AtomicUsize>,
}

impl<E: Env> Driver<E> {
    async fn run(mut self) {
        loop {
            self.deliver();
            let deadline = self.tracker.poll_timeout();
            let sleep = crate::sleep_until_deadline(&self.env, deadline);
            tokio::select! {
                payload = self.source.recv() => {
                    let Some(payload) = payload else { break };
                    self.on_notice(&payload);
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

    fn on_notice(&mut self, payload: &[u8]) {
        match wire::decode(payload) {
            Ok(msg) => {
                let now = self.env.now();
                self.tracker.handle_message(now, msg);
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
