//! What every connection task shares, bound and connecting sockets alike: reading the next
//! message with the limits' rejections counted, and tasks that cannot outlive their owner.

use std::io;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use super::framing::Reject;
use super::zmtp::{FrameReader, Incoming};
use super::Shared;

/// TCP keepalive: idle this long, then probes. With `TCP_USER_TIMEOUT` set as well, Linux
/// ends the connection once a probe stays unanswered for the user timeout, so a peer whose
/// host vanished without closing the connection is found in about
/// `KEEPALIVE_IDLE + user_timeout` (15 s with the defaults) even when nothing is being sent.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;

/// Makes a connection notice a peer that vanished without closing it: keepalive probes when
/// idle, and data (or probes) unacknowledged for `user_timeout` end the connection. Every
/// ZMQ connection, bound or connecting, gets it. Best effort: a platform without these
/// options keeps kvx's own timeouts (`recv_timeout`, `send_timeout`).
pub(super) fn watch_liveness(stream: &TcpStream, user_timeout: Duration) {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    let sock = socket2::SockRef::from(stream);
    let _ = sock.set_tcp_keepalive(&keepalive);
    let _ = sock.set_tcp_user_timeout(Some(user_timeout));
}

/// Aborts a task when dropped, so a helper task cannot outlive the task that owns it.
#[derive(Debug)]
pub(super) struct AbortOnDrop<T>(pub(super) JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What `next_message` read.
#[derive(Debug)]
pub(super) enum Read {
    /// A message's frames.
    Message(Vec<Bytes>),
    /// A message that arrived but was dropped (counted and logged): over
    /// `frame_max_bytes`, or too many frames.
    Dropped,
    /// A heartbeat's PING, with the context to answer in the PONG.
    Ping(Bytes),
    /// A heartbeat's PONG.
    Pong,
}

/// Reads the next message or heartbeat, skipping other commands. `Err` says why the
/// connection is over: closed, broken, too slow (`message_timeout`), its stream can no
/// longer be trusted, or (CURVE) a box failed authentication; the last three are counted and
/// logged sparsely.
pub(super) async fn next_message(
    shared: &Shared,
    socket: &'static str,
    reader: &mut FrameReader<OwnedReadHalf>,
) -> Result<Read, String> {
    loop {
        match reader.next().await {
            Ok(Incoming::Message(frames)) => return Ok(Read::Message(frames)),
            Ok(Incoming::Ping(context)) => return Ok(Read::Ping(context)),
            Ok(Incoming::Pong) => return Ok(Read::Pong),
            Ok(Incoming::Command) => {}
            Ok(Incoming::Oversize(len)) => {
                let max = shared.config.frame_max_bytes;
                shared.rejected(
                    socket,
                    &Reject::Oversize {
                        len: len as usize,
                        max,
                    },
                );
                return Ok(Read::Dropped);
            }
            Ok(Incoming::TooManyFrames(_)) => {
                shared.rejected(socket, &Reject::Malformed("more frames than any shape has"));
                return Ok(Read::Dropped);
            }
            Ok(Incoming::Closed) => return Err("the peer closed the connection".into()),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                let c = &shared.counters.protocol_violations;
                shared.refused(
                    c,
                    socket,
                    "peer disconnected: its stream broke the limits",
                    &e,
                );
                return Err(format!("the peer's stream broke the limits: {e}"));
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                // A CURVE MESSAGE box that does not authenticate, or replays a nonce.
                let c = &shared.counters.curve_refused;
                shared.refused(c, socket, "peer disconnected: a CURVE box failed", &e);
                return Err(format!("the peer's stream failed authentication: {e}"));
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                let c = &shared.counters.messages_timed_out;
                shared.refused(c, socket, "peer disconnected: a message took too long", &e);
                return Err(format!("too slow: {e}"));
            }
            Err(e) => {
                tracing::debug!(socket, error = %e, "peer connection ended");
                return Err(format!("receive failed: {e}"));
            }
        }
    }
}
