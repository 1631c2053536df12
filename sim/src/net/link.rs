//! One control connection's life: sessions (one per successful connect), the pipes that
//! carry each direction FIFO with latency, and the client's reconnect loop (a break is
//! `state`'s).

use std::time::Duration;

use bytes::Bytes;
use kvx_io::{ClientEvent, Inbound, TransportError};
use kvx_proto::{wire, PeerId};
use tokio::sync::{mpsc, watch};

use super::{describe, endpoint_error};
use crate::tables::net::Session;
use crate::world::{Inner, World};

/// Connects `link` afresh if its server is bound and reachable: a new session with its own
/// pipes, under the peer id the server keeps for the link's identity.
pub(super) fn open_session(
    world: &World,
    link: u64,
    events: &mpsc::Sender<ClientEvent>,
) -> Result<(), TransportError> {
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
        return Err(TransportError::Io(format!(
            "{endpoint} is unreachable from {client}"
        )));
    }
    let server = inner
        .net
        .servers
        .get_mut(&endpoint)
        .ok_or(TransportError::Closed)?;
    let fresh = PeerId(server.peers.len() as u64 + 1);
    let peer = *server.peers.entry(identity).or_insert(fresh);
    server.routes.insert(peer, link);
    let incoming = server.incoming.clone();
    let (up_tx, up_rx) = mpsc::unbounded_channel();
    let (down_tx, down_rx) = mpsc::unbounded_channel();
    let l = inner
        .net
        .links
        .get_mut(&link)
        .ok_or(TransportError::Closed)?;
    let epoch = l.epoch;
    l.session = Some(Session {
        peer,
        server_node: server_node.clone(),
        up: up_tx,
        down: down_tx,
        up_last: now,
        down_last: now,
    });
    inner.trace.record(
        now,
        format_args!("connect {client} -> {endpoint} as {peer}"),
    );
    drop(w);
    world.spawn_infra(up_pipe(world.clone(), link, epoch, up_rx, incoming, peer));
    world.spawn_infra(down_pipe(
        world.clone(),
        link,
        epoch,
        down_rx,
        events.clone(),
    ));
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
    incoming: mpsc::Sender<Inbound>,
    peer: PeerId,
) {
    while let Some((at, bytes)) = rx.recv().await {
        world.sleep_until(at).await;
        {
            let now = world.now();
            let mut w = world.lock();
            let Some((client, server, _)) = live(&w, link, epoch) else {
                return;
            };
            let what = describe(&bytes);
            w.trace
                .record(now, format_args!("{client} -> {server} {peer}: {what}"));
            if let Ok(msg) = wire::decode(&bytes) {
                w.checker.on_request(now, &server, peer, &client, &msg);
            }
        }
        if incoming.send(Inbound::Message(peer, bytes)).await.is_err() {
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
            let Some((client, server, peer)) = live(&w, link, epoch) else {
                return;
            };
            let what = describe(&bytes);
            w.trace
                .record(now, format_args!("{server} -> {client} {peer}: {what}"));
        }
        if events.send(ClientEvent::Message(bytes)).await.is_err() {
            return;
        }
    }
}

/// The ROUTER sends a reply: the checker sees what the receiver decided; the reply goes to
/// the peer's current connection, or is lost when it has none.
pub(super) fn route_reply(world: &World, endpoint: &str, peer: PeerId, bytes: Bytes) {
    let now = world.now();
    let mut w = world.lock();
    let inner = &mut *w;
    let Some(server) = inner.net.servers.get(endpoint) else {
        return;
    };
    let server_node = server.node.clone();
    if let Ok(wire::Message::AllocResponse(reply)) = wire::decode(&bytes) {
        inner.checker.on_reply(now, &server_node, peer, &reply);
    }
    let link = server.routes.get(&peer).copied();
    let client = link
        .and_then(|l| inner.net.links.get(&l))
        .map(|l| l.client.clone());
    let (Some(link), Some(client)) = (link, client) else {
        let what = describe(&bytes);
        inner.trace.record(
            now,
            format_args!("{server_node} -> {peer} LOST (no connection): {what}"),
        );
        return;
    };
    let delay = inner.control_delay(&server_node, &client);
    let Some(session) = inner
        .net
        .links
        .get_mut(&link)
        .and_then(|l| l.session.as_mut())
    else {
        let what = describe(&bytes);
        inner.trace.record(
            now,
            format_args!("{server_node} -> {client} LOST (down): {what}"),
        );
        return;
    };
    let at = (now + delay).max(session.down_last);
    session.down_last = at;
    let _ = session.down.send((at, bytes));
}

/// The client side of one connection, in the client's process: forwards what the handle
/// sends, notices a break, and reconnects with backoff.
pub(super) async fn client_task(
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
    // After `Disconnected`, everything is dropped until the caller acknowledges it and every
    // earlier one (`kvx_io::DISCONNECT_ACK`, an empty payload that is never sent on), as
    // ZmqTransport's DEALER does: a payload sent before the caller failed its requests must
    // not reach the next connection. A count: one acknowledgement lifts one disconnect.
    let mut unacknowledged = 0u64;
    loop {
        broken.borrow_and_update();
        loop {
            tokio::select! {
                p = out_rx.recv() => match p {
                    Some(p) if p.is_empty() => unacknowledged = unacknowledged.saturating_sub(1),
                    Some(p) if unacknowledged > 0 => drop_payload(&world, link, &p),
                    Some(p) => send_up(&world, link, p),
                    None => return close_link(&world, link),
                },
                r = broken.changed() => {
                    if r.is_err() { return close_link(&world, link) }
                    break;
                }
            }
        }
        unacknowledged += 1;
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
                        Some(p) if p.is_empty() => {
                            unacknowledged = unacknowledged.saturating_sub(1)
                        }
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
    if let Some(s) = inner
        .net
        .links
        .get_mut(&link)
        .and_then(|l| l.session.as_mut())
    {
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
