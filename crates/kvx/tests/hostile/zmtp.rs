//! A raw ZMTP 3.0 peer over `std::net::TcpStream`, written from the spec (RFC 23, NULL
//! mechanism) rather than from kvx's code, so that it can say anything a hostile peer would:
//! any greeting, any READY (socket type, identity), frames short or long, MORE set or not,
//! and plain bytes.
//!
//! Every read is bounded by a deadline; nothing here waits without one.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Frame flags (RFC 23 §2.3.4).
pub const MORE: u8 = 0x01;
pub const LONG: u8 = 0x02;
pub const COMMAND: u8 = 0x04;

/// The longest any helper here waits for one thing.
pub const WAIT: Duration = Duration::from_secs(5);

/// A ZMTP 3.0 greeting: signature `ff 00…00 7f`, version 3.0, mechanism NULL, as-server 0,
/// filler.
pub fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// One frame: short (1-byte length) below 256 bytes, long (8-byte length) from 256.
pub fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 9);
    if body.len() < 256 {
        out.extend_from_slice(&[flags & !LONG, body.len() as u8]);
    } else {
        out.push(flags | LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    }
    out.extend_from_slice(body);
    out
}

/// The header alone of a long frame announcing `len` bytes.
pub fn long_header(flags: u8, len: u64) -> Vec<u8> {
    let mut out = vec![flags | LONG];
    out.extend_from_slice(&len.to_be_bytes());
    out
}

/// A multipart message: MORE on every frame but the last.
pub fn message(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, body) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { MORE } else { 0 };
        out.extend_from_slice(&frame(more, body));
    }
    out
}

/// The body of a READY command: `Socket-Type`, then `Identity` when given (libzmq's order).
pub fn ready_body(socket_type: &[u8], identity: Option<&[u8]>) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    let mut property = |name: &[u8], value: &[u8]| {
        body.push(name.len() as u8);
        body.extend_from_slice(name);
        body.extend_from_slice(&(value.len() as u32).to_be_bytes());
        body.extend_from_slice(value);
    };
    property(b"Socket-Type", socket_type);
    if let Some(identity) = identity {
        property(b"Identity", identity);
    }
    body
}

/// Greeting and READY, as a peer of type `socket_type` opens a connection.
pub fn hello(socket_type: &[u8], identity: Option<&[u8]>) -> Vec<u8> {
    let mut out = greeting().to_vec();
    out.extend_from_slice(&frame(COMMAND, &ready_body(socket_type, identity)));
    out
}

/// What reading found.
#[derive(Debug, PartialEq, Eq)]
pub enum Heard {
    /// A complete message's frames (commands are skipped).
    Message(Vec<Vec<u8>>),
    /// The server closed the connection (end of stream or reset).
    Closed,
    /// Nothing complete arrived before the deadline.
    Nothing,
}

/// One connection to a kvx server.
#[derive(Debug)]
pub struct Peer {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Peer {
    /// A TCP connection and nothing else.
    pub fn tcp(addr: SocketAddr) -> io::Result<Peer> {
        Peer::from_stream(TcpStream::connect_timeout(&addr, WAIT)?)
    }

    /// A TCP connection to `addr` from the loopback address `source` (127.x.y.z): a peer on
    /// another host, as far as a cap per source address can tell.
    pub fn tcp_from(addr: SocketAddr, source: [u8; 4]) -> io::Result<Peer> {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        socket.bind(&SocketAddr::from((source, 0)).into())?;
        socket.connect_timeout(&addr.into(), WAIT)?;
        Peer::from_stream(socket.into())
    }

    fn from_stream(stream: TcpStream) -> io::Result<Peer> {
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(WAIT))?;
        Ok(Peer {
            stream,
            buf: Vec::new(),
        })
    }

    /// A connection that has sent greeting and READY as `socket_type` (with `identity`) and
    /// read the server's greeting and READY.
    pub fn handshake(
        addr: SocketAddr,
        socket_type: &[u8],
        identity: Option<&[u8]>,
    ) -> io::Result<Peer> {
        let mut peer = Peer::tcp(addr)?;
        peer.send(&hello(socket_type, identity))?;
        peer.read_server_hello()?;
        Ok(peer)
    }

    /// A DEALER, as an LMCache or kvx sender connects to a receiver.
    pub fn dealer(addr: SocketAddr, identity: Option<&[u8]>) -> io::Result<Peer> {
        Peer::handshake(addr, b"DEALER", identity)
    }

    /// A PUSH, as a sender connects to a proxy.
    pub fn push(addr: SocketAddr) -> io::Result<Peer> {
        Peer::handshake(addr, b"PUSH", None)
    }

