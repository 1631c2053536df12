//! The control plane: small msgpack payloads between peers. Framing belongs to the
//! transport, encoding to `kvx_proto::wire`, so the codec runs in every simulation.
//!
//! Every implementation owns its sockets in a background task and hands out channel-backed
//! handles. Channels are bounded (backpressure instead of growth), and receiving from them is
//! cancel-safe, so drivers can `select!` over a handle and their timers freely.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvx_proto::proxy::NoticeFrom;
use kvx_proto::{PeerId, Principal};
use tokio::sync::{mpsc, watch};

/// Depth of every handle's channels.
pub const CHANNEL_DEPTH: usize = 1024;

/// Why a transport could not bind, connect or send.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The endpoint is not one this transport takes (ZMQ: `tcp://host:port`), or the
    /// in-memory one is bound twice or not bound: fix the address.
    #[error("invalid endpoint {endpoint:?}: {why}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        why: String,
    },
    /// Connecting (TCP and handshake) took longer than the transport's bound: the peer is
    /// down, unreachable or overloaded; retry later or check the address.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What timed out.
        what: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The handle's transport task has shut down: nothing more goes through this handle.
    #[error("the connection is closed")]
    Closed,
    /// A frame over the transport's size limit. No transport in this workspace returns it:
    /// ZMQ drops such a frame (counted in its stats) instead.
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    FrameTooLarge {
        /// The frame's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The peer refused this connection in its handshake (ZMTP's ERROR command), for the
    /// reason it gave; or, for a routing identity that breaks ZMQ's rules, `connect` refused
    /// it before connecting. A kvx receiver refuses a sender's identity when another
    /// connection holds it: give each sender its own. Retrying does not help while the other
    /// connection lasts.
    #[error("connection to {endpoint} refused: {why}")]
    Refused {
        /// The endpoint as given.
        endpoint: String,
        /// Why, in the refusing side's words.
        why: String,
    },
    /// The operating system refused (a bind, a connect, a handshake), in its words.
    #[error("{0}")]
    Io(String),
}

/// Who stands behind a connected peer (`kvx_proto::Principal`), as a transport knows it.
pub type PrincipalOf = Arc<dyn Fn(PeerId) -> Option<Principal> + Send + Sync>;

/// What a `ControlServer` hears, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inbound {
    /// A payload from `PeerId`.
    Message(PeerId, Bytes),
    /// `PeerId`'s last connection closed (the peer went away, or its connection broke and
    /// no other holds its identity): what it began will not be finished through this
    /// connection, and its own side has failed it already (a kvx sender fails its requests
    /// when its control connection breaks: `SenderFlow::handle_receiver_lost`). Anything it
    /// sends after reconnecting comes after this.
    Lost(PeerId),
}

/// Where a `ControlServer`'s inbound traffic comes from: payloads only (a transport that
/// cannot tell when a peer goes), or payloads and lost peers in one order.
enum Incoming {
    Payloads(mpsc::Receiver<(PeerId, Bytes)>),
    Events(mpsc::Receiver<Inbound>),
}

/// The receiver's side of the alloc channel (LMCache: a ROUTER bound to the alloc port):
/// payloads from many senders, each tagged with the sender's `PeerId`, and replies to them.
pub struct ControlServer {
    local_endpoint: String,
    incoming: Incoming,
    outgoing: mpsc::Sender<(PeerId, Bytes)>,
    principal_of: Option<PrincipalOf>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer")
            .field("local_endpoint", &self.local_endpoint)
            .field("principals", &self.principal_of.is_some())
            .finish_non_exhaustive()
    }
}

impl ControlServer {
    /// For implementations: wraps the channels their IO task serves.
    pub fn new(
        local_endpoint: String,
        incoming: mpsc::Receiver<(PeerId, Bytes)>,
        outgoing: mpsc::Sender<(PeerId, Bytes)>,
    ) -> Self {
        Self {
            local_endpoint,
            incoming: Incoming::Payloads(incoming),
            outgoing,
            principal_of: None,
        }
    }

    /// For implementations that know when a peer's last connection closes: payloads and
    /// lost peers on one channel, in the order they happened (`Inbound`).
    pub fn with_lost_peers(
        local_endpoint: String,
        incoming: mpsc::Receiver<Inbound>,
        outgoing: mpsc::Sender<(PeerId, Bytes)>,
    ) -> Self {
        Self {
            local_endpoint,
            incoming: Incoming::Events(incoming),
            outgoing,
            principal_of: None,
        }
    }

