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
//! - notices (PUSH → PULL) are FIFO per sink.
//!
//! madsim's own `Endpoint` may reorder datagrams, so it is not used: connections are tables in
//! the `World` and pipes are tasks on its `infra` node.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::CHANNEL_DEPTH;
use kvx_io::{ClientEvent, ControlClient, ControlServer, NotifySink, NotifySource, Transport};
use kvx_io::TransportError;
use kvx_proto::{wire, PeerId};
use tokio::sync::{mpsc, watch};

use crate::world::{Inner, World};

#[derive(Debug)]
struct Server {
    node: String,
    incoming: mpsc::Sender<(PeerId, Bytes)>,
    peers: BTreeMap<String, PeerId>,
    routes: BTreeMap<PeerId, u64>,
}

#[derive(Debug)]
struct Source {
    node: String,
    incoming: mpsc::Sender<Bytes>,
}

#[derive(Debug)]
struct Session {
    peer: PeerId,
    server_node: String,
    up: mpsc::UnboundedSender<(Duration, Bytes)>,
    down: mpsc::UnboundedSender<(Duration, Bytes)>,
    up_last: Duration,
    down_last: Duration,
}

#[derive(Debug)]
struct Link {
    client: String,
    endpoint: String,
    identity: String,
    /// Bumped on every break; a pipe delivers only while its session's epoch is current.
    epoch: u64,
    session: Option<Session>,
    broken: watch::Sender<u64>,
}

/// The transport's tables, inside the `World`.
#[derive(Debug, Default)]
pub struct NetState {
    servers: BTreeMap<String, Server>,
    sources: BTreeMap<String, Source>,
    links: BTreeMap<u64, Link>,
    next_link: u64,
}

/// A node's view of the simulated transport.
#[derive(Debug, Clone)]
pub struct SimTransport {
    world: World,
    node: String,
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
        Ok(ControlServer::new(endpoint.to_owned(), in_rx, out_tx))
    }

    async fn connect(&self, endpoint: &str, identity: &str) -> Result<ControlClient, TransportError> {
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
        let to = {
            let w = self.world.lock();
            let source = w.net.sources.get(endpoint);
            let source = source.ok_or_else(|| endpoint_error(endpoint, "nothing is bound there"))?;
            source.node.clone()
        };
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
                    let Some(source) = w.net.sources.get(&ep) else { continue };
                    let incoming = source.incoming.clone();
                    let what = describe(&bytes);
                    w.trace.record(now, format_args!("{from} -> {ep}: {what}"));
                    if let Ok(msg) = wire::decode(&bytes) {
                        w.checker.on_notice(now, &from, &msg);
                    }
                    incoming
                };
                let _ = incoming.send(bytes).await;
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

/// Connects `link` afresh if its server is bound and reachable: a new session with its own
/// pipes, under the peer id the server keeps for the link's identity.
fn open_session(world: &World, link: u64, events: &mpsc::Sender<ClientEvent>) -> Result<(), TransportError> {
    let now = world.now();
    let mut w = world.lock();
    let inner = &mut *w;
    let l = inner.net.links.get(&link).ok_or(TransportError::Closed)?;
    let (client, endpoint, identity) = (l.client.clone(), l.endpoint.clone(), l.identity.clone());
    let Some(server) = inner.net.servers.get(&endpoint) else {
        return Err(endpoint_error(&endpoint, "nothing is bound there"));
    };
    let server_node = server.node.clone();
    if !inner.reachable(&client, &server_node) {
        return Err(TransportError::Io(format!("{endpoint} is unreachable from {client}")));
    }
    let server = inner.net.servers.get_mut(&endpoint).ok_or(TransportError::Closed)?;
    let fresh = PeerId(server.peers.len() as u64 + 1);
    let peer = *server.peers.entry(identity).or_insert(fresh);
    server.routes.insert(peer, link);
    let incoming = server.incoming.clone();
    let (up_tx, up_rx) = mpsc::unbounded_channel();
    let (down_tx, down_rx) = mpsc::unbounded_channel();
    let l = inner.net.links.get_mut(&link).ok_or(TransportError::Closed)?;
    let epoch = l.epoch;
    l.session = Some(Session {
        peer,
        server_node: server_node.clone(),
        up: up_tx,
        down: down_tx,
        up_last: now,
        down_last: now,
    });
    inner.trace.record(now, format_args!("connect {client} -> {endpoint} as {peer}"));
    drop(w);
    world.spawn_infra(up_pipe(world.clone(), link, epoch, up_rx, incoming, peer));
    world.spawn_infra(down_pipe(world.clone(), link, epoch, down_rx, events.clone()));
    Ok(())
}

