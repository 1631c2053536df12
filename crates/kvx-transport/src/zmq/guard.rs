//! The frame-length guard in front of every bound socket (ROUTER and PULL).
//!
//! Why it exists: the `zeromq` 0.7 codec reserves a frame's announced length before reading
//! any of it and has no maximum message size, so a peer that sends the 9-byte header of a
//! 1 TiB frame aborts the whole process ("memory allocation failed"), and nothing in the
//! crate's API reaches in front of the codec. So kvx owns the listening socket: the guard
//! accepts each connection at the public endpoint, connects it to the zeromq socket bound on
//! an internal loopback port, and copies bytes both ways, reading the peer's ZMTP framing as
//! it goes (64-byte greeting, then `flags, length, body` per frame). A frame announced longer
//! than `frame_refuse_bytes` closes that connection before the rest of its length reaches
//! zeromq, so the codec never sees it; every other peer is unaffected. Replies pass back
//! unchanged. The cost is one extra loopback hop each way (`docs/spec/zmq.md` §6 has the
//! measured round trip). Connecting sockets (DEALER, PUSH) talk to the receiver and proxy
//! their operator configured, so they are not guarded.

use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The ZMTP 3 greeting's length: signature, version, mechanism, as-server, filler.
const GREETING_LEN: u64 = 64;
/// Flag bits a ZMTP 3 frame may carry (MORE, LONG, COMMAND); the others are reserved.
const FLAG_BITS: u8 = 0b0000_0111;
const FLAG_LONG: u8 = 0b0000_0010;

/// Where the parser is in the peer's byte stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Position {
    /// Inside the greeting; this many bytes are left.
    Greeting(u64),
    /// At a frame's flags byte.
    Flags,
    /// Inside a frame's length field: bytes left, and the length so far.
    Length { left: u8, value: u64 },
    /// Inside a frame's body; this many bytes are left.
    Body(u64),
}

/// Reads a peer's ZMTP framing byte by byte (headers only; bodies are skipped in one step)
/// and refuses the stream at the first announced frame over the limit.
#[derive(Debug)]
pub(super) struct FrameGate {
    position: Position,
    refuse_above: u64,
}

impl FrameGate {
    pub(super) fn new(refuse_above: u64) -> Self {
        Self {
            position: Position::Greeting(GREETING_LEN),
            refuse_above,
        }
    }

    /// Accounts for `bytes`, the next bytes of the stream; an error means the stream must be
    /// closed before any of `bytes` is passed on.
    pub(super) fn admit(&mut self, mut bytes: &[u8]) -> Result<(), String> {
        while !bytes.is_empty() {
            match self.position {
                Position::Greeting(left) => {
                    let left = skip(&mut bytes, left);
                    self.position = if left > 0 {
                        Position::Greeting(left)
                    } else {
                        Position::Flags
                    };
                }
                Position::Body(left) => {
                    let left = skip(&mut bytes, left);
                    self.position = if left > 0 {
                        Position::Body(left)
                    } else {
                        Position::Flags
                    };
                }
                Position::Flags => {
                    let flags = bytes[0];
                    bytes = &bytes[1..];
                    if flags & !FLAG_BITS != 0 {
                        return Err(format!("reserved ZMTP frame flags set ({flags:#04x})"));
                    }
                    let left = if flags & FLAG_LONG != 0 { 8 } else { 1 };
                    self.position = Position::Length { left, value: 0 };
                }
                Position::Length { left, value } => {
                    let value = (value << 8) | u64::from(bytes[0]);
                    bytes = &bytes[1..];
                    self.position = if left > 1 {
                        Position::Length {
                            left: left - 1,
                            value,
                        }
                    } else if value > self.refuse_above {
                        return Err(format!(
                            "a frame of {value} bytes announced (limit {})",
                            self.refuse_above
                        ));
                    } else if value == 0 {
                        Position::Flags
                    } else {
                        Position::Body(value)
                    };
                }
            }
        }
        Ok(())
    }
}

/// Skips up to `left` bytes of `bytes`; returns how many of `left` remain.
fn skip(bytes: &mut &[u8], left: u64) -> u64 {
    let take = usize::try_from(left).map_or(bytes.len(), |l| l.min(bytes.len()));
    *bytes = &bytes[take..];
    left - take as u64
}

