//! CURVE (CurveZMQ, ZeroMQ RFC 26; the ZMTP 3 mechanism of RFC 23 §"The CURVE Security
//! Mechanism"): the handshake of a bound socket (the CURVE server: ROUTER, PULL) and of a
//! connecting one (the CURVE client: DEALER, PUSH), and the MESSAGE boxes every frame travels
//! in afterwards. Byte for byte as libzmq 4.3 writes them, so a pyzmq/libzmq peer with
//! `curve_server` or `curve_serverkey` set talks to kvx, both ways (`docs/spec/zmq.md` §9).
//!
//! The handshake, with `C`/`c` the client's long-term public/secret key, `S`/`s` the server's,
//! and `C'`/`c'`, `S'`/`s'` keys made for one connection (Box[x](A->B) is NaCl's
//! `crypto_box` from A's secret key to B's public key; nonces are a 16- or 8-byte prefix and
//! an 8-byte big-endian counter, or 16 random bytes):
//!
//! | command | from | body |
//! |---|---|---|
//! | HELLO (200 bytes) | client | version 1.0, 72 zero bytes, `C'`, nonce, Box[64 zeros](C'->S), prefix `CurveZMQHELLO---` |
//! | WELCOME (168) | server | 16-byte nonce, Box[S' + cookie](S->C'), prefix `WELCOME-`; cookie = 16-byte nonce + secretbox[C' + s'] under a key made for this connection, prefix `COOKIE--` |
//! | INITIATE | client | cookie, nonce, Box[C + vouch + metadata](C'->S'), prefix `CurveZMQINITIATE`; vouch = 16-byte nonce + Box[C' + S](C->S'), prefix `VOUCH---` |
//! | READY | server | nonce, Box[metadata](S'->C'), prefix `CurveZMQREADY---` |
//! | MESSAGE | both | nonce, Box[flags + frame](C'<->S'), prefix `CurveZMQMESSAGEC` from the client, `CurveZMQMESSAGES` from the server |
//!
//! Every short nonce a side sends is one more than its last (the client's HELLO is 1, its
//! INITIATE 2, its first MESSAGE 3; the server's READY is 1), and a side refuses any nonce not
//! above the last it received, so a recorded box cannot be replayed. Each MESSAGE command is
//! one ZMTP frame with no flags of its own (libzmq marks it neither MORE nor COMMAND); the
//! frame's MORE bit travels inside the box, in its first byte.
//!
//! What a bound socket checks, in order: the greeting names CURVE; HELLO opens with its
//! secret key (the client knows its public key); the cookie in INITIATE opens and holds this
//! connection's `C'` and `s'`; INITIATE's box opens; the vouch opens with the client's
//! long-term key `C` and holds `C'` and this server's `S` (the client holds `c`); `C` is on the
//! allow-list. Any failure ends the connection (`ZmqStats::curve_refused`), after an ERROR
//! command where the peer can read one. Nothing secret reaches a log: keys appear at most as
//! `fingerprint`, the first 8 Z85 characters of a public key.
//!
//! The crypto is RustCrypto's `crypto_box` (`SalsaBox`: X25519 and XSalsa20-Poly1305, NaCl's
//! `crypto_box`) and `crypto_secretbox` (`XSalsa20Poly1305`, NaCl's `crypto_secretbox`, for the
//! cookie): pure Rust, so no libsodium to find and link, the same primitives libzmq uses (with
//! libsodium or tweetnacl), constant-time tag checks, and secret keys zeroed on drop. Boxes are
//! written as NaCl's "easy" form, the 16-byte tag before the ciphertext, as libzmq puts them on
//! the wire.

use std::io;

use bytes::Bytes;
use crypto_box::aead::OsRng;
use crypto_box::SecretKey;
use crypto_secretbox::{KeyInit, XSalsa20Poly1305};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::curve_box::KEY_BYTES;
use super::curve_box::{nonce, open, random, salsa, seal, short_nonce, CurveRx, CurveTx, TAG};
use super::curve_keys::{fingerprint, AllowList, CurveKeyPair};
use super::frames::command_frame;
use super::zmtp::{self, FrameReader, HandshakeError};

// ---------------------------------------------------------------------------------------
// The handshake

fn refused(why: impl Into<String>) -> HandshakeError {
    HandshakeError::Unauthenticated(why.into())
}

fn failed(e: io::Error) -> HandshakeError {
    HandshakeError::Failed(e.to_string())
}

