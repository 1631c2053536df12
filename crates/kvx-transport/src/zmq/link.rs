//! What the connecting sockets (the DEALER in `dealer`, the PUSH in `push`) share: opening
//! a connection (TCP, then the ZMTP handshake, bounded together by `connect_timeout`),
//! writing batches of messages, and reconnecting after a break.
//!
//! libzmq reconnects a DEALER or PUSH by itself; kvx's own sockets do it here. Each socket
//! task watches its connection (the reader reporting the peer gone, a failed or timed-out
//! write, and for the DEALER a silence of `recv_timeout` with requests outstanding), and when
//! it breaks opens a fresh one, waiting an exponentially growing, jittered backoff between
//! attempts. Each attempt is bounded by `connect_timeout`.
//!
//! Payloads handed in while the connection is down, and those still queued when it broke,
//! are dropped and counted. Holding them for the next connection would deliver requests the
//! sender has already failed on `Disconnected`, and LMCache's serial channel matches replies
//! by order alone, so a stale reply would be taken for a new request's. For the same reason a
//! DEALER that reported `Disconnected` is *fenced* (`Outgoing`): it drops every payload until
//! the caller acknowledges the disconnect (`kvx_io::transport::DISCONNECT_ACK`), even once
//! reconnected, so a payload the caller sent before it had failed its requests never reaches
//! the next connection.

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::{TransportError, CHANNEL_DEPTH};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::conn::watch_liveness;
use super::handshake::handshake;
use super::zmtp::{self, FrameReader, ReadLimits, Sealer};
use super::{bad_endpoint, bump, worth_logging, Shared};

/// Which socket a connection is for: its type, its routing identity (DEALER), and the
/// socket types it may talk to.
#[derive(Debug, Clone)]
pub(super) struct Role {
    pub(super) ours: &'static str,
    pub(super) identity: Option<Bytes>,
    pub(super) peers: &'static [&'static str],
}

/// A live connection after the handshake.
pub(super) struct Link {
    pub(super) reader: FrameReader<OwnedReadHalf>,
    pub(super) writer: OwnedWriteHalf,
    /// How messages are written: plain, or boxed under CURVE.
    pub(super) sealer: Sealer,
    /// The peer announced heartbeats in its READY (a kvx ROUTER answers PING with PONG).
    pub(super) heartbeats: bool,
    /// The epoch the peer announced (its process's incarnation), if it did.
    pub(super) epoch: Option<u64>,
}

/// The most messages one write gathers from the queue: enough to pay one system call for a
/// burst, few enough that a slow peer's `send_timeout` still concerns a bounded amount.
const BATCH_MAX: usize = 64;

/// What a caller hands a connecting socket, with the DEALER's disconnect fence: payloads are
/// dropped (counted) while any `Disconnected` is unacknowledged. The caller acknowledges each
/// one with an empty payload, never sent on (no message encodes to zero bytes). A count, not a
/// flag: the acknowledgement of one disconnect must not lift the fence of a later one (a
/// receiver in a crash loop with a lagging caller: D1, R1, D2, then ack 1).
#[derive(Debug)]
pub(super) struct Outgoing {
    rx: mpsc::Receiver<Bytes>,
    unacknowledged: u64,
}

impl Outgoing {
    pub(super) fn new() -> (mpsc::Sender<Bytes>, Self) {
        let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
        (
            tx,
            Self {
                rx,
                unacknowledged: 0,
            },
        )
    }

    /// Drops everything until the caller acknowledges this disconnect and every earlier one
    /// (a DEALER, as it reports `Disconnected`).
    pub(super) fn fence(&mut self) {
        self.unacknowledged += 1;
    }

    /// Whether `payload` is to be sent; consumes acknowledgements and fenced payloads.
    fn admit(&mut self, shared: &Shared, payload: &Bytes) -> bool {
        if payload.is_empty() {
            self.unacknowledged = self.unacknowledged.saturating_sub(1);
            return false;
        }
        if self.unacknowledged > 0 {
            dropped_while_down(shared);
            return false;
        }
        true
    }

    /// The next payload to send; `None` when the handle is gone. Cancel-safe.
    pub(super) async fn recv(&mut self, shared: &Shared) -> Option<Bytes> {
        loop {
            let payload = self.rx.recv().await?;
            if self.admit(shared, &payload) {
                return Some(payload);
            }
        }
    }

    fn try_recv(&mut self, shared: &Shared) -> Option<Bytes> {
        loop {
            let payload = self.rx.try_recv().ok()?;
            if self.admit(shared, &payload) {
                return Some(payload);
            }
        }
    }
}

