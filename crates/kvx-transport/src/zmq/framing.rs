//! How kvx lays its payloads into ZMQ multipart messages, and which incoming shapes it
//! accepts. Pure functions over frames, so every rule is unit-tested without sockets
//! (`docs/spec/zmq.md` §2).
//!
//! LMCache's alloc channel is the REQ/REP envelope: the DEALER sends `["", payload]`, the
//! ROUTER sees `[identity, "", payload]` and answers `[identity, "", reply]`. LMCache reads
//! `frames[-1]` as the payload, so a missing delimiter is tolerated; kvx accepts exactly that
//! tolerance and nothing looser. Anything else (a non-empty delimiter, extra envelope frames)
//! is not something an LMCache or kvx peer sends, so it is dropped rather than guessed at.

use bytes::Bytes;

/// Why an incoming message was not passed on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Reject {
    #[error("a frame of {len} bytes exceeds the {max}-byte limit")]
    Oversize { len: usize, max: usize },
    #[error("malformed multipart message: {0}")]
    Malformed(&'static str),
}

/// Refuses the message if any frame is larger than `max`. Checked over every frame, not just
/// the payload, so that no oversize frame is ever handed on in any position.
fn check_sizes(frames: &[Bytes], max: usize) -> Result<(), Reject> {
    match frames.iter().map(Bytes::len).find(|&len| len > max) {
        Some(len) => Err(Reject::Oversize { len, max }),
        None => Ok(()),
    }
}

/// The payload of `[("")?, payload]`: the envelope after the routing identity on a ROUTER,
/// or a whole reply on a DEALER.
fn enveloped(frames: &[Bytes]) -> Result<Bytes, Reject> {
    match frames {
        [payload] => Ok(payload.clone()),
        [delimiter, payload] if delimiter.is_empty() => Ok(payload.clone()),
        [_, _] => Err(Reject::Malformed("the delimiter frame is not empty")),
        [] => Err(Reject::Malformed("no payload frame")),
        _ => Err(Reject::Malformed("more than one frame before the payload")),
    }
}

/// The payload of an incoming `["", payload]` (or `[payload]`): a request on a ROUTER (its
/// routing identity comes from the connection, not a frame) and a reply on a DEALER alike.
pub(crate) fn enveloped_in(frames: &[Bytes], max: usize) -> Result<Bytes, Reject> {
    check_sizes(frames, max)?;
    enveloped(frames)
}

/// A PULL's incoming notice: exactly one frame (LMCache's PUSH sends `msgpack(ProxyNotif)`
/// alone).
pub(crate) fn notice_in(frames: &[Bytes], max: usize) -> Result<Bytes, Reject> {
    check_sizes(frames, max)?;
    match frames {
        [payload] => Ok(payload.clone()),
        _ => Err(Reject::Malformed("a notice must be exactly one frame")),
    }
}

/// What a DEALER sends (as LMCache's sender does) and a ROUTER puts on the wire to the peer's
/// connection (the identity frame of ZMQ's model only picks the connection): `["", payload]`.
pub(crate) fn enveloped_out(payload: &[u8]) -> [&[u8]; 2] {
    [b"", payload]
}

/// What a PUSH sends: the payload as the only frame.
pub(crate) fn notice_out(payload: &[u8]) -> [&[u8]; 1] {
    [payload]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(frames: &[&'static [u8]]) -> Vec<Bytes> {
        frames.iter().map(|f| Bytes::from_static(f)).collect()
    }

    #[test]
    fn router_accepts_the_lmcache_envelope_and_a_missing_delimiter() {
        let got = enveloped_in(&frames(&[b"", b"payload"]), 64);
        assert_eq!(got, Ok(Bytes::from_static(b"payload")));
        let got = enveloped_in(&frames(&[b"payload"]), 64);
        assert_eq!(got, Ok(Bytes::from_static(b"payload")));
        // An empty payload is still a payload: what it means is the codec's business.
        let got = enveloped_in(&frames(&[b"", b""]), 64);
        assert_eq!(got, Ok(Bytes::new()));
    }

    #[test]
    fn router_rejects_other_shapes() {
        assert!(matches!(
            enveloped_in(&frames(&[]), 64),
            Err(Reject::Malformed(_))
        ));
        assert!(matches!(
            enveloped_in(&frames(&[b"x", b"payload"]), 64),
            Err(Reject::Malformed(_))
        ));
        assert!(matches!(
            enveloped_in(&frames(&[b"", b"", b"payload"]), 64),
            Err(Reject::Malformed(_))
        ));
    }

    #[test]
    fn every_frame_is_held_to_the_limit() {
        let big: &'static [u8] = &[7u8; 65];
        assert_eq!(
            enveloped_in(&frames(&[b"", big]), 64),
            Err(Reject::Oversize { len: 65, max: 64 })
        );
        assert_eq!(
            enveloped_in(&frames(&[big, b"payload"]), 64),
            Err(Reject::Oversize { len: 65, max: 64 })
        );
        assert_eq!(
            enveloped_in(&frames(&[b"", big]), 64),
            Err(Reject::Oversize { len: 65, max: 64 })
        );
        assert_eq!(
            notice_in(&frames(&[big]), 64),
            Err(Reject::Oversize { len: 65, max: 64 })
        );
        // Exactly the limit passes.
        let edge: &'static [u8] = &[7u8; 64];
        assert_eq!(
            enveloped_in(&frames(&[b"", edge]), 64),
            Ok(Bytes::from_static(edge))
        );
    }

    #[test]
    fn dealer_takes_the_payload_after_the_delimiter() {
        assert_eq!(
            enveloped_in(&frames(&[b"", b"r"]), 64),
            Ok(Bytes::from_static(b"r"))
        );
        assert_eq!(
            enveloped_in(&frames(&[b"r"]), 64),
            Ok(Bytes::from_static(b"r"))
        );
        assert!(matches!(
            enveloped_in(&frames(&[b"a", b"r"]), 64),
            Err(Reject::Malformed(_))
        ));
    }

    #[test]
    fn notices_are_single_frames() {
        assert_eq!(
            notice_in(&frames(&[b"n"]), 64),
            Ok(Bytes::from_static(b"n"))
        );
        assert!(matches!(
            notice_in(&frames(&[b"", b"n"]), 64),
            Err(Reject::Malformed(_))
        ));
    }

    #[test]
    fn outgoing_shapes() {
        assert_eq!(enveloped_out(b"p"), [&b""[..], b"p"]);
        assert_eq!(notice_out(b"p"), [&b"p"[..]]);
    }
}
