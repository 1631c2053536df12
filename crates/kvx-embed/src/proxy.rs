//! The proxy, for an embedding program: it awaits each request's notices from every TP rank
//! (`expect`, as a serving router does before dispatching a prefill), or, started
//! `standalone`, awaits every id from its first notice and reports outcomes as events.

use std::time::Duration;

use kvx_io::mem::MemFabric;
use kvx_node::proxy::ProxyEvents;
use kvx_node::{ProxyHandle, ProxyNode, ProxyOutcome};
use kvx_proto::proxy::{ExpectError, ProxyEvent};
use kvx_proto::{Checked, ProxyConfig, ReqId};
use tokio::sync::{oneshot, Mutex};

use crate::choice::{EnvChoice, FabricChoice, TransportChoice};
use crate::error::EmbedError;
use crate::runtime::Runtime;

/// A running proxy: its notice channel is bound at `endpoint()`.
#[derive(Debug)]
pub struct Proxy {
    runtime: Runtime,
    handle: ProxyHandle,
    events: Mutex<ProxyEvents>,
}

/// One awaited request's outcome, to come.
#[derive(Debug)]
pub struct ProxyWait {
    outcome: oneshot::Receiver<ProxyOutcome>,
}

impl Proxy {
    /// Binds the notice channel at `endpoint` (`tcp://host:port` for ZeroMQ; port 0 lets
    /// the OS pick) over `transport`. `cfg.await_on_first_notice` set: a standalone proxy,
    /// whose outcomes come from `next_event`.
    pub fn start(
        runtime: &Runtime,
        transport: TransportChoice,
        endpoint: &str,
        cfg: Checked<ProxyConfig>,
    ) -> Result<Self, EmbedError> {
        // The proxy moves no KV bytes: the in-process fabric will do for its environment.
        let choice = EnvChoice {
            transport,
            fabric: FabricChoice::Mem(MemFabric::new()),
        };
        let env = choice.into_env()?;
        let (handle, events) =
            runtime.block_on(ProxyNode::start_with_events(env, cfg, endpoint))?;
        Ok(Self {
            runtime: runtime.clone(),
            handle,
            events: Mutex::new(events),
        })
    }

    /// The bound notice endpoint (the port the OS picked filled in).
    pub fn endpoint(&self) -> &str {
        self.handle.endpoint()
    }

    /// Starts awaiting `req_id` from `tp_ranks` senders. Call it before the prefill starts.
    pub fn expect(&self, req_id: &str, tp_ranks: u32) -> Result<ProxyWait, ExpectError> {
        let outcome = self
            .runtime
            .block_on(self.handle.expect(ReqId(req_id.to_owned()), tp_ranks))?;
        Ok(ProxyWait { outcome })
    }

    /// The next outcome of a request no `expect` awaits (a standalone proxy), waiting at most
    /// `timeout`; `None` when none came.
    pub fn next_event(&self, timeout: Duration) -> Option<ProxyEvent> {
        self.runtime.block_on_for(timeout, self.event()).flatten()
    }

    /// The async form of `next_event`, unbounded: `None` once the proxy has stopped.
    /// Dropping it loses no event.
    pub async fn event(&self) -> Option<ProxyEvent> {
        self.events.lock().await.next().await
    }
}

impl ProxyWait {
    /// The outcome, waiting at most `timeout`: `None` when it has not come yet (call again).
    pub fn wait(&mut self, runtime: &Runtime, timeout: Duration) -> Option<ProxyOutcome> {
        runtime.block_on_for(timeout, self.next_outcome())
    }

    /// The outcome, awaited without giving the wait up: dropped before it came, the next
    /// call awaits the same outcome.
    pub async fn next_outcome(&mut self) -> ProxyOutcome {
        (&mut self.outcome)
            .await
            .unwrap_or(Err(kvx_proto::proxy::ProxyFailure::ProxyGone))
    }

    /// The outcome, awaited.
    pub async fn outcome(self) -> ProxyOutcome {
        self.outcome
            .await
            .unwrap_or(Err(kvx_proto::proxy::ProxyFailure::ProxyGone))
    }
}
