//! The bound sockets: the receiver's ROUTER (`serve`) and the proxy's PULL
//! (`notify_source`), speaking ZMTP through `zmtp` (which holds every frame to the limits
//! before buffering it; see there for why kvx does not use the `zeromq` crate).
//!
//! One task accepts connections, at most `connections_max` at once; each connection gets a
//! task that handshakes (bounded by `handshake_timeout`) and reads messages (each bounded by
//! `message_timeout` once begun), and a ROUTER connection also a writer task fed by a
//! bounded queue. A ROUTER refuses identities as libzmq does (`Routes`, `peers`). Everything ends when the handle is dropped: the accept task and every
//! connection task watch the incoming channel and stop when its receiver is gone, which
//! closes the listener and every accepted connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::{
    ControlServer, Inbound, Notice, NotifySource, TransportError, CHANNEL_DEPTH,
};
use kvx_io::{ConnectionBudget, Evicted, Held};
use kvx_proto::proxy::NoticeFrom;
use kvx_proto::PeerId;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::inbound::InboundBudget;

use super::conn::{next_message, watch_liveness, AbortOnDrop, Read};
use super::frames::{error_command, pong_body};
use super::handshake::{handshake_server, Handshaken};
use super::zmtp::{
    announced_epoch, announces_heartbeats, FrameReader, HandshakeError, ReadLimits, Sealer,
};
use super::{bump, fingerprint, framing, peers, worth_logging, Shared};

/// Binds `bind` (`tcp://host:port`, already normalised); `endpoint` is the caller's text,
/// for errors.
async fn listen(endpoint: &str, bind: &str) -> Result<TcpListener, TransportError> {
    let hostport = bind.strip_prefix("tcp://").unwrap_or(bind);
    let addr: SocketAddr = tokio::net::lookup_host(hostport)
        .await
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| TransportError::Endpoint {
            endpoint: endpoint.to_owned(),
            why: "cannot resolve the address".into(),
        })?;
    TcpListener::bind(addr)
        .await
        .map_err(|e| TransportError::Io(format!("bind {endpoint}: {e}")))
}

fn local_endpoint(listener: &TcpListener) -> Result<String, TransportError> {
    let addr = listener
        .local_addr()
        .map_err(|e| TransportError::Io(e.to_string()))?;
    Ok(format!("tcp://{addr}"))
}

