//! `ZmqTransport`: `kvx_io::Transport` over ZeroMQ, speaking LMCache's socket pattern and
//! framing byte for byte (`docs/spec/zmq.md`). kvx speaks ZMTP 3 itself (`zmtp`) on all four
//! sockets; the spec's §6 says why the `zeromq` crate is only a test peer now.
//!
//! - `serve` binds a ROUTER (`server`): the receiver's alloc channel. Each sender's routing
//!   identity maps to one stable `PeerId` (`peers`); payloads arrive as `[identity, "",
//!   payload]` and replies leave the same way (`framing`).
//! - `connect` opens a DEALER (`dealer`) with the sender's identity in its ZMTP READY, as
//!   libzmq does; it watches the connection and reconnects with backoff (`link`), reporting
//!   `Disconnected` and `Reconnected`.
//! - `notify_sink` / `notify_source`: PUSH (`push`) → PULL (`server`), one frame per notice;
//!   the PULL tags each notice with its connection's number and, under CURVE, the principal
//!   of the key it proved (`kvx_io::Notice`), which the proxy binds requests to.
//! - `conn`: reading messages and task lifetimes, shared by every connection.
//! - `inbound`: the byte budget of received messages a bound socket's handle has not
//!   finished with.
//!
//! Every socket is owned by a background task that serves a channel-backed handle from
//! `kvx_io`; the task ends when its handle is dropped. Every wait is bounded by a `ZmqConfig`
//! timeout, every queue by `kvx_io::transport::CHANNEL_DEPTH` (and a bound socket's incoming
//! one by `inbound_bytes_max` too), incoming messages by
//! `ZmqConfig::frame_max_bytes` (checked before a frame is buffered), `frame_refuse_bytes`
//! and `message_timeout`, and a bound socket's connections by `connections_max` and
//! `handshake_timeout`. What a hostile peer meets is `docs/spec/zmq.md` §8.
//!
//! - `curve`: the CURVE mechanism (`ZmqConfig::curve`, off by default): bound sockets as
//!   CURVE servers with an allow-list of client keys, connecting sockets as CURVE clients;
//!   `ZmqTransport::peer_public_key` names the client key each ROUTER peer proved
//!   (`docs/spec/zmq.md` §9).
//!
//! The layers, each using only those below it: `frames` (writing frames) → `curve_box`
//! (CURVE's MESSAGE boxes) and `curve_keys` (key pairs, certificates, allow-lists) → `zmtp`
//! (greeting, READY, the frame reader, the `Sealer`) → `curve` (the CURVE handshake) →
//! `handshake` (a connection's handshake, NULL or CURVE) → the sockets (`server`, `dealer`,
//! `push`, `link`, `conn`).

mod conn;
mod curve;
mod curve_box;
mod curve_keys;
mod dealer;
mod frames;
mod framing;
mod handshake;
mod inbound;
mod link;
mod peers;
mod push;
mod server;
mod z85;
mod zmtp;

pub use curve_keys::{
    decode_key, fingerprint, load_public_key, AllowList, CurveConfigError, CurveKeyPair, KEY_BYTES,
};

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::{ControlClient, ControlServer, NotifySink, NotifySource, TransportError};
use kvx_io::Transport;
use kvx_proto::wire::DEFAULT_FRAME_MAX_BYTES;
use kvx_proto::{PeerId, Principal};

use framing::Reject;
use peers::PeerTable;

