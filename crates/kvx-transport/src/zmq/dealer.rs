//! The sender's DEALER on a receiver's alloc channel (`Transport::connect`): sends
//! `["", payload]` under the sender's identity, delivers the last frame of each reply, and
//! reconnects after a break (`link`), reporting `Disconnected` and `Reconnected`.
//!
//! Per connection, a reader task hands replies straight to the `ControlClient`'s channel and
//! ends when the peer goes (EOF is seen the moment a restarted receiver's old process exits);
//! this task writes requests, batching whatever is queued into one write, and, to a peer that
//! announced heartbeats (a kvx ROUTER), a PING every `heartbeat_interval`: a peer from which
//! nothing has come for `heartbeat_timeout` is presumed hung (a stopped process, a link that
//! went down without a reset) and the connection is given up.

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use kvx_io::transport::{ClientEvent, ControlClient, TransportError, CHANNEL_DEPTH};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::conn::{next_message, AbortOnDrop, Read};
use super::frames::ping_body;
use super::link::{
    discard_queued, next_batch, note_broken, open, reconnect, write_bounded, Backoff, End, Link,
    Outgoing, Role,
};
use super::peers::check_identity;
use super::{bump, framing, zmtp, Shared};

/// libzmq's rules for a routing identity (`peers::check_identity`): 1 to 255 bytes, not
/// starting with a zero byte (those are reserved for identities the ROUTER generates). An
/// empty identity would be replaced by a random one per connection, losing `PeerId`
/// stability.
fn dealer_identity(endpoint: &str, identity: &str) -> Result<Bytes, TransportError> {
    match check_identity(identity.as_bytes()) {
        Ok(()) => Ok(Bytes::copy_from_slice(identity.as_bytes())),
        Err(why) => Err(TransportError::Refused {
            endpoint: endpoint.to_owned(),
            why: format!("identity refused: {why}"),
        }),
    }
}

pub(super) async fn connect(
    shared: Arc<Shared>,
    endpoint: &str,
    identity: &str,
) -> Result<ControlClient, TransportError> {
    let role = Role {
        ours: "DEALER",
        identity: Some(dealer_identity(endpoint, identity)?),
        peers: &["ROUTER", "REP"],
    };
    let link = open(&shared, endpoint, &role).await?;
    let (events, events_rx) = mpsc::channel(CHANNEL_DEPTH);
    let (outgoing_tx, outgoing) = Outgoing::new();
    let dealer = Dealer {
        backoff: Backoff::new(&shared),
        shared,
        endpoint: endpoint.to_owned(),
        role,
        events,
        outgoing,
    };
    tokio::spawn(dealer.run(link));
    Ok(ControlClient::new(events_rx, outgoing_tx))
}

struct Dealer {
    shared: Arc<Shared>,
    endpoint: String,
    role: Role,
    backoff: Backoff,
    events: mpsc::Sender<ClientEvent>,
    outgoing: Outgoing,
}

/// Replies heard on one connection, and when the last reply or heartbeat came: the writer's
/// silence checks.
#[derive(Debug)]
struct Heard {
    replies: u64,
    last: Instant,
}

type SharedHeard = Arc<Mutex<Heard>>;

