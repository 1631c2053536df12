//! The simulated world that every node shares: which nodes are up, the network's faults and
//! latency model, the transport's and fabric's connection tables (`tables::net`,
//! `tables::fabric`), each node's command channel, the checker, the request outcomes and the
//! trace. One lock; nothing awaits while holding it (madsim runs one task
//! at a time, so the lock never contends — it only keeps the code safe Rust).
//!
//! Connections (transport links and fabric queue pairs) are served by tasks on an `infra`
//! node that is never crashed or paused: the network and the NICs keep working while a
//! process hangs, and a crash breaks the crashed node's connections explicitly.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvx_proto::rng::SeededRng;
use madsim::runtime::Handle;
use madsim::task::NodeId;
use tokio::time::Instant;

use crate::checker::Checker;
use crate::commands::{DecoderCmd, EngineCmd, Mailboxes};
use crate::config::LinkModel;
use crate::known_bugs::KnownBug;
use crate::outcomes::Outcomes;
use crate::tables::fabric::FabricState;
use crate::tables::net::NetState;
use crate::trace::Trace;

#[derive(Debug, Clone, Copy, Default)]
pub struct NodeState {
    pub up: bool,
    /// Starts so far (a restart adds one).
    pub incarnation: u32,
}

pub struct Inner {
    pub rng: SeededRng,
    pub model: LinkModel,
    pub nodes: BTreeMap<String, NodeState>,
    partitions: BTreeSet<(String, String)>,
    /// Extra latency per node pair: (control messages and writes, writes only).
    slow: BTreeMap<(String, String), (Duration, Duration)>,
    pub net: NetState,
    pub fabric: FabricState,
    pub checker: Checker,
    pub outcomes: Outcomes,
    pub trace: Trace,
    pub mailboxes: Mailboxes,
    /// Known bugs whose workaround is off (`--expose`).
    pub exposed: Vec<KnownBug>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner").field("nodes", &self.nodes).finish()
    }
}

fn pair(a: &str, b: &str) -> (String, String) {
    if a <= b {
        (a.to_owned(), b.to_owned())
    } else {
        (b.to_owned(), a.to_owned())
    }
}

impl Inner {
    /// Both nodes are up and no partition separates them.
    pub fn reachable(&self, a: &str, b: &str) -> bool {
        let up = |n: &str| self.nodes.get(n).is_some_and(|s| s.up);
        up(a) && up(b) && !self.partitions.contains(&pair(a, b))
    }

    /// Extra latency a slowdown fault adds between `a` and `b`.
    pub fn slowdown(&self, a: &str, b: &str) -> Duration {
        self.slow.get(&pair(a, b)).map_or(Duration::ZERO, |s| s.0)
    }

    /// Extra latency a slowdown fault adds to writes between `a` and `b`.
    pub fn fabric_slowdown(&self, a: &str, b: &str) -> Duration {
        self.slow
            .get(&pair(a, b))
            .map_or(Duration::ZERO, |s| s.0 + s.1)
    }

    /// One control message's latency from `a` to `b`.
    pub fn control_delay(&mut self, a: &str, b: &str) -> Duration {
        let (lo, hi) = (
            self.model.control_latency_min,
            self.model.control_latency_max,
        );
        self.rng.duration(lo, hi) + self.slowdown(a, b)
    }
}

/// A handle on the world; clones share it.
#[derive(Clone)]
pub struct World {
    inner: Arc<Mutex<Inner>>,
    epoch: Instant,
    infra: NodeId,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("World")
    }
}

