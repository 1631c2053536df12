//! `SimFabric`: a model of RDMA verbs, not a shim.
//! - Every node's registered memory is a `SimMemory`; a write copies bytes from the sender's
//!   staging into the receiver's buffer **when it lands** (a DMA reads its source during the
//!   transfer, so a staging slot reused too early shows up as corrupt data).
//! - Each connection is a queue pair: writes land in posting order and complete in posting
//!   order, after the acknowledgement's latency; a local completion tells the receiver
//!   nothing — it hears of a write only from a `Landed` notice, and only if the write carried
//!   an immediate.
//! - Each node's NIC sends `egress_bytes_per_sec` shared by its connections, plus the fabric
//!   latency (and any slowdown fault) per write.
//! - Access as the TCP and shared-memory fabrics enforce it (`kvx_io::access`): a connection
//!   attaches with a credential the receiver's buffer issued, and a write lands only under its
//!   peer's current grant, once; any other is refused (nothing copied, nothing announced,
//!   the connection stays up). The checker sees every write *attempted*, before the access
//!   check, so a protocol bug that makes a sender write outside its grant is still caught.
//! - Checksums: a write's carried checksum is compared with the bytes that land, and the
//!   notice says how they compared.
//! - A connection error (a partition, a crash of either side, a write out of bounds, a write
//!   in flight past `qp_retry_timeout`, or the sender's `reset`) flushes every outstanding
//!   write with `FabricError::Flushed`, in order; nothing lands after the flush, and the
//!   connection stays in error (as a QP does) until the sender connects afresh.
//!
//! Queue pairs run on the world's `infra` node: a NIC keeps working while its process hangs.
//!
//! Inside: `memory` (`SimMemory`), `qp` (one queue pair's task), `state` (the fabric's tables
//! in the `World` and what a break does to them).

mod qp;

use crate::tables::fabric::{Conn, Exposed};
pub use crate::tables::memory::SimMemory;
use qp::QueuePair;

use std::sync::Arc;
use std::time::Duration;

use kvx_io::{
    ChecksumCheck, Fabric, FabricAccess, FabricConn, FabricCredential, FabricError, FabricListener,
    LandedWrite, PostWrite, SlotGeometry, SlotMemory,
};
use tokio::sync::{mpsc, watch};

use crate::world::World;

/// A node's view of the simulated fabric.
#[derive(Debug, Clone)]
pub struct SimFabric {
    world: World,
    node: String,
}

impl SimFabric {
    pub fn new(world: World, node: &str) -> Self {
        Self {
            world,
            node: node.to_owned(),
        }
    }
}

impl Fabric for SimFabric {
    type Memory = SimMemory;

    fn allocate_staging(&self, geometry: SlotGeometry) -> Result<Arc<SimMemory>, FabricError> {
        Ok(Arc::new(SimMemory::new(geometry)))
    }

    async fn expose(
        &self,
        endpoint: &str,
        geometry: SlotGeometry,
    ) -> Result<FabricListener<SimMemory>, FabricError> {
        let slots = geometry.slots;
        let memory = Arc::new(SimMemory::new(geometry));
        let (tx, rx) = kvx_io::landing_channel(slots);
        let mut w = self.world.lock();
        // Different for every buffer and every incarnation of its node (so a restarted
        // receiver voids its predecessor's credentials), and drawn from neither the world's
        // random numbers (so adding it changed no seed's run) nor the OS.
        let incarnation = w.nodes.get(&self.node).map_or(0, |n| n.incarnation);
        let access = Arc::new(FabricAccess::new(slots, sim_key(endpoint, incarnation)));
        if w.fabric.exposed.contains_key(endpoint) {
            let why = "already exposed".to_owned();
            return Err(FabricError::Endpoint {
                endpoint: endpoint.to_owned(),
                why,
            });
        }
        let exposed = Exposed {
            node: self.node.clone(),
            memory: memory.clone(),
            landed: tx,
            access: access.clone(),
        };
        w.fabric.exposed.insert(endpoint.to_owned(), exposed);
        Ok(FabricListener {
            local_endpoint: endpoint.to_owned(),
            memory,
            landed: rx,
            access,
            // Every write goes in through `FabricAccess::land`.
            revocation_stops_writes: true,
        })
    }