    /// For implementations that know who stands behind a peer (its public key, or the
    /// address it connects from): `principal` answers for a connected peer.
    pub fn with_principals(mut self, principal_of: PrincipalOf) -> Self {
        self.principal_of = Some(principal_of);
        self
    }

    /// Who stands behind `peer`, when the transport knows (`kvx_proto::Principal`); the
    /// receiver binds its share to that (`ReceiverLedger::bind_principal`).
    pub fn principal(&self, peer: PeerId) -> Option<Principal> {
        self.principal_of.as_ref().and_then(|f| f(peer))
    }

    /// The endpoint actually bound (a port chosen by the OS is filled in).
    pub fn local_endpoint(&self) -> &str {
        &self.local_endpoint
    }

    /// The next payload and its sender; None once the transport has shut down. Cancel-safe.
    /// Lost peers are passed over (`next` reports them).
    pub async fn recv(&mut self) -> Option<(PeerId, Bytes)> {
        loop {
            match self.next().await? {
                Inbound::Message(peer, payload) => return Some((peer, payload)),
                Inbound::Lost(_) => continue,
            }
        }
    }

    /// The next payload or lost peer, in the order they happened; None once the transport
    /// has shut down. Cancel-safe.
    pub async fn next(&mut self) -> Option<Inbound> {
        match &mut self.incoming {
            Incoming::Payloads(rx) => rx
                .recv()
                .await
                .map(|(peer, payload)| Inbound::Message(peer, payload)),
            Incoming::Events(rx) => rx.recv().await,
        }
    }

    /// Queues a reply to `to`. A peer that is gone loses it silently, as with ZMQ's ROUTER.
    pub async fn send(&self, to: PeerId, payload: Bytes) -> Result<(), TransportError> {
        self.outgoing
            .send((to, payload))
            .await
            .map_err(|_| TransportError::Closed)
    }

    /// A clonable sender of replies, for other tasks.
    pub fn replies(&self) -> mpsc::Sender<(PeerId, Bytes)> {
        self.outgoing.clone()
    }
}

/// The payload a `ControlClient`'s caller sends to acknowledge a `ClientEvent::Disconnected`.
/// Empty, since no message encodes to zero bytes; transports never send it on.
pub const DISCONNECT_ACK: Bytes = Bytes::new();

/// What a `ControlClient` hears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// A payload from the receiver, in the order it sent them.
    Message(Bytes),
    /// The connection broke: messages in flight may be lost. The transport reconnects by
    /// itself; the sender fails what was in flight (`SenderFlow::handle_receiver_lost`).
    ///
    /// From this event on, the client drops every payload handed to it until the caller
    /// sends `DISCONNECT_ACK` (one per `Disconnected`; the fence stays up while any is
    /// unacknowledged), saying it has failed everything it sent before: otherwise a
    /// payload sent before the caller had processed this event could reach the *next*
    /// connection, where a serial (LMCache) receiver's reply to it would be matched to a later
    /// request. After the acknowledgement, payloads are delivered once reconnected (and
    /// dropped while still down).
    Disconnected,
    /// Connected again after a `Disconnected`.
    Reconnected,
}

/// A sender's side of the alloc channel to one receiver (LMCache: a DEALER).
#[derive(Debug)]
pub struct ControlClient {
    incoming: mpsc::Receiver<ClientEvent>,
    outgoing: mpsc::Sender<Bytes>,
}

impl ControlClient {
    /// For implementations: wraps the channels their IO task serves.
    pub fn new(incoming: mpsc::Receiver<ClientEvent>, outgoing: mpsc::Sender<Bytes>) -> Self {
        Self { incoming, outgoing }
    }

    /// The next event; None once the transport has shut down. Cancel-safe.
    pub async fn recv(&mut self) -> Option<ClientEvent> {
        self.incoming.recv().await
    }

    /// Queues a payload for the receiver, waiting while the channel is full. While the
    /// connection is down, or a `Disconnected` is not yet acknowledged, it is dropped
    /// (`ClientEvent::Disconnected`). `Closed` once the transport has shut down.
    pub async fn send(&self, payload: Bytes) -> Result<(), TransportError> {
        self.outgoing
            .send(payload)
            .await
            .map_err(|_| TransportError::Closed)
    }

    /// A clonable sender of payloads (and of `DISCONNECT_ACK`), for other tasks.
    pub fn sender(&self) -> mpsc::Sender<Bytes> {
        self.outgoing.clone()
    }
}

