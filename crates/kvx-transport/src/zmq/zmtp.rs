//! The ZMTP 3 subset kvx speaks on every socket (RFC 23, the NULL mechanism, and CURVE through
//! `curve`): the greeting, the READY command, and multipart messages of `flags, length, body`
//! frames (under CURVE, each frame in a MESSAGE box: `Sealer` and `FrameReader` here).
//!
//! Why kvx reads and writes ZMTP itself instead of through the `zeromq` crate (0.7): its codec
//! reserves a frame's announced length before reading it and has no maximum message size, so
//! nine bytes announcing a 1 TiB frame abort the process, and nothing in its API reaches in
//! front of the codec. Here every frame length is checked before a byte of the body is
//! buffered: a message whose frames add up to more than `frame_max_bytes` is skipped as it
//! streams past (the message is dropped and counted), a frame announced over
//! `frame_refuse_bytes` ends the connection, and so does a message that takes longer than
//! `message_timeout` once its first byte arrived, or a READY over `READY_MAX_BYTES`. That
//! holds for bound sockets (ROUTER, PULL: any peer can reach them) and connecting ones
//! (DEALER, PUSH: a restarted or impostor peer on the configured port) alike.

use std::io;

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::curve_box::{CurveRx, CurveTx, COMMAND_INSIDE, MESSAGE_OVERHEAD};
use super::frames::{
    command_frame, encode_message, parse_heartbeat, Heartbeat, COMMAND, EPOCH_PROPERTY,
    HEARTBEAT_PROPERTY, LONG, MORE,
};
use tokio::sync::OwnedSemaphorePermit;

use super::inbound::{read_mapped, InboundBudget};
use super::PeerBytes;

/// The most frames of one message that are buffered. No shape kvx accepts has more than
/// three; without a limit, a peer sending frames with MORE set forever would grow one message
/// without end, each frame within `frame_max_bytes`.
pub(super) const FRAMES_MAX: u64 = 4;

/// The security mechanisms kvx speaks, as the greeting names them.
pub(super) const NULL: &[u8] = b"NULL";
pub(super) const CURVE: &[u8] = b"CURVE";

/// kvx's greeting: signature (with libzmq's padding), ZMTP 3.0, the `mechanism`, the
/// as-server flag (1 for a CURVE server), filler. 3.0 rather than 3.1: a 3.1 peer then never
/// sends heartbeats, and the framing is the same.
pub(super) fn greeting(mechanism: &[u8], as_server: bool) -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[8] = 0x01;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..12 + mechanism.len()].copy_from_slice(mechanism);
    g[32] = u8::from(as_server);
    g
}

/// The mechanism a greeting names, as it may appear in a message.
fn mechanism_name(g: &[u8; 64]) -> String {
    let m = &g[12..32];
    let end = m.iter().position(|&b| b == 0).unwrap_or(m.len());
    PeerBytes(&m[..end]).to_string()
}

/// Checks a peer's greeting: a ZMTP 3 signature, and the `ours` mechanism. A peer speaking
/// another mechanism (NULL against CURVE, or the other way round) is `Unauthenticated`.
pub(super) fn check_greeting(g: &[u8; 64], ours: &[u8]) -> Result<(), HandshakeError> {
    if g[0] != 0xff || g[9] & 0x01 != 0x01 {
        return Err(HandshakeError::Failed("not a ZMTP greeting".into()));
    }
    if g[10] < 3 {
        return Err(HandshakeError::Failed(format!(
            "ZMTP {}.{} is too old (3.0 or later)",
            g[10], g[11]
        )));
    }
    let named = |m: &[u8]| g[12..12 + m.len()] == *m && g[12 + m.len()..32].iter().all(|&b| b == 0);
    if !named(NULL) && !named(CURVE) {
        return Err(HandshakeError::Failed(format!(
            "the {} security mechanism is not supported (NULL or CURVE)",
            mechanism_name(g)
        )));
    }
    if !named(ours) {
        return Err(HandshakeError::Unauthenticated(format!(
            "the peer speaks the {} security mechanism and this socket {} (CURVE must be on \
             at both ends or at neither)",
            mechanism_name(g),
            String::from_utf8_lossy(ours)
        )));
    }
    Ok(())
}