fn heard(h: &SharedHeard) -> std::sync::MutexGuard<'_, Heard> {
    h.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Dealer {
    /// Serves the connection, reconnecting after each break, until the `ControlClient` is
    /// dropped (clones of `ControlClient::sender()` alone do not keep the socket alive).
    async fn run(mut self, first: Link) {
        let mut link = first;
        let mut epoch = link.epoch;
        loop {
            let began = Instant::now();
            let why = match self.serve(link).await {
                End::HandleGone => break,
                End::Broken(why) => why,
            };
            self.backoff.after_connection(began.elapsed());
            note_broken(&self.shared, "DEALER", &self.endpoint, &why);
            // Nothing the caller sent before it has processed `Disconnected` may reach the
            // next connection: fence until it acknowledges (`kvx_io::DISCONNECT_ACK`).
            self.outgoing.fence();
            discard_queued(&self.shared, &mut self.outgoing);
            if self.events.send(ClientEvent::Disconnected).await.is_err() {
                break;
            }
            let events = &self.events;
            let back = reconnect(
                &self.shared,
                &self.endpoint,
                &self.role,
                &mut self.backoff,
                &mut self.outgoing,
                || events.closed(),
            )
            .await;
            let Some(fresh) = back else { break };
            link = fresh;
            if epoch.is_some_and(|before| link.epoch.is_some_and(|now| now != before)) {
                // What it held went with the old incarnation; the requests sent to it failed
                // at the `Disconnected` above.
                bump(&self.shared.counters.peer_restarts);
                tracing::info!(endpoint = %self.endpoint,
                    "DEALER: the receiver came back as a new process (a new epoch): it restarted");
            }
            epoch = link.epoch.or(epoch);
            if self.events.send(ClientEvent::Reconnected).await.is_err() {
                break;
            }
        }
        tracing::debug!(endpoint = %self.endpoint, "DEALER handle dropped; closing");
    }

    /// One connection's life. Returns only after the reader task has ended, so no reply of
    /// this connection can follow the `Disconnected` sent next.
    async fn serve(&mut self, link: Link) -> End {
        let Link {
            reader,
            writer,
            sealer,
            heartbeats,
            epoch: _,
        } = link;
        let heard_on = SharedHeard::new(Mutex::new(Heard {
            replies: 0,
            last: Instant::now(),
        }));
        let mut reading = AbortOnDrop(tokio::spawn(read_replies(
            self.shared.clone(),
            reader,
            self.events.clone(),
            heard_on.clone(),
        )));
        let (end, reader_joined) = self
            .write_requests(writer, sealer, heartbeats, &mut reading, &heard_on)
            .await;
        if !reader_joined {
            // Aborting only asks: wait until the reader is really gone.
            reading.0.abort();
            let _ = (&mut reading.0).await;
        }
        end
    }

    /// Writes requests until the connection breaks or the handle goes; true with the end when
    /// it came from the reader (whose task is then joined already). A connection with
    /// requests outstanding and no reply for `recv_timeout` is presumed dead: a half-open TCP
    /// connection never reports EOF, and every LMCache request gets a reply. With
    /// `heartbeats` (the peer announced them), PINGs go out every `heartbeat_interval`, and a
    /// peer silent for `heartbeat_timeout` is presumed dead whether or not anything is
    /// outstanding.
    async fn write_requests(
        &mut self,
        mut writer: tokio::net::tcp::OwnedWriteHalf,
        mut sealer: zmtp::Sealer,
        heartbeats: bool,
        reading: &mut AbortOnDrop<End>,
        heard_on: &SharedHeard,
    ) -> (End, bool) {
        let recv_timeout = self.shared.config.recv_timeout;
        let (interval, liveness) = (
            self.shared.config.heartbeat_interval,
            self.shared.config.heartbeat_timeout,
        );
        let ping = ping_body(liveness);
        let mut next_ping = Instant::now() + interval;
        // Requests written; with `Heard`, what is outstanding, and since when it is silent.
        let mut sent = 0u64;
        let mut silent_since = Instant::now();
        let mut buf = Vec::with_capacity(1024);
        loop {
            let (outstanding, last_heard) = {
                let h = heard(heard_on);
                (sent > h.replies, h.last)
            };
            let mut encode = |payload: &[u8], out: &mut Vec<u8>| {
                sealer.message(&framing::enveloped_out(payload), out);
            };
            tokio::select! {
                _ = self.events.closed() => return (End::HandleGone, false),
                ended = &mut reading.0 => {
                    let end = ended.unwrap_or_else(|e| End::Broken(format!("reader task: {e}")));
                    return (end, true);
                }
                taken = next_batch(&self.shared, &mut self.outgoing, &mut buf, &mut encode) => {
                    let Some(taken) = taken else { return (End::HandleGone, false) };
                    // Read again: replies may have come since the loop began.
                    if sent == heard(heard_on).replies {
                        silent_since = Instant::now();
                    }
                    if let Err(why) = write_bounded(&self.shared, &mut writer, &buf).await {
                        return (End::Broken(why), false);
                    }
                    sent += taken;
                }
                _ = tokio::time::sleep_until(silent_since + recv_timeout), if outstanding => {
                    let h = heard(heard_on);
                    if h.replies >= sent {
                        continue;
                    }
                    if h.last > silent_since {
                        // Replies came meanwhile: silence counts from the last one.
                        silent_since = h.last;
                        continue;
                    }
                    let why = format!("{} request(s) unanswered for {recv_timeout:?}", sent - h.replies);
                    return (End::Broken(why), false);
                }
                () = tokio::time::sleep_until(next_ping), if heartbeats => {
                    buf.clear();
                    sealer.command(&ping, &mut buf);
                    if let Err(why) = write_bounded(&self.shared, &mut writer, &buf).await {
                        return (End::Broken(why), false);
                    }
                    next_ping = Instant::now() + interval;
                }
                () = tokio::time::sleep_until(last_heard + liveness), if heartbeats => {
                    if heard(heard_on).last > last_heard {
                        continue;
                    }
                    bump(&self.shared.counters.peers_silent);
                    let why = format!(
                        "nothing heard for {liveness:?} (heartbeat_timeout) from a peer that \
                         answers heartbeats: hung, or its link is down"
                    );
                    return (End::Broken(why), false);
                }
            }
        }
    }
}

/// Hands one connection's replies to the `ControlClient` until the connection ends.
async fn read_replies(
    shared: Arc<Shared>,
    mut reader: zmtp::FrameReader<tokio::net::tcp::OwnedReadHalf>,
    events: mpsc::Sender<ClientEvent>,
    heard_on: SharedHeard,
) -> End {
    let max = shared.config.frame_max_bytes;
    loop {
        let next = match next_message(&shared, "DEALER", &mut reader).await {
            Ok(next) => next,
            Err(why) => return End::Broken(why),
        };
        // Every message answers a request, even one dropped as oversize: the peer is alive.
        // So is one that answers a heartbeat.
        let frames = {
            let mut h = heard(&heard_on);
            h.last = Instant::now();
            match next {
                Read::Message(frames) => {
                    h.replies += 1;
                    frames
                }
                Read::Dropped => {
                    h.replies += 1;
                    continue;
                }
                Read::Ping(_) | Read::Pong => continue,
            }
        };
        match framing::enveloped_in(&frames, max) {
            Ok(payload) => {
                if events.send(ClientEvent::Message(payload)).await.is_err() {
                    return End::HandleGone;
                }
            }
            Err(reject) => shared.rejected("DEALER", &reject),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_follow_libzmq_rules() {
        let ep = "tcp://127.0.0.1:1";
        assert!(dealer_identity(ep, "127.0.0.123700-to-127.0.0.123610").is_ok());
        assert!(dealer_identity(ep, "").is_err());
        assert!(dealer_identity(ep, "\0abc").is_err());
        assert!(dealer_identity(ep, &"x".repeat(256)).is_err());
        assert!(dealer_identity(ep, &"x".repeat(255)).is_ok());
    }
}