/// A sender's side of the notice channel to the proxy (LMCache: PUSH).
#[derive(Debug, Clone)]
pub struct NotifySink {
    outgoing: mpsc::Sender<Bytes>,
    /// Closed (its sender dropped) when the IO task serving `outgoing` has ended; `None`
    /// when there is no such task (the payloads are delivered as they are queued).
    io_task: Option<watch::Receiver<()>>,
}

impl NotifySink {
    /// For implementations: wraps the channel that is delivered as it is queued.
    pub fn new(outgoing: mpsc::Sender<Bytes>) -> Self {
        Self {
            outgoing,
            io_task: None,
        }
    }

    /// For implementations: wraps the channel an IO task serves; that task holds the
    /// `watch::Sender` of `io_task` until it has written what was queued and ended.
    pub fn served_by(outgoing: mpsc::Sender<Bytes>, io_task: watch::Receiver<()>) -> Self {
        Self {
            outgoing,
            io_task: Some(io_task),
        }
    }

    /// Lets the handle go and waits until what was queued has been written (or its
    /// connection found down) and the IO task has ended. Unbounded: the caller bounds it.
    /// A process that exits right after its last notice would otherwise lose it with the
    /// task that was writing it. The IO task ends once every clone is closed or dropped.
    pub async fn close(self) {
        let Self { outgoing, io_task } = self;
        drop(outgoing);
        if let Some(mut ended) = io_task {
            while ended.changed().await.is_ok() {}
        }
    }

    /// Queues a notice for the proxy, waiting while the channel is full. `Closed` once the
    /// transport has shut down.
    pub async fn send(&self, payload: Bytes) -> Result<(), TransportError> {
        self.outgoing
            .send(payload)
            .await
            .map_err(|_| TransportError::Closed)
    }
}

/// One notice as the proxy's notice channel received it, and who sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The connection it came on and, under CURVE, its key's principal: what the proxy
    /// binds each request to (`kvx_proto::proxy`).
    pub from: NoticeFrom,
    /// How a log names the sender: under CURVE the fingerprint of its public key, else the
    /// address it connects from (or the in-process sender's name). Never a secret.
    pub label: Arc<str>,
    /// The notice's bytes.
    pub payload: Bytes,
}

/// The proxy's side of the notice channel (LMCache: PULL bound to the proxy port).
#[derive(Debug)]
pub struct NotifySource {
    local_endpoint: String,
    incoming: mpsc::Receiver<Notice>,
}

impl NotifySource {
    /// For implementations: wraps the channel their IO task serves. Each notice's
    /// `NoticeFrom::connection` is one number per sink connection, never reused while the
    /// source lasts.
    pub fn new(local_endpoint: String, incoming: mpsc::Receiver<Notice>) -> Self {
        Self {
            local_endpoint,
            incoming,
        }
    }

    /// The endpoint actually bound (a port chosen by the OS is filled in).
    pub fn local_endpoint(&self) -> &str {
        &self.local_endpoint
    }

    /// The next notice and who sent it; None once the transport has shut down. Cancel-safe.
    /// A proxy needs the sender: a notice counts only from the senders its request is bound
    /// to.
    pub async fn recv_notice(&mut self) -> Option<Notice> {
        self.incoming.recv().await
    }

    /// The next notice's bytes alone, for a reader that counts nothing by sender (a test of
    /// the transport itself); None once the transport has shut down. Cancel-safe.
    pub async fn recv(&mut self) -> Option<Bytes> {
        Some(self.recv_notice().await?.payload)
    }
}

/// Makes the four kinds of handle. Endpoints are transport-specific strings
/// (`tcp://127.0.0.1:8400` for ZMQ; any name for the in-memory transport); a port of 0 asks
/// the OS for one, and `local_endpoint()` tells which.
pub trait Transport: Clone + Send + Sync + 'static {
    /// Binds the alloc channel's server side.
    fn serve(
        &self,
        endpoint: &str,
    ) -> impl Future<Output = Result<ControlServer, TransportError>> + Send;
    /// Connects to a receiver's alloc channel as `identity` (unique per sender).
    fn connect(
        &self,
        endpoint: &str,
        identity: &str,
    ) -> impl Future<Output = Result<ControlClient, TransportError>> + Send;
    /// Connects to the proxy's notice channel.
    fn notify_sink(
        &self,
        endpoint: &str,
    ) -> impl Future<Output = Result<NotifySink, TransportError>> + Send;
    /// Binds the proxy's notice channel.
    fn notify_source(
        &self,
        endpoint: &str,
    ) -> impl Future<Output = Result<NotifySource, TransportError>> + Send;
}
