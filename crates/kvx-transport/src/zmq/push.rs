//! The sender's PUSH to the proxy's notice channel (`Transport::notify_sink`): one frame
//! per notice, reconnecting after a break (`link`).
//!
//! A PULL never sends anything after the handshake, but a reader task still watches the
//! connection: its end of stream is how a departed proxy is noticed at once, rather than
//! when a later write fails (and the notices written meanwhile are lost).

use std::sync::Arc;

use kvx_io::transport::{NotifySink, TransportError};

use super::conn::{next_message, AbortOnDrop};
use super::link::{
    discard_queued, next_batch, note_broken, open, reconnect, write_bounded, Backoff, End, Link,
    Outgoing, Role,
};
use super::{framing, Shared};

const ROLE: Role = Role {
    ours: "PUSH",
    identity: None,
    peers: &["PULL"],
};

pub(super) async fn notify_sink(
    shared: Arc<Shared>,
    endpoint: &str,
) -> Result<NotifySink, TransportError> {
    let link = open(&shared, endpoint, &ROLE).await?;
    let (tx, outgoing) = Outgoing::new();
    let (alive, io_task) = tokio::sync::watch::channel(());
    let pusher = Pusher {
        _alive: alive,
        backoff: Backoff::new(&shared),
        shared,
        endpoint: endpoint.to_owned(),
        outgoing,
    };
    tokio::spawn(pusher.run(link));
    Ok(NotifySink::served_by(tx, io_task))
}

struct Pusher {
    /// Dropped as the task ends: how `NotifySink::close` knows it has.
    _alive: tokio::sync::watch::Sender<()>,
    shared: Arc<Shared>,
    endpoint: String,
    backoff: Backoff,
    outgoing: Outgoing,
}

impl Pusher {
    /// Ends when every clone of the `NotifySink` is dropped.
    async fn run(mut self, first: Link) {
        let mut link = first;
        loop {
            let began = tokio::time::Instant::now();
            let why = match self.serve(link).await {
                End::HandleGone => break,
                End::Broken(why) => why,
            };
            self.backoff.after_connection(began.elapsed());
            note_broken(&self.shared, "PUSH", &self.endpoint, &why);
            discard_queued(&self.shared, &mut self.outgoing);
            // A NotifySink has no other half: it is gone when `outgoing` closes.
            let back = reconnect(
                &self.shared,
                &self.endpoint,
                &ROLE,
                &mut self.backoff,
                &mut self.outgoing,
                std::future::pending,
            )
            .await;
            let Some(fresh) = back else { break };
            link = fresh;
        }
        tracing::debug!(endpoint = %self.endpoint, "PUSH handle dropped; closing");
    }

    async fn serve(&mut self, link: Link) -> End {
        let Link {
            mut reader,
            mut writer,
            mut sealer,
            heartbeats: _,
            epoch: _,
        } = link;
        let shared = self.shared.clone();
        // Anything a PULL sends is ignored; the read ends when the connection does.
        let mut watching = AbortOnDrop(tokio::spawn(async move {
            loop {
                if let Err(why) = next_message(&shared, "PUSH", &mut reader).await {
                    return why;
                }
            }
        }));
        let mut buf = Vec::with_capacity(1024);
        let mut encode = |payload: &[u8], out: &mut Vec<u8>| {
            sealer.message(&framing::notice_out(payload), out);
        };
        loop {
            tokio::select! {
                why = &mut watching.0 => {
                    return End::Broken(why.unwrap_or_else(|e| format!("reader task: {e}")));
                }
                taken = next_batch(&self.shared, &mut self.outgoing, &mut buf, &mut encode) => {
                    if taken.is_none() {
                        return End::HandleGone;
                    }
                    if let Err(why) = write_bounded(&self.shared, &mut writer, &buf).await {
                        return End::Broken(why);
                    }
                }
            }
        }
    }
}
