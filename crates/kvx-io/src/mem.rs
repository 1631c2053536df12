//! In-process implementations: `MemTransport` and `MemFabric`. Endpoints are plain names
//! in a registry shared by clones. They keep the contracts of the real ones (per-connection
//! FIFO, routing by identity, flush on reset), so the conformance suite runs against them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use kvx_proto::proxy::NoticeFrom;
use kvx_proto::PeerId;
use tokio::sync::{mpsc, watch};

use crate::access::{FabricAccess, FabricCredential};
use crate::checksum::copy_with_checksum;
use crate::fabric::{
    landing_channel, Completion, ConnOp, Fabric, FabricConn, FabricError, FabricListener,
    LocalMemory, SlotMemory,
};
use crate::geometry::SlotGeometry;
use crate::region::ExternalRegion;
use crate::transport::{
    ClientEvent, ControlClient, ControlServer, Notice, NotifySink, NotifySource, Transport,
    TransportError, CHANNEL_DEPTH,
};
use kvx_proto::receiver::{ChecksumCheck, LandedWrite};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poison| poison.into_inner())
}

type Routes = Arc<Mutex<HashMap<PeerId, mpsc::Sender<ClientEvent>>>>;

#[derive(Debug)]
struct ServerEntry {
    incoming: mpsc::Sender<(PeerId, Bytes)>,
    routes: Routes,
    peers: HashMap<String, PeerId>,
}

#[derive(Debug, Default)]
struct Registry {
    servers: HashMap<String, ServerEntry>,
    notices: HashMap<String, mpsc::Sender<Notice>>,
    next_peer: u64,
    /// The number the next notice sink's connection gets.
    next_notice_connection: u64,
}

/// An in-process transport: endpoints are names in a registry shared by clones.
#[derive(Debug, Clone, Default)]
pub struct MemTransport {
    registry: Arc<Mutex<Registry>>,
}

impl MemTransport {
    /// An empty registry; clones share it.
    pub fn new() -> Self {
        Self::default()
    }
}

fn taken(endpoint: &str) -> TransportError {
    TransportError::Endpoint {
        endpoint: endpoint.to_owned(),
        why: "already bound".into(),
    }
}

fn unknown(endpoint: &str) -> TransportError {
    TransportError::Endpoint {
        endpoint: endpoint.to_owned(),
        why: "nothing is bound there".into(),
    }
}

impl Transport for MemTransport {
    async fn serve(&self, endpoint: &str) -> Result<ControlServer, TransportError> {
        let (in_tx, in_rx) = mpsc::channel(CHANNEL_DEPTH);
        let (out_tx, mut out_rx) = mpsc::channel::<(PeerId, Bytes)>(CHANNEL_DEPTH);
        let routes: Routes = Arc::default();
        {
            let mut reg = lock(&self.registry);
            if reg.servers.contains_key(endpoint) {
                return Err(taken(endpoint));
            }
            let entry = ServerEntry {
                incoming: in_tx,
                routes: routes.clone(),
                peers: HashMap::new(),
            };
            reg.servers.insert(endpoint.to_owned(), entry);
        }
        tokio::spawn(async move {
            while let Some((peer, payload)) = out_rx.recv().await {
                let route = lock(&routes).get(&peer).cloned();
                if let Some(route) = route {
                    // A client that went away loses the reply, as with ZMQ's ROUTER.
                    let _ = route.send(ClientEvent::Message(payload)).await;
                }
            }
        });
        Ok(ControlServer::new(endpoint.to_owned(), in_rx, out_tx))
    }

    async fn connect(
        &self,
        endpoint: &str,
        identity: &str,
    ) -> Result<ControlClient, TransportError> {
        let (ev_tx, ev_rx) = mpsc::channel(CHANNEL_DEPTH);
        let (out_tx, mut out_rx) = mpsc::channel::<Bytes>(CHANNEL_DEPTH);
        let (peer, incoming) = {
            let mut reg = lock(&self.registry);
            reg.next_peer += 1;
            let fresh = PeerId(reg.next_peer);
            let entry = reg
                .servers
                .get_mut(endpoint)
                .ok_or_else(|| unknown(endpoint))?;
            // Like a ROUTER, one identity is one peer, across reconnects.
            let peer = *entry.peers.entry(identity.to_owned()).or_insert(fresh);
            lock(&entry.routes).insert(peer, ev_tx);
            (peer, entry.incoming.clone())
        };
        tokio::spawn(async move {
            while let Some(payload) = out_rx.recv().await {
                // Never disconnected, so never fenced; acknowledgements are not sent on.
                if payload == crate::transport::DISCONNECT_ACK {
                    continue;
                }
                if incoming.send((peer, payload)).await.is_err() {
                    break;
                }
            }
        });
        Ok(ControlClient::new(ev_rx, out_tx))
    }

