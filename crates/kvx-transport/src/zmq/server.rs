//! The bound sockets: the receiver's ROUTER (`serve`) and the proxy's PULL
//! (`notify_source`). Each listens behind a frame-length guard (`guard`): the zeromq socket
//! binds an internal loopback port and the guard the public endpoint. Each is owned by
//! background tasks that end when the handle is dropped, which closes the guard, the socket,
//! its listener and every accepted connection.

use std::sync::Arc;

use bytes::Bytes;
use kvx_io::transport::{ControlServer, NotifySource, TransportError, CHANNEL_DEPTH};
use kvx_proto::PeerId;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{
    PullSocket, RouterRecvHalf, RouterSendHalf, RouterSocket, Socket, SocketRecv, SocketSend,
};

use super::{bump, framing, guard, worth_logging, zmq_error, Shared};

/// Where a bound socket's zeromq side listens: loopback only, behind the guard.
const INTERNAL: &str = "tcp://127.0.0.1:0";

/// Binds the guard at `zmq_endpoint` (`tcp://host:port`) in front of the zeromq socket
/// bound at `inner` (`tcp://127.0.0.1:port`); returns the public endpoint and the guard.
/// The first address `tcp://host:port` resolves to.
async fn socket_addr(endpoint: &str) -> Option<std::net::SocketAddr> {
    let hostport = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
    tokio::net::lookup_host(hostport).await.ok()?.next()
}

async fn guard_in_front(
    shared: &Shared,
    endpoint: &str,
    zmq_endpoint: &str,
    inner: &str,
) -> Result<(String, AbortOnDrop), TransportError> {
    let public = socket_addr(zmq_endpoint)
        .await
        .ok_or_else(|| TransportError::Endpoint {
            endpoint: endpoint.to_owned(),
            why: "cannot resolve the address".into(),
        })?;
    let inner = socket_addr(inner)
        .await
        .ok_or_else(|| TransportError::Io(format!("internal endpoint {inner} unusable")))?;
    let refuse = shared.config.frame_refuse_bytes as u64;
    let g = guard::bind(public, inner, refuse)
        .await
        .map_err(|e| TransportError::Io(format!("bind {endpoint}: {e}")))?;
    Ok((format!("tcp://{}", g.local), AbortOnDrop(g.task)))
}

/// Aborts a task when dropped, so a helper task cannot outlive the task that owns it.
#[derive(Debug)]
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(super) async fn serve(
    shared: Arc<Shared>,
    endpoint: &str,
    zmq_endpoint: &str,
) -> Result<ControlServer, TransportError> {
    let mut socket = RouterSocket::new();
    let inner = socket
        .bind(INTERNAL)
        .await
        .map_err(|e| zmq_error("bind", endpoint, e))?
        .to_string();
    let (local, guard) = guard_in_front(&shared, endpoint, zmq_endpoint, &inner).await?;
    let (in_tx, in_rx) = mpsc::channel(CHANNEL_DEPTH);
    let (out_tx, out_rx) = mpsc::channel(CHANNEL_DEPTH);
    // Receiving and replying run in separate tasks over the split socket, so a reply stuck
    // behind one slow peer (up to `send_timeout`) never stops requests from everyone else.
    let (send_half, recv_half) = socket.split();
    let replies = tokio::spawn(route_replies(shared.clone(), send_half, out_rx));
    tokio::spawn(route_requests(
        shared,
        recv_half,
        in_tx,
        [AbortOnDrop(replies), guard],
    ));
    tracing::debug!(endpoint = %local, "ROUTER bound");
    Ok(ControlServer::new(local, in_rx, out_tx))
}

/// Passes each well-formed incoming message on as `(PeerId, payload)`. Ends when the
/// `ControlServer` is dropped, taking the reply task, the guard and the socket with it:
/// clones of `ControlServer::replies()` do not keep a dropped server bound.
async fn route_requests(
    shared: Arc<Shared>,
    mut socket: RouterRecvHalf,
    incoming: mpsc::Sender<(PeerId, Bytes)>,
    _replies_and_guard: [AbortOnDrop; 2],
) {
    let max = shared.config.frame_max_bytes;
    loop {
        let received = tokio::select! {
            _ = incoming.closed() => break,
            received = socket.recv() => received,
        };
        match received {
            Ok(message) => match framing::routed_in(message, max) {
                Ok((identity, payload)) => {
                    let peer = shared.peers().peer_for(&identity);
                    if incoming.send((peer, payload)).await.is_err() {
                        break;
                    }
                }
                Err(reject) => shared.rejected("ROUTER", &reject),
            },
            Err(e) => {
                // The ROUTER drops a failing peer itself and only reports errors it cannot
                // attribute; yield so that even a pathological repeat cannot spin.
                tracing::warn!(error = %e, "ROUTER receive failed");
                tokio::task::yield_now().await;
            }
        }
    }
    tracing::debug!("ROUTER handle dropped; closing");
}

/// Sends each reply as `[identity, "", payload]`. A reply to a peer that is not connected is
/// lost, as with any ROUTER; the sender's reply timeout covers it.
async fn route_replies(
    shared: Arc<Shared>,
    mut socket: RouterSendHalf,
    mut outgoing: mpsc::Receiver<(PeerId, Bytes)>,
) {
    let send_timeout = shared.config.send_timeout;
    while let Some((peer, payload)) = outgoing.recv().await {
        let identity = shared.peers().identity_of(peer);
        let Some(identity) = identity else {
            unroutable(&shared, peer, "no such peer");
            continue;
        };
        let message = framing::routed_out(identity, payload);
        match tokio::time::timeout(send_timeout, socket.send(message)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => unroutable(&shared, peer, &e.to_string()),
            Err(_) => {
                let n = bump(&shared.counters.send_timeouts);
                tracing::warn!(%peer, after = ?send_timeout, timeouts_so_far = n,
                    "ROUTER reply timed out (the peer is not reading); dropped");
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

pub(super) async fn notify_source(
    shared: Arc<Shared>,
    endpoint: &str,
    zmq_endpoint: &str,
) -> Result<NotifySource, TransportError> {
    let mut socket = PullSocket::new();
    let inner = socket
        .bind(INTERNAL)
        .await
        .map_err(|e| zmq_error("bind", endpoint, e))?
        .to_string();
    let (local, guard) = guard_in_front(&shared, endpoint, zmq_endpoint, &inner).await?;
    let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
    tokio::spawn(pull_notices(shared, socket, tx, guard));
    tracing::debug!(endpoint = %local, "PULL bound");
    Ok(NotifySource::new(local, rx))
}

async fn pull_notices(
    shared: Arc<Shared>,
    mut socket: PullSocket,
    incoming: mpsc::Sender<Bytes>,
    _guard: AbortOnDrop,
) {
    let max = shared.config.frame_max_bytes;
    loop {
        let received = tokio::select! {
            _ = incoming.closed() => break,
            received = socket.recv() => received,
        };
        match received {
            Ok(message) => match framing::notice_in(message, max) {
                Ok(payload) => {
                    if incoming.send(payload).await.is_err() {
                        break;
                    }
                }
                Err(reject) => shared.rejected("PULL", &reject),
            },
            Err(e) => {
                // A peer whose stream failed; the PULL has already dropped it.
                tracing::debug!(error = %e, "PULL receive failed");
                tokio::task::yield_now().await;
            }
        }
    }
    // zeromq 0.7's PullSocket, unlike its other sockets, has no Drop that shuts its
    // connections down: their writer tasks would keep them open after the socket is gone.
    socket.backend().shutdown();
    tracing::debug!("PULL handle dropped; closing");
}
