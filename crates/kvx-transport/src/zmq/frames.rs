//! ZMTP 3 frames as kvx writes them (RFC 23): the flags byte, short and long lengths, a
//! multipart message, a command frame, and the ERROR command. The bottom of the ZMQ layer:
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