impl World {
    /// Creates the world and its `infra` node. Must run inside a madsim runtime.
    pub fn new(seed: u64, model: LinkModel) -> Self {
        let infra = Handle::current().create_node().name("infra").build().id();
        let inner = Inner {
            rng: SeededRng::new(seed ^ 0x05EE_D0F3_011D),
            model,
            nodes: BTreeMap::new(),
            partitions: BTreeSet::new(),
            slow: BTreeMap::new(),
            net: NetState::default(),
            fabric: FabricState::default(),
            checker: Checker::default(),
            outcomes: Outcomes::default(),
            trace: Trace::default(),
            mailboxes: Mailboxes::default(),
            exposed: Vec::new(),
        };
        Self {
            inner: Arc::new(Mutex::new(inner)),
            epoch: Instant::now(),
            infra,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Virtual time since the world began.
    pub fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Sleeps until `at`; returns at once when it has passed. (madsim, like tokio, sleeps
    /// at least 1 ms, so the network's latencies are modelled at millisecond scale.)
    pub async fn sleep_until(&self, at: Duration) {
        if at > self.now() {
            tokio::time::sleep_until(self.epoch + at).await
        }
    }

    pub fn record(&self, what: std::fmt::Arguments<'_>) {
        let now = self.now();
        self.lock().trace.record(now, what);
    }

    /// Runs `fut` on the `infra` node (the network and the NICs).
    pub fn spawn_infra<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if let Some(node) = Handle::current().get_node(self.infra) {
            node.spawn(fut);
        }
    }

    /// A node (re)started; returns its incarnation.
    pub fn node_started(&self, name: &str) -> u32 {
        let now = self.now();
        let mut w = self.lock();
        let state = w.nodes.entry(name.to_owned()).or_default();
        state.up = true;
        state.incarnation += 1;
        let inc = state.incarnation;
        w.trace
            .record(now, format_args!("node {name} up (incarnation {inc})"));
        inc
    }

    pub fn incarnation(&self, name: &str) -> u32 {
        self.lock().nodes.get(name).map_or(0, |s| s.incarnation)
    }

    pub fn is_up(&self, name: &str) -> bool {
        self.lock().nodes.get(name).is_some_and(|s| s.up)
    }

    /// A node crashed: it is down, its endpoints are gone and every connection touching it
    /// breaks. The caller kills its madsim node right after.
    pub fn crash(&self, name: &str) {
        let now = self.now();
        let mut w = self.lock();
        if let Some(state) = w.nodes.get_mut(name) {
            state.up = false;
        }
        w.trace.record(now, format_args!("node {name} CRASHED"));
        let w = &mut *w;
        w.mailboxes.close(name);
        w.net.on_crash(&mut w.trace, now, name);
        w.fabric.on_crash(&mut w.trace, now, name);
        w.checker.on_crash(now, name);
    }

    /// Cuts `a` from `b`: every connection between them breaks and none can be made.
    pub fn partition(&self, a: &str, b: &str) {
        let now = self.now();
        let mut w = self.lock();
        let w = &mut *w;
        w.partitions.insert(pair(a, b));
        w.trace.record(now, format_args!("partition {a} | {b}"));
        w.net.break_between(&mut w.trace, now, a, b, "partitioned");
        w.fabric
            .break_between(&mut w.trace, now, a, b, "partitioned");
    }

    /// Breaks the control connection(s) from `a` to `b` once (a TCP reset).
    pub fn disconnect(&self, a: &str, b: &str) {
        let now = self.now();
        let w = &mut *self.lock();
        w.net.break_between(&mut w.trace, now, a, b, "disconnected");
    }

    /// Adds `extra` latency between `a` and `b` (control and fabric) until healed.
    /// Adds `extra` latency between `a` and `b` until healed: to writes only when
    /// `fabric_only` (a slow NIC or PCIe path), else to control messages too.
    pub fn slow_down(&self, a: &str, b: &str, extra: Duration, fabric_only: bool) {
        let now = self.now();
        let mut w = self.lock();
        let entry = w.slow.entry(pair(a, b)).or_default();
        if fabric_only {
            entry.1 = extra;
        } else {
            entry.0 = extra;
        }
        let what = if fabric_only { "fabric" } else { "all" };
        w.trace
            .record(now, format_args!("slow {a} ~ {b} +{extra:?} ({what})"));
    }

    /// Ends every partition and slowdown.
    pub fn heal_network(&self) {
        let now = self.now();
        let mut w = self.lock();
        w.partitions.clear();
        w.slow.clear();
        w.trace.record(now, format_args!("network healed"));
    }

    pub fn end_partition(&self, a: &str, b: &str) {
        let now = self.now();
        let mut w = self.lock();
        w.partitions.remove(&pair(a, b));
        w.trace
            .record(now, format_args!("partition {a} | {b} healed"));
    }

    pub fn end_slow(&self, a: &str, b: &str, fabric_only: bool) {
        let now = self.now();
        let mut w = self.lock();
        if let Some(entry) = w.slow.get_mut(&pair(a, b)) {
            if fabric_only {
                entry.1 = Duration::ZERO;
            } else {
                entry.0 = Duration::ZERO;
            }
        }
        w.trace.record(now, format_args!("slow {a} ~ {b} ends"));
    }

    /// Hands a command to the prefill engine on `node`; false when the node is down.
    pub fn send_engine(&self, node: &str, cmd: EngineCmd) -> bool {
        let tx = self.lock().mailboxes.engine(node);
        tx.is_some_and(|tx| tx.send(cmd).is_ok())
    }

    pub fn send_decoder(&self, node: &str, cmd: DecoderCmd) -> bool {
        let tx = self.lock().mailboxes.decoder(node);
        tx.is_some_and(|tx| tx.send(cmd).is_ok())
    }
}