    /// Reads the server's greeting and READY; an error if they are not what a ZMTP 3 server
    /// sends or do not arrive within `WAIT`.
    pub fn read_server_hello(&mut self) -> io::Result<()> {
        let deadline = Instant::now() + WAIT;
        let g = self.take(64, deadline)?;
        if g[0] != 0xff || g[9] & 1 != 1 || g[10] < 3 {
            return Err(io::Error::other("the server's greeting is not ZMTP 3"));
        }
        let (flags, body) = self.read_frame(deadline)?;
        if flags & COMMAND != 0 && body.starts_with(b"\x05ERROR") {
            // ZMTP 3.1's ERROR in place of READY: the server refuses this peer, with a reason.
            let reason = body.get(7..).unwrap_or_default();
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("refused: {}", String::from_utf8_lossy(reason)),
            ));
        }
        if flags & COMMAND == 0 || !body.starts_with(b"\x05READY") {
            return Err(io::Error::other("the server sent no READY"));
        }
        Ok(())
    }

    /// Connects a DEALER under `identity`, which the server must refuse in the handshake
    /// (an ERROR in place of READY); its reason.
    pub fn refused_dealer(addr: SocketAddr, identity: Option<&[u8]>) -> String {
        match Peer::dealer(addr, identity) {
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => e.to_string(),
            Err(e) => panic!("expected a refusal in the handshake, got {e}"),
            Ok(_) => panic!("expected a refusal in the handshake, got a READY"),
        }
    }

    pub fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)?;
        self.stream.flush()
    }

    /// Sends `["", payload]`, as a DEALER sends a request.
    pub fn send_request(&mut self, payload: &[u8]) -> io::Result<()> {
        self.send(&message(&[b"", payload]))
    }

    /// Sends a request and returns the last frame of the reply (LMCache reads `frames[-1]`).
    pub fn request(&mut self, payload: &[u8]) -> io::Result<Vec<u8>> {
        self.send_request(payload)?;
        match self.recv_within(WAIT) {
            Heard::Message(mut frames) => frames
                .pop()
                .ok_or_else(|| io::Error::other("an empty reply")),
            Heard::Closed => Err(io::ErrorKind::ConnectionAborted.into()),
            Heard::Nothing => Err(io::ErrorKind::TimedOut.into()),
        }
    }

    /// The next message, skipping commands, or what happened instead within `within`.
    pub fn recv_within(&mut self, within: Duration) -> Heard {
        let deadline = Instant::now() + within;
        let mut frames = Vec::new();
        // Bounded: each pass consumes a frame, and the deadline ends a silent stream.
        for _ in 0..10_000 {
            match self.read_frame(deadline) {
                Ok((flags, body)) => {
                    if flags & COMMAND != 0 {
                        continue;
                    }
                    frames.push(body);
                    if flags & MORE == 0 {
                        return Heard::Message(frames);
                    }
                }
                Err(e) if closed(&e) => return Heard::Closed,
                Err(_) => return Heard::Nothing,
            }
        }
        Heard::Nothing
    }

    /// Whether the server closes the connection within `within` (whatever it sends before is
    /// discarded).
    pub fn closed_within(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        self.buf.clear();
        let mut chunk = [0u8; 4096];
        for _ in 0..100_000 {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            if self
                .stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .is_err()
            {
                return true;
            }
            match self.stream.read(&mut chunk) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if closed(&e) => return true,
                Err(_) => return false,
            }
        }
        false
    }

    /// Whether the server has closed the connection by now, without waiting: drains what has
    /// arrived and reports an end of stream or reset.
    pub fn is_closed_now(&mut self) -> bool {
        if self.stream.set_nonblocking(true).is_err() {
            return true;
        }
        let mut chunk = [0u8; 4096];
        let mut verdict = false;
        for _ in 0..64 {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    verdict = true;
                    break;
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    verdict = true;
                    break;
                }
            }
        }
        let _ = self.stream.set_nonblocking(false);
        verdict
    }

    /// One frame: its flags and body.
    fn read_frame(&mut self, deadline: Instant) -> io::Result<(u8, Vec<u8>)> {
        let head = self.take(2, deadline)?;
        let flags = head[0];
        let len = if flags & LONG != 0 {
            let mut rest = vec![head[1]];
            rest.extend_from_slice(&self.take(7, deadline)?);
            u64::from_be_bytes(rest.try_into().expect("8 bytes"))
        } else {
            u64::from(head[1])
        };
        // A test peer never expects anything near this; refuse rather than allocate it.
        if len > 64 << 20 {
            return Err(io::Error::other(format!(
                "a {len}-byte frame from the server"
            )));
        }
        let body = self.take(len as usize, deadline)?;
        Ok((flags, body))
    }

    /// Exactly `n` bytes, or an error at the deadline or end of stream.
    fn take(&mut self, n: usize, deadline: Instant) -> io::Result<Vec<u8>> {
        let mut chunk = [0u8; 8192];
        while self.buf.len() < n {
            let left = deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .ok_or(io::ErrorKind::TimedOut)?;
            self.stream.set_read_timeout(Some(left))?;
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(got) => self.buf.extend_from_slice(&chunk[..got]),
                Err(e) => return Err(e),
            }
        }
        Ok(self.buf.drain(..n).collect())
    }
}

/// Whether an IO error means the other end closed the connection.
fn closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}
