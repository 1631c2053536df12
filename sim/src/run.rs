//! One simulated run: builds the cluster from a `SimConfig` inside a fresh madsim runtime on
//! a fresh thread, runs the workload and the faults, waits for quiescence, runs the final
//! checks and reports. Nothing here can hang: every wait is bounded, madsim's time limit is
//! a backstop, and a panic anywhere (an `expect("invariant: …")` in a driver, madsim finding
//! that every task blocks forever) becomes a failed report.
//!
//! Determinism: madsim orders ready tasks from the seed and makes std's `RandomState`
//! deterministic per thread, which is why every run gets its own thread. `tokio::select!`
//! draws its branch order from tokio's thread-local generator, whose default seed depends on
//! a process-wide counter; the run is therefore polled inside a current-thread tokio runtime
//! built with `rng_seed` (needs `--cfg tokio_unstable`), so that generator is seeded too.

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvx_node::ProxyNode;
use kvx_proto::broken_variants::{self, Variant};
use madsim::runtime::Handle;

use crate::app;
use crate::commands::{DecoderCmd, EngineCmd};
use crate::config::{receiver_node, sender_node, LinkModel, SimConfig, PROXY_ENDPOINT};
use crate::faults::{self, NodeIds};
use crate::known_bugs::KnownBug;
use crate::nodes;
use crate::outcomes::ReqRecord;
use crate::router;
use crate::world::World;

#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Print every trace line as it happens.
    pub trace: bool,
    /// The deliberately broken behaviour to run with (None: the real code).
    pub variant: Option<Variant>,
    /// Known bugs to leave unworked-around.
    pub expose: Vec<KnownBug>,
}

#[derive(Debug, Clone, Default)]
pub struct RunReport {
    pub seed: u64,
    /// Broken rules, each naming its invariant; empty when the run passed.
    pub violations: Vec<String>,
    pub trace_hash: u64,
    pub events: u64,
    pub requests: usize,
    pub delivered: usize,
    pub virtual_time: Duration,
    /// The last lines of the trace, for a failure report.
    pub tail: Vec<String>,
    /// What every request's parties learned (for scenario assertions).
    pub outcomes: BTreeMap<String, ReqRecord>,
    /// ProxyNotif messages the proxy received, per request.
    pub proxy_notifs: BTreeMap<String, u32>,
}

impl RunReport {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Runs `cfg` on a thread of its own and reports.
pub fn run(cfg: SimConfig, opts: RunOptions) -> RunReport {
    let seed = cfg.seed;
    let spawned = std::thread::Builder::new()
        .name(format!("kvx-sim-{seed}"))
        .spawn(move || run_here(cfg, opts));
    let joined = spawned
        .map_err(|e| e.to_string())
        .and_then(|h| h.join().map_err(|_| "the run's thread panicked".to_owned()));
    joined.unwrap_or_else(|why| RunReport {
        seed,
        violations: vec![why],
        ..RunReport::default()
    })
}

fn run_here(cfg: SimConfig, opts: RunOptions) -> RunReport {
    let seed = cfg.seed;
    broken_variants::set(opts.variant);
    let slot: Arc<Mutex<Option<World>>> = Arc::default();
    let limit = run_limit(&cfg);
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let rng = tokio1::runtime::RngSeed::from_bytes(&seed.to_le_bytes());
        let rt = tokio1::runtime::Builder::new_current_thread()
            .rng_seed(rng)
            .build();
        let rt = rt.map_err(|e| format!("cannot build the seeding runtime: {e}"))?;
        let mut sim =
            madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
        sim.set_time_limit(limit);
        let slot = slot.clone();
        rt.block_on(tokio1::task::unconstrained(async move {
            sim.block_on(simulate(cfg, opts, slot))
        }))
    }));
    let world = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    match result {
        Ok(Ok(report)) => report,
        Ok(Err(why)) => RunReport {
            seed,
            violations: vec![why],
            ..RunReport::default()
        },
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "a panic".to_owned());
            let mut report = world.map(|w| report(&w, seed)).unwrap_or_default();
            report.seed = seed;
            report
                .violations
                .insert(0, format!("panic (stuck or an invariant assertion): {msg}"));
            report
        }
    }
}

