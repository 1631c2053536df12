//! `SimTransport`: `kvx_io::Transport` with exactly the ordering the production transport
//! (ZMQ over TCP) gives, no weaker and no stronger:
//! - each connection is FIFO in each direction (a message's delivery time is never earlier
//!   than the previous one's), with latency and jitter from the `LinkModel`;
//! - messages are lost only when their connection breaks (a disconnect, a partition, a
//!   crash): everything in flight on it, both ways, is dropped;
//! - a broken client reports `Disconnected`, drops what it is handed while down (as
//!   `ZmqTransport` does), reconnects with backoff and reports `Reconnected`; the server
//!   keeps one `PeerId` per identity and routes a reply to the peer's current connection,
//!   dropping it when there is none (ROUTER);
//! - notices (PUSH → PULL) are FIFO per sink, and each sink is one connection: its notices
//!   carry its number (`kvx_io::Notice`), with no principal (no CURVE here).
//!
//! madsim's own `Endpoint` may reorder datagrams, so it is not used: connections are tables in
//! the `World` (`state`: the tables and what a break does to them) and pipes are tasks on its
//! `infra` node (`link`: sessions, pipes, the client's reconnect loop).

mod link;

use crate::tables::net::{Link, Server, Source};
use link::{client_task, open_session, route_reply};

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::CHANNEL_DEPTH;
use kvx_io::TransportError;
use kvx_io::{ControlClient, ControlServer, Notice, NotifySink, NotifySource, Transport};
use kvx_proto::proxy::NoticeFrom;
use kvx_proto::{wire, PeerId};
use tokio::sync::{mpsc, watch};

use crate::world::World;

/// A node's view of the simulated transport.
#[derive(Debug, Clone)]
pub struct SimTransport {
    pub(super) world: World,
    pub(super) node: String,
}

impl SimTransport {
    pub fn new(world: World, node: &str) -> Self {
        Self {
            world,
            node: node.to_owned(),
        }
    }
}

fn endpoint_error(endpoint: &str, why: &str) -> TransportError {
    TransportError::Endpoint {
        endpoint: endpoint.to_owned(),
        why: why.to_owned(),
    }
}

/// A message in words, for the trace.
pub fn describe(bytes: &[u8]) -> String {
    match wire::decode(bytes) {
        Ok(wire::Message::AllocRequest(m)) => format!(
            "AllocRequest {} keys={} total={} last={} seq={:?}",
            m.req_id,
            m.keys.len(),
            m.total_chunks,
            m.is_last_batch,
            m.seq
        ),
        Ok(wire::Message::AllocResponse(m)) => format!(
            "AllocResponse seq={:?} slots={:?} gens={:?} err={:?}",
            m.seq, m.remote_indexes, m.generations, m.error
        ),
        Ok(other) => format!("{other:?}"),
        Err(e) => format!("<undecodable: {e}>"),
    }
}

impl Transport for SimTransport {
    async fn serve(&self, endpoint: &str) -> Result<ControlServer, TransportError> {
        let (in_tx, in_rx) = mpsc::channel(CHANNEL_DEPTH);
        let (out_tx, mut out_rx) = mpsc::channel::<(PeerId, Bytes)>(CHANNEL_DEPTH);
        {
            let mut w = self.world.lock();
            if w.net.servers.contains_key(endpoint) {
                return Err(endpoint_error(endpoint, "already bound"));
            }
            let server = Server {
                node: self.node.clone(),
                incoming: in_tx,
                peers: BTreeMap::new(),
                routes: BTreeMap::new(),
            };
            w.net.servers.insert(endpoint.to_owned(), server);
        }
        // The ROUTER's sending side runs in the server's process: it dies with it.
        let (world, ep) = (self.world.clone(), endpoint.to_owned());
        tokio::spawn(async move {
            while let Some((peer, bytes)) = out_rx.recv().await {
                route_reply(&world, &ep, peer, bytes);
            }
        });
        Ok(ControlServer::with_lost_peers(
            endpoint.to_owned(),
            in_rx,
            out_tx,
        ))
    }

