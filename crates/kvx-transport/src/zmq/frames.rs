//! ZMTP 3 frames as kvx writes them (RFC 23): the flags byte, short and long lengths, a
//! multipart message, a command frame, the ERROR command, and the heartbeat commands PING and
//! PONG (RFC 37, ZMTP 3.1). The bottom of the ZMQ layer:
//! it needs nothing of its own, and `zmtp.rs` (which reads frames), `curve_box.rs` (which
//! writes MESSAGE boxes as frames) and the sockets all write through it.

/// A frame's flags: more frames of this message follow; an 8-byte length; a command.
pub(super) const MORE: u8 = 0x01;
pub(super) const LONG: u8 = 0x02;
pub(super) const COMMAND: u8 = 0x04;

/// Appends `frames` as one message to `out`: MORE on all but the last, long frames from 256
/// bytes, as libzmq frames them.
pub(super) fn encode_message(frames: &[&[u8]], out: &mut Vec<u8>) {
    for (i, frame) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { MORE } else { 0 };
        if frame.len() < 256 {
            out.extend_from_slice(&[more, frame.len() as u8]);
        } else {
            out.push(more | LONG);
            out.extend_from_slice(&(frame.len() as u64).to_be_bytes());
        }
        out.extend_from_slice(frame);
    }
}

/// An ERROR command (RFC 23: `command-size %d5 "ERROR" error-reason`), which a server sends
/// instead of its READY to refuse the peer, with `reason` (cut to the 255 bytes the reason
/// may have, at a character boundary).
pub(super) fn error_command(reason: &str) -> Vec<u8> {
    let mut cut = reason.len().min(255);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    let reason = &reason.as_bytes()[..cut];
    let mut body = Vec::with_capacity(reason.len() + 7);
    body.push(5);
    body.extend_from_slice(b"ERROR");
    body.push(reason.len() as u8);
    body.extend_from_slice(reason);
    command_frame(&body)
}

/// `body` as one command frame: short below 256 bytes, long from there.
pub(super) fn command_frame(body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(body.len() + 9);
    if body.len() < 256 {
        frame.extend_from_slice(&[COMMAND, body.len() as u8]);
    } else {
        frame.push(COMMAND | LONG);
        frame.extend_from_slice(&(body.len() as u64).to_be_bytes());
    }
    frame.extend_from_slice(body);
    frame
}

/// The READY property by which a kvx socket says it takes part in heartbeats: a DEALER that
/// it sends PING every so often, a ROUTER that it answers each PING with PONG. Each end holds
/// its peer to a silence deadline only where the peer announced it (`docs/spec/zmq.md` §5),
/// so a libzmq peer, which announces nothing, is never cut off for keeping quiet.
pub(super) const HEARTBEAT_PROPERTY: &[u8] = b"X-Kvx-Heartbeat";

/// The READY property in which a kvx DEALER or ROUTER announces its process's epoch, 16 hex
/// digits (`docs/spec/protocol.md` §Restarts and epochs): the peer then knows when it talks to
/// a new incarnation.
pub(super) const EPOCH_PROPERTY: &[u8] = b"X-Kvx-Epoch";

/// The most context bytes a PING carries (RFC 37).
pub(super) const PING_CONTEXT_MAX: usize = 16;

/// A PING command body (`%d4 "PING" ping-ttl ping-context`) with no context; `ttl` in
/// tenths of a second (how long the peer may wait for traffic before presuming this end
/// dead; informative for kvx, which holds its peers to its own deadline).
pub(super) fn ping_body(ttl: std::time::Duration) -> Vec<u8> {
    let tenths = u16::try_from(ttl.as_millis() / 100).unwrap_or(u16::MAX);
    let mut body = b"\x04PING".to_vec();
    body.extend_from_slice(&tenths.to_be_bytes());
    body
}

/// The PONG command body answering a PING with `context`.
pub(super) fn pong_body(context: &[u8]) -> Vec<u8> {
    let mut body = b"\x04PONG".to_vec();
    body.extend_from_slice(&context[..context.len().min(PING_CONTEXT_MAX)]);
    body
}

/// A heartbeat command, as `parse_heartbeat` reads one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Heartbeat {
    /// PING, with the context to send back.
    Ping(bytes::Bytes),
    Pong,
}

/// The heartbeat command `body` is, if it is one (a PING's context longer than 16 bytes is
/// cut to 16).
pub(super) fn parse_heartbeat(body: &[u8]) -> Option<Heartbeat> {
    if let Some(rest) = body.strip_prefix(b"\x04PING") {
        let context = rest.get(2..).unwrap_or_default();
        let context = &context[..context.len().min(PING_CONTEXT_MAX)];
        return Some(Heartbeat::Ping(bytes::Bytes::copy_from_slice(context)));
    }
    body.starts_with(b"\x04PONG").then_some(Heartbeat::Pong)
}