/// One connection attempt to `endpoint` (`tcp://host:port`, already checked), TCP and ZMTP
/// handshake together bounded by `connect_timeout`. A refused TCP connection is retried
/// within that bound: the peer may be starting.
pub(super) async fn open(
    shared: &Shared,
    endpoint: &str,
    role: &Role,
) -> Result<Link, TransportError> {
    let after = shared.config.connect_timeout;
    match tokio::time::timeout(after, open_unbounded(shared, endpoint, role)).await {
        Ok(link) => link,
        Err(_) => Err(TransportError::Timeout {
            what: "connect",
            after,
        }),
    }
}

async fn open_unbounded(
    shared: &Shared,
    endpoint: &str,
    role: &Role,
) -> Result<Link, TransportError> {
    let hostport = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
    let addrs: Vec<_> = tokio::net::lookup_host(hostport)
        .await
        .map_err(|e| bad_endpoint(endpoint, format!("cannot resolve the address: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(bad_endpoint(endpoint, "the address resolves to nothing"));
    }
    // Every address in turn (`localhost` may give `::1` first while the peer listens on IPv4
    // only), each with its share of the connect timeout, so one that drops connection attempts
    // silently cannot use up the whole bound. A round in which some address refused or did
    // not answer, and none connected, is retried (the peer may be starting) until the
    // caller's bound; one in which every address failed otherwise (unreachable, say) is final.
    let share =
        (shared.config.connect_timeout / addrs.len() as u32).max(Duration::from_millis(100));
    let mut retry = Duration::from_millis(10);
    let stream = 'connected: loop {
        let mut retryable = false;
        let mut last = String::new();
        for addr in &addrs {
            match tokio::time::timeout(share, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => break 'connected stream,
                Ok(Err(e)) => {
                    retryable |= e.kind() == io::ErrorKind::ConnectionRefused;
                    last = format!("{addr}: {e}");
                }
                Err(_) => retryable = true,
            }
        }
        if !retryable {
            return Err(TransportError::Io(format!("connect {endpoint}: {last}")));
        }
        tokio::time::sleep(retry).await;
        retry = (retry * 2).min(Duration::from_millis(200));
    };
    watch_liveness(&stream, shared.config.send_timeout);
    // Control messages are small and latency-bound.
    let _ = stream.set_nodelay(true);
    let (rd, mut writer) = stream.into_split();
    let mut reader = FrameReader::new(rd, ReadLimits::of(&shared.config));
    let curve = shared
        .config
        .curve
        .as_ref()
        .and_then(|c| Some((&c.keys, c.server_key.as_ref()?)));
    let (props, sealer) = handshake(
        &mut reader,
        &mut writer,
        role.ours,
        role.identity.as_deref(),
        Some(shared.epoch),
        role.peers,
        curve,
    )
    .await
    .map_err(|e| match e {
        zmtp::HandshakeError::Refused(why) => TransportError::Refused {
            endpoint: endpoint.to_owned(),
            why,
        },
        why @ (zmtp::HandshakeError::Unauthenticated(_) | zmtp::HandshakeError::NotAllowed(_)) => {
            let n = bump(&shared.counters.curve_refused);
            if worth_logging(n) {
                tracing::warn!(socket = role.ours, %endpoint, so_far = n, %why,
                    "connection refused by security (CURVE)");
            }
            TransportError::Refused {
                endpoint: endpoint.to_owned(),
                why: why.to_string(),
            }
        }
        zmtp::HandshakeError::Failed(why) => {
            TransportError::Io(format!("ZMTP handshake with {endpoint}: {why}"))
        }
    })?;
    Ok(Link {
        reader,
        writer,
        sealer,
        heartbeats: zmtp::announces_heartbeats(&props),
        epoch: zmtp::announced_epoch(&props),
    })
}

/// Waits for the next payload and takes whatever else is queued behind it (up to
/// `BATCH_MAX`), encoding each as one message into `buf` (cleared first) with `encode`.
/// Returns how many were taken; `None` when the handle is gone. Cancel-safe.
pub(super) async fn next_batch(
    shared: &Shared,
    outgoing: &mut Outgoing,
    buf: &mut Vec<u8>,
    mut encode: impl FnMut(&[u8], &mut Vec<u8>),
) -> Option<u64> {
    let first = outgoing.recv(shared).await?;
    buf.clear();
    encode(&first, buf);
    let mut taken = 1;
    while taken < BATCH_MAX {
        let Some(more) = outgoing.try_recv(shared) else {
            break;
        };
        encode(&more, buf);
        taken += 1;
    }
    Some(taken as u64)
}

/// Writes `bytes` within `send_timeout`; `Err` says why the connection is presumed dead.
pub(super) async fn write_bounded(
    shared: &Shared,
    writer: &mut OwnedWriteHalf,
    bytes: &[u8],
) -> Result<(), String> {
    let after = shared.config.send_timeout;
    match tokio::time::timeout(after, writer.write_all(bytes)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("send failed: {e}")),
        Err(_) => {
            bump(&shared.counters.send_timeouts);
            Err(format!("send timed out after {after:?}"))
        }
    }
}