/// A READY command announcing `socket_type` (and, for a DEALER, its routing `identity`, as
/// libzmq sends it; for a DEALER or ROUTER, `epoch`), as one frame on the wire.
pub(super) fn ready(socket_type: &str, identity: Option<&[u8]>, epoch: Option<u64>) -> Vec<u8> {
    let mut body = b"\x05READY".to_vec();
    body.extend_from_slice(&metadata(socket_type, identity, epoch));
    command_frame(&body)
}

/// The properties a READY (or CURVE's INITIATE and READY boxes) carry: `Socket-Type`, a
/// DEALER's `Identity`, and for a DEALER or ROUTER `X-Kvx-Heartbeat` (`HEARTBEAT_PROPERTY`:
/// it takes part in heartbeats) and `X-Kvx-Epoch` (`EPOCH_PROPERTY`, when `epoch` is given).
/// libzmq keeps unknown properties as metadata.
pub(super) fn metadata(socket_type: &str, identity: Option<&[u8]>, epoch: Option<u64>) -> Vec<u8> {
    let mut body = Vec::with_capacity(32 + identity.map_or(0, <[u8]>::len));
    let mut property = |name: &[u8], value: &[u8]| {
        body.push(name.len() as u8);
        body.extend_from_slice(name);
        body.extend_from_slice(&(value.len() as u32).to_be_bytes());
        body.extend_from_slice(value);
    };
    property(b"Socket-Type", socket_type.as_bytes());
    if let Some(identity) = identity {
        property(b"Identity", identity);
    }
    if matches!(socket_type, "DEALER" | "ROUTER") {
        property(HEARTBEAT_PROPERTY, b"1");
        if let Some(epoch) = epoch {
            property(EPOCH_PROPERTY, format!("{epoch:016x}").as_bytes());
        }
    }
    body
}

/// The epoch a peer's READY properties announce (`EPOCH_PROPERTY`), if one is well formed.
pub(super) fn announced_epoch(props: &[(String, Bytes)]) -> Option<u64> {
    let name = std::str::from_utf8(EPOCH_PROPERTY).unwrap_or_default();
    let (_, value) = props.iter().find(|(k, _)| k.eq_ignore_ascii_case(name))?;
    let text = std::str::from_utf8(value).ok()?;
    (text.len() == 16).then(|| u64::from_str_radix(text, 16).ok())?
}

/// Whether a peer's READY properties announce heartbeats (`HEARTBEAT_PROPERTY`).
pub(super) fn announces_heartbeats(props: &[(String, Bytes)]) -> bool {
    let name = std::str::from_utf8(HEARTBEAT_PROPERTY).unwrap_or_default();
    props.iter().any(|(k, _)| k.eq_ignore_ascii_case(name))
}

/// The properties of a READY command body; an error for anything else.
pub(super) fn parse_ready(body: &[u8]) -> Result<Vec<(String, Bytes)>, String> {
    let bad = || "malformed READY command".to_owned();
    let (&name_len, rest) = body.split_first().ok_or_else(bad)?;
    let name = rest.get(..usize::from(name_len)).ok_or_else(bad)?;
    if name != b"READY" {
        return Err(format!(
            "expected READY, got the command {}",
            PeerBytes(name)
        ));
    }
    let mut rest = &rest[usize::from(name_len)..];
    let mut props = Vec::new();
    while let Some((&n, tail)) = rest.split_first() {
        let key = tail.get(..usize::from(n)).ok_or_else(bad)?;
        let tail = &tail[usize::from(n)..];
        let len = tail.get(..4).ok_or_else(bad)?;
        let len = u32::from_be_bytes(len.try_into().map_err(|_| bad())?) as usize;
        let value = tail.get(4..4 + len).ok_or_else(bad)?;
        props.push((
            String::from_utf8_lossy(key).into_owned(),
            Bytes::copy_from_slice(value),
        ));
        rest = &tail[4 + len..];
    }
    Ok(props)
}

/// The longest READY command accepted, checked against its frame header before any of the
/// body is buffered. libzmq's READY with the longest identity (255 bytes) is 296 bytes; the
/// rest leaves room for `ZMQ_METADATA` properties. A longer one ends the handshake, so no
/// identity or property longer than this ever reaches the peer table or the log.
pub(super) const READY_MAX_BYTES: u64 = 4096;

