//! A ROUTER's replies: routed by identity to the peer's current connection, and written
//! straight from the routing task when nothing is queued for that connection, else queued for
//! the connection's writer task.
//!
//! Why two paths: a reply that went through the writer task always cost one task hand-off,
//! which with two worker threads is a cross-thread wake-up on every round trip. Almost every
//! reply fits the socket's send buffer at once, so the router writes it with a non-blocking
//! `try_write`. Only when the peer is slow (the buffer is full) does the rest of the reply go
//! to the writer task, which waits for the socket; while anything is queued, every later reply
//! for that connection is queued behind it, so replies stay in order. One slow peer never
//! stops the router: its queue is bounded and a reply that cannot be queued within
//! `send_timeout` is dropped and counted, as before.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use kvx_io::transport::CHANNEL_DEPTH;
use kvx_proto::PeerId;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::mpsc;

use super::conn::AbortOnDrop;
use super::{bump, framing, worth_logging, zmtp, Shared};

/// One connection's outgoing side.
#[derive(Debug)]
pub(super) struct ConnOut {
    writer: Arc<OwnedWriteHalf>,
    /// Replies handed to the writer task and not yet fully written. Only the routing task
    /// raises it and only the writer task lowers it (after writing), so when the router reads
    /// zero, nothing of this connection is queued or being written, and it may write itself.
    queued: Arc<AtomicUsize>,
    queue: mpsc::Sender<Vec<u8>>,
    _writer_task: AbortOnDrop<()>,
}

impl ConnOut {
    pub(super) fn new(writer: OwnedWriteHalf) -> Self {
        let writer = Arc::new(writer);
        let queued = Arc::new(AtomicUsize::new(0));
        let (queue, rx) = mpsc::channel(CHANNEL_DEPTH);
        let task = tokio::spawn(write_queued(writer.clone(), queued.clone(), rx));
        Self {
            writer,
            queued,
            queue,
            _writer_task: AbortOnDrop(task),
        }
    }
}

/// The connected peers' outgoing sides, by routing identity. A newer connection with an
/// identity takes it over (a DEALER that reconnected while its old connection lingers).
#[derive(Debug, Default)]
pub(super) struct Routes {
    pub(super) next_conn: u64,
    pub(super) next_anonymous: u32,
    pub(super) by_identity: HashMap<Bytes, (u64, Arc<ConnOut>)>,
}

pub(super) type SharedRoutes = Arc<Mutex<Routes>>;

pub(super) fn lock(routes: &SharedRoutes) -> MutexGuard<'_, Routes> {
    routes.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes what the router queued, in order, waiting for the socket as needed.
async fn write_queued(
    writer: Arc<OwnedWriteHalf>,
    queued: Arc<AtomicUsize>,
    mut rx: mpsc::Receiver<Vec<u8>>,
) {
    while let Some(bytes) = rx.recv().await {
        if write_all(&writer, &bytes).await.is_err() {
            return;
        }
        queued.fetch_sub(1, Ordering::Release);
    }
}

async fn write_all(writer: &OwnedWriteHalf, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        writer.writable().await?;
        match writer.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Hands each reply to its peer's connection. A reply to a peer that is not connected is
/// lost, as with any ROUTER; the sender's reply timeout covers it.
pub(super) async fn route_replies(
    shared: Arc<Shared>,
    routes: SharedRoutes,
    mut outgoing: mpsc::Receiver<(PeerId, Bytes)>,
) {
    let mut buf = Vec::with_capacity(256);
    while let Some((peer, payload)) = outgoing.recv().await {
        let Some(identity) = shared.peers().identity_of(peer) else {
            unroutable(&shared, peer, "no such peer");
            continue;
        };
        let conn = lock(&routes)
            .by_identity
            .get(&identity)
            .map(|(_, c)| c.clone());
        let Some(conn) = conn else {
            unroutable(&shared, peer, "not connected");
            continue;
        };
        buf.clear();
        zmtp::encode_message(&framing::routed_out(&payload), &mut buf);
        let rest = if conn.queued.load(Ordering::Acquire) == 0 {
            match conn.writer.try_write(&buf) {
                Ok(n) if n == buf.len() => continue,
                Ok(n) => &buf[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => &buf[..],
                Err(_) => {
                    unroutable(&shared, peer, "its connection closed");
                    continue;
                }
            }
        } else {
            &buf[..]
        };
        enqueue(&shared, peer, &conn, rest.to_vec(), rest.len() < buf.len()).await;
    }
}

/// Queues `bytes` behind whatever the connection's writer task holds. `partial` says the
/// reply's first bytes are already on the wire: then the rest must follow, and there is room
/// for it (nothing was queued).
async fn enqueue(shared: &Shared, peer: PeerId, conn: &ConnOut, bytes: Vec<u8>, partial: bool) {
    conn.queued.fetch_add(1, Ordering::AcqRel);
    let sent = if partial {
        conn.queue
            .try_send(bytes)
            .map_err(|_| "its connection closed")
    } else {
        let after = shared.config.send_timeout;
        match tokio::time::timeout(after, conn.queue.send(bytes)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err("its connection closed"),
            Err(_) => {
                let n = bump(&shared.counters.send_timeouts);
                tracing::warn!(%peer, ?after, timeouts_so_far = n,
                    "ROUTER reply timed out (the peer is not reading); dropped");
                Err("")
            }
        }
    };
    if let Err(why) = sent {
        conn.queued.fetch_sub(1, Ordering::AcqRel);
        if !why.is_empty() {
            unroutable(shared, peer, why);
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
