//! The fault injector: applies the planned faults at their times on the supervisor node
//! (never itself faulted), undoes each after it lasted, and heals everything at `heal_at`
//! (every partition and slowdown ends, every hung process resumes, every crashed node
//! restarts), after which the run must converge.

use std::collections::BTreeMap;
use std::sync::Arc;

use madsim::runtime::Handle;
use madsim::task::NodeId;

use crate::config::{Fault, SimConfig};
use crate::world::World;

pub type NodeIds = Arc<BTreeMap<String, NodeId>>;

pub async fn inject(world: World, cfg: Arc<SimConfig>, ids: NodeIds) {
    if cfg.faults.is_empty() {
        return;
    }
    for ev in &cfg.faults {
        world.sleep_until(ev.at).await;
        apply(&world, &ids, &ev.fault);
    }
    world.sleep_until(cfg.heal_at).await;
    world.heal_network();
    for (node, &id) in ids.iter() {
        Handle::current().resume(id);
        restart(&world, &ids, node);
    }
}

fn apply(world: &World, ids: &NodeIds, fault: &Fault) {
    match fault.clone() {
        Fault::Disconnect { a, b } => {
            world.record(format_args!("disconnect {a} ~ {b}"));
            world.disconnect(&a, &b);
        }
        Fault::Partition { a, b, lasts } => {
            world.partition(&a, &b);
            let world = world.clone();
            tokio::spawn(async move {
                tokio::time::sleep(lasts).await;
                world.end_partition(&a, &b);
            });
        }
        Fault::Crash { node, lasts } => {
            crash(world, ids, &node);
            let (world, ids) = (world.clone(), ids.clone());
            tokio::spawn(async move {
                tokio::time::sleep(lasts).await;
                restart(&world, &ids, &node);
            });
        }
        Fault::Pause { node, lasts } => {
            let (Some(&id), true) = (ids.get(&node), world.is_up(&node)) else {
                return;
            };
            world.record(format_args!("node {node} HANGS for {lasts:?}"));
            Handle::current().pause(id);
            let world = world.clone();
            tokio::spawn(async move {
                tokio::time::sleep(lasts).await;
                world.record(format_args!("node {node} resumes"));
                Handle::current().resume(id);
            });
        }
        Fault::Slow {
            a,
            b,
            extra,
            lasts,
            fabric_only,
        } => {
            world.slow_down(&a, &b, extra, fabric_only);
            let world = world.clone();
            tokio::spawn(async move {
                tokio::time::sleep(lasts).await;
                world.end_slow(&a, &b, fabric_only);
            });
        }
    }
}

fn crash(world: &World, ids: &NodeIds, node: &str) {
    let Some(&id) = ids.get(node) else { return };
    if !world.is_up(node) {
        return;
    }
    world.crash(node);
    let now = world.now();
    world.lock().outcomes.on_crash(node, now);
    Handle::current().kill(id);
}

/// Restarts a crashed node: madsim re-runs its init, which starts its drivers afresh.
fn restart(world: &World, ids: &NodeIds, node: &str) {
    let Some(&id) = ids.get(node) else { return };
    if world.is_up(node) {
        return;
    }
    Handle::current().restart(id);
}