/// The properties of a metadata block (`name-len name value-len value`…), as in READY.
fn properties(metadata: &[u8]) -> Result<Vec<(String, Bytes)>, HandshakeError> {
    let mut body = b"\x05READY".to_vec();
    body.extend_from_slice(metadata);
    zmtp::parse_ready(&body).map_err(HandshakeError::Failed)
}

/// A client's handshake (after the greetings): HELLO, WELCOME, INITIATE, READY. The peer's
/// READY properties and the sending half; `reader` opens the peer's boxes from here on.
pub(super) async fn client<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    keys: &CurveKeyPair,
    server: &[u8; KEY_BYTES],
    metadata: &[u8],
) -> Result<(Vec<(String, Bytes)>, CurveTx), HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let transient = SecretKey::generate(&mut OsRng);
    let transient_public = transient.public_key().to_bytes();
    // HELLO: nonce 1.
    let to_server = salsa(server, &transient);
    let mut hello = b"\x05HELLO\x01\x00".to_vec();
    hello.extend_from_slice(&[0u8; 72]);
    hello.extend_from_slice(&transient_public);
    let short = 1u64.to_be_bytes();
    hello.extend_from_slice(&short);
    seal(
        &to_server,
        &nonce(b"CurveZMQHELLO---", &short),
        &[0u8; 64],
        &mut hello,
    );
    debug_assert_eq!(hello.len(), 200);
    writer
        .write_all(&command_frame(&hello))
        .await
        .map_err(failed)?;

    // WELCOME
    let welcome = reader.handshake_command().await.map_err(failed)?;
    zmtp::refused_by_peer(&welcome)?;
    if welcome.len() != 168 || !welcome.starts_with(b"\x07WELCOME") {
        return Err(HandshakeError::Failed(
            "expected a WELCOME command (168 bytes)".into(),
        ));
    }
    let plain = open(
        &to_server,
        &nonce(b"WELCOME-", &welcome[8..24]),
        &welcome[24..],
    )
    .ok_or_else(|| {
        refused(format!(
            "the server's WELCOME does not open: it does not hold the secret key of the \
             server key configured here ({})",
            fingerprint(server)
        ))
    })?;
    let server_transient: [u8; KEY_BYTES] = plain[..32].try_into().expect("invariant: 128 bytes");
    let cookie = &plain[32..128];
    let session = salsa(&server_transient, &transient);

    // INITIATE: nonce 2, with the vouch made by the long-term key.
    let vouch_nonce: [u8; 16] = random();
    let mut vouch_plain = transient_public.to_vec();
    vouch_plain.extend_from_slice(server);
    let mut initiate_plain = keys.public().to_vec();
    initiate_plain.extend_from_slice(&vouch_nonce);
    seal(
        &salsa(&server_transient, keys.secret()),
        &nonce(b"VOUCH---", &vouch_nonce),
        &vouch_plain,
        &mut initiate_plain,
    );
    initiate_plain.extend_from_slice(metadata);
    let short = 2u64.to_be_bytes();
    let mut initiate = b"\x08INITIATE".to_vec();
    initiate.extend_from_slice(cookie);
    initiate.extend_from_slice(&short);
    seal(
        &session,
        &nonce(b"CurveZMQINITIATE", &short),
        &initiate_plain,
        &mut initiate,
    );
    writer
        .write_all(&command_frame(&initiate))
        .await
        .map_err(failed)?;

    // READY
    let ready = reader.handshake_command().await.map_err(failed)?;
    zmtp::refused_by_peer(&ready)?;
    if ready.len() < 14 + TAG || !ready.starts_with(b"\x05READY") {
        return Err(HandshakeError::Failed("expected a READY command".into()));
    }
    let short = &ready[6..14];
    let metadata = open(&session, &nonce(b"CurveZMQREADY---", short), &ready[14..])
        .ok_or_else(|| refused("the server's READY does not open"))?;
    let props = properties(&metadata)?;
    let last = short_nonce(short);
    reader.set_curve(CurveRx {
        // The same key again (`SalsaBox` is not `Clone`): one X25519 per direction.
        cipher: salsa(&server_transient, &transient),
        prefix: b"CurveZMQMESSAGES",
        last,
    });
    Ok((
        props,
        CurveTx {
            cipher: session,
            prefix: b"CurveZMQMESSAGEC",
            next: 3,
        },
    ))
}

