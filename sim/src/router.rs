//! The router: plays the disaggregated serving front end. For each planned request it asks
//! the proxy to expect it, dispatches one job per TP rank to the prefill engines — admitting
//! the ranks one after another in rank order and only then letting them transfer (the
//! protocol's TP rule, `docs/spec/protocol.md` §Tensor parallelism) — aborts it if the plan
//! says so, awaits the proxy's word and tells the decoders, and records what every party
//! learned. Every wait is bounded; a wait that runs out is a violation (a stuck state).

use std::sync::Arc;
use std::time::Duration;

use kvx_node::ProxyHandle;
use kvx_proto::ReqId;
use tokio::sync::oneshot;

use crate::app::flag;
use crate::commands::{DecoderCmd, Dispatch, EngineCmd, Job};
use crate::config::{receiver_node, sender_node, RequestPlan, SimConfig};
use crate::known_bugs::KnownBug;
use crate::world::World;

type Done = oneshot::Receiver<Result<(), String>>;

/// Runs every planned request; returns when all have ended everywhere (or their bounds ran out).
pub async fn run_all(world: &World, cfg: &Arc<SimConfig>, proxy: &ProxyHandle) {
    let mut tasks = Vec::new();
    for plan in &cfg.requests {
        let (world, cfg, proxy, plan) = (world.clone(), cfg.clone(), proxy.clone(), plan.clone());
        tasks.push(tokio::spawn(async move {
            run_one(&world, &cfg, &proxy, &plan).await
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

async fn run_one(world: &World, cfg: &SimConfig, proxy: &ProxyHandle, plan: &RequestPlan) {
    world.sleep_until(plan.start_at).await;
    let now = world.now();
    {
        let mut w = world.lock();
        w.checker.register_request(&plan.id, plan.chunks);
        w.outcomes.on_begin(plan, cfg.tp, now);
        w.trace
            .record(now, format_args!("request {} begins: {plan:?}", plan.id));
    }
    let verdict = match proxy.expect(ReqId(plan.id.clone()), cfg.tp as u32).await {
        Ok(rx) => rx,
        Err(e) => {
            return flag(
                world,
                format!("the proxy refused to expect {}: {e}", plan.id),
            )
        }
    };
    if let Some(after) = plan.cancel_after {
        let (world, id, p, tp) = (world.clone(), plan.id.clone(), plan.prefill, cfg.tp);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            world.record(format_args!("client aborts {id}"));
            for rank in 0..tp {
                world.send_engine(&sender_node(p, rank), EngineCmd::Cancel(id.clone()));
            }
        });
    }
    let bound = cfg.request_bound();
    let ranks = dispatch(world, cfg, plan, bound).await;
    let outcome = match tokio::time::timeout(bound, verdict).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(_)) => {
            return flag(
                world,
                format!("the proxy dropped {} without an outcome", plan.id),
            )
        }
        Err(_) => {
            return flag(
                world,
                format!("G4: the proxy did not decide {} within {bound:?}", plan.id),
            )
        }
    };
    let now = world.now();
    let ready = outcome.is_ok();
    world.record(format_args!("proxy: {} {outcome:?}", plan.id));
    let outcome = outcome.map_err(|failure| failure.to_string());
    if !world.lock().outcomes.on_proxy(&plan.id, outcome, now) {
        flag(world, format!("G2: {} ended twice at the proxy", plan.id));
    }
    for rank in 0..cfg.tp {
        let cmd = DecoderCmd::Verdict {
            req_id: plan.id.clone(),
            ready,
            chunks: plan.chunks,
        };
        world.send_decoder(&receiver_node(plan.decode, rank), cmd);
    }
    for (rank, entry) in ranks.into_iter().enumerate() {
        if let Some((node, inc, done)) = entry {
            await_sender(world, plan, rank, &node, inc, done, bound).await;
        }
    }
}

/// Dispatches every rank's job: admitted one after another in rank order, then all told to
/// transfer. A rank that is refused (or whose sender is down) aborts the rest. With the TP
/// rule exposed (`--expose tp-admission-cycle`) every rank goes at once, as before the rule.
async fn dispatch(
    world: &World,
    cfg: &SimConfig,
    plan: &RequestPlan,
    bound: Duration,
) -> Vec<Option<(String, u32, Done)>> {
    let ordered = !world.lock().exposed.contains(&KnownBug::TpAdmissionCycle);
    let mut ranks = Vec::new();
    let mut gos = Vec::new();
    for rank in 0..cfg.tp {
        let node = sender_node(plan.prefill, rank);
        let job = Job {
            req_id: plan.id.clone(),
            rank,
            decode: plan.decode,
            chunks: plan.chunks,
            declared: plan.declared,
            batch_chunks: plan.batch_chunks,
        };
        let (admitted_tx, admitted_rx) = oneshot::channel();
        let (go_tx, go_rx) = oneshot::channel();
        let (done_tx, done_rx) = oneshot::channel();
        let d = Dispatch {
            job,
            admitted: admitted_tx,
            go: go_rx,
            done: done_tx,
        };
        let inc = world.incarnation(&node);
        if !world.send_engine(&node, EngineCmd::Prefill(Box::new(d))) {
            break;
        }
        world.lock().outcomes.on_dispatch(&plan.id, rank);
        ranks.push(Some((node, inc, done_rx)));
        if !ordered {
            let _ = go_tx.send(());
            continue;
        }
        gos.push(go_tx);
        if !matches!(
            tokio::time::timeout(bound, admitted_rx).await,
            Ok(Ok(Ok(())))
        ) {
            break;
        }
    }
    if ordered && ranks.len() == cfg.tp {
        for go in gos {
            let _ = go.send(());
        }
    }
    // Dropped `go`s abort the ranks already admitted.
    ranks.resize_with(cfg.tp, || None);
    ranks
}

async fn await_sender(
    world: &World,
    plan: &RequestPlan,
    rank: usize,
    node: &str,
    inc: u32,
    done: Done,
    bound: Duration,
) {
    match tokio::time::timeout(bound, done).await {
        Ok(Ok(outcome)) => {
            world.record(format_args!("sender {node}: {} {outcome:?}", plan.id));
            if !world.lock().outcomes.on_sender(&plan.id, rank, outcome) {
                flag(world, format!("G2: {} ended twice at {node}", plan.id));
            }
        }
        // The engine's task died with its node.
        Ok(Err(_)) if world.incarnation(node) != inc || !world.is_up(node) => {
            world.lock().outcomes.on_sender_lost(&plan.id, rank);
        }
        Ok(Err(_)) => flag(
            world,
            format!(
                "the engine on {node} dropped {} without an outcome",
                plan.id
            ),
        ),
        Err(_) => flag(
            world,
            format!("G4: {node} did not end {} within {bound:?}", plan.id),
        ),
    }
}
