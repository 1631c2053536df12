//! The router: plays the disaggregated serving front end. For each planned request it asks
//! the proxy to expect it, dispatches one job per TP rank to the prefill engines, aborts it
//! if the plan says so, awaits the proxy's word and tells the decoders, and records what
//! every party learned. Every wait is bounded; a wait that runs out is a violation (a stuck
//! state), never a hang.

use std::sync::Arc;
use std::time::Duration;

use kvx_node::ProxyHandle;
use kvx_proto::ReqId;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use crate::config::{receiver_node, sender_node, RequestPlan, SimConfig};
use crate::known_bugs::KnownBug;
use crate::nodes::{DecoderCmd, EngineCmd, Job};
use crate::world::World;

/// Runs every planned request; returns when all have ended everywhere (or their bounds ran out).
pub async fn run_all(world: &World, cfg: &Arc<SimConfig>, proxy: &ProxyHandle) {
    // Admission at the proxy (the tp-admission-cycle workaround): one chunk budget per
    // decode worker, as large as its buffer.
    let throttle = cfg.tp > 1 && !world.lock().exposed.contains(&KnownBug::TpAdmissionCycle);
    let budgets: Vec<Arc<Semaphore>> = cfg.decode.iter().map(|d| Arc::new(Semaphore::new(d.receiver.buffer_slots as usize))).collect();
    let mut tasks = Vec::new();
    for plan in &cfg.requests {
        let (world, cfg, proxy, plan) = (world.clone(), cfg.clone(), proxy.clone(), plan.clone());
        let budget = throttle.then(|| budgets[plan.decode].clone());
        tasks.push(tokio::spawn(async move {
            let mut permit = None;
            if let Some(budget) = budget {
                world.sleep_until(plan.start_at).await;
                let need = plan.declared.min(cfg.decode[plan.decode].receiver.buffer_slots);
                permit = budget.acquire_many_owned(need).await.ok();
            }
            run_one(&world, &cfg, &proxy, &plan, &mut permit).await
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

async fn run_one(world: &World, cfg: &SimConfig, proxy: &ProxyHandle, plan: &RequestPlan, permit: &mut Option<OwnedSemaphorePermit>) {
    world.sleep_until(plan.start_at).await;
    let now = world.now();
    {
        let mut w = world.lock();
        w.checker.register_request(&plan.id, plan.chunks);
        w.outcomes.on_begin(plan, cfg.tp, now);
        w.trace.record(now, format_args!("request {} begins: {plan:?}", plan.id));
    }
    let done = match proxy.expect(ReqId(plan.id.clone()), cfg.tp as u32).await {
        Ok(rx) => rx,
        Err(e) => return flag(world, format!("the proxy refused to expect {}: {e}", plan.id)),
    };
    let mut ranks = Vec::new();
    for rank in 0..cfg.tp {
        let job = Job {
            req_id: plan.id.clone(),
            rank,
            decode: plan.decode,
            chunks: plan.chunks,
            declared: plan.declared,
            batch_chunks: plan.batch_chunks,
        };
        let (tx, rx) = oneshot::channel();
        let node = sender_node(plan.prefill, rank);
        let sent = world.send_engine(&node, EngineCmd::Prefill(job, tx));
        if sent {
            world.lock().outcomes.on_dispatch(&plan.id, rank);
        }
        ranks.push(sent.then_some((node, world.incarnation(&sender_node(plan.prefill, rank)), rx)));
    }
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
    let verdict = match tokio::time::timeout(bound, done).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(_)) => return flag(world, format!("the proxy dropped {} without an outcome", plan.id)),
        Err(_) => return flag(world, format!("G4: the proxy did not decide {} within {bound:?}", plan.id)),
    };
    let now = world.now();
    let ready = verdict.is_ok();
    world.record(format_args!("proxy: {} {verdict:?}", plan.id));
    if !world.lock().outcomes.on_proxy(&plan.id, verdict, now) {
        flag(world, format!("G2: {} ended twice at the proxy", plan.id));
    }
    // The decoders are told now and consume at once: the budget is free again.
    permit.take();
    for rank in 0..cfg.tp {
        let cmd = DecoderCmd::Verdict { req_id: plan.id.clone(), rank, ready, chunks: plan.chunks };
        world.send_decoder(&receiver_node(plan.decode, rank), cmd);
    }
    for (rank, entry) in ranks.into_iter().enumerate() {
        let Some((node, inc, rx)) = entry else { continue };
        await_sender(world, plan, rank, &node, inc, rx, bound).await;
    }
}

async fn await_sender(
    world: &World,
    plan: &RequestPlan,
    rank: usize,
    node: &str,
    inc: u32,
    rx: oneshot::Receiver<Result<(), String>>,
    bound: Duration,
) {
    match tokio::time::timeout(bound, rx).await {
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
        Ok(Err(_)) => flag(world, format!("the engine on {node} dropped {} without an outcome", plan.id)),
        Err(_) => flag(world, format!("G4: {node} did not end {} within {bound:?}", plan.id)),
    }
}

fn flag(world: &World, what: String) {
    let now = world.now();
    world.lock().checker.flag(now, what);
}
