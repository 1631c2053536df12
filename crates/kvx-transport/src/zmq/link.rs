//! What the connecting sockets (the DEALER in `dealer`, the PUSH in `push`) share: opening
//! a connection with a bounded handshake, and reconnecting after a break.
//!
//! zeromq 0.7 reconnects only SUB sockets by itself; a DEALER or PUSH whose peer goes away
//! simply loses its only peer, and sends then fail. So each task watches its connection
//! (the socket monitor's `Disconnected`, a failed or timed-out send, and for the DEALER a
//! silence of `recv_timeout` with requests outstanding), and when it breaks drops the socket
//! and opens a fresh one, waiting an exponentially growing, jittered backoff between
//! attempts. Each attempt is bounded by `connect_timeout`.
//!
//! Payloads handed in while the connection is down, and those still queued when it broke,
//! are dropped and counted. Holding them for the next connection would deliver requests the
//! sender has already failed on `Disconnected`, and LMCache's serial channel matches replies
//! by order alone, so a stale reply would be taken for a new request's.

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc as zmq_mpsc;
use kvx_io::transport::TransportError;
use tokio::sync::mpsc;
use zeromq::util::PeerIdentity;
use zeromq::{Socket, SocketEvent, SocketOptions};

use super::{bump, worth_logging, zmq_error, Shared};

/// A live connection: the socket and the monitor that reports its peer leaving.
pub(super) struct Link<S> {
    pub(super) socket: S,
    pub(super) monitor: zmq_mpsc::Receiver<SocketEvent>,
}

/// One connection attempt, bounded by `connect_timeout`.
pub(super) async fn open<S: Socket>(
    shared: &Shared,
    endpoint: &str,
    identity: Option<&PeerIdentity>,
) -> Result<Link<S>, TransportError> {
    let after = shared.config.connect_timeout;
    let mut options = SocketOptions::default();
    // zeromq retries refused connects itself within this bound; the outer timeout also
    // covers the handshake with a peer that accepts but never answers.
    options.connect_timeout(after);
    if let Some(identity) = identity {
        options.peer_identity(identity.clone());
    }
    let mut socket = S::with_options(options);
    // Subscribe before connecting, so no disconnect can go unobserved.
    let monitor = socket.monitor();
    match tokio::time::timeout(after, socket.connect(endpoint)).await {
        Ok(Ok(())) => Ok(Link { socket, monitor }),
        Ok(Err(e)) => Err(zmq_error("connect", endpoint, e)),
        Err(_) => Err(TransportError::Timeout {
            what: "connect",
            after,
        }),
    }
}

/// Exponential backoff from `min` to `max`, with up to a quarter of jitter so that senders
/// that lost the same receiver do not all return at the same instant.
#[derive(Debug)]
struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    fn new(shared: &Shared) -> Self {
        Self {
            next: shared.config.reconnect_backoff_min,
            max: shared.config.reconnect_backoff_max,
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
pub(super) fn discard_queued(shared: &Shared, outgoing: &mut mpsc::Receiver<Bytes>) {
    while outgoing.try_recv().is_ok() {
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
    outgoing: &mut mpsc::Receiver<Bytes>,
    gone: impl Future<Output = ()>,
    fut: F,
) -> Option<F::Output> {
    tokio::pin!(fut);
    tokio::pin!(gone);
    loop {
        tokio::select! {
            out = &mut fut => return Some(out),
            _ = &mut gone => return None,
            payload = outgoing.recv() => match payload {
                Some(_) => dropped_while_down(shared),
                None => return None,
            },
        }
    }
}

/// Opens a fresh connection after a break, with backoff; `None` if the handle went away.
pub(super) async fn reconnect<S: Socket, G>(
    shared: &Shared,
    endpoint: &str,
    identity: Option<&PeerIdentity>,
    outgoing: &mut mpsc::Receiver<Bytes>,
    gone: impl Fn() -> G,
) -> Option<Link<S>>
where
    G: Future<Output = ()>,
{
    let mut backoff = Backoff::new(shared);
    for attempt in 1u64.. {
        let wait = backoff.next_wait();
        while_down(shared, outgoing, gone(), tokio::time::sleep(wait)).await?;
        let opened = open::<S>(shared, endpoint, identity);
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
    tracing::warn!(
        socket,
        endpoint,
        why,
        disconnects_so_far = n,
        "connection lost; reconnecting"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_with_bounded_jitter() {
        let mut b = Backoff {
            next: Duration::from_millis(100),
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
    }
}