/// Exponential backoff from `min` to `max`, with up to a quarter of jitter so that senders
/// that lost the same receiver do not all return at the same instant.
///
/// It is kept across connections: a peer that accepts and then drops every connection (a
/// crash loop, an impostor on the port) is retried ever more slowly, not ten times a second.
/// `reset` starts over once a connection has proved itself.
#[derive(Debug)]
pub(super) struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

impl Backoff {
    pub(super) fn new(shared: &Shared) -> Self {
        Self {
            next: shared.config.reconnect_backoff_min,
            min: shared.config.reconnect_backoff_min,
            max: shared.config.reconnect_backoff_max,
        }
    }

    /// After a connection that lasted `lived`: one that outlived the longest wait was healthy.
    pub(super) fn after_connection(&mut self, lived: Duration) {
        if lived >= self.max {
            self.next = self.min;
        }
    }

    fn next_wait(&mut self) -> Duration {
        let base = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        // RandomState is randomly keyed per instance: a dependency-free source of jitter.
        let noise = RandomState::new().build_hasher().finish();
        let jitter = (base / 4).mul_f64((noise % 1024) as f64 / 1024.0);
        base.saturating_add(jitter)
    }
}

/// Drains what is queued on `outgoing` without waiting, counting it as dropped.
pub(super) fn discard_queued(shared: &Shared, outgoing: &mut Outgoing) {
    while outgoing.try_recv(shared).is_some() {
        dropped_while_down(shared);
    }
}

fn dropped_while_down(shared: &Shared) {
    let n = bump(&shared.counters.dropped_while_down);
    if worth_logging(n) {
        tracing::warn!(
            dropped_so_far = n,
            "payload dropped: the connection is down"
        );
    }
}

/// Runs `fut` while the connection is down: payloads handed in meanwhile are dropped, and
/// `None` comes back as soon as the handle is gone (`gone` resolves or `outgoing` closes).
async fn while_down<F: Future>(
    shared: &Shared,
    outgoing: &mut Outgoing,
    gone: impl Future<Output = ()>,
    fut: F,
) -> Option<F::Output> {
    tokio::pin!(fut);
    tokio::pin!(gone);
    loop {
        tokio::select! {
            out = &mut fut => return Some(out),
            _ = &mut gone => return None,
            payload = outgoing.recv(shared) => match payload {
                Some(_) => dropped_while_down(shared),
                None => return None,
            },
        }
    }
}

/// Opens a fresh connection after a break, with backoff; `None` if the handle went away.
pub(super) async fn reconnect<G>(
    shared: &Shared,
    endpoint: &str,
    role: &Role,
    backoff: &mut Backoff,
    outgoing: &mut Outgoing,
    gone: impl Fn() -> G,
) -> Option<Link>
where
    G: Future<Output = ()>,
{
    for attempt in 1u64.. {
        let wait = backoff.next_wait();
        while_down(shared, outgoing, gone(), tokio::time::sleep(wait)).await?;
        let opened = open(shared, endpoint, role);
        match while_down(shared, outgoing, gone(), opened).await? {
            Ok(link) => {
                discard_queued(shared, outgoing);
                let n = bump(&shared.counters.reconnects);
                tracing::info!(endpoint, attempt, reconnects_so_far = n, "reconnected");
                return Some(link);
            }
            Err(e) if worth_logging(attempt) => {
                tracing::warn!(endpoint, attempt, error = %e, "reconnect attempt failed");
            }
            Err(_) => {}
        }
    }
    None
}

/// Why serving a connection stopped.
pub(super) enum End {
    /// The handle was dropped: the task ends.
    HandleGone,
    /// The connection broke: reconnect.
    Broken(String),
}

pub(super) fn note_broken(shared: &Shared, socket: &'static str, endpoint: &str, why: &str) {
    let n = bump(&shared.counters.disconnects);
    if worth_logging(n) {
        tracing::warn!(
            socket,
            endpoint,
            why,
            disconnects_so_far = n,
            "connection lost; reconnecting"
        );
    } else {
        tracing::debug!(
            socket,
            endpoint,
            why,
            disconnects_so_far = n,
            "connection lost"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_with_bounded_jitter() {
        let mut b = Backoff {
            next: Duration::from_millis(100),
            min: Duration::from_millis(100),
            max: Duration::from_millis(500),
        };
        let bases = [100u64, 200, 400, 500, 500];
        for base in bases {
            let wait = b.next_wait();
            let base = Duration::from_millis(base);
            assert!(
                wait >= base && wait <= base + base / 4,
                "{wait:?} vs {base:?}"
            );
        }
        // A short-lived connection keeps the backoff where it was; a long one resets it.
        b.after_connection(Duration::from_millis(499));
        assert!(b.next_wait() >= Duration::from_millis(500));
        b.after_connection(Duration::from_millis(500));
        assert!(b.next_wait() < Duration::from_millis(200));
    }
}
