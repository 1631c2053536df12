//! What runs on each simulated node: the real kvx-node drivers, started by the node's init
//! (so a restart starts them afresh), plus the application around them — a prefill engine
//! (`engine`) on each sender node and a decoder (`decoder`) on each receiver node — driving
//! them through their public handles as vLLM would.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvx_node::{ReceiverNode, SenderNode};
use kvx_proto::{Placement, ReqId, StagingSlot};
use tokio::sync::{mpsc, Semaphore};

use crate::app::{env, flag};
use crate::commands::EngineCmd;
use crate::config::{receiver_node, sender_node, SimConfig, PROXY_ENDPOINT};
use crate::decoder::{Decoder, Intake};
use crate::engine::{self, Peers};
use crate::world::World;

/// A sender node's life: start the driver, connect to its rank's receivers, serve the engine.
pub async fn sender_main(world: World, cfg: Arc<SimConfig>, p: usize, rank: usize) {
    let name = sender_node(p, rank);
    let inc = world.node_started(&name);
    let worker = &cfg.prefill[p];
    let local_id = format!("{name}.{inc}");
    let started = SenderNode::start(
        env(&world, &name),
        worker.sender.clone(),
        cfg.chunk_bytes,
        local_id,
        Some(PROXY_ENDPOINT.to_owned()),
    )
    .await;
    let handle = match started {
        Ok(h) => h,
        Err(e) => return flag(&world, format!("sender {name} could not start: {e}")),
    };
    let peers: Peers = Arc::default();
    for d in 0..cfg.decode.len() {
        tokio::spawn(engine::connect(
            world.clone(),
            handle.clone(),
            receiver_node(d, rank),
            d,
            peers.clone(),
        ));
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    world.lock().mailboxes.open_engine(&name, tx);
    let app = (worker.sender.staging_placement == Placement::Caller)
        .then(|| engine::AppStaging::new(worker.sender.staging_slots));
    let state = engine::EngineState {
        peers: peers.clone(),
        interleave: Arc::new(Semaphore::new(worker.interleave)),
        app: app.clone(),
    };
    while let Some(cmd) = rx.recv().await {
        match cmd {
            EngineCmd::Prefill(d) => {
                let run = engine::prefill(
                    world.clone(),
                    cfg.clone(),
                    handle.clone(),
                    p,
                    *d,
                    state.clone(),
                );
                tokio::spawn(run);
            }
            EngineCmd::Cancel(req) => {
                // Unknown: it ended already, a harmless race.
                let _ = handle.cancel(&ReqId(req));
            }
            EngineCmd::Staging(reply) => {
                let free = match &app {
                    // The engine's own slots: free when it holds them back and no chunk
                    // reads them.
                    Some(app) => app
                        .free()
                        .into_iter()
                        .filter(|&s| handle.staging_readers(StagingSlot(s)) == 0)
                        .count() as u32,
                    None => handle.staging_free(),
                };
                let _ = reply.send((free, worker.sender.staging_slots));
            }
        }
    }
}

/// A receiver node's life: start the driver, then serve as the decoder.
pub async fn receiver_main(world: World, cfg: Arc<SimConfig>, d: usize, rank: usize) {
    let name = receiver_node(d, rank);
    world.node_started(&name);
    let rc = cfg.decode[d].receiver.clone();
    let (alloc, fabric) = (format!("{name}/alloc"), format!("{name}/fabric"));
    let handle = match ReceiverNode::start(
        env(&world, &name),
        rc.clone(),
        cfg.chunk_bytes,
        &alloc,
        &fabric,
    )
    .await
    {
        Ok(h) => h,
        Err(e) => return flag(&world, format!("receiver {name} could not start: {e}")),
    };
    let now = world.now();
    world
        .lock()
        .checker
        .on_receiver_start(now, &name, rc.buffer_slots, rc.write_quarantine);
    let (tx, rx) = mpsc::unbounded_channel();
    world.lock().mailboxes.open_decoder(&name, tx.clone());
    let (intake, reader) = if cfg.decoder_takes_leases {
        let (leases, reader, ends) = handle.into_ready_leases_with_ends();
        (Intake::Leases { leases, ends }, reader)
    } else {
        let (notices, reader) = handle.into_parts();
        (Intake::Notices(notices), reader)
    };
    let decoder = Decoder {
        world,
        cfg,
        name,
        rank,
        intake,
        reader,
        tx,
        ready: BTreeMap::new(),
        leased: BTreeMap::new(),
        verdicts: BTreeMap::new(),
    };
    decoder.run(rx).await;
}