/// Accepts connections until `closed` resolves, handing each to `serve_conn` with its place
/// in the socket's `ConnectionBudget`: at most `connections_max` at once,
/// `connections_per_source_max` from one address; past either, the quietest connection is
/// closed for the newcomer (counted, logged sparsely), so a flood of connections can neither
/// grow the process without bound nor lock a talking peer out. A place is freed when its
/// connection's task ends.
async fn accept_loop<F, Fut>(
    shared: Arc<Shared>,
    socket: &'static str,
    listener: TcpListener,
    closed: impl std::future::Future<Output = ()>,
    serve_conn: F,
) where
    F: Fn(TcpStream, Arc<Held>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::pin!(closed);
    let budget = ConnectionBudget::new(
        shared.config.connections_max,
        shared.config.connections_per_source_max,
    );
    let mut accept_errors = 0u64;
    loop {
        let accepted = tokio::select! {
            () = &mut closed => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, from)) => {
                let (held, Evicted(evicted)) = budget.open(from.ip());
                for _ in 0..evicted {
                    shared.refused(
                        &shared.counters.connections_refused,
                        socket,
                        "connection closed for a newcomer: the socket holds connections_max \
                         connections (or connections_per_source_max from its address), and \
                         this one had gone longest without a message",
                        &shared.config.connections_max,
                    );
                }
                let _ = stream.set_nodelay(true);
                watch_liveness(&stream, shared.config.send_timeout);
                let held = Arc::new(held);
                let conn = serve_conn(stream, held.clone());
                tokio::spawn(async move {
                    held.run(conn).await;
                });
            }
            Err(e) => {
                // Out of descriptors, say: back off instead of spinning, and say so sparsely.
                accept_errors += 1;
                if worth_logging(accept_errors) {
                    tracing::warn!(socket, error = %e, so_far = accept_errors, "accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The peer's half of the handshake within `handshake_timeout` (our greeting out, its
/// greeting and READY in, or CURVE's HELLO to INITIATE: `zmtp::handshake_server`); `None`
/// (counted, logged sparsely) when the peer fails it. A peer refused for security (the other
/// mechanism, a CURVE box that does not open, a key off the allow-list) is told why in an
/// ERROR command and counted in `curve_refused`. The caller answers with `accept` or
/// `refuse`.
async fn handshake(
    shared: &Shared,
    reader: &mut FrameReader<tokio::net::tcp::OwnedReadHalf>,
    writer: &mut OwnedWriteHalf,
    ours: &'static str,
    peers: &[&str],
) -> Option<Handshaken> {
    let bound = shared.config.handshake_timeout;
    let curve = shared
        .config
        .curve
        .as_ref()
        .and_then(|c| Some((&c.keys, c.allowed_clients.as_ref()?)));
    let handshake = handshake_server(reader, writer, ours, peers, curve);
    let why = match tokio::time::timeout(bound, handshake).await {
        Ok(Ok(handshaken)) => return Some(handshaken),
        Ok(Err(why @ (HandshakeError::Unauthenticated(_) | HandshakeError::NotAllowed(_)))) => {
            shared.refused(
                &shared.counters.curve_refused,
                ours,
                "connection refused by security (CURVE); connection closed",
                &why,
            );
            refuse(shared, writer, &why.to_string()).await;
            return None;
        }
        Ok(Err(why)) => why.to_string(),
        Err(_) => format!("not done within {bound:?}"),
    };
    shared.refused(
        &shared.counters.handshakes_failed,
        ours,
        "ZMTP handshake failed; connection closed",
        &why,
    );
    None
}

/// Completes the handshake with our READY (in a CURVE box, under CURVE), within
/// `handshake_timeout`; false when the peer did not take it (the connection is then closed).
async fn accept(
    shared: &Shared,
    writer: &mut OwnedWriteHalf,
    sealer: &mut Sealer,
    ours: &'static str,
) -> bool {
    use tokio::io::AsyncWriteExt;
    let ready = sealer.ready(ours, Some(shared.epoch));
    let bound = shared.config.handshake_timeout;
    matches!(
        tokio::time::timeout(bound, writer.write_all(&ready)).await,
        Ok(Ok(()))
    )
}

/// Refuses the peer with an ERROR command carrying `reason` (RFC 23), so that it can report
/// why instead of a lost connection; the caller then closes the connection. Bounded by
/// `handshake_timeout`, and best effort: a peer that does not read it is closed all the same.
async fn refuse(shared: &Shared, writer: &mut OwnedWriteHalf, reason: &str) {
    use tokio::io::AsyncWriteExt;
    let error = error_command(reason);
    let bound = shared.config.handshake_timeout;
    let _ = tokio::time::timeout(bound, async {
        writer.write_all(&error).await?;
        writer.shutdown().await
    })
    .await;
}

/// A connection's reader (its large frames within the socket's `large` budget) and writer.
fn reader_for(
    shared: &Shared,
    stream: TcpStream,
    large: InboundBudget,
) -> (FrameReader<tokio::net::tcp::OwnedReadHalf>, OwnedWriteHalf) {
    let (rd, wr) = stream.into_split();
    let reader = FrameReader::new(rd, ReadLimits::of(&shared.config)).with_budget(large);
    (reader, wr)
}

// ---------------------------------------------------------------------------------------
// ROUTER

/// The connected peers' reply queues, by routing identity: one connection per identity.
/// A second connection announcing an identity already connected is refused, as libzmq's
/// ROUTER refuses it (`ZMQ_ROUTER_HANDOVER` off, its default): the connection holding the
/// identity keeps it, so a peer that knows or guesses a sender's identity cannot take the
/// sender's replies or act under its `PeerId` (`docs/spec/zmq.md` §3).
#[derive(Debug, Default)]
struct Routes {
    next_conn: u64,
    next_anonymous: u32,
    by_identity: HashMap<Bytes, (u64, mpsc::Sender<Bytes>)>,
}

impl Routes {
    /// Registers a connection under `announced` (or, for an anonymous peer, an identity made
    /// up here); its id, identity and reply queue, or `None` when the identity is taken.
    fn claim(&mut self, announced: Option<Bytes>) -> Option<(u64, Bytes, mpsc::Receiver<Bytes>)> {
        let identity = match announced {
            Some(identity) if self.by_identity.contains_key(&identity) => return None,
            Some(identity) => identity,
            None => self.anonymous(),
        };
        self.next_conn += 1;
        let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
        self.by_identity
            .insert(identity.clone(), (self.next_conn, tx));
        Some((self.next_conn, identity, rx))
    }

    /// An identity for a peer that announced none, as libzmq names one: a zero byte (which
    /// no identity from the wire may begin with) and a counter, skipping any in use.
    fn anonymous(&mut self) -> Bytes {
        loop {
            self.next_anonymous = self.next_anonymous.wrapping_add(1);
            let mut id = vec![0u8];
            id.extend_from_slice(&self.next_anonymous.to_be_bytes());
            let id = Bytes::from(id);
            if !self.by_identity.contains_key(&id) {
                return id;
            }
        }
    }

    /// Forgets connection `conn`'s route, unless the identity belongs to another by now.
    fn release(&mut self, identity: &Bytes, conn: u64) {
        if self
            .by_identity
            .get(identity)
            .is_some_and(|(c, _)| *c == conn)
        {
            self.by_identity.remove(identity);
        }
    }
}

/// The reason a ROUTER's ERROR gives a peer whose identity another connection holds. It
/// names no identity: the peer knows its own.
pub(crate) const IDENTITY_HELD: &str = "identity refused: another connection holds it";

/// The reason a CURVE ROUTER's ERROR gives a peer presenting an identity that another key
/// presented first (`peers::PeerTable::bind_key`).
pub(crate) const IDENTITY_OF_ANOTHER_KEY: &str =
    "identity refused: it belongs to another CURVE key";

/// Refuses a ROUTER peer's identity: counted in `identities_refused`, logged sparsely as
/// `log` with `label` (never the identity's bytes), and answered with an ERROR saying `reason`.
async fn refuse_identity(
    shared: &Shared,
    writer: &mut OwnedWriteHalf,
    log: &'static str,
    label: &(dyn std::fmt::Display + Sync),
    reason: &str,
) {
    shared.refused(&shared.counters.identities_refused, "ROUTER", log, label);
    refuse(shared, writer, reason).await;
}

type SharedRoutes = Arc<Mutex<Routes>>;

fn lock(routes: &SharedRoutes) -> MutexGuard<'_, Routes> {
    routes.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) async fn serve(
    shared: Arc<Shared>,
    endpoint: &str,
    zmq_endpoint: &str,
) -> Result<ControlServer, TransportError> {
    let listener = listen(endpoint, zmq_endpoint).await?;
    let local = local_endpoint(&listener)?;
    // The receiver binds each peer's share to its principal (`Shared::principal`).
    let principals = shared.clone();
    let (in_tx, in_rx) = mpsc::channel(CHANNEL_DEPTH);
    let (out_tx, out_rx) = mpsc::channel(CHANNEL_DEPTH);
    let budget = InboundBudget::new(shared.config.inbound_bytes_max);
    let large = InboundBudget::new(shared.config.unfinished_bytes_max);
    let routes = SharedRoutes::default();
    // Replies run in their own task, so a reply stuck behind one slow peer (up to
    // `send_timeout`) never stops requests from everyone else.
    let replies = AbortOnDrop(tokio::spawn(route_replies(
        shared.clone(),
        routes.clone(),
        out_rx,
    )));
    let closed = {
        let in_tx = in_tx.clone();
        async move {
            in_tx.closed().await;
            // Clones of `ControlServer::replies()` do not keep a dropped server bound.
            drop(replies);
            tracing::debug!("ROUTER handle dropped; closing");
        }
    };
    tokio::spawn(accept_loop(
        shared.clone(),
        "ROUTER",
        listener,
        closed,
        move |stream, held| {
            let incoming = (in_tx.clone(), budget.clone(), large.clone());
            router_conn(shared.clone(), routes.clone(), incoming, stream, held)
        },
    ));
    tracing::debug!(endpoint = %local, "ROUTER bound");
    Ok(ControlServer::with_lost_peers(local, in_rx, out_tx)
        .with_principals(Arc::new(move |peer| principals.principal(peer))))
}

/// One DEALER's connection: handshake, then its requests in, its replies out.
async fn router_conn(
    shared: Arc<Shared>,
    routes: SharedRoutes,
    (incoming, budget, large): (mpsc::Sender<Inbound>, InboundBudget, InboundBudget),
    stream: TcpStream,
    held: Arc<Held>,
) {
    let source = stream
        .peer_addr()
        .map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |a| a.ip());
    let (mut reader, mut writer) = reader_for(&shared, stream, large);
    let Some(Handshaken {
        props,
        mut sealer,
        client_key,
    }) = handshake(
        &shared,
        &mut reader,
        &mut writer,
        "ROUTER",
        &["DEALER", "REQ", "ROUTER"],
    )
    .await
    else {
        return;
    };
    let announced = match peers::announced_identity(&props) {
        Ok(announced) => announced,
        Err(why) => {
            let reason = format!("identity refused: {why}");
            let log = "identity refused; connection closed";
            return refuse_identity(&shared, &mut writer, log, &why, &reason).await;
        }
    };
    let claimed = lock(&routes).claim(announced.clone());
    let Some((conn, identity, queue)) = claimed else {
        let taken = announced.unwrap_or_default();
        let log = "identity refused: another connection holds it; connection closed";
        let label = kvx_io::SecretLabel(&taken);
        return refuse_identity(&shared, &mut writer, log, &label, IDENTITY_HELD).await;
    };
    // Under CURVE the identity belongs to the key that first presented it.
    let bound = shared.peers().bind_key(&identity, client_key);
    if bound.is_err() {
        lock(&routes).release(&identity, conn);
        let log = "identity refused: it belongs to another CURVE key; connection closed";
        let label = kvx_io::SecretLabel(&identity);
        return refuse_identity(&shared, &mut writer, log, &label, IDENTITY_OF_ANOTHER_KEY).await;
    }
    if !accept(&shared, &mut writer, &mut sealer, "ROUTER").await {
        lock(&routes).release(&identity, conn);
        return;
    }
    // While this connection holds the identity, its `PeerId` is not forgotten (`peers`), and
    // who holds it is known (`ZmqTransport::peer_public_key`, `peer_source`).
    let principal = peers::Principal {
        source,
        key: client_key,
    };
    shared.peers().held(&identity, principal);
    if shared
        .peers()
        .epoch_seen(&identity, announced_epoch(&props))
    {
        // Its previous connection's requests failed when it closed (`Inbound::Lost` came
        // before the identity was free to take).
        bump(&shared.counters.peer_restarts);
        tracing::info!(peer = %kvx_io::SecretLabel(&identity),
            "ROUTER: a sender came back as a new process (a new epoch): it restarted");
    }
    // A kvx DEALER pings (it announced heartbeats): each PING is answered, and one that falls
    // silent for `heartbeat_timeout` is hung or cut off and lost like a closed one.
    let heartbeats = announces_heartbeats(&props);
    let (pongs, pongs_rx) = mpsc::channel(PONGS_QUEUED);
    let mut writing = AbortOnDrop(tokio::spawn(write_replies(
        shared.clone(),
        writer,
        sealer,
        queue,
        pongs_rx,
    )));
    let max = shared.config.frame_max_bytes;
    let liveness = shared.config.heartbeat_timeout;
    let mut last_heard = tokio::time::Instant::now();
    // The `PeerId` this connection's messages went under, once one did.
    let mut spoke: Option<PeerId> = None;
    loop {
        let next = tokio::select! {
            () = incoming.closed() => break,
            // The replies' side is over (a write timed out): stop taking requests that
            // could never be answered here.
            _ = &mut writing.0 => break,
            // Dropping a message half read is fine here: the connection goes with it.
            () = tokio::time::sleep_until(last_heard + liveness), if heartbeats => {
                let n = bump(&shared.counters.peers_silent);
                if worth_logging(n) {
                    tracing::warn!(peer = %kvx_io::SecretLabel(&identity), ?liveness,
                        silent_so_far = n,
                        "ROUTER: a peer that sends heartbeats fell silent (hung, or its link \
                         is down); connection closed");
                }
                break;
            }
            next = next_message(&shared, "ROUTER", &mut reader) => next.ok(),
        };
        let Some(next) = next else { break };
        last_heard = tokio::time::Instant::now();
        let frames = match next {
            Read::Message(frames) => frames,
            Read::Dropped => {
                held.heard(); // counted
                continue;
            }
            Read::Ping(context) => {
                // A full queue means PONGs are not being written: the writer's own
                // `send_timeout` ends the connection then.
                let _ = pongs.try_send(context);
                continue;
            }
            Read::Pong => continue,
        };
        held.heard();
        match framing::enveloped_in(&frames, max) {
            Ok(payload) => {
                let peer = shared.peers().peer_for(&identity);
                let payload = tokio::select! {
                    () = incoming.closed() => break,
                    payload = budget.admit(payload) => payload,
                };
                // Its bytes are in the inbound budget now: their share of the unfinished
                // one goes back.
                reader.release_reserved();
                spoke = Some(peer);
                if incoming
                    .send(Inbound::Message(peer, payload))
                    .await
                    .is_err()
                {
                    break;
                }
            }
            Err(reject) => shared.rejected("ROUTER", &reject),
        }
        reader.release_reserved();
    }
    // The peer's last connection is gone (this one held its identity: no other could
    // connect under it). Said before the identity is released, so that whatever it sends
    // after reconnecting comes after; only for a peer that said anything (nothing of a
    // silent one can be open); bounded, since a receiver that stopped reading has closed
    // its channel or is shutting down.
    if let Some(peer) = spoke {
        let lost = incoming.send(Inbound::Lost(peer));
        let _ = tokio::time::timeout(shared.config.send_timeout, lost).await;
    }
    lock(&routes).release(&identity, conn);
    shared.peers().released(&identity);
}

/// PONGs waiting to be written on one connection; a peer pinging faster than they are written
/// finds the rest dropped.
const PONGS_QUEUED: usize = 4;

/// Writes one connection's replies as `["", payload]`, as many as are queued per write, and
/// the PONGs answering its peer's heartbeats. A
/// write that takes longer than `send_timeout` (the peer stopped reading, or vanished
/// without closing) ends the connection: its replies are lost, as the peer is.
async fn write_replies(
    shared: Arc<Shared>,
    mut writer: OwnedWriteHalf,
    mut sealer: Sealer,
    mut queue: mpsc::Receiver<Bytes>,
    mut pongs: mpsc::Receiver<Bytes>,
) {
    use tokio::io::AsyncWriteExt;
    let after = shared.config.send_timeout;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        tokio::select! {
            payload = queue.recv() => {
                let Some(payload) = payload else { return };
                sealer.message(&framing::enveloped_out(&payload), &mut buf);
                while let Ok(more) = queue.try_recv() {
                    sealer.message(&framing::enveloped_out(&more), &mut buf);
                }
            }
            context = pongs.recv() => {
                let Some(context) = context else { return };
                sealer.command(&pong_body(&context), &mut buf);
            }
        }
        match tokio::time::timeout(after, writer.write_all(&buf)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return,
            Err(_) => {
                let n = bump(&shared.counters.send_timeouts);
                tracing::warn!(
                    ?after,
                    timeouts_so_far = n,
                    "ROUTER reply write timed out (the peer is not reading); connection closed"
                );
                // Dropping the write half sends FIN; the peer's DEALER reconnects.
                return;
            }
        }
    }
}

/// Hands each reply to its peer's connection without waiting: one task routes every peer's
/// replies, so a peer that stopped reading must not hold up the others. A reply to a peer
/// that is not connected, or whose queue (`CHANNEL_DEPTH` replies) is full, is lost, as with
/// any ROUTER; the sender's reply timeout covers it.
async fn route_replies(
    shared: Arc<Shared>,
    routes: SharedRoutes,
    mut outgoing: mpsc::Receiver<(PeerId, Bytes)>,
) {
    while let Some((peer, payload)) = outgoing.recv().await {
        let Some(identity) = shared.peers().identity_of(peer) else {
            unroutable(&shared, peer, "no such peer");
            continue;
        };
        let queue = lock(&routes)
            .by_identity
            .get(&identity)
            .map(|(_, q)| q.clone());
        let Some(queue) = queue else {
            unroutable(&shared, peer, "not connected");
            continue;
        };
        match queue.try_send(payload) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Closed(_)) => {
                unroutable(&shared, peer, "its connection closed")
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                let n = bump(&shared.counters.send_timeouts);
                if worth_logging(n) {
                    tracing::warn!(%peer, dropped_so_far = n,
                        "ROUTER reply dropped: the peer is not reading its replies");
                }
            }
        }
    }
}