    async fn notify_sink(&self, endpoint: &str) -> Result<NotifySink, TransportError> {
        let (incoming, connection) = {
            let mut reg = lock(&self.registry);
            let tx = reg.notices.get(endpoint).ok_or_else(|| unknown(endpoint))?;
            let tx = tx.clone();
            reg.next_notice_connection += 1;
            (tx, reg.next_notice_connection)
        };
        // Each sink is one connection, as a PUSH's is: its notices carry its number, so the
        // proxy counts them as one sender's.
        let from = NoticeFrom::connection(connection);
        let label: std::sync::Arc<str> = format!("in-process sink {connection}").into();
        let (out_tx, mut out_rx) = mpsc::channel::<Bytes>(CHANNEL_DEPTH);
        let (ended_tx, ended_rx) = watch::channel(());
        tokio::spawn(async move {
            let _ended = ended_tx;
            while let Some(payload) = out_rx.recv().await {
                let label = label.clone();
                let notice = Notice {
                    from,
                    label,
                    payload,
                };
                if incoming.send(notice).await.is_err() {
                    break;
                }
            }
        });
        Ok(NotifySink::served_by(out_tx, ended_rx))
    }

    async fn notify_source(&self, endpoint: &str) -> Result<NotifySource, TransportError> {
        let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
        let mut reg = lock(&self.registry);
        if reg.notices.contains_key(endpoint) {
            return Err(taken(endpoint));
        }
        reg.notices.insert(endpoint.to_owned(), tx);
        Ok(NotifySource::new(endpoint.to_owned(), rx))
    }
}

#[derive(Debug)]
struct Exposed {
    /// Weak: the listener owns the buffer (a caller's region is let go with it), and a
    /// connection holds it only while it lives.
    memory: std::sync::Weak<LocalMemory>,
    landed: mpsc::Sender<LandedWrite>,
    access: Arc<FabricAccess>,
}

/// An in-process fabric: a write is a copy from staging into the exposed buffer, after the
/// same access checks as the real fabrics.
#[derive(Debug, Clone, Default)]
pub struct MemFabric {
    exposed: Arc<Mutex<HashMap<String, Exposed>>>,
}

impl MemFabric {
    /// No buffer exposed; clones share what is.
    pub fn new() -> Self {
        Self::default()
    }
}

impl MemFabric {
    /// Accepts writes into `memory` at `endpoint`.
    fn expose_memory(
        &self,
        endpoint: &str,
        memory: Arc<LocalMemory>,
    ) -> Result<FabricListener<LocalMemory>, FabricError> {
        let slots = memory.slots();
        let access = Arc::new(FabricAccess::with_random_key(slots)?);
        let (tx, rx) = landing_channel(slots);
        let mut exposed = lock(&self.exposed);
        if exposed
            .get(endpoint)
            .is_some_and(|e| e.memory.strong_count() > 0)
        {
            let why = "already exposed".to_owned();
            return Err(FabricError::Endpoint {
                endpoint: endpoint.to_owned(),
                why,
            });
        }
        exposed.insert(
            endpoint.to_owned(),
            Exposed {
                memory: Arc::downgrade(&memory),
                landed: tx,
                access: access.clone(),
            },
        );
        Ok(FabricListener {
            local_endpoint: endpoint.to_owned(),
            memory,
            landed: rx,
            access,
            // Every byte goes in through `FabricAccess::land`.
            revocation_stops_writes: true,
        })
    }
}

impl Fabric for MemFabric {
    type Memory = LocalMemory;

    fn allocate_staging(&self, geometry: SlotGeometry) -> Result<Arc<LocalMemory>, FabricError> {
        Ok(Arc::new(LocalMemory::allocate(geometry)?))
    }

    fn staging_in(&self, region: ExternalRegion) -> Result<Arc<LocalMemory>, FabricError> {
        Ok(Arc::new(LocalMemory::external(region)))
    }