/// Runs `body` in a fresh simulated world (a madsim runtime on a thread of its own, seeded
/// like a run), for tests that drive the simulated transport and fabric directly. A panic
/// in `body` propagates.
pub fn with_world<F, Fut, T>(seed: u64, body: F) -> T
where
    F: FnOnce(World) -> Fut + Send + 'static,
    Fut: Future<Output = T> + 'static,
    T: Send + 'static,
{
    let joined = std::thread::spawn(move || {
        let rng = tokio1::runtime::RngSeed::from_bytes(&seed.to_le_bytes());
        let rt = tokio1::runtime::Builder::new_current_thread()
            .rng_seed(rng)
            .build();
        let rt = rt.unwrap_or_else(|e| panic!("cannot build the seeding runtime: {e}"));
        let mut sim =
            madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
        sim.set_time_limit(Duration::from_secs(3_600));
        rt.block_on(tokio1::task::unconstrained(async move {
            sim.block_on(async move { body(World::new(seed, LinkModel::default())).await })
        }))
    })
    .join();
    joined.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// The longest a run may take in virtual time before madsim stops it.
fn run_limit(cfg: &SimConfig) -> Duration {
    let last = cfg
        .requests
        .iter()
        .map(|r| r.start_at)
        .max()
        .unwrap_or_default();
    last.max(cfg.heal_at) + cfg.request_bound() * 2 + cfg.settle() * 2 + Duration::from_secs(60)
}

async fn simulate(
    cfg: SimConfig,
    opts: RunOptions,
    slot: Arc<Mutex<Option<World>>>,
) -> Result<RunReport, String> {
    cfg.check()
        .map_err(|e| format!("the simulated deployment is invalid: {e}"))?;
    let cfg = Arc::new(cfg);
    let world = World::new(cfg.seed, cfg.model.clone());
    world.lock().trace.print = opts.trace;
    world.lock().exposed = opts.expose.clone();
    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(world.clone());
    for (p, w) in cfg.prefill.iter().enumerate() {
        let s = &w.sender;
        world.record(format_args!(
            "config p{p}: staging {} inflight_max {} {:?} interleave {} allocate_first {} write_timeout {:?}",
            s.staging_slots, s.inflight_max, s.pipelining, w.interleave, w.allocate_first, s.write_timeout
        ));
    }
    for (d, w) in cfg.decode.iter().enumerate() {
        let r = &w.receiver;
        world.record(format_args!(
            "config d{d}: buffer {} idle {:?} quarantine {:?}",
            r.buffer_slots, r.request_idle_timeout, r.write_quarantine
        ));
    }
    world.record(format_args!(
        "config: tp {} exposed {:?} variant {:?}",
        cfg.tp, opts.expose, opts.variant
    ));
    let proxy = start_proxy(&world, &cfg).await?;
    let ids = start_nodes(&world, &cfg);
    tokio::spawn(faults::inject(world.clone(), cfg.clone(), ids.clone()));
    let monitor = tokio::spawn(monitor(world.clone(), cfg.clone()));
    router::run_all(&world, &cfg, &proxy).await;
    monitor.abort();
    // Quiescence: the faults have healed, and every lease, quarantine and TTL a failure left
    // behind has run out.
    world.sleep_until(cfg.heal_at).await;
    tokio::time::sleep(cfg.settle()).await;
    final_checks(&world, &cfg).await;
    Ok(report(&world, cfg.seed))
}

async fn start_proxy(world: &World, cfg: &Arc<SimConfig>) -> Result<kvx_node::ProxyHandle, String> {
    let node = Handle::current().create_node().name("proxy").build();
    world.node_started("proxy");
    let (env, pc) = (app::env(world, "proxy"), cfg.proxy.clone());
    let started = node.spawn(async move {
        ProxyNode::start(env, pc, PROXY_ENDPOINT)
            .await
            .map_err(|e| e.to_string())
    });
    started
        .await
        .map_err(|e| format!("proxy task: {e}"))?
        .map_err(|e| format!("the proxy could not start: {e}"))
}

/// Creates a madsim node per receiver and sender; each node's init starts its drivers, and
/// runs again when the node restarts.
fn start_nodes(world: &World, cfg: &Arc<SimConfig>) -> NodeIds {
    let mut ids = std::collections::BTreeMap::new();
    for d in 0..cfg.decode.len() {
        for rank in 0..cfg.tp {
            let (w, c, name) = (world.clone(), cfg.clone(), receiver_node(d, rank));
            let init = move || nodes::receiver_main(w.clone(), c.clone(), d, rank);
            ids.insert(
                name.clone(),
                Handle::current()
                    .create_node()
                    .name(name)
                    .init(init)
                    .build()
                    .id(),
            );
        }
    }
    for p in 0..cfg.prefill.len() {
        for rank in 0..cfg.tp {
            let (w, c, name) = (world.clone(), cfg.clone(), sender_node(p, rank));
            let init = move || nodes::sender_main(w.clone(), c.clone(), p, rank);
            ids.insert(
                name.clone(),
                Handle::current()
                    .create_node()
                    .name(name)
                    .init(init)
                    .build()
                    .id(),
            );
        }
    }
    Arc::new(ids)
}

fn receivers(cfg: &SimConfig) -> Vec<String> {
    (0..cfg.decode.len())
        .flat_map(|d| (0..cfg.tp).map(move |r| receiver_node(d, r)))
        .collect()
}

fn senders(cfg: &SimConfig) -> Vec<String> {
    (0..cfg.prefill.len())
        .flat_map(|p| (0..cfg.tp).map(move |r| sender_node(p, r)))
        .collect()
}

/// Reads every receiver's own accounting now and then (R2), while requests run.
async fn monitor(world: World, cfg: Arc<SimConfig>) {
    for _ in 0..100_000 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for r in receivers(&cfg) {
            let (tx, _rx) = tokio::sync::oneshot::channel();
            world.send_decoder(&r, DecoderCmd::Snapshot(tx));
        }
    }
}