/// Timeouts, backoff and limits of a `ZmqTransport`. `Default` gives the values in
/// `docs/spec/zmq.md` §5.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqConfig {
    /// Longest one connection attempt may take: TCP connect (refused connects are retried
    /// within it) plus the ZMTP greeting and READY handshake. `connect` and `notify_sink`
    /// fail after one such attempt; reconnects retry with backoff.
    pub connect_timeout: Duration,
    /// Longest one write to a connection may take (its socket buffer stays full because the
    /// peer does not read); the connection is then presumed dead and closed (a DEALER or
    /// PUSH reconnects). Also the TCP user timeout of connecting sockets: data unacknowledged
    /// this long ends the connection.
    pub send_timeout: Duration,
    /// A DEALER that has sent messages and heard nothing back for this long presumes the
    /// connection dead (a half-open TCP connection never reports EOF) and reconnects. Keep it
    /// above the protocol's own reply timeouts, which are the precise ones.
    pub recv_timeout: Duration,
    /// How often a DEALER sends a heartbeat (ZMTP 3.1 PING) on a connection to a peer that
    /// announced heartbeats (a kvx ROUTER, which answers each with PONG). Default 1 s.
    pub heartbeat_interval: Duration,
    /// The liveness deadline: a connection whose peer announced heartbeats (`X-Kvx-Heartbeat`
    /// in its READY) and from which nothing (message, PING or PONG) has arrived for this long
    /// is presumed dead and closed; a DEALER reconnects and reports `Disconnected`, a ROUTER
    /// reports the peer `Lost`. Unlike TCP's own timers it finds a peer whose process is
    /// stopped or hung (its kernel still acknowledges every byte). Default 4 s; at least
    /// twice `heartbeat_interval`. Peers that announce nothing (libzmq's) are not held to it.
    pub heartbeat_timeout: Duration,
    /// First wait before a reconnect attempt; it doubles up to `reconnect_backoff_max`.
    pub reconnect_backoff_min: Duration,
    pub reconnect_backoff_max: Duration,
    /// Largest incoming frame passed on; larger ones are dropped, counted and logged. At most
    /// the wire's own limit (`kvx_proto::wire::DEFAULT_FRAME_MAX_BYTES`, 1 MiB), which the
    /// drivers decode with: a larger frame let through here would only fail there.
    pub frame_max_bytes: usize,
    /// A peer that announces a frame longer than this is disconnected before any of the
    /// frame is read (a DEALER or PUSH then reconnects); frames between `frame_max_bytes` and this are
    /// skipped as they arrive (never buffered) and their message dropped as above. At least
    /// `frame_max_bytes`.
    pub frame_refuse_bytes: usize,
    /// Routing identities remembered at most (`PeerId` stability); the least recently
    /// heard is forgotten first.
    pub peers_max: usize,
    /// Connections a bound socket (ROUTER or PULL) holds at once, handshaking or not. Past
    /// it a newcomer is still taken, and the quietest connection is closed for it (the one
    /// longest without a message, one that never sent any first: `kvx_io::ConnectionBudget`),
    /// counted in `ZmqStats::connections_refused`; so idle connections never lock a sender
    /// out. Default 1024: one connection per sending process and TP rank, so a receiver rank
    /// or a proxy serving a few hundred prefill ranks has room to spare, while a flood holds
    /// at most 1024 × (`frame_max_bytes` + 8 KiB) of buffers (`docs/spec/zmq.md` §5).
    pub connections_max: usize,
    /// Connections from one source address at most (the quietest of them is closed for a
    /// newcomer past it), so that one address's flood evicts its own connections first.
    /// Default 256; above `connections_max` it is `connections_max`.
    pub connections_per_source_max: usize,
    /// How long an accepted connection has to complete the ZMTP handshake (greeting and
    /// READY); a peer that connects and says nothing, or trickles its greeting, is closed
    /// then (`ZmqStats::handshakes_failed`). Default 5 s. (A connecting socket's handshake
    /// is bounded by `connect_timeout`.)
    pub handshake_timeout: Duration,
    /// How long an incoming message may take from its first byte to its last, on every
    /// socket: a peer that trickles a frame is disconnected then
    /// (`ZmqStats::messages_timed_out`), so it holds its buffer no longer. Waiting between
    /// messages is not bounded by it. Default 5 s, the `send_timeout` within which a kvx
    /// sender writes a whole batch of messages.
    pub message_timeout: Duration,
    /// Bytes of received messages a bound socket (ROUTER or PULL) holds before its handle
    /// has finished with them (`inbound`): past it, connections wait to read more, and their
    /// peers meet TCP backpressure. Default 64 MiB: 64 messages of `frame_max_bytes`, against
    /// `CHANNEL_DEPTH` (1024) of them without it. At most 4 GiB.
    pub inbound_bytes_max: usize,
    /// Bytes of frame bodies longer than 16 KiB that a bound socket's connections hold in
    /// all while they read them, from each body's header until its message is handed on into
    /// `inbound_bytes_max` (`zmtp::FrameReader::with_budget`): a body that finds it spent
    /// waits, within `message_timeout`, before anything of it is allocated or read. Without it
    /// every connection may hold an unfinished message of `frame_max_bytes`, about 1 GiB over
    /// `connections_max` connections; with it a flood of unfinished large frames holds this
    /// much, and when its connections go, what they held goes with them. Smaller frames (every
    /// message a kvx or LMCache sender sends in practice) never wait for it. Default 8 MiB;
    /// at least `frame_max_bytes`, at most 4 GiB.
    pub unfinished_bytes_max: usize,
    /// CURVE (RFC 26) on this transport's sockets; `None` (the default) speaks the NULL
    /// mechanism, unauthenticated and in the clear. (Boxed: it is large, and rarely set.)
    pub curve: Option<Box<CurveConfig>>,
}