fn unroutable(shared: &Shared, peer: PeerId, why: &str) {
    let n = bump(&shared.counters.unroutable_replies);
    // Routine when a sender goes away with replies pending, so debug unless it piles up.
    if worth_logging(n) {
        tracing::debug!(%peer, why, unroutable_so_far = n, "reply dropped");
    }
}

// ---------------------------------------------------------------------------------------
// PULL

pub(super) async fn notify_source(
    shared: Arc<Shared>,
    endpoint: &str,
    zmq_endpoint: &str,
) -> Result<NotifySource, TransportError> {
    let listener = listen(endpoint, zmq_endpoint).await?;
    let local = local_endpoint(&listener)?;
    let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
    let budget = InboundBudget::new(shared.config.inbound_bytes_max);
    let large = InboundBudget::new(shared.config.unfinished_bytes_max);
    // Numbers this socket's connections, for the proxy's binding (`kvx_proto::proxy`).
    let connections = Arc::new(AtomicU64::new(0));
    let closed = {
        let tx = tx.clone();
        async move {
            tx.closed().await;
            tracing::debug!("PULL handle dropped; closing");
        }
    };
    tokio::spawn(accept_loop(
        shared.clone(),
        "PULL",
        listener,
        closed,
        move |stream, held| {
            let incoming = (tx.clone(), budget.clone(), large.clone());
            let connection = connections.fetch_add(1, Ordering::Relaxed) + 1;
            pull_conn(shared.clone(), incoming, connection, stream, held)
        },
    ));
    tracing::debug!(endpoint = %local, "PULL bound");
    Ok(NotifySource::new(local, rx))
}

