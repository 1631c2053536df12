//! The proxy driver: binds the notice channel, aggregates notices per request across TP
//! ranks (`ProxyTracker`), and answers `ProxyHandle::wait_ready`.

use std::collections::HashMap;

use kvx_io::{Env, NotifySource, Transport};
use kvx_proto::proxy::{ExpectError, ProxyEvent, ProxyTracker};
use kvx_proto::wire;
use kvx_proto::{ProxyConfig, ReqId};
use tokio::sync::{mpsc, oneshot};

use crate::StartError;

/// How an awaited request ended at the proxy.
pub type ProxyOutcome = Result<(), String>;

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
}

#[derive(Debug)]
pub struct ProxyNode;

impl ProxyNode {
    pub async fn start<E: Env>(
        env: E,
        cfg: ProxyConfig,
        endpoint: &str,
    ) -> Result<ProxyHandle, StartError> {
        let tracker = ProxyTracker::new(cfg)?;
        let source = env.transport().notify_source(endpoint).await?;
        let (tx, rx) = mpsc::channel(kvx_io::transport::CHANNEL_DEPTH);
        let handle = ProxyHandle {
            cmds: tx,
            endpoint: source.local_endpoint().to_owned(),
        };
        env.spawn(
            Driver {
                env: env.clone(),
                tracker,
                source,
                cmds: rx,
                waiting: HashMap::new(),
                undecodable_logged: kvx_io::LogLimiter::default(),
            }
            .run(),
        );
        Ok(handle)
    }
}

impl ProxyHandle {
    /// The bound notice endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Starts awaiting `req_id` from `tp_ranks` senders; the returned receiver resolves when
    /// every rank reported, a sender reported failure, or `kv_ready_timeout` passed. Call it
    /// before dispatching the prefill, as LMCache's proxy does.
    pub async fn expect(
        &self,
        req_id: ReqId,
        tp_ranks: u32,
    ) -> Result<oneshot::Receiver<ProxyOutcome>, ExpectError> {
        let (done_tx, done_rx) = oneshot::channel();
        let (ack_tx, ack_rx) = oneshot::channel();
        let gone = || ExpectError::TooMany(0);
        self.cmds
            .send(Cmd::Expect(req_id, tp_ranks, done_tx, ack_tx))
            .await
            .map_err(|_| gone())?;
        ack_rx.await.map_err(|_| gone())??;
        Ok(done_rx)
    }
}

struct Driver<E: Env> {
    env: E,
    tracker: ProxyTracker,
    source: NotifySource,
    cmds: mpsc::Receiver<Cmd>,
    waiting: HashMap<ReqId, oneshot::Sender<ProxyOutcome>>,
    /// Undecodable notices are logged at most once a second: a peer can send them at will.
    undecodable_logged: kvx_io::LogLimiter,
}

impl<E: Env> Driver<E> {
    async fn run(mut self) {
        loop {
            while let Some(ev) = self.tracker.poll_event() {
                let (req_id, outcome) = match ev {
                    ProxyEvent::Ready { req_id } => (req_id, Ok(())),
                    ProxyEvent::Failed { req_id, reason } => (req_id, Err(reason)),
                };
                if let Some(tx) = self.waiting.remove(&req_id) {
                    let _ = tx.send(outcome);
                }
            }
            let deadline = self.tracker.poll_timeout();
            let sleep = crate::sleep_until_deadline(&self.env, deadline);
            tokio::select! {
                payload = self.source.recv() => {
                    let Some(payload) = payload else { return };
                    match wire::decode(&payload) {
                        Ok(msg) => {
                            let now = self.env.now();
                            self.tracker.handle_message(now, msg);
                        }
                        Err(e) => {
                            metrics::counter!(crate::metrics::DECODE_ERRORS).increment(1);
                            if let Some(left_out) = self.undecodable_logged.allow() {
                                tracing::warn!(error = %e, left_out, "undecodable notice");
                            }
                        }
                    }
                }
                cmd = self.cmds.recv() => {
                    let Some(Cmd::Expect(req_id, ranks, done, ack)) = cmd else { return };
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
    }
}