/// A bound guard: its public address and the task accepting connections (abort it to stop).
#[derive(Debug)]
pub(super) struct Guard {
    pub(super) local: SocketAddr,
    pub(super) task: JoinHandle<()>,
}

/// Listens at `public` and passes every accepted connection on to `inner` through a
/// `FrameGate`.
pub(super) async fn bind(
    public: SocketAddr,
    inner: SocketAddr,
    refuse_above: u64,
) -> io::Result<Guard> {
    let listener = TcpListener::bind(public).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((peer, from)) => {
                    tokio::spawn(async move {
                        if let Err(why) = relay(peer, inner, refuse_above).await {
                            tracing::warn!(%from, %why, "ZMTP connection closed by the guard");
                        }
                    });
                }
                Err(e) => {
                    // Out of descriptors, say: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
    Ok(Guard { local, task })
}

/// Copies one connection both ways until either side closes or the peer breaks the limit;
/// then both are closed.
async fn relay(peer: TcpStream, inner: SocketAddr, refuse_above: u64) -> Result<(), String> {
    let inside = TcpStream::connect(inner)
        .await
        .map_err(|e| format!("the internal socket refused: {e}"))?;
    for s in [&peer, &inside] {
        let _ = s.set_nodelay(true);
    }
    let (peer_in, peer_out) = peer.into_split();
    let (inside_in, inside_out) = inside.into_split();
    tokio::select! {
        up = inbound(peer_in, inside_out, FrameGate::new(refuse_above)) => up,
        down = outbound(inside_in, peer_out) => down,
    }
}

/// Peer → zeromq, through the gate.
async fn inbound(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut gate: FrameGate,
) -> Result<(), String> {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = from.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Ok(());
        }
        gate.admit(&buf[..n])?;
        to.write_all(&buf[..n]).await.map_err(|e| e.to_string())?;
    }
}

/// zeromq → peer, unchanged.
async fn outbound(mut from: OwnedReadHalf, mut to: OwnedWriteHalf) -> Result<(), String> {
    tokio::io::copy(&mut from, &mut to)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greeting() -> Vec<u8> {
        let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 1];
        g.resize(64, 0);
        g
    }

    #[test]
    fn passes_short_and_long_frames_within_the_limit_in_any_split() {
        let mut stream = greeting();
        stream.extend([0x04, 3, b'a', b'b', b'c']); // a short command
        stream.extend([0x01, 0]); // an empty delimiter, more to come
        stream.extend([0x02, 0, 0, 0, 0, 0, 0, 1, 0]); // a long frame of 256 bytes
        stream.extend([0x55; 256]);
        for split in 1..stream.len() {
            let mut gate = FrameGate::new(256);
            let (a, b) = stream.split_at(split);
            assert_eq!(gate.admit(a), Ok(()), "split at {split}");
            assert_eq!(gate.admit(b), Ok(()), "split at {split}");
            assert_eq!(gate.position, Position::Flags);
        }
    }

    #[test]
    fn refuses_an_announced_frame_over_the_limit_before_its_last_length_byte_passes() {
        let mut stream = greeting();
        stream.extend([0x02, 0, 0, 1, 0, 0, 0, 0, 0]); // 1 TiB announced
        let mut gate = FrameGate::new(1 << 20);
        let (head, last) = stream.split_at(stream.len() - 1);
        assert_eq!(gate.admit(head), Ok(()), "the length is not known yet");
        assert!(gate.admit(last).is_err());
        let mut gate = FrameGate::new(255);
        let mut short = greeting();
        short.extend([0x00, 0xff]);
        assert_eq!(gate.admit(&short), Ok(()), "255 is within a 255 limit");
        let mut gate = FrameGate::new(255);
        let mut long = greeting();
        long.extend([0x02, 0, 0, 0, 0, 0, 0, 1, 0]);
        assert!(gate.admit(&long).is_err(), "256 is over it");
    }

    #[test]
    fn refuses_reserved_flags() {
        let mut stream = greeting();
        stream.push(0x80);
        assert!(FrameGate::new(1024).admit(&stream).is_err());
    }
}