/// The read buffer of a connection: greetings, frame headers and whatever a read brings in
/// beyond them. A frame body that is not already in it gets an allocation of its own, of
/// exactly its length, so the buffer never grows.
const READ_CHUNK: usize = 8 << 10;

/// Frame bodies from this long on are read into a mapping of their own
/// (`inbound::read_mapped`), unmapped when their bytes are dropped.
const MAPPED_BODY: usize = 128 << 10;

/// Frame bodies up to this long are read on the connection's own account; longer ones first
/// reserve their length in the socket's budget of large frames (`FrameReader::with_budget`).
pub(super) const SMALL_FRAME: usize = 16 << 10;

/// What reading one message found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Incoming {
    /// A complete message's frames.
    Message(Vec<Bytes>),
    /// A PING (ZMTP 3.1 heartbeat), with the context its PONG sends back.
    Ping(Bytes),
    /// A PONG, answering one of this end's PINGs.
    Pong,
    /// Any other command frame after the handshake, skipped without buffering.
    Command,
    /// A message whose frames add up to more than `frame_max_bytes` (the count is the total
    /// when it crossed the limit); what was past the limit was skipped without buffering.
    Oversize(u64),
    /// A message of more than `FRAMES_MAX` frames; the frames past the limit were skipped
    /// without buffering them. The count is how many it had.
    TooManyFrames(u64),
    /// The peer closed the connection cleanly between messages.
    Closed,
}

/// What one connection's reader holds its peer to (`ZmqConfig`, `docs/spec/zmq.md` §5).
#[derive(Debug, Clone, Copy)]
pub(super) struct ReadLimits {
    /// The most bytes of frame bodies one message may have; past it, the message is dropped.
    pub(super) message_max_bytes: u64,
    /// A frame announced longer than this ends the connection.
    pub(super) refuse_above_bytes: u64,
    /// How long a message may take from its first byte to its last.
    pub(super) message_timeout: Duration,
}

impl ReadLimits {
    pub(super) fn of(config: &super::ZmqConfig) -> Self {
        Self {
            message_max_bytes: config.frame_max_bytes as u64,
            refuse_above_bytes: config.frame_refuse_bytes as u64,
            message_timeout: config.message_timeout,
        }
    }
}

/// Reads frames from one connection, holding each frame to the limits before buffering it.
///
/// What a connection holds at any time is bounded: the read buffer (`READ_CHUNK`) plus the
/// bodies of the message being read, at most `message_max_bytes` together, for at most
/// `message_timeout`. With a budget of large frames (`with_budget`), what all the readers
/// sharing it hold in bodies longer than `SMALL_FRAME` is bounded too, from a body's header
/// until its message is handed on (`release_reserved`), the next message begins, or the
/// reader is dropped.
#[derive(Debug)]
pub(super) struct FrameReader<R> {
    io: R,
    buf: BytesMut,
    limits: ReadLimits,
    /// Under CURVE, after the handshake: every frame is a MESSAGE box, opened here.
    curve: Option<CurveRx>,
    large: Option<InboundBudget>,
    /// The shares of `large` the bodies of the current message hold.
    reserved: Vec<OwnedSemaphorePermit>,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(super) fn new(io: R, limits: ReadLimits) -> Self {
        Self {
            io,
            buf: BytesMut::with_capacity(READ_CHUNK),
            limits,
            curve: None,
            large: None,
            reserved: Vec::new(),
        }
    }

    /// From now on, every frame is a CURVE MESSAGE box (`curve::client`, `curve::server`).
    pub(super) fn set_curve(&mut self, rx: CurveRx) {
        self.curve = Some(rx);
    }

    /// Bodies longer than `SMALL_FRAME` wait for their length in `budget` before they are
    /// allocated, and hold it until `release_reserved` (the caller has handed the message on,
    /// into a budget of its own), the next message, or the end of the connection. The wait
    /// counts against `message_timeout`.
    pub(super) fn with_budget(mut self, budget: InboundBudget) -> Self {
        self.large = Some(budget);
        self
    }

    /// Gives back what the last message's large bodies reserved.
    pub(super) fn release_reserved(&mut self) {
        self.reserved.clear();
    }

