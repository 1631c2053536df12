//! The sender's PUSH to the proxy's notice channel (`Transport::notify_sink`): one frame
//! per notice, reconnecting after a break (`link`).

use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use kvx_io::transport::{NotifySink, TransportError, CHANNEL_DEPTH};
use tokio::sync::mpsc;
use zeromq::{PushSocket, SocketEvent, SocketSend};

use super::link::{discard_queued, note_broken, open, reconnect, End, Link};
use super::{bump, framing, Shared};

pub(super) async fn notify_sink(
    shared: Arc<Shared>,
    endpoint: &str,
) -> Result<NotifySink, TransportError> {
    let link = open::<PushSocket>(&shared, endpoint, None).await?;
    let (tx, outgoing) = mpsc::channel(CHANNEL_DEPTH);
    let pusher = Pusher {
        shared,
        endpoint: endpoint.to_owned(),
        outgoing,
    };
    tokio::spawn(pusher.run(link));
    Ok(NotifySink::new(tx))
}

struct Pusher {
    shared: Arc<Shared>,
    endpoint: String,
    outgoing: mpsc::Receiver<Bytes>,
}

impl Pusher {
    /// Ends when every clone of the `NotifySink` is dropped.
    async fn run(mut self, first: Link<PushSocket>) {
        let mut link = first;
        loop {
            let why = match self.serve(&mut link).await {
                End::HandleGone => break,
                End::Broken(why) => why,
            };
            note_broken(&self.shared, "PUSH", &self.endpoint, &why);
            drop(link);
            discard_queued(&self.shared, &mut self.outgoing);
            // A NotifySink has no other half: it is gone when `outgoing` closes.
            let back = reconnect::<PushSocket, _>(
                &self.shared,
                &self.endpoint,
                None,
                &mut self.outgoing,
                std::future::pending,
            )
            .await;
            let Some(fresh) = back else { break };
            link = fresh;
        }
        tracing::debug!(endpoint = %self.endpoint, "PUSH handle dropped; closing");
    }

    /// zeromq's PUSH never reads its connection, so a peer that left is noticed only when a
    /// write to it fails: the notice that discovers it (and possibly one before) is lost.
    async fn serve(&mut self, link: &mut Link<PushSocket>) -> End {
        let send_timeout = self.shared.config.send_timeout;
        loop {
            tokio::select! {
                event = link.monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) => {
                        return End::Broken("the peer closed the connection".into())
                    }
                    Some(_) => {}
                    None => return End::Broken("the socket monitor closed".into()),
                },
                payload = self.outgoing.recv() => {
                    let Some(payload) = payload else { return End::HandleGone };
                    let message = framing::notice_out(payload);
                    match tokio::time::timeout(send_timeout, link.socket.send(message)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return End::Broken(format!("send failed: {e}")),
                        Err(_) => {
                            bump(&self.shared.counters.send_timeouts);
                            return End::Broken(format!("send timed out after {send_timeout:?}"));
                        }
                    }
                }
            }
        }
    }
}