/// CURVE settings of a `ZmqTransport` (`docs/spec/zmq.md` §9). Each side is on where its
/// field is set: a transport that both binds and connects (a proxy) may be a CURVE server
/// and client at once, with one key pair. A peer speaking NULL to a CURVE socket, or CURVE to
/// a NULL one, is refused (`ZmqStats::curve_refused`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurveConfig {
    /// This end's long-term key pair (`CurveKeyPair::load` reads a `.key_secret` file).
    pub keys: CurveKeyPair,
    /// Server side: when set, the bound sockets (ROUTER, PULL) are CURVE servers that accept
    /// a client only if its long-term public key is on this list (`AllowList::load_dir`).
    pub allowed_clients: Option<AllowList>,
    /// Client side: when set, the connecting sockets (DEALER, PUSH) are CURVE clients of a
    /// server holding this public key (`load_public_key` reads its `.key` file). Every
    /// server this transport connects to holds the same key.
    pub server_key: Option<[u8; KEY_BYTES]>,
}

impl Default for ZmqConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            send_timeout: Duration::from_secs(5),
            recv_timeout: Duration::from_secs(60),
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(4),
            reconnect_backoff_min: Duration::from_millis(100),
            reconnect_backoff_max: Duration::from_secs(5),
            frame_max_bytes: DEFAULT_FRAME_MAX_BYTES,
            frame_refuse_bytes: 16 * DEFAULT_FRAME_MAX_BYTES,
            peers_max: 65_536,
            connections_max: 1024,
            connections_per_source_max: 256,
            handshake_timeout: Duration::from_secs(5),
            message_timeout: Duration::from_secs(5),
            inbound_bytes_max: 64 << 20,
            curve: None,
            unfinished_bytes_max: 8 << 20,
        }
    }
}

/// The longest any `ZmqConfig` duration may be.
pub const SETTING_MAX: Duration = Duration::from_secs(24 * 60 * 60);

/// The most `ZmqConfig::connections_max` may be (far past any file descriptor limit).
pub const CONNECTIONS_MAX_LIMIT: usize = 1 << 20;

/// A `ZmqConfig` that cannot work, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid ZMQ transport configuration: {0}")]
pub struct ZmqConfigError(String);