/// One PUSH's connection, number `connection` of its socket: handshake, then one notice per
/// message, each tagged with who sent it (the connection, and under CURVE the principal of
/// the key it proved).
async fn pull_conn(
    shared: Arc<Shared>,
    (incoming, budget, large): (mpsc::Sender<Notice>, InboundBudget, InboundBudget),
    connection: u64,
    stream: TcpStream,
    held: Arc<Held>,
) {
    let source = stream
        .peer_addr()
        .map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |a| a.ip());
    // The write half stays open for the connection's life: closing it would tell the PUSH
    // that this end is gone.
    let (mut reader, mut writer) = reader_for(&shared, stream, large);
    let Some(mut handshaken) =
        handshake(&shared, &mut reader, &mut writer, "PULL", &["PUSH"]).await
    else {
        return;
    };
    if !accept(&shared, &mut writer, &mut handshaken.sealer, "PULL").await {
        return;
    }
    // Without CURVE the connection alone stands for the sender: an address is shared by
    // every process of a host, so it cannot tell two TP ranks apart.
    let key = handshaken.client_key;
    let from = NoticeFrom {
        connection,
        principal: key.map(|k| shared.principal_of(Some(k), source)),
    };
    let label: Arc<str> = match key {
        Some(k) => format!("key {}", fingerprint(&k)).into(),
        None => format!("address {source}").into(),
    };
    let max = shared.config.frame_max_bytes;
    loop {
        let next = tokio::select! {
            () = incoming.closed() => break,
            next = next_message(&shared, "PULL", &mut reader) => next.ok(),
        };
        let Some(next) = next else { break };
        let frames = match next {
            Read::Message(frames) => frames,
            Read::Dropped => {
                held.heard(); // counted
                continue;
            }
            // A PUSH sends no heartbeats; one that does is not answered.
            Read::Ping(_) | Read::Pong => continue,
        };
        held.heard();
        match framing::notice_in(&frames, max) {
            Ok(payload) => {
                let payload = tokio::select! {
                    () = incoming.closed() => break,
                    payload = budget.admit(payload) => payload,
                };
                reader.release_reserved();
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
            Err(reject) => shared.rejected("PULL", &reject),
        }
        reader.release_reserved();
    }
    drop(writer);
}