    async fn connect(
        &self,
        endpoint: &str,
        staging: Arc<SimMemory>,
        credential: FabricCredential,
    ) -> Result<FabricConn, FabricError> {
        // Setting up a queue pair takes a round trip.
        let rtt = 2 * self.world.lock().model.control_latency_max;
        tokio::time::sleep(rtt).await;
        let now = self.world.now();
        let (signal_tx, signal_rx) = watch::channel(false);
        let id = {
            let mut w = self.world.lock();
            let inner = &mut *w;
            let exposed = inner.fabric.exposed.get(endpoint);
            let exposed = exposed.ok_or_else(|| FabricError::NotExposed(endpoint.to_owned()))?;
            let receiver = exposed.node.clone();
            if !inner.reachable(&self.node, &receiver) {
                return Err(FabricError::Io(format!(
                    "{endpoint} is unreachable from {}",
                    self.node
                )));
            }
            let peer = exposed.access.authenticate(&credential).ok_or_else(|| {
                FabricError::Unauthorized(endpoint.to_owned(), "not issued by this buffer".into())
            })?;
            if staging.slot_bytes() != exposed.memory.slot_bytes() {
                return Err(FabricError::Incompatible {
                    endpoint: endpoint.to_owned(),
                    why: kvx_io::fabric::slot_size_mismatch(
                        staging.slot_bytes(),
                        exposed.memory.slot_bytes(),
                    ),
                });
            }
            inner.fabric.next_conn += 1;
            let id = inner.fabric.next_conn;
            let conn = Conn {
                sender: self.node.clone(),
                receiver,
                endpoint: endpoint.to_owned(),
                peer,
                broken: None,
                signal: signal_tx,
                last_land: now,
            };
            inner.fabric.conns.insert(id, conn);
            inner
                .trace
                .record(now, format_args!("qp {id}: {} -> {endpoint}", self.node));
            id
        };
        let (ops_tx, ops_rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let qp = QueuePair::new(self.world.clone(), id, staging, done_tx);
        self.world.spawn_infra(qp.run(ops_rx, signal_rx));
        Ok(FabricConn::new(ops_tx, done_rx))
    }
}

/// A buffer's credential key in the simulation: a fixed function of its endpoint and its
/// node's incarnation (the simulation forges no credentials; it needs them distinct).
fn sim_key(endpoint: &str, incarnation: u32) -> [u8; 16] {
    use std::hash::{Hash, Hasher};
    let mut key = [0u8; 16];
    for (half, salt) in [(0usize, 0x5EED_u64), (8, 0xC0DE)] {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (endpoint, incarnation, salt).hash(&mut h);
        key[half..half + 8].copy_from_slice(&h.finish().to_le_bytes());
    }
    key
}

/// Where a write posted now on connection `id` lands, or why it cannot; the bool says the
/// write will exceed the retry timeout (the connection errors at the returned time).
pub(crate) fn schedule(
    world: &World,
    id: u64,
    len: usize,
) -> Result<(Duration, bool), FabricError> {
    let now = world.now();
    let mut w = world.lock();
    let inner = &mut *w;
    let conn = inner.fabric.conns.get(&id).ok_or(FabricError::Closed)?;
    if conn.broken.is_some() {
        return Err(FabricError::Flushed);
    }
    let (sender, receiver) = (conn.sender.clone(), conn.receiver.clone());
    let model = &inner.model;
    let wire =
        Duration::from_nanos((len as u64 * 1_000_000_000) / model.egress_bytes_per_sec.max(1));
    let free = inner.fabric.egress_free.entry(sender.clone()).or_default();
    let sent = (*free).max(now) + wire;
    *free = sent;
    let flight = model.fabric_latency + inner.fabric_slowdown(&sender, &receiver);
    let retry = model.qp_retry_timeout;
    let conn = inner.fabric.conns.get_mut(&id).ok_or(FabricError::Closed)?;
    let land = (sent + flight).max(conn.last_land);
    conn.last_land = land;
    if land > now + retry {
        return Ok((now + retry, true));
    }
    Ok((land, false))
}

/// Lands one write: checks the connection and the bounds, lets the checker see it, checks it
/// against the access rules, copies the bytes and announces it. `Err` means the connection is
/// now in error; `Ok(Some(e))` that this write failed (refused, or its checksum did not match)
/// with the connection still up.
pub(crate) fn land(
    world: &World,
    id: u64,
    staging: &SimMemory,
    w: &PostWrite,
) -> Result<Option<FabricError>, FabricError> {
    let now = world.now();
    let mut g = world.lock();
    let inner = &mut *g;
    let conn = inner.fabric.conns.get(&id).ok_or(FabricError::Closed)?;
    if conn.broken.is_some() {
        return Err(FabricError::Flushed);
    }
    let (sender, endpoint, peer) = (conn.sender.clone(), conn.endpoint.clone(), conn.peer);
    let exposed = inner
        .fabric
        .exposed
        .get(&endpoint)
        .filter(|e| inner.reachable(&sender, &e.node));
    let Some(exposed) = exposed else {
        inner
            .fabric
            .break_conn(&mut inner.trace, now, id, "the receiver is gone");
        return Err(FabricError::Flushed);
    };
    let remote = exposed.memory.clone();
    let fits = w.local.0 < staging.slots()
        && w.len <= staging.slot_bytes()
        && w.remote.0 < remote.slots()
        && w.len <= remote.slot_bytes();
    if !fits {
        inner
            .fabric
            .break_conn(&mut inner.trace, now, id, "remote access error");
        return Err(FabricError::OutOfBounds(w.id.0, format!("{w:?}")));
    }
    let (receiver, landed, access) = (
        exposed.node.clone(),
        exposed.landed.clone(),
        exposed.access.clone(),
    );
    inner
        .checker
        .on_write(now, &receiver, &sender, w.remote, w.imm);
    let admitted = access.admit(peer, w.remote.0, w.len as u64, w.imm);
    inner.trace.record(
        now,
        format_args!(
            "write {} {sender} -> {receiver} slot {} imm {:?}{}",
            w.id.0,
            w.remote.0,
            w.imm,
            if admitted.is_err() { " REFUSED" } else { "" }
        ),
    );
    drop(g);
    let admitted = match admitted {
        Ok(admitted) => admitted,
        Err(refusal) => return Ok(Some(FabricError::Refused(refusal.to_string()))),
    };
    let mut buf = vec![0u8; w.len];
    staging.read_slot(w.local.0, &mut buf);
    // Through the access rules' `land`, as every fabric lands bytes: the copy is one step
    // here, so it never meets a revocation half-way.
    if let Err(refusal) = access.land(&admitted, || remote.write_slot(w.remote.0, &buf)) {
        return Ok(Some(FabricError::Refused(refusal.to_string())));
    }
    let tag = admitted.tag;
    let checksum = match w.checksum {
        None => ChecksumCheck::Absent,
        Some(carried) => match kvx_io::chunk_checksum(&buf) {
            computed if computed == carried => ChecksumCheck::Match,
            computed => ChecksumCheck::Mismatch { carried, computed },
        },
    };
    // A receiver that stopped listening lost the notice; the bytes are there.
    let _ = landed.try_send(LandedWrite {
        peer,
        slot: w.remote,
        tag,
        bytes: w.len as u64,
        checksum,
    });
    Ok(match checksum {
        ChecksumCheck::Mismatch { .. } => Some(FabricError::Corrupt(
            "the landed bytes do not match the chunk's checksum".into(),
        )),
        _ => None,
    })
}

pub(crate) fn is_broken(world: &World, id: u64) -> bool {
    world
        .lock()
        .fabric
        .conns
        .get(&id)
        .is_none_or(|c| c.broken.is_some())
}

pub(crate) fn fail(world: &World, id: u64, why: &str) {
    let now = world.now();
    let w = &mut *world.lock();
    w.fabric.break_conn(&mut w.trace, now, id, why);
}

pub(crate) fn close(world: &World, id: u64) {
    world.lock().fabric.conns.remove(&id);
}

pub(crate) fn ack_latency(world: &World) -> Duration {
    world.lock().model.fabric_latency
}