    async fn expose(
        &self,
        endpoint: &str,
        geometry: SlotGeometry,
    ) -> Result<FabricListener<LocalMemory>, FabricError> {
        let memory = LocalMemory::allocate(geometry)?;
        self.expose_memory(endpoint, Arc::new(memory))
    }

    async fn expose_in(
        &self,
        endpoint: &str,
        region: ExternalRegion,
    ) -> Result<FabricListener<LocalMemory>, FabricError> {
        self.expose_memory(endpoint, Arc::new(LocalMemory::external(region)))
    }

    async fn connect(
        &self,
        endpoint: &str,
        staging: Arc<LocalMemory>,
        credential: FabricCredential,
    ) -> Result<FabricConn, FabricError> {
        let (remote, landed, access) = {
            let exposed = lock(&self.exposed);
            let gone = || FabricError::NotExposed(endpoint.to_owned());
            let e = exposed.get(endpoint).ok_or_else(gone)?;
            let memory = e.memory.upgrade().ok_or_else(gone)?;
            (memory, e.landed.clone(), e.access.clone())
        };
        let peer = access.authenticate(&credential).ok_or_else(|| {
            FabricError::Unauthorized(endpoint.to_owned(), "not issued by this buffer".into())
        })?;
        if staging.slot_bytes() != remote.slot_bytes() {
            return Err(FabricError::Incompatible {
                endpoint: endpoint.to_owned(),
                why: crate::fabric::slot_size_mismatch(staging.slot_bytes(), remote.slot_bytes()),
            });
        }
        let (ops_tx, mut ops_rx) = mpsc::unbounded_channel::<ConnOp>();
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut flushed = false;
            'ops: while let Some(op) = ops_rx.recv().await {
                for op in op.unrolled() {
                    let ConnOp::Write(w) = op else {
                        flushed = true;
                        continue;
                    };
                    let result = if flushed {
                        Err(FabricError::Flushed)
                    } else {
                        land(&staging, &remote, &access, peer, &w).map(|notice| {
                            // A receiver that stopped listening lost the notice; the write landed.
                            let _ = landed.try_send(notice);
                            notice.checksum
                        })
                    };
                    let result = match result {
                        Ok(ChecksumCheck::Mismatch { .. }) => Err(FabricError::Corrupt(
                            "the landed bytes do not match the chunk's checksum".into(),
                        )),
                        Ok(_) => Ok(()),
                        Err(e) => Err(e),
                    };
                    if done_tx.send(Completion { id: w.id, result }).is_err() {
                        break 'ops;
                    }
                }
            }
        });
        Ok(FabricConn::new(ops_tx, done_rx))
    }
}

/// One write, checked against the access rules and both geometries, then copied.
fn land(
    staging: &LocalMemory,
    remote: &LocalMemory,
    access: &FabricAccess,
    peer: PeerId,
    w: &crate::fabric::PostWrite,
) -> Result<LandedWrite, FabricError> {
    let fits = w.len <= staging.slot_bytes()
        && w.len <= remote.slot_bytes()
        && w.local.0 < staging.slots()
        && w.remote.0 < remote.slots();
    if !fits {
        return Err(FabricError::OutOfBounds(w.id.0, format!("{w:?}")));
    }
    let refused = |r: crate::WriteRefusal| FabricError::Refused(r.to_string());
    let admitted = access
        .admit(peer, w.remote.0, w.len as u64, w.imm)
        .map_err(refused)?;
    // Straight from slot to slot, while the grant still stands, the checksum over the bytes
    // as they landed.
    let mut landed = 0;
    access
        .land(&admitted, || {
            staging.inspect_slot(w.local.0, w.len, &mut |src| {
                remote.fill_slot(w.remote.0, w.len, &mut |dst| {
                    if w.checksum.is_some() {
                        landed = copy_with_checksum(dst, src);
                    } else {
                        dst.copy_from_slice(src);
                    }
                });
            });
        })
        .map_err(refused)?;
    let tag = admitted.tag;
    let checksum = match w.checksum {
        None => ChecksumCheck::Absent,
        Some(carried) => {
            let computed = landed;
            if computed == carried {
                ChecksumCheck::Match
            } else {
                ChecksumCheck::Mismatch { carried, computed }
            }
        }
    };
    Ok(LandedWrite {
        peer,
        slot: w.remote,
        tag,
        bytes: w.len as u64,
        checksum,
    })
}