    /// One read into the buffer (at most its free room); the byte count, 0 at end of stream.
    async fn read_some(&mut self) -> io::Result<usize> {
        // Callers read only when what is left is a partial greeting or header.
        debug_assert!(self.buf.len() < 64);
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 2 {
            // Moves the partial header to the front of the allocation instead of growing it
            // (`BytesMut::reserve` reuses the consumed front when it is larger than what is
            // kept), so the buffer stays `READ_CHUNK`.
            self.buf.reserve(READ_CHUNK - self.buf.len());
        }
        self.io.read_buf(&mut self.buf).await
    }

    /// Reads until `buf` holds `n` bytes (`n` at most a greeting); false on a clean end of
    /// stream before any byte of this step when `eof_ok`.
    async fn fill(&mut self, n: usize, eof_ok: bool) -> io::Result<bool> {
        debug_assert!(n <= 64);
        while self.buf.len() < n {
            if self.read_some().await? == 0 {
                if eof_ok && self.buf.is_empty() {
                    return Ok(false);
                }
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(true)
    }

    pub(super) async fn greeting(&mut self) -> io::Result<[u8; 64]> {
        self.fill(64, false).await?;
        let mut g = [0u8; 64];
        self.buf.copy_to_slice(&mut g);
        Ok(g)
    }

    /// Discards `left` body bytes as they arrive, never holding more than one read.
    async fn skip(&mut self, mut left: u64) -> io::Result<()> {
        loop {
            let take = left.min(self.buf.len() as u64) as usize;
            self.buf.advance(take);
            left -= take as u64;
            if left == 0 {
                return Ok(());
            }
            if self.read_some().await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// A frame body of `len` bytes (already held to the limits). Copied out of the read
    /// buffer when it is all there (so a small payload never pins the buffer); otherwise read
    /// into an allocation of exactly `len`: from `MAPPED_BODY` on, a mapping of its own.
    async fn body(&mut self, len: usize) -> io::Result<Bytes> {
        if self.buf.len() >= len {
            let body = Bytes::copy_from_slice(&self.buf[..len]);
            self.buf.advance(len);
            return Ok(body);
        }
        if let Some(budget) = self.large.as_ref().filter(|_| len > SMALL_FRAME) {
            self.reserved.extend(budget.reserve(len).await);
        }
        if len >= MAPPED_BODY {
            return read_mapped(&mut self.io, &mut self.buf, len).await;
        }
        let mut body = BytesMut::with_capacity(len);
        body.extend_from_slice(&self.buf);
        self.buf.clear();
        while body.len() < len {
            let room = len - body.len();
            if self.io.read_buf(&mut (&mut body).limit(room)).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(body.freeze())
    }

    /// The next frame's flags and length, checked: no reserved flags, no command inside a
    /// message (frame `index` > 0, or MORE on a command), no length over the refusal limit.
    async fn header(&mut self, index: u64) -> io::Result<(u8, u64)> {
        self.fill(1, false).await?;
        let flags = self.buf[0];
        if flags & !(MORE | LONG | COMMAND) != 0 {
            return Err(invalid(format!("reserved ZMTP frame flags {flags:#04x}")));
        }
        // A command is one frame on its own, never inside a message: anything else would
        // put message boundaries out of step.
        if flags & COMMAND != 0 && (index > 0 || flags & MORE != 0) {
            return Err(invalid("a command frame inside a multipart message".into()));
        }
        let header = if flags & LONG != 0 { 9 } else { 2 };
        self.fill(header, false).await?;
        let len = if flags & LONG != 0 {
            u64::from_be_bytes(self.buf[1..9].try_into().expect("invariant: 8 bytes"))
        } else {
            u64::from(self.buf[1])
        };
        self.buf.advance(header);
        // Under CURVE a frame carries its box's overhead too.
        let overhead = if self.curve.is_some() {
            MESSAGE_OVERHEAD as u64
        } else {
            0
        };
        if len > self.limits.refuse_above_bytes.saturating_add(overhead) {
            return Err(invalid(format!(
                "a frame of {len} bytes announced (limit {})",
                self.limits.refuse_above_bytes
            )));
        }
        Ok((flags, len))
    }

    /// The peer's READY (or other) command during the handshake: one command frame of at
    /// most `READY_MAX_BYTES`, refused from its header when longer.
    pub(super) async fn handshake_command(&mut self) -> io::Result<Bytes> {
        let (flags, len) = self.header(0).await?;
        if flags & COMMAND == 0 {
            return Err(invalid("a message before the READY command".into()));
        }
        if len > READY_MAX_BYTES {
            return Err(invalid(format!(
                "a command of {len} bytes in the handshake (limit {READY_MAX_BYTES})"
            )));
        }
        self.body(len as usize).await
    }

    /// Reads one message (or skips one command). Waiting for a message's first byte is not
    /// bounded (a connection may be idle), but from then on the whole message must arrive
    /// within `message_timeout`: a peer that trickles a frame cannot hold its buffer for
    /// long (`ErrorKind::TimedOut`). An `InvalidData` error means the stream cannot be
    /// trusted any further (reserved flags, a frame announced over `frame_refuse_bytes`, a
    /// command inside a message). Not cancel-safe once a message has begun: a caller that
    /// drops it mid-message must drop the connection.
    pub(super) async fn next(&mut self) -> io::Result<Incoming> {
        if !self.fill(1, true).await? {
            return Ok(Incoming::Closed);
        }
        let bound = self.limits.message_timeout;
        let message = async {
            if self.curve.is_some() {
                self.curve_message().await
            } else {
                self.message().await
            }
        };
        match tokio::time::timeout(bound, message).await {
            Ok(incoming) => incoming,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("a message took longer than {bound:?} to arrive"),
            )),
        }
    }

    async fn message(&mut self) -> io::Result<Incoming> {
        self.release_reserved();
        let mut frames = Vec::new();
        let mut count = 0u64;
        let mut total = 0u64;
        let mut oversize = None;
        loop {
            let (flags, len) = self.header(count).await?;
            count += 1;
            if flags & COMMAND != 0 {
                // Heartbeats are read (a few bytes); other commands after the handshake are
                // ignored, never buffered, whatever their size.
                if len > HEARTBEAT_MAX_BYTES {
                    self.skip(len).await?;
                    return Ok(Incoming::Command);
                }
                let body = self.body(len as usize).await?;
                return Ok(read_command(&body));
            }
            total = total.saturating_add(len);
            if total > self.limits.message_max_bytes {
                oversize.get_or_insert(total);
            }
            if oversize.is_some() || count > FRAMES_MAX {
                // The message is dropped: the rest of it streams past unbuffered.
                self.skip(len).await?;
            } else {
                frames.push(self.body(len as usize).await?);
            }
            if flags & MORE == 0 {
                return Ok(match oversize {
                    Some(total) => Incoming::Oversize(total),
                    None if count > FRAMES_MAX => Incoming::TooManyFrames(count),
                    None => Incoming::Message(frames),
                });
            }
        }
    }
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// One message under CURVE: MESSAGE boxes, one per frame, the MORE bit inside each. A box
    /// holds a frame whole, and its MORE bit is known only once it is open, so a frame cannot
    /// stream past unread: one over `frame_max_bytes` ends the connection (`InvalidData`),
    /// where without CURVE it is skipped. Frames past the message's limits are opened and
    /// dropped. A box that does not open, or replays a nonce, ends it too
    /// (`PermissionDenied`).
    async fn curve_message(&mut self) -> io::Result<Incoming> {
        let mut frames = Vec::new();
        let mut count = 0u64;
        let mut total = 0u64;
        let mut oversize = None;
        loop {
            let (flags, len) = self.header(0).await?;
            if flags & (MORE | COMMAND) != 0 {
                return Err(invalid(format!(
                    "a frame with flags {flags:#04x} under CURVE (every frame is one MESSAGE)"
                )));
            }
            if len > self.limits.message_max_bytes + MESSAGE_OVERHEAD as u64 {
                return Err(invalid(format!(
                    "a CURVE frame of {len} bytes (over frame_max_bytes {} and its box)",
                    self.limits.message_max_bytes
                )));
            }
            let command = self.body(len as usize).await?;
            let rx = self.curve.as_mut().expect("invariant: under CURVE");
            let (inner, frame) = rx.open(&command)?;
            count += 1;
            if inner & COMMAND_INSIDE != 0 {
                // A command inside the box (ZMTP 3.1's PING or PONG): never part of a message.
                if count > 1 || inner & MORE != 0 {
                    return Err(invalid("a command frame inside a multipart message".into()));
                }
                return Ok(read_command(&frame));
            }
            total = total.saturating_add(frame.len() as u64);
            if total > self.limits.message_max_bytes {
                oversize.get_or_insert(total);
            }
            if oversize.is_none() && count <= FRAMES_MAX {
                frames.push(frame);
            }
            if inner & MORE == 0 {
                return Ok(match oversize {
                    Some(total) => Incoming::Oversize(total),
                    None if count > FRAMES_MAX => Incoming::TooManyFrames(count),
                    None => Incoming::Message(frames),
                });
            }
        }
    }
}

/// How a connection writes messages: plain frames (NULL), or each frame in a CURVE MESSAGE
/// box with the connection's next nonce.
#[derive(Debug, Default)]
pub(super) enum Sealer {
    #[default]
    Null,
    Curve(CurveTx),
}

impl Sealer {
    /// Appends `frames` as one message to `out` (`encode_message`, or boxed).
    pub(super) fn message(&mut self, frames: &[&[u8]], out: &mut Vec<u8>) {
        match self {
            Self::Null => encode_message(frames, out),
            Self::Curve(tx) => {
                for (i, frame) in frames.iter().enumerate() {
                    tx.message(i + 1 < frames.len(), frame, out);
                }
            }
        }
    }

    /// A bound socket's READY of type `ours` (announcing `epoch`), accepting the peer.
    pub(super) fn ready(&mut self, ours: &str, epoch: Option<u64>) -> Vec<u8> {
        match self {
            Self::Null => ready(ours, None, epoch),
            Self::Curve(tx) => tx.ready(&metadata(ours, None, epoch)),
        }
    }

    /// Appends the command `body` (PING, PONG) to `out`: a command frame, or boxed.
    pub(super) fn command(&mut self, body: &[u8], out: &mut Vec<u8>) {
        match self {
            Self::Null => out.extend_from_slice(&command_frame(body)),
            Self::Curve(tx) => tx.command(body, out),
        }
    }
}

/// The longest command after the handshake that is read rather than skipped: a PING with
/// the longest context is 23 bytes.
const HEARTBEAT_MAX_BYTES: u64 = 64;

/// What a command read after the handshake is.
fn read_command(body: &[u8]) -> Incoming {
    match parse_heartbeat(body) {
        Some(Heartbeat::Ping(context)) => Incoming::Ping(context),
        Some(Heartbeat::Pong) => Incoming::Pong,
        None => Incoming::Command,
    }
}

fn invalid(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// The reason of an ERROR command body, if `body` is one (escaped: it is the peer's text).
fn parse_error(body: &[u8]) -> Option<String> {
    let rest = body.strip_prefix(b"\x05ERROR")?;
    let (&len, reason) = rest.split_first().unwrap_or((&0, &[]));
    let reason = &reason[..reason.len().min(usize::from(len))];
    Some(String::from_utf8_lossy(&reason.escape_ascii().collect::<Vec<u8>>()).into_owned())
}

/// Why a handshake did not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum HandshakeError {
    /// The peer sent ERROR instead of READY: it refused this connection, for this reason.
    Refused(String),
    /// Security: the peer speaks another mechanism (NULL against CURVE), or a CURVE box,
    /// cookie or vouch did not open (a wrong key, a forged or tampered command).
    Unauthenticated(String),
    /// CURVE: the client proved its long-term key, and the key (its fingerprint here) is not
    /// on the allow-list.
    NotAllowed(String),
    /// Anything else: not ZMTP, a socket type that cannot talk to ours, a broken stream.
    Failed(String),
}

impl std::fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(why) => write!(f, "refused by the peer: {why}"),
            Self::Unauthenticated(why) => write!(f, "CURVE: {why}"),
            Self::NotAllowed(key) => {
                write!(
                    f,
                    "CURVE: the client key {key} (a fingerprint) is not on the allow-list"
                )
            }
            Self::Failed(why) => f.write_str(why),
        }
    }
}

/// `Refused`, with its reason, when `body` is an ERROR command.
pub(super) fn refused_by_peer(body: &[u8]) -> Result<(), HandshakeError> {
    match parse_error(body) {
        Some(reason) => Err(HandshakeError::Refused(reason)),
        None => Ok(()),
    }
}

#[cfg(test)]
#[path = "zmtp_tests.rs"]
mod tests;