impl ZmqConfig {
    pub fn validate(&self) -> Result<(), ZmqConfigError> {
        let positive = [
            ("connect_timeout", self.connect_timeout),
            ("send_timeout", self.send_timeout),
            ("recv_timeout", self.recv_timeout),
            ("heartbeat_interval", self.heartbeat_interval),
            ("reconnect_backoff_min", self.reconnect_backoff_min),
            ("handshake_timeout", self.handshake_timeout),
            ("message_timeout", self.message_timeout),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, d)| d.is_zero()) {
            return Err(ZmqConfigError(format!("{name} must be positive")));
        }
        // A day is "never" for all of these, and the cap keeps deadline arithmetic
        // (`now + timeout`, doubling backoff) far from overflow.
        let longest = [
            ("connect_timeout", self.connect_timeout),
            ("send_timeout", self.send_timeout),
            ("recv_timeout", self.recv_timeout),
            ("heartbeat_timeout", self.heartbeat_timeout),
            ("reconnect_backoff_max", self.reconnect_backoff_max),
            ("handshake_timeout", self.handshake_timeout),
            ("message_timeout", self.message_timeout),
        ];
        if let Some((name, _)) = longest.iter().find(|(_, d)| *d > SETTING_MAX) {
            return Err(ZmqConfigError(format!(
                "{name} must be at most {SETTING_MAX:?}"
            )));
        }
        if self.heartbeat_timeout < 2 * self.heartbeat_interval {
            return Err(ZmqConfigError(
                "heartbeat_timeout must be at least twice heartbeat_interval (one late \
                 heartbeat must not end a connection)"
                    .into(),
            ));
        }
        if self.reconnect_backoff_max < self.reconnect_backoff_min {
            return Err(ZmqConfigError(
                "reconnect_backoff_max must be at least reconnect_backoff_min".into(),
            ));
        }
        if self.frame_max_bytes == 0 || self.peers_max == 0 {
            return Err(ZmqConfigError(
                "frame_max_bytes and peers_max must be at least 1".into(),
            ));
        }
        if self.frame_max_bytes > DEFAULT_FRAME_MAX_BYTES {
            return Err(ZmqConfigError(format!(
                "frame_max_bytes {} exceeds {DEFAULT_FRAME_MAX_BYTES}, the largest message the \
                 drivers decode (kvx_proto::wire::DEFAULT_FRAME_MAX_BYTES)",
                self.frame_max_bytes
            )));
        }
        if !(1..=CONNECTIONS_MAX_LIMIT).contains(&self.connections_max) {
            return Err(ZmqConfigError(format!(
                "connections_max must be 1 to {CONNECTIONS_MAX_LIMIT}"
            )));
        }
        if self.connections_per_source_max == 0 {
            return Err(ZmqConfigError(
                "connections_per_source_max must be at least 1".into(),
            ));
        }
        if self.inbound_bytes_max == 0 || u32::try_from(self.inbound_bytes_max).is_err() {
            return Err(ZmqConfigError(
                "inbound_bytes_max must be 1 byte to 4 GiB".into(),
            ));
        }
        if self.unfinished_bytes_max < self.frame_max_bytes
            || u32::try_from(self.unfinished_bytes_max).is_err()
        {
            return Err(ZmqConfigError(
                "unfinished_bytes_max must be frame_max_bytes to 4 GiB".into(),
            ));
        }
        if self.frame_refuse_bytes < self.frame_max_bytes {
            return Err(ZmqConfigError(
                "frame_refuse_bytes must be at least frame_max_bytes".into(),
            ));
        }
        if let Some(curve) = &self.curve {
            if curve.allowed_clients.is_none() && curve.server_key.is_none() {
                return Err(ZmqConfigError(
                    "curve needs allowed_clients (to serve) or server_key (to connect), or both"
                        .into(),
                ));
            }
            if curve
                .allowed_clients
                .as_ref()
                .is_some_and(AllowList::is_empty)
            {
                return Err(ZmqConfigError(
                    "curve.allowed_clients is empty: every client would be refused".into(),
                ));
            }
        }
        Ok(())
    }
}

/// Counts of what the transport dropped or survived, over every socket it made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZmqStats {
    /// Incoming messages with a frame over `frame_max_bytes`.
    pub oversize_dropped: u64,
    /// Incoming messages whose multipart shape is not one kvx accepts.
    pub malformed_dropped: u64,
    /// Sends that could not be made: a DEALER's, PUSH's or ROUTER's write that took longer
    /// than `send_timeout` (the connection is then closed), or a ROUTER reply dropped because
    /// its peer's queue was full (the peer is not reading).
    pub send_timeouts: u64,
    /// Replies to a peer the ROUTER no longer knows or is not connected to.
    pub unroutable_replies: u64,
    /// Payloads handed to a DEALER or PUSH while its connection was down.
    pub dropped_while_down: u64,
    /// Connections of DEALERs and PUSHes that broke.
    pub disconnects: u64,
    /// Connections of DEALERs and PUSHes re-established after a break.
    pub reconnects: u64,
    /// Connections a ROUTER or PULL closed as soon as it accepted them: it already held
    /// `connections_max`.
    pub connections_refused: u64,
    /// Accepted connections closed because their handshake failed (not ZMTP 3, not NULL, a
    /// socket type that cannot talk to this one, a READY over its limit) or took longer
    /// than `handshake_timeout`.
    pub handshakes_failed: u64,
    /// ROUTER connections closed after the handshake for their identity: one already
    /// connected (the connection holding it keeps it), one beginning with a zero byte, or
    /// one longer than 255 bytes (`docs/spec/zmq.md` §3).
    pub identities_refused: u64,
    /// Connections closed because a message took longer than `message_timeout` to arrive.
    pub messages_timed_out: u64,
    /// Connections closed because their stream broke the framing rules: reserved flags, a
    /// frame announced over `frame_refuse_bytes`, a command inside a message.
    pub protocol_violations: u64,
    /// Connections refused or ended by security: a peer speaking NULL to a CURVE socket or
    /// CURVE to a NULL one, a CURVE handshake box, cookie or vouch that does not open (a
    /// wrong server key, a forgery), a client key not on the allow-list, and after the
    /// handshake a MESSAGE box that does not authenticate or replays a nonce.
    pub curve_refused: u64,
    /// Connections closed because a peer that announced heartbeats sent nothing for
    /// `heartbeat_timeout` (a hung process, a link down without a reset): a DEALER's to its
    /// ROUTER, a ROUTER's to its DEALERs.
    pub peers_silent: u64,
    /// Peers heard under a new epoch: a DEALER's ROUTER, or a ROUTER's sender identity, that
    /// came back as a new process (it restarted).
    pub peer_restarts: u64,
}