/// What a server's handshake established: the client's READY properties (from INITIATE), its
/// long-term public key, and the sending half, whose first box is the READY.
pub(super) struct Accepted {
    pub(super) props: Vec<(String, Bytes)>,
    pub(super) client_key: [u8; KEY_BYTES],
    pub(super) tx: CurveTx,
}

/// A server's handshake (after the greetings): HELLO, WELCOME, INITIATE, up to the allow-list
/// check. The caller answers with `ready` (or refuses with an ERROR); `reader` opens the
/// client's boxes from here on.
pub(super) async fn server<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    keys: &CurveKeyPair,
    allowed: &AllowList,
) -> Result<Accepted, HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // HELLO
    let hello = reader.handshake_command().await.map_err(failed)?;
    if hello.len() != 200 || !hello.starts_with(b"\x05HELLO") {
        return Err(refused("expected a CURVE HELLO command (200 bytes)"));
    }
    if hello[6..8] != [1, 0] {
        return Err(refused(format!(
            "CurveZMQ version {}.{} (1.0 here)",
            hello[6], hello[7]
        )));
    }
    let client_transient: [u8; KEY_BYTES] = hello[80..112]
        .try_into()
        .expect("invariant: HELLO is 200 bytes");
    let hello_nonce = short_nonce(&hello[112..120]);
    let from_client = salsa(&client_transient, keys.secret());
    let signature = open(
        &from_client,
        &nonce(b"CurveZMQHELLO---", &hello[112..120]),
        &hello[120..200],
    );
    if signature.is_none_or(|s| s.iter().any(|&b| b != 0)) {
        return Err(refused(
            "the client's HELLO does not open: it was made for another server key",
        ));
    }

    // WELCOME, with the cookie: C' and s' under a key that lives only as long as this
    // handshake.
    let transient = SecretKey::generate(&mut OsRng);
    let cookie_key = XSalsa20Poly1305::new(&random::<32>().into());
    let cookie_nonce: [u8; 16] = random();
    let mut cookie_plain = client_transient.to_vec();
    cookie_plain.extend_from_slice(&transient.to_bytes());
    let mut welcome_plain = transient.public_key().to_bytes().to_vec();
    welcome_plain.extend_from_slice(&cookie_nonce);
    seal(
        &cookie_key,
        &nonce(b"COOKIE--", &cookie_nonce),
        &cookie_plain,
        &mut welcome_plain,
    );
    cookie_plain.fill(0);
    let welcome_nonce: [u8; 16] = random();
    let mut welcome = b"\x07WELCOME".to_vec();
    welcome.extend_from_slice(&welcome_nonce);
    seal(
        &from_client,
        &nonce(b"WELCOME-", &welcome_nonce),
        &welcome_plain,
        &mut welcome,
    );
    debug_assert_eq!(welcome.len(), 168);
    writer
        .write_all(&command_frame(&welcome))
        .await
        .map_err(failed)?;

    // INITIATE
    let initiate = reader.handshake_command().await.map_err(failed)?;
    if initiate.len() < 257 || !initiate.starts_with(b"\x08INITIATE") {
        return Err(refused("expected a CURVE INITIATE command"));
    }
    let cookie = open(
        &cookie_key,
        &nonce(b"COOKIE--", &initiate[9..25]),
        &initiate[25..105],
    )
    .ok_or_else(|| refused("the INITIATE cookie does not open"))?;
    if cookie[..32] != client_transient || cookie[32..] != transient.to_bytes() {
        return Err(refused("the INITIATE cookie is not this connection's"));
    }
    let short = &initiate[105..113];
    let initiate_nonce = short_nonce(short);
    if initiate_nonce <= hello_nonce {
        return Err(refused("an INITIATE nonce not above HELLO's"));
    }
    let session = salsa(&client_transient, &transient);
    let plain = open(
        &session,
        &nonce(b"CurveZMQINITIATE", short),
        &initiate[113..],
    )
    .ok_or_else(|| refused("the INITIATE box does not open"))?;
    // `plain` is at least 128 bytes: INITIATE is at least 257.
    let client_key: [u8; KEY_BYTES] = plain[..32]
        .try_into()
        .expect("invariant: INITIATE holds at least 128 bytes");
    let vouch = open(
        &salsa(&client_key, &transient),
        &nonce(b"VOUCH---", &plain[32..48]),
        &plain[48..128],
    )
    .ok_or_else(|| refused("the vouch does not open: the client does not hold its key"))?;
    if vouch[..32] != client_transient || vouch[32..] != keys.public() {
        return Err(refused(
            "the vouch names another connection key or server key",
        ));
    }
    let props = properties(&plain[128..])?;
    if !allowed.contains(&client_key) {
        return Err(HandshakeError::NotAllowed(fingerprint(&client_key)));
    }
    reader.set_curve(CurveRx {
        cipher: salsa(&client_transient, &transient),
        prefix: b"CurveZMQMESSAGEC",
        last: initiate_nonce,
    });
    Ok(Accepted {
        props,
        client_key,
        tx: CurveTx {
            cipher: session,
            prefix: b"CurveZMQMESSAGES",
            next: 1,
        },
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{DuplexStream, ReadHalf, WriteHalf};

    use super::*;
    use crate::zmq::frames::error_command;
    use crate::zmq::handshake::{handshake, handshake_server, Handshaken};
    use crate::zmq::zmtp::{Incoming, ReadLimits, Sealer};

    type Reader = FrameReader<ReadHalf<DuplexStream>>;
    type Writer = WriteHalf<DuplexStream>;

    const BOUND: Duration = Duration::from_secs(10);

    fn ends() -> ((Reader, Writer), (Reader, Writer)) {
        let limits = ReadLimits {
            message_max_bytes: 1 << 20,
            refuse_above_bytes: 16 << 20,
            message_timeout: BOUND,
        };
        let (a, b) = tokio::io::duplex(1 << 20);
        let (ar, aw) = tokio::io::split(a);
        let (br, bw) = tokio::io::split(b);
        (
            (FrameReader::new(ar, limits), aw),
            (FrameReader::new(br, limits), bw),
        )
    }

    /// A ROUTER's handshake answered with READY (or, refused, with an ERROR), against a
    /// DEALER's; both results, and both ends for what follows.
    async fn connect(
        server: ServerCurveOwned,
        client: Option<(CurveKeyPair, [u8; KEY_BYTES])>,
    ) -> (
        Result<Handshaken, HandshakeError>,
        Result<Sealer, HandshakeError>,
        (Reader, Writer),
        (Reader, Writer),
    ) {
        let ((mut sr, mut sw), (mut cr, mut cw)) = ends();
        let serving = async {
            let curve = server.as_ref().map(|(k, a)| (k, a));
            let got = handshake_server(&mut sr, &mut sw, "ROUTER", &["DEALER"], curve).await;
            match got {
                Ok(mut h) => {
                    sw.write_all(&h.sealer.ready("ROUTER", None))
                        .await
                        .expect("write");
                    Ok(h)
                }
                Err(e) => {
                    sw.write_all(&error_command(&e.to_string()))
                        .await
                        .expect("write");
                    Err(e)
                }
            }
        };
        let connecting = async {
            let curve = client.as_ref().map(|(k, s)| (k, s));
            handshake(
                &mut cr,
                &mut cw,
                "DEALER",
                Some(b"s0-to-r0"),
                None,
                &["ROUTER"],
                curve,
            )
            .await
            .map(|(props, sealer)| {
                assert!(props
                    .iter()
                    .any(|(k, v)| k == "Socket-Type" && v == "ROUTER"));
                sealer
            })
        };
        let (s, c) = tokio::time::timeout(BOUND, async { tokio::join!(serving, connecting) })
            .await
            .expect("both handshakes end");
        (s, c, (sr, sw), (cr, cw))
    }

    type ServerCurveOwned = Option<(CurveKeyPair, AllowList)>;

    async fn next(reader: &mut Reader) -> io::Result<Incoming> {
        tokio::time::timeout(BOUND, reader.next())
            .await
            .expect("bounded")
    }

    #[tokio::test]
    async fn handshake_and_messages_both_ways() {
        let (server, client) = (CurveKeyPair::generate(), CurveKeyPair::generate());
        let allowed = AllowList::new([client.public()]);
        let (s, c, (mut sr, mut sw), (mut cr, mut cw)) = connect(
            Some((server.clone(), allowed)),
            Some((client.clone(), server.public())),
        )
        .await;
        let mut s = s.expect("the server accepts");
        let mut c = c.expect("the client completes");
        assert_eq!(s.client_key, Some(client.public()), "the proven key");
        assert!(s
            .props
            .iter()
            .any(|(k, v)| k == "Identity" && v == "s0-to-r0"));

        let mut out = Vec::new();
        c.message(&[b"", b"request"], &mut out);
        c.message(&[b"", &[7u8; 300]], &mut out);
        assert!(
            !out.windows(7).any(|w| w == b"request"),
            "nothing in the clear"
        );
        cw.write_all(&out).await.expect("write");
        assert_eq!(
            next(&mut sr).await.expect("read"),
            Incoming::Message(vec![Bytes::new(), Bytes::from_static(b"request")])
        );
        assert_eq!(
            next(&mut sr).await.expect("read"),
            Incoming::Message(vec![Bytes::new(), Bytes::from(vec![7u8; 300])])
        );
        let mut out = Vec::new();
        s.sealer.message(&[b"", b"reply"], &mut out);
        sw.write_all(&out).await.expect("write");
        assert_eq!(
            next(&mut cr).await.expect("read"),
            Incoming::Message(vec![Bytes::new(), Bytes::from_static(b"reply")])
        );
    }

    #[tokio::test]
    async fn a_client_key_off_the_allow_list_is_refused() {
        let (server, client) = (CurveKeyPair::generate(), CurveKeyPair::generate());
        let others = AllowList::new([CurveKeyPair::generate().public()]);
        let (s, c, ..) = connect(
            Some((server.clone(), others)),
            Some((client.clone(), server.public())),
        )
        .await;
        assert_eq!(
            s.expect_err("refused"),
            HandshakeError::NotAllowed(fingerprint(&client.public()))
        );
        assert!(
            matches!(c, Err(HandshakeError::Refused(ref why)) if why.contains("allow-list")),
            "{c:?}"
        );
    }

    #[tokio::test]
    async fn a_client_with_the_wrong_server_key_is_refused() {
        let (server, client) = (CurveKeyPair::generate(), CurveKeyPair::generate());
        let allowed = AllowList::new([client.public()]);
        let wrong = CurveKeyPair::generate().public();
        let (s, c, ..) = connect(Some((server, allowed)), Some((client, wrong))).await;
        assert!(
            matches!(s, Err(HandshakeError::Unauthenticated(ref why)) if why.contains("HELLO")),
            "{s:?}"
        );
        assert!(matches!(c, Err(HandshakeError::Refused(_))), "{c:?}");
    }

    #[tokio::test]
    async fn null_against_curve_is_refused_both_ways() {
        let (server, client) = (CurveKeyPair::generate(), CurveKeyPair::generate());
        let allowed = AllowList::new([client.public()]);
        let (s, c, ..) = connect(Some((server.clone(), allowed)), None).await;
        assert!(
            matches!(s, Err(HandshakeError::Unauthenticated(ref why)) if why.contains("NULL")),
            "{s:?}"
        );
        assert!(
            matches!(c, Err(HandshakeError::Unauthenticated(_))),
            "{c:?}"
        );
        let (s, c, ..) = connect(None, Some((client, server.public()))).await;
        assert!(
            matches!(s, Err(HandshakeError::Unauthenticated(_))),
            "{s:?}"
        );
        assert!(
            matches!(c, Err(HandshakeError::Unauthenticated(ref why)) if why.contains("NULL")),
            "{c:?}"
        );
    }

    /// A MESSAGE box changed in flight, or sent twice, ends the connection.
    #[tokio::test]
    async fn a_tampered_or_replayed_box_is_refused() {
        let (server, client) = (CurveKeyPair::generate(), CurveKeyPair::generate());
        let allowed = AllowList::new([client.public()]);
        for tamper in [true, false] {
            let (s, c, (mut sr, _sw), (_cr, mut cw)) = connect(
                Some((server.clone(), allowed.clone())),
                Some((client.clone(), server.public())),
            )
            .await;
            s.expect("accepted");
            let mut c = c.expect("connected");
            let mut one = Vec::new();
            c.message(&[b"payload"], &mut one);
            let mut stream = one.clone();
            if tamper {
                let last = stream.len() - 1;
                stream[last] ^= 0x01;
            } else {
                stream.extend_from_slice(&one);
                cw.write_all(&stream[..one.len()]).await.expect("write");
                assert_eq!(
                    next(&mut sr).await.expect("the first copy"),
                    Incoming::Message(vec![Bytes::from_static(b"payload")])
                );
                stream.drain(..one.len());
            }
            cw.write_all(&stream).await.expect("write");
            let err = next(&mut sr).await.expect_err("refused");
            assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        }
    }
}