/// G3: after quiescence every buffer and every staging pool is entirely free, and nothing is
/// tracked anywhere; then the checker's and the outcomes' own final verdicts.
async fn final_checks(world: &World, cfg: &Arc<SimConfig>) {
    let bound = Duration::from_secs(1);
    for r in receivers(cfg) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if !world.send_decoder(&r, DecoderCmd::Snapshot(tx)) {
            flag(world, format!("G3: receiver {r} is not running at the end"));
            continue;
        }
        match tokio::time::timeout(bound, rx).await {
            Ok(Ok(s))
                if s.free == s.capacity
                    && s.tracked_requests == 0
                    && s.admission_queue_len == 0 => {}
            Ok(Ok(s)) => flag(
                world,
                format!("G3: receiver {r} is not entirely free after quiescence: {s:?}"),
            ),
            _ => flag(world, format!("G3: receiver {r} did not answer a snapshot")),
        }
    }
    for s in senders(cfg) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if !world.send_engine(&s, EngineCmd::Staging(tx)) {
            flag(world, format!("G3: sender {s} is not running at the end"));
            continue;
        }
        match tokio::time::timeout(bound, rx).await {
            Ok(Ok((free, cap))) if free == cap => {}
            Ok(Ok((free, cap))) => flag(
                world,
                format!("G3: sender {s} holds staging after quiescence: {free} of {cap} free"),
            ),
            _ => flag(world, format!("G3: sender {s} did not answer")),
        }
    }
    let now = world.now();
    let mut w = world.lock();
    w.checker.finish(now);
    let found = w.outcomes.check(cfg.decoder_consumes, |plan, rank| {
        cfg.receiver_of(plan, rank)
    });
    for why in found {
        w.checker.flag(now, why);
    }
}

fn flag(world: &World, what: String) {
    let now = world.now();
    world.lock().checker.flag(now, what);
}

fn report(world: &World, seed: u64) -> RunReport {
    let now = world.now();
    let w = world.lock();
    RunReport {
        seed,
        violations: w.checker.violations().to_vec(),
        trace_hash: w.trace.hash(),
        events: w.trace.events(),
        requests: w.outcomes.reqs.len(),
        delivered: w
            .outcomes
            .reqs
            .values()
            .filter(|r| matches!(r.proxy, Some(Ok(()))))
            .count(),
        virtual_time: now,
        tail: w.trace.tail().cloned().collect(),
        outcomes: w.outcomes.reqs.clone(),
        proxy_notifs: w.checker.proxy_notifs(),
    }
}