#[derive(Debug, Default)]
struct Counters {
    oversize_dropped: AtomicU64,
    malformed_dropped: AtomicU64,
    send_timeouts: AtomicU64,
    unroutable_replies: AtomicU64,
    dropped_while_down: AtomicU64,
    disconnects: AtomicU64,
    reconnects: AtomicU64,
    connections_refused: AtomicU64,
    handshakes_failed: AtomicU64,
    identities_refused: AtomicU64,
    messages_timed_out: AtomicU64,
    protocol_violations: AtomicU64,
    curve_refused: AtomicU64,
    peers_silent: AtomicU64,
    peer_restarts: AtomicU64,
}

/// A transport's epoch: 64 bits from the operating system's random numbers.
fn new_epoch() -> u64 {
    use crypto_box::aead::rand_core::RngCore;
    crypto_box::aead::OsRng.next_u64()
}

/// Adds one; returns the new count.
fn bump(counter: &AtomicU64) -> u64 {
    counter.fetch_add(1, Ordering::Relaxed) + 1
}

/// Whether the `n`th occurrence of a per-message problem is logged: a peer that floods bad
/// frames must not flood the log too, but the first few and then a sparse sample are kept.
fn worth_logging(n: u64) -> bool {
    n <= 8 || n.is_power_of_two()
}

/// Bytes a peer chose, as they may appear in a log: escaped, and cut to `LOGGED_BYTES_MAX`
/// with the full length said, so a hostile identity or command name cannot flood or forge
/// log lines.
struct PeerBytes<'a>(&'a [u8]);

const LOGGED_BYTES_MAX: usize = 64;

impl std::fmt::Display for PeerBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = &self.0[..self.0.len().min(LOGGED_BYTES_MAX)];
        write!(f, "\"{}\"", shown.escape_ascii())?;
        if shown.len() < self.0.len() {
            write!(f, "… ({} bytes)", self.0.len())?;
        }
        Ok(())
    }
}

/// What every socket task of one transport shares.
#[derive(Debug)]
struct Shared {
    config: ZmqConfig,
    counters: Counters,
    peers: Mutex<PeerTable>,
    /// The key of this process's principal hashes (SipHash, random keys per process).
    principal_key: RandomState,
    /// This transport's epoch, announced in its DEALERs' and ROUTERs' READY
    /// (`docs/spec/protocol.md` §Restarts and epochs).
    epoch: u64,
}

impl Shared {
    /// Who stands behind `peer` for fair shares (`kvx_proto::Principal`,
    /// `docs/spec/protocol.md` §Principals), while a ROUTER connection holds its identity: a
    /// keyed hash of the CURVE public key it proved, or without CURVE of the address it
    /// connects from (an IPv4-mapped IPv6 address as the IPv4 one). The key is this
    /// process's, so no peer can choose a value that lands it in another principal's share.
    fn principal(&self, peer: PeerId) -> Option<Principal> {
        let who = self.peers().principal_of(peer)?;
        Some(self.principal_of(who.key, who.source))
    }