    async fn connect(
        &self,
        endpoint: &str,
        identity: &str,
    ) -> Result<ControlClient, TransportError> {
        let (ev_tx, ev_rx) = mpsc::channel(CHANNEL_DEPTH);
        let (out_tx, out_rx) = mpsc::channel(CHANNEL_DEPTH);
        // A connection attempt takes a round trip.
        let rtt = 2 * self.world.lock().model.control_latency_max;
        tokio::time::sleep(rtt).await;
        let (broken_tx, broken_rx) = watch::channel(0u64);
        let link = {
            let mut w = self.world.lock();
            w.net.next_link += 1;
            let id = w.net.next_link;
            let link = Link {
                client: self.node.clone(),
                endpoint: endpoint.to_owned(),
                identity: identity.to_owned(),
                epoch: 0,
                session: None,
                broken: broken_tx,
            };
            w.net.links.insert(id, link);
            id
        };
        if let Err(e) = open_session(&self.world, link, &ev_tx) {
            self.world.lock().net.links.remove(&link);
            return Err(e);
        }
        let world = self.world.clone();
        tokio::spawn(client_task(world, link, out_rx, ev_tx, broken_rx));
        Ok(ControlClient::new(ev_rx, out_tx))
    }

    async fn notify_sink(&self, endpoint: &str) -> Result<NotifySink, TransportError> {
        let (to, connection) = {
            let mut w = self.world.lock();
            let source = w.net.sources.get(endpoint);
            let source =
                source.ok_or_else(|| endpoint_error(endpoint, "nothing is bound there"))?;
            let to = source.node.clone();
            w.net.next_sink += 1;
            (to, w.net.next_sink)
        };
        let from_sink = NoticeFrom::connection(connection);
        let label: std::sync::Arc<str> = format!("{} (sink {connection})", self.node).into();
        let (out_tx, mut out_rx) = mpsc::channel::<Bytes>(CHANNEL_DEPTH);
        let (pipe_tx, mut pipe_rx) = mpsc::unbounded_channel::<(Duration, Bytes)>();
        let (world, from, ep) = (self.world.clone(), self.node.clone(), endpoint.to_owned());
        // PUSH side, in the sender's process: stamps each notice with its delivery time.
        tokio::spawn(async move {
            let mut last = Duration::ZERO;
            while let Some(bytes) = out_rx.recv().await {
                let now = world.now();
                let at = (now + world.lock().control_delay(&from, &to)).max(last);
                last = at;
                if pipe_tx.send((at, bytes)).is_err() {
                    return;
                }
            }
        });
        let (world, from) = (self.world.clone(), self.node.clone());
        self.world.spawn_infra(async move {
            while let Some((at, bytes)) = pipe_rx.recv().await {
                world.sleep_until(at).await;
                let incoming = {
                    let now = world.now();
                    let mut w = world.lock();
                    let Some(source) = w.net.sources.get(&ep) else {
                        continue;
                    };
                    let incoming = source.incoming.clone();
                    let what = describe(&bytes);
                    w.trace.record(now, format_args!("{from} -> {ep}: {what}"));
                    if let Ok(msg) = wire::decode(&bytes) {
                        w.checker.on_notice(now, &from, &msg);
                    }
                    incoming
                };
                let notice = Notice {
                    from: from_sink,
                    label: label.clone(),
                    payload: bytes,
                };
                let _ = incoming.send(notice).await;
            }
        });
        Ok(NotifySink::new(out_tx))
    }

    async fn notify_source(&self, endpoint: &str) -> Result<NotifySource, TransportError> {
        let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
        let mut w = self.world.lock();
        if w.net.sources.contains_key(endpoint) {
            return Err(endpoint_error(endpoint, "already bound"));
        }
        let source = Source {
            node: self.node.clone(),
            incoming: tx,
        };
        w.net.sources.insert(endpoint.to_owned(), source);
        Ok(NotifySource::new(endpoint.to_owned(), rx))
    }
}