/// Whether a pipe of session `epoch` may still deliver (its connection has not broken since).
fn live(inner: &Inner, link: u64, epoch: u64) -> Option<(String, String, PeerId)> {
    let l = inner.net.links.get(&link)?;
    let s = l.session.as_ref()?;
    (l.epoch == epoch).then(|| (l.client.clone(), s.server_node.clone(), s.peer))
}

async fn up_pipe(
    world: World,
    link: u64,
    epoch: u64,
    mut rx: mpsc::UnboundedReceiver<(Duration, Bytes)>,
    incoming: mpsc::Sender<(PeerId, Bytes)>,
    peer: PeerId,
) {
    while let Some((at, bytes)) = rx.recv().await {
        world.sleep_until(at).await;
        {
            let now = world.now();
            let mut w = world.lock();
            let Some((client, server, _)) = live(&w, link, epoch) else { return };
            let what = describe(&bytes);
            w.trace.record(now, format_args!("{client} -> {server} {peer}: {what}"));
            if let Ok(msg) = wire::decode(&bytes) {
                w.checker.on_request(now, &server, peer, &client, &msg);
            }
        }
        if incoming.send((peer, bytes)).await.is_err() {
            return;
        }
    }
}

async fn down_pipe(
    world: World,
    link: u64,
    epoch: u64,
    mut rx: mpsc::UnboundedReceiver<(Duration, Bytes)>,
    events: mpsc::Sender<ClientEvent>,
) {
    while let Some((at, bytes)) = rx.recv().await {
        world.sleep_until(at).await;
        {
            let now = world.now();
            let mut w = world.lock();
            let Some((client, server, peer)) = live(&w, link, epoch) else { return };
            let what = describe(&bytes);
            w.trace.record(now, format_args!("{server} -> {client} {peer}: {what}"));
        }
        if events.send(ClientEvent::Message(bytes)).await.is_err() {
            return;
        }
    }
}

/// The ROUTER sends a reply: the checker sees what the receiver decided; the reply goes to
/// the peer's current connection, or is lost when it has none.
fn route_reply(world: &World, endpoint: &str, peer: PeerId, bytes: Bytes) {
    let now = world.now();
    let mut w = world.lock();
    let inner = &mut *w;
    let Some(server) = inner.net.servers.get(endpoint) else { return };
    let server_node = server.node.clone();
    if let Ok(wire::Message::AllocResponse(reply)) = wire::decode(&bytes) {
        inner.checker.on_reply(now, &server_node, peer, &reply);
    }
    let link = server.routes.get(&peer).copied();
    let client = link.and_then(|l| inner.net.links.get(&l)).map(|l| l.client.clone());
    let (Some(link), Some(client)) = (link, client) else {
        let what = describe(&bytes);
        inner.trace.record(now, format_args!("{server_node} -> {peer} LOST (no connection): {what}"));
        return;
    };
    let delay = inner.control_delay(&server_node, &client);
    let Some(session) = inner.net.links.get_mut(&link).and_then(|l| l.session.as_mut()) else {
        let what = describe(&bytes);
        inner.trace.record(now, format_args!("{server_node} -> {client} LOST (down): {what}"));
        return;
    };
    let at = (now + delay).max(session.down_last);
    session.down_last = at;
    let _ = session.down.send((at, bytes));
}