    /// The principal of a connection that proved `key` (CURVE), or else came from `source`:
    /// `principal`'s hash, which the PULL uses too, so that a key is one principal on every
    /// socket of this transport.
    fn principal_of(&self, key: Option<[u8; KEY_BYTES]>, source: IpAddr) -> Principal {
        let mut h = self.principal_key.build_hasher();
        match (key, source.to_canonical()) {
            (Some(key), _) => {
                h.write_u8(b'k');
                h.write(&key);
            }
            (None, IpAddr::V4(a)) => {
                h.write_u8(b'4');
                h.write(&a.octets());
            }
            (None, IpAddr::V6(a)) => {
                h.write_u8(b'6');
                h.write(&a.octets());
            }
        }
        Principal::new(h.finish())
    }

    fn peers(&self) -> MutexGuard<'_, PeerTable> {
        // The table has no invariant a panicking holder could break halfway.
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a connection refused or cut off (`counter`), and logs it sparsely
    /// (`worth_logging`): a hostile peer that repeats itself must not flood the log.
    fn refused(
        &self,
        counter: &AtomicU64,
        socket: &'static str,
        what: &'static str,
        why: &dyn std::fmt::Display,
    ) {
        let n = bump(counter);
        if worth_logging(n) {
            tracing::warn!(socket, so_far = n, %why, "{what}");
        }
    }

    /// Counts and (sparsely) logs an incoming message that was not passed on.
    fn rejected(&self, socket: &'static str, reject: &Reject) {
        let counter = match reject {
            Reject::Oversize { .. } => &self.counters.oversize_dropped,
            Reject::Malformed(_) => &self.counters.malformed_dropped,
        };
        let n = bump(counter);
        if worth_logging(n) {
            tracing::warn!(
                socket,
                dropped_so_far = n,
                "dropped an incoming message: {reject}"
            );
        }
    }
}

/// LMCache-compatible ZMQ transport. Clones share configuration, counters and the
/// identity ↔ `PeerId` table.
#[derive(Debug, Clone)]
pub struct ZmqTransport {
    shared: Arc<Shared>,
}

impl Default for ZmqTransport {
    fn default() -> Self {
        Self::with_valid_config(ZmqConfig::default())
    }
}

impl ZmqTransport {
    pub fn new(config: ZmqConfig) -> Result<Self, ZmqConfigError> {
        config.validate()?;
        Ok(Self::with_valid_config(config))
    }

    fn with_valid_config(config: ZmqConfig) -> Self {
        let peers = Mutex::new(PeerTable::new(config.peers_max));
        Self {
            shared: Arc::new(Shared {
                config,
                counters: Counters::default(),
                peers,
                principal_key: RandomState::new(),
                epoch: new_epoch(),
            }),
        }
    }

    pub fn config(&self) -> &ZmqConfig {
        &self.shared.config
    }

    /// This transport's epoch: 64 random bits drawn when it was made, announced to every kvx
    /// peer in the handshake (`X-Kvx-Epoch`), so that a peer knows a restarted process for a
    /// new incarnation (`docs/spec/protocol.md` §Restarts and epochs).
    pub fn epoch(&self) -> u64 {
        self.shared.epoch
    }

