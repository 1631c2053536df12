//! The handshake of a connection (RFC 23 with the NULL or CURVE mechanism): the greeting both
//! ways, then READY both ways (NULL) or CURVE's HELLO to READY (`curve.rs`), the peer's socket
//! type checked. What a bound socket learns (`Handshaken`) and how each side then writes
//! (`Sealer`). Above both `zmtp.rs` (greeting, READY, frames) and `curve.rs` (the mechanism).

use std::io;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::curve;
use super::curve_keys::{AllowList, CurveKeyPair, KEY_BYTES};
use super::zmtp::{
    check_greeting, greeting, metadata, parse_ready, ready, refused_by_peer, FrameReader,
    HandshakeError, Sealer, CURVE, NULL,
};
use super::PeerBytes;

/// A CURVE client's keys: its own pair and the server's public key.
pub(super) type ClientCurve<'a> = Option<(&'a CurveKeyPair, &'a [u8; KEY_BYTES])>;

/// A CURVE server's keys: its own pair and the client keys it accepts.
pub(super) type ServerCurve<'a> = Option<(&'a CurveKeyPair, &'a AllowList)>;

/// What a bound socket's handshake established (`handshake_server`).
#[derive(Debug)]
pub(super) struct Handshaken {
    /// The peer's READY properties (under CURVE, from its INITIATE).
    pub(super) props: Vec<(String, Bytes)>,
    /// How this connection writes; its first use is the READY accepting the peer.
    pub(super) sealer: Sealer,
    /// The client's long-term public key, under CURVE.
    pub(super) client_key: Option<[u8; KEY_BYTES]>,
}

/// The handshake of a connecting socket of type `ours` (with `identity` in its READY, for a
/// DEALER, and `epoch`): our greeting and READY out, the peer's checked (greeting, then READY with a
/// `Socket-Type` in `peers`). Under CURVE (`curve` set), the greeting names CURVE and READY
/// is CURVE's handshake (`curve::client`). Returns the peer's READY properties and how to
/// write to it; `Refused` when the peer answered with ERROR. The caller bounds it in time.
pub(super) async fn handshake<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    ours: &str,
    identity: Option<&[u8]>,
    epoch: Option<u64>,
    peers: &[&str],
    curve: ClientCurve<'_>,
) -> Result<(Vec<(String, Bytes)>, Sealer), HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let failed = |e: io::Error| HandshakeError::Failed(e.to_string());
    let Some((keys, server)) = curve else {
        let mut hello = greeting(NULL, false).to_vec();
        hello.extend_from_slice(&ready(ours, identity, epoch));
        writer.write_all(&hello).await.map_err(failed)?;
        let greeting = reader.greeting().await.map_err(failed)?;
        check_greeting(&greeting, NULL)?;
        let props = peer_ready(reader).await?;
        check_socket_type(&props, ours, peers)?;
        return Ok((props, Sealer::Null));
    };
    writer
        .write_all(&greeting(CURVE, false))
        .await
        .map_err(failed)?;
    let greeting = reader.greeting().await.map_err(failed)?;
    check_greeting(&greeting, CURVE)?;
    let (props, tx) = curve::client(
        reader,
        writer,
        keys,
        server,
        &metadata(ours, identity, epoch),
    )
    .await?;
    check_socket_type(&props, ours, peers)?;
    Ok((props, Sealer::Curve(tx)))
}

/// The first half of a bound socket's handshake: our greeting out, then the peer's greeting
/// and READY in and checked, as in `handshake` (under CURVE, `curve::server` up to and
/// including the allow-list). Our READY waits for the caller's verdict on the peer's
/// properties: it sends it (`Sealer::ready`) to accept the peer, or an ERROR
/// (`error_command`) to refuse it with a reason the peer can report. ZMTP lets a server
/// answer after the client's READY: a client sends its READY without waiting for ours.
pub(super) async fn handshake_server<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    ours: &str,
    peers: &[&str],
    curve: ServerCurve<'_>,
) -> Result<Handshaken, HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let failed = |e: io::Error| HandshakeError::Failed(e.to_string());
    let mechanism = if curve.is_some() { CURVE } else { NULL };
    writer
        .write_all(&greeting(mechanism, curve.is_some()))
        .await
        .map_err(failed)?;
    let greeting = reader.greeting().await.map_err(failed)?;
    check_greeting(&greeting, mechanism)?;
    let Some((keys, allowed)) = curve else {
        let props = peer_ready(reader).await?;
        check_socket_type(&props, ours, peers)?;
        return Ok(Handshaken {
            props,
            sealer: Sealer::Null,
            client_key: None,
        });
    };
    let accepted = curve::server(reader, writer, keys, allowed).await?;
    check_socket_type(&accepted.props, ours, peers)?;
    Ok(Handshaken {
        props: accepted.props,
        sealer: Sealer::Curve(accepted.tx),
        client_key: Some(accepted.client_key),
    })
}

/// The peer's READY (NULL mechanism); its properties.
async fn peer_ready<R: AsyncRead + Unpin>(
    reader: &mut FrameReader<R>,
) -> Result<Vec<(String, Bytes)>, HandshakeError> {
    let failed = |e: io::Error| HandshakeError::Failed(e.to_string());
    let body = reader.handshake_command().await.map_err(failed)?;
    refused_by_peer(&body)?;
    parse_ready(&body).map_err(HandshakeError::Failed)
}

/// Checks that the peer's `Socket-Type` is one of `peers`.
fn check_socket_type(
    props: &[(String, Bytes)],
    ours: &str,
    peers: &[&str],
) -> Result<(), HandshakeError> {
    let kind = props
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("Socket-Type"))
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    if !peers.iter().any(|p| p.as_bytes() == kind) {
        return Err(HandshakeError::Failed(format!(
            "a {} socket cannot talk to a {ours}",
            PeerBytes(&kind)
        )));
    }
    Ok(())
}