/// The client side of one connection, in the client's process: forwards what the handle
/// sends, notices a break, and reconnects with backoff.
async fn client_task(
    world: World,
    link: u64,
    mut out_rx: mpsc::Receiver<Bytes>,
    events: mpsc::Sender<ClientEvent>,
    mut broken: watch::Receiver<u64>,
) {
    let (min, max) = {
        let w = world.lock();
        (w.model.reconnect_backoff_min, w.model.reconnect_backoff_max)
    };
    loop {
        broken.borrow_and_update();
        loop {
            tokio::select! {
                p = out_rx.recv() => match p {
                    Some(p) => send_up(&world, link, p),
                    None => return close_link(&world, link),
                },
                r = broken.changed() => {
                    if r.is_err() { return close_link(&world, link) }
                    break;
                }
            }
        }
        if events.send(ClientEvent::Disconnected).await.is_err() {
            return close_link(&world, link);
        }
        let mut backoff = min;
        loop {
            let sleep = tokio::time::sleep(backoff);
            tokio::pin!(sleep);
            let retry = loop {
                tokio::select! {
                    p = out_rx.recv() => match p {
                        Some(p) => drop_payload(&world, link, &p),
                        None => return close_link(&world, link),
                    },
                    _ = &mut sleep => break true,
                }
            };
            if retry && open_session(&world, link, &events).is_ok() {
                break;
            }
            backoff = (backoff * 2).min(max);
        }
        if events.send(ClientEvent::Reconnected).await.is_err() {
            return close_link(&world, link);
        }
    }
}

fn send_up(world: &World, link: u64, bytes: Bytes) {
    let now = world.now();
    let mut w = world.lock();
    let inner = &mut *w;
    let ends = inner.net.links.get(&link).and_then(|l| {
        let s = l.session.as_ref()?;
        Some((l.client.clone(), s.server_node.clone()))
    });
    let Some((client, server)) = ends else {
        drop(w);
        return drop_payload(world, link, &bytes);
    };
    let delay = inner.control_delay(&client, &server);
    if let Some(s) = inner.net.links.get_mut(&link).and_then(|l| l.session.as_mut()) {
        let at = (now + delay).max(s.up_last);
        s.up_last = at;
        let _ = s.up.send((at, bytes));
    }
}

fn drop_payload(world: &World, link: u64, bytes: &[u8]) {
    let what = describe(bytes);
    world.record(format_args!("link {link} down: dropped {what}"));
}

fn close_link(world: &World, link: u64) {
    let mut w = world.lock();
    if let Some(l) = w.net.links.remove(&link) {
        if let (Some(s), Some(server)) = (l.session, w.net.servers.get_mut(&l.endpoint)) {
            if server.routes.get(&s.peer) == Some(&link) {
                server.routes.remove(&s.peer);
            }
        }
    }
}

/// Breaks one link: its session (and everything in flight on it) is gone; the client hears.
fn break_link(inner: &mut Inner, now: Duration, link: u64, why: &str) {
    let Some(l) = inner.net.links.get_mut(&link) else { return };
    let Some(s) = l.session.take() else { return };
    l.epoch += 1;
    let _ = l.broken.send(l.epoch);
    let (client, endpoint) = (l.client.clone(), l.endpoint.clone());
    if let Some(server) = inner.net.servers.get_mut(&endpoint) {
        if server.routes.get(&s.peer) == Some(&link) {
            server.routes.remove(&s.peer);
        }
    }
    inner.trace.record(now, format_args!("link {client} -> {endpoint} BROKEN ({why})"));
}

/// Breaks every control connection between nodes `a` and `b`.
pub fn break_between(inner: &mut Inner, now: Duration, a: &str, b: &str, why: &str) {
    let hit: Vec<u64> = inner
        .net
        .links
        .iter()
        .filter(|(_, l)| {
            let server = l.session.as_ref().map(|s| s.server_node.as_str());
            server.is_some_and(|s| (l.client == a && s == b) || (l.client == b && s == a))
        })
        .map(|(id, _)| *id)
        .collect();
    for id in hit {
        break_link(inner, now, id, why);
    }
}

/// `node` crashed: its bound endpoints vanish, connections it served break (their clients
/// reconnect later), connections it owned are gone.
pub fn on_crash(inner: &mut Inner, now: Duration, node: &str) {
    inner.net.servers.retain(|_, s| s.node != node);
    inner.net.sources.retain(|_, s| s.node != node);
    let hit: Vec<u64> = inner
        .net
        .links
        .iter()
        .filter(|(_, l)| l.client == node || l.session.as_ref().is_some_and(|s| s.server_node == node))
        .map(|(id, _)| *id)
        .collect();
    for id in hit {
        break_link(inner, now, id, "crash");
        if inner.net.links.get(&id).is_some_and(|l| l.client == node) {
            inner.net.links.remove(&id);
        }
    }
}