    pub fn stats(&self) -> ZmqStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ZmqStats {
            oversize_dropped: get(&c.oversize_dropped),
            malformed_dropped: get(&c.malformed_dropped),
            send_timeouts: get(&c.send_timeouts),
            unroutable_replies: get(&c.unroutable_replies),
            dropped_while_down: get(&c.dropped_while_down),
            disconnects: get(&c.disconnects),
            reconnects: get(&c.reconnects),
            connections_refused: get(&c.connections_refused),
            handshakes_failed: get(&c.handshakes_failed),
            identities_refused: get(&c.identities_refused),
            messages_timed_out: get(&c.messages_timed_out),
            protocol_violations: get(&c.protocol_violations),
            curve_refused: get(&c.curve_refused),
            peers_silent: get(&c.peers_silent),
            peer_restarts: get(&c.peer_restarts),
        }
    }

    /// The ZMQ routing identity a server heard `peer` under (for logs: LMCache identities
    /// read `"{sender}-to-{receiver}"`), while the transport remembers it.
    pub fn peer_identity(&self, peer: PeerId) -> Option<Bytes> {
        self.shared.peers().identity_of(peer)
    }

    /// The long-term CURVE public key `peer`'s connection to a ROUTER proved (it holds the
    /// secret half: RFC 26's vouch), while that connection lasts; `None` without CURVE, or
    /// when no connection holds the peer's identity now. With CURVE on, this is the peer's
    /// authenticated principal: the key, not the identity it chose, nor its address.
    pub fn peer_public_key(&self, peer: PeerId) -> Option<[u8; KEY_BYTES]> {
        self.shared.peers().principal_of(peer)?.key
    }

    /// The source address of `peer`'s connection to a ROUTER, while that connection lasts.
    /// Without CURVE this is all there is to tell peers apart by (identities are chosen by
    /// the peer), and it holds only as far as the network is trusted (`docs/operations.md`).
    pub fn peer_source(&self, peer: PeerId) -> Option<IpAddr> {
        Some(self.shared.peers().principal_of(peer)?.source)
    }
}

fn bad_endpoint(endpoint: &str, why: impl Into<String>) -> TransportError {
    TransportError::Endpoint {
        endpoint: endpoint.to_owned(),
        why: why.into(),
    }
}

/// Parses `tcp://host:port` (host: a name, an IPv4 address, `[IPv6]`, or `*` when binding)
/// into the `tcp://host:port` kvx binds or connects to. Binding accepts libzmq's `*` (LMCache
/// binds `tcp://*:port`) as `0.0.0.0`, every IPv4 interface, as libzmq does without
/// `ZMQ_IPV6`; and port 0 (the OS picks one). An IPv6 address must be in brackets.
fn tcp_endpoint(endpoint: &str, binding: bool) -> Result<String, TransportError> {
    let Some(hostport) = endpoint.strip_prefix("tcp://") else {
        return Err(bad_endpoint(
            endpoint,
            "only tcp:// endpoints are supported",
        ));
    };
    let (host, port) = hostport
        .rsplit_once(':')
        .ok_or_else(|| bad_endpoint(endpoint, "expected tcp://host:port"))?;
    let port: u16 = match port.parse() {
        Ok(p) if port.bytes().all(|b| b.is_ascii_digit()) => p,
        _ => {
            return Err(bad_endpoint(
                endpoint,
                format!("{port:?} is not a port number"),
            ))
        }
    };
    let host = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        inner
            .parse::<std::net::Ipv6Addr>()
            .map_err(|_| bad_endpoint(endpoint, format!("[{inner}] is not an IPv6 address")))?;
        host
    } else if host.contains(':') {
        return Err(bad_endpoint(
            endpoint,
            "an IPv6 address must be in brackets: tcp://[addr]:port",
        ));
    } else if host == "*" {
        if !binding {
            return Err(bad_endpoint(endpoint, "cannot connect to `*`"));
        }
        "0.0.0.0"
    } else if !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_')
    {
        host
    } else {
        return Err(bad_endpoint(endpoint, format!("{host:?} is not a host")));
    };
    if port == 0 && !binding {
        return Err(bad_endpoint(endpoint, "cannot connect to port 0"));
    }
    Ok(format!("tcp://{host}:{port}"))
}

impl Transport for ZmqTransport {
    async fn serve(&self, endpoint: &str) -> Result<ControlServer, TransportError> {
        let zmq_endpoint = tcp_endpoint(endpoint, true)?;
        server::serve(self.shared.clone(), endpoint, &zmq_endpoint).await
    }

    async fn connect(
        &self,
        endpoint: &str,
        identity: &str,
    ) -> Result<ControlClient, TransportError> {
        let zmq_endpoint = tcp_endpoint(endpoint, false)?;
        dealer::connect(self.shared.clone(), &zmq_endpoint, identity).await
    }

    async fn notify_sink(&self, endpoint: &str) -> Result<NotifySink, TransportError> {
        let zmq_endpoint = tcp_endpoint(endpoint, false)?;
        push::notify_sink(self.shared.clone(), &zmq_endpoint).await
    }

