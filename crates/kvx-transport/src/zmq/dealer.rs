//! The sender's DEALER on a receiver's alloc channel (`Transport::connect`): sends
//! `["", payload]` under the sender's identity, delivers the last frame of each reply, and
//! reconnects after a break (`link`), reporting `Disconnected` and `Reconnected`.

use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use kvx_io::transport::{ClientEvent, ControlClient, TransportError, CHANNEL_DEPTH};
use tokio::sync::mpsc;
use tokio::time::Instant;
use zeromq::util::PeerIdentity;
use zeromq::{DealerSocket, SocketEvent, SocketRecv, SocketSend};

use super::link::{discard_queued, note_broken, open, reconnect, End, Link};
use super::{bad_endpoint, bump, framing, Shared};

/// libzmq's rules for a routing identity: 1 to 255 bytes, not starting with a zero byte
/// (those are reserved for identities the ROUTER generates). zeromq would silently replace
/// an empty identity by a random one, losing `PeerId` stability.
fn dealer_identity(endpoint: &str, identity: &str) -> Result<PeerIdentity, TransportError> {
    let bytes = identity.as_bytes();
    if bytes.is_empty() || bytes.len() > PeerIdentity::MAX_LENGTH || bytes[0] == 0 {
        return Err(bad_endpoint(
            endpoint,
            format!("identity {identity:?} must be 1 to 255 bytes and not start with a zero byte"),
        ));
    }
    PeerIdentity::try_from(bytes).map_err(|e| bad_endpoint(endpoint, e.to_string()))
}

pub(super) async fn connect(
    shared: Arc<Shared>,
    endpoint: &str,
    identity: &str,
) -> Result<ControlClient, TransportError> {
    let identity = dealer_identity(endpoint, identity)?;
    let link = open::<DealerSocket>(&shared, endpoint, Some(&identity)).await?;
    let (events, events_rx) = mpsc::channel(CHANNEL_DEPTH);
    let (outgoing_tx, outgoing) = mpsc::channel(CHANNEL_DEPTH);
    let dealer = Dealer {
        shared,
        endpoint: endpoint.to_owned(),
        identity,
        events,
        outgoing,
    };
    tokio::spawn(dealer.run(link));
    Ok(ControlClient::new(events_rx, outgoing_tx))
}

struct Dealer {
    shared: Arc<Shared>,
    endpoint: String,
    identity: PeerIdentity,
    events: mpsc::Sender<ClientEvent>,
    outgoing: mpsc::Receiver<Bytes>,
}

impl Dealer {
    /// Serves the connection, reconnecting after each break, until the `ControlClient` is
    /// dropped (clones of `ControlClient::sender()` alone do not keep the socket alive).
    async fn run(mut self, first: Link<DealerSocket>) {
        let mut link = first;
        loop {
            let why = match self.serve(&mut link).await {
                End::HandleGone => break,
                End::Broken(why) => why,
            };
            note_broken(&self.shared, "DEALER", &self.endpoint, &why);
            drop(link);
            discard_queued(&self.shared, &mut self.outgoing);
            if self.events.send(ClientEvent::Disconnected).await.is_err() {
                break;
            }
            let events = &self.events;
            let back = reconnect::<DealerSocket, _>(
                &self.shared,
                &self.endpoint,
                Some(&self.identity),
                &mut self.outgoing,
                || events.closed(),
            )
            .await;
            let Some(fresh) = back else { break };
            link = fresh;
            if self.events.send(ClientEvent::Reconnected).await.is_err() {
                break;
            }
        }
        tracing::debug!(endpoint = %self.endpoint, "DEALER handle dropped; closing");
    }

    async fn serve(&mut self, link: &mut Link<DealerSocket>) -> End {
        let config = &self.shared.config;
        // Requests sent and not yet answered, and when the channel last made progress: the
        // connection is presumed dead after `recv_timeout` of silence with some outstanding.
        let mut outstanding = 0u64;
        let mut progress = Instant::now();
        loop {
            let silent_until = progress + config.recv_timeout;
            tokio::select! {
                _ = self.events.closed() => return End::HandleGone,
                event = link.monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) => {
                        return End::Broken("the peer closed the connection".into())
                    }
                    Some(_) => {}
                    None => return End::Broken("the socket monitor closed".into()),
                },
                received = link.socket.recv() => {
                    let message = match received {
                        Ok(message) => message,
                        Err(e) => return End::Broken(format!("receive failed: {e}")),
                    };
                    outstanding = outstanding.saturating_sub(1);
                    progress = Instant::now();
                    match framing::reply_in(message, config.frame_max_bytes) {
                        Ok(payload) => {
                            if self.events.send(ClientEvent::Message(payload)).await.is_err() {
                                return End::HandleGone;
                            }
                        }
                        Err(reject) => self.shared.rejected("DEALER", &reject),
                    }
                }
                payload = self.outgoing.recv() => {
                    let Some(payload) = payload else { return End::HandleGone };
                    let message = framing::request_out(payload);
                    match tokio::time::timeout(config.send_timeout, link.socket.send(message)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return End::Broken(format!("send failed: {e}")),
                        Err(_) => {
                            bump(&self.shared.counters.send_timeouts);
                            return End::Broken(format!("send timed out after {:?}", config.send_timeout));
                        }
                    }
                    if outstanding == 0 {
                        progress = Instant::now();
                    }
                    outstanding += 1;
                }
                _ = tokio::time::sleep_until(silent_until), if outstanding > 0 => {
                    return End::Broken(format!(
                        "{outstanding} request(s) unanswered for {:?}", config.recv_timeout
                    ));
                }
            }
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
