//! CURVE's boxes (CurveZMQ, ZeroMQ RFC 26): NaCl's `crypto_box` sealing and opening with
//! the nonces CurveZMQ builds, and the two halves of an established connection — `CurveTx`,
//! which writes each frame as a MESSAGE command and the server's READY, and `CurveRx`, which
//! opens MESSAGE commands and refuses replays. The handshake that makes them is `curve.rs`;
//! the frame reader and writer that use them are `zmtp.rs`. Below both: it needs only the
//! frame encoding (`frames.rs`).

use std::fmt;
use std::io;

use bytes::Bytes;
use crypto_box::aead::rand_core::RngCore;
use crypto_box::aead::{AeadInPlace, OsRng};
use crypto_box::{PublicKey, SalsaBox, SecretKey};

use super::frames::{command_frame, LONG};

/// Bytes of a CURVE key, public or secret.
pub const KEY_BYTES: usize = 32;

/// The bytes a MESSAGE command adds to a frame: `\x07MESSAGE`, the 8-byte nonce, the 16-byte
/// tag and the flags byte.
pub(super) const MESSAGE_OVERHEAD: usize = 8 + 8 + 16 + 1;

/// The bytes of a box's authentication tag (Poly1305).
pub(super) const TAG: usize = 16;

/// The flags byte inside a MESSAGE box of a command (RFC 26: bit 1).
pub(super) const COMMAND_INSIDE: u8 = 0x02;

pub(super) fn nonce(prefix: &[u8], tail: &[u8]) -> [u8; 24] {
    debug_assert_eq!(prefix.len() + tail.len(), 24);
    let mut n = [0u8; 24];
    n[..prefix.len()].copy_from_slice(prefix);
    n[prefix.len()..].copy_from_slice(tail);
    n
}

/// Appends Box[`plain`] (tag, then ciphertext) to `out`.
pub(super) fn seal<A: AeadInPlace>(cipher: &A, nonce: &[u8; 24], plain: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0u8; TAG]);
    out.extend_from_slice(plain);
    let tag = cipher
        .encrypt_in_place_detached(
            crypto_box::aead::Nonce::<A>::from_slice(nonce),
            b"",
            &mut out[start + TAG..],
        )
        .expect("invariant: XSalsa20-Poly1305 seals any length without associated data");
    out[start..start + TAG].copy_from_slice(&tag);
}

/// The plaintext of `boxed` (tag, then ciphertext); `None` when it does not authenticate.
pub(super) fn open<A: AeadInPlace>(cipher: &A, nonce: &[u8; 24], boxed: &[u8]) -> Option<Vec<u8>> {
    let (tag, sealed) = (boxed.get(..TAG)?, boxed.get(TAG..)?);
    let mut plain = sealed.to_vec();
    cipher
        .decrypt_in_place_detached(
            crypto_box::aead::Nonce::<A>::from_slice(nonce),
            b"",
            &mut plain,
            crypto_box::aead::Tag::<A>::from_slice(tag),
        )
        .ok()?;
    Some(plain)
}

pub(super) fn salsa(public: &[u8; KEY_BYTES], secret: &SecretKey) -> SalsaBox {
    SalsaBox::new(&PublicKey::from_bytes(*public), secret)
}

pub(super) fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    OsRng.fill_bytes(&mut b);
    b
}

pub(super) fn short_nonce(bytes: &[u8]) -> u64 {
    u64::from_be_bytes(bytes.try_into().expect("invariant: 8 bytes"))
}

/// The sending half of a connection's boxes: the key shared by the two short-term keys and
/// the next short nonce.
pub(super) struct CurveTx {
    pub(super) cipher: SalsaBox,
    pub(super) prefix: &'static [u8; 16],
    pub(super) next: u64,
}

impl fmt::Debug for CurveTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CurveTx")
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

impl CurveTx {
    fn take_nonce(&mut self) -> [u8; 8] {
        let n = self.next;
        // 2^64 boxes are never sent; a wrapped counter would reuse nonces, so it stops there.
        self.next = n.checked_add(1).expect("CURVE nonce space exhausted");
        n.to_be_bytes()
    }

    /// Appends one frame as a MESSAGE command (itself one ZMTP frame without flags): `more`
    /// is the frame's MORE bit, carried inside the box.
    pub(super) fn message(&mut self, more: bool, frame: &[u8], out: &mut Vec<u8>) {
        self.boxed(u8::from(more), frame, out);
    }

    /// Appends one command (PING, PONG) as a MESSAGE command with the command flag inside
    /// the box, as libzmq sends its heartbeats under CURVE.
    pub(super) fn command(&mut self, body: &[u8], out: &mut Vec<u8>) {
        self.boxed(COMMAND_INSIDE, body, out);
    }

    /// One MESSAGE command: `flags` (MORE, or the command flag) and `frame`, in a box.
    fn boxed(&mut self, flags: u8, frame: &[u8], out: &mut Vec<u8>) {
        let len = MESSAGE_OVERHEAD + frame.len();
        if len < 256 {
            out.extend_from_slice(&[0, len as u8]);
        } else {
            out.push(LONG);
            out.extend_from_slice(&(len as u64).to_be_bytes());
        }
        let short = self.take_nonce();
        out.extend_from_slice(b"\x07MESSAGE");
        out.extend_from_slice(&short);
        let start = out.len();
        out.extend_from_slice(&[0u8; TAG]);
        out.push(flags);
        out.extend_from_slice(frame);
        let tag = self
            .cipher
            .encrypt_in_place_detached(
                (&nonce(self.prefix, &short)).into(),
                b"",
                &mut out[start + TAG..],
            )
            .expect("invariant: XSalsa20-Poly1305 seals any length without associated data");
        out[start..start + TAG].copy_from_slice(&tag);
    }

    /// The server's READY command: `metadata` in a box, as one command frame.
    pub(super) fn ready(&mut self, metadata: &[u8]) -> Vec<u8> {
        let short = self.take_nonce();
        let mut body = b"\x05READY".to_vec();
        body.extend_from_slice(&short);
        seal(
            &self.cipher,
            &nonce(b"CurveZMQREADY---", &short),
            metadata,
            &mut body,
        );
        command_frame(&body)
    }
}

/// The receiving half: the shared key and the last short nonce heard.
pub(super) struct CurveRx {
    pub(super) cipher: SalsaBox,
    pub(super) prefix: &'static [u8; 16],
    pub(super) last: u64,
}

impl fmt::Debug for CurveRx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CurveRx")
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

/// Why a MESSAGE command was refused: the connection cannot be trusted past it.
pub(super) fn unauthentic(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, format!("CURVE: {why}"))
}

impl CurveRx {
    /// A MESSAGE command's flags byte and frame; an error (`PermissionDenied`) for anything
    /// else, a nonce not above the last, or a box that does not open.
    pub(super) fn open(&mut self, command: &[u8]) -> io::Result<(u8, Bytes)> {
        if command.len() < MESSAGE_OVERHEAD || !command.starts_with(b"\x07MESSAGE") {
            return Err(unauthentic("a frame that is no MESSAGE command"));
        }
        let short = &command[8..16];
        let n = short_nonce(short);
        if n <= self.last {
            return Err(unauthentic(
                "a MESSAGE nonce not above the last (a replay?)",
            ));
        }
        let plain = open(&self.cipher, &nonce(self.prefix, short), &command[16..])
            .ok_or_else(|| unauthentic("a MESSAGE box that does not authenticate"))?;
        self.last = n;
        let (&flags, frame) = plain.split_first().expect("invariant: the flags byte");
        Ok((flags, Bytes::copy_from_slice(frame)))
    }
}