    async fn notify_source(&self, endpoint: &str) -> Result<NotifySource, TransportError> {
        let zmq_endpoint = tcp_endpoint(endpoint, true)?;
        server::notify_source(self.shared.clone(), endpoint, &zmq_endpoint).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            tcp_endpoint("tcp://*:8400", true).ok().as_deref(),
            Some("tcp://0.0.0.0:8400")
        );
        assert_eq!(
            tcp_endpoint("tcp://127.0.0.1:0", true).ok().as_deref(),
            Some("tcp://127.0.0.1:0")
        );
        assert!(tcp_endpoint("tcp://*:8400", false).is_err());
        assert!(tcp_endpoint("tcp://127.0.0.1:0", false).is_err());
        assert!(tcp_endpoint("ipc:///tmp/x", true).is_err());
        assert!(tcp_endpoint("127.0.0.1:80", false).is_err());
        assert_eq!(
            tcp_endpoint("tcp://[::1]:5555", false).ok().as_deref(),
            Some("tcp://[::1]:5555")
        );
        assert_eq!(
            tcp_endpoint("tcp://decode-0.cluster:5555", false)
                .ok()
                .as_deref(),
            Some("tcp://decode-0.cluster:5555")
        );
        for bad in [
            "tcp://:5555",
            "tcp://host",
            "tcp://host:65536",
            "tcp://host:x",
            "tcp://a b:1",
            "tcp://[]:1",
            "tcp://[foo]:1",
            "tcp://[1.2.3.4]:1",
            "tcp://host:+80",
            "tcp://::1:5555",
        ] {
            assert!(tcp_endpoint(bad, true).is_err(), "{bad}");
        }
    }

    #[test]
    fn config_validation() {
        assert_eq!(ZmqConfig::default().validate(), Ok(()));
        let zero = ZmqConfig {
            send_timeout: Duration::ZERO,
            ..ZmqConfig::default()
        };
        assert!(zero.validate().is_err());
        let backwards = ZmqConfig {
            reconnect_backoff_max: Duration::from_millis(1),
            ..ZmqConfig::default()
        };
        assert!(backwards.validate().is_err());
        let twitchy = ZmqConfig {
            heartbeat_timeout: Duration::from_millis(1500),
            ..ZmqConfig::default()
        };
        assert!(twitchy.validate().is_err());
        let forever = ZmqConfig {
            recv_timeout: Duration::MAX,
            ..ZmqConfig::default()
        };
        assert!(forever.validate().is_err());
    }

    #[test]
    fn hostile_peer_limits_are_validated() {
        for bad in [
            ZmqConfig {
                connections_max: 0,
                ..ZmqConfig::default()
            },
            ZmqConfig {
                connections_max: CONNECTIONS_MAX_LIMIT + 1,
                ..ZmqConfig::default()
            },
            ZmqConfig {
                handshake_timeout: Duration::ZERO,
                ..ZmqConfig::default()
            },
            ZmqConfig {
                message_timeout: SETTING_MAX + Duration::from_secs(1),
                ..ZmqConfig::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn frames_larger_than_the_drivers_decode_are_refused_at_configuration() {
        let err = ZmqConfig {
            frame_max_bytes: DEFAULT_FRAME_MAX_BYTES + 1,
            ..ZmqConfig::default()
        }
        .validate()
        .expect_err("past the wire's limit");
        assert!(err.to_string().contains("frame_max_bytes"), "{err}");
        ZmqConfig {
            frame_max_bytes: DEFAULT_FRAME_MAX_BYTES,
            ..ZmqConfig::default()
        }
        .validate()
        .expect("the wire's limit itself");
    }

    #[test]
    fn peer_bytes_are_escaped_and_cut_in_logs() {
        assert_eq!(PeerBytes(b"s0-to-r0").to_string(), "\"s0-to-r0\"");
        assert_eq!(
            PeerBytes(b"\0\n\x1b[31m").to_string(),
            "\"\\x00\\n\\x1b[31m\""
        );
        let long = PeerBytes(&[b'x'; 1 << 20]).to_string();
        assert!(long.len() < 100, "{long}");
        assert!(long.ends_with("… (1048576 bytes)"), "{long}");
    }

    #[test]
    fn sparse_logging() {
        let logged: Vec<u64> = (1..=100).filter(|&n| worth_logging(n)).collect();
        assert_eq!(logged, [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]);
    }
}
