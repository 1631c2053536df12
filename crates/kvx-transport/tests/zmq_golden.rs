//! Byte-level interop with LMCache: raw ZMTP streams captured from LMCache/libzmq
//! (`shared/golden/zmtp_*.hex`, see its README) are replayed over a plain TCP socket against
//! kvx's sockets, and kvx's bytes on the wire are compared with libzmq's.
//!
//! Only what must differ is allowed to: the `zeromq` crate greets with ZMTP 3.0 where libzmq
//! says 3.1 (both sides then speak 3.0 framing, which is the same), and the property order of
//! a READY command is free. Message frames must match byte for byte.

use std::collections::HashMap;
use std::fs;
use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::ClientEvent;
use kvx_io::Transport;
use kvx_transport::zmq::ZmqTransport;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const GOLDEN_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/golden/");
const STEP: Duration = Duration::from_secs(10);
/// The identity LMCache's DEALER used in the capture (`{local_id}-to-{receiver_id}`).
const GOLDEN_IDENTITY: &[u8] = b"127.0.0.123700-to-127.0.0.123610";

fn golden(name: &str) -> Vec<u8> {
    let path = format!("{GOLDEN_DIR}{name}");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("cannot read golden vector {path}: {e} (is shared/ beside the checkout?)")
    });
    hex::decode(text.trim()).expect("golden files are hex")
}

async fn step<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(STEP, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {STEP:?}"))
}

/// One ZMTP frame: its flags byte and body.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Frame {
    flags: u8,
    body: Vec<u8>,
}

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// Splits a captured stream into its 64-byte greeting and the frames after it.
fn parse_stream(stream: &[u8]) -> (&[u8], Vec<Frame>) {
    let (greeting, mut rest) = stream.split_at(64);
    let mut frames = Vec::new();
    while !rest.is_empty() {
        let flags = rest[0];
        let (len, header) = if flags & LONG != 0 {
            let len = u64::from_be_bytes(rest[1..9].try_into().expect("8 bytes"));
            (usize::try_from(len).expect("fits"), 9)
        } else {
            (usize::from(rest[1]), 2)
        };
        frames.push(Frame {
            flags,
            body: rest[header..header + len].to_vec(),
        });
        rest = &rest[header + len..];
    }
    (greeting, frames)
}

/// Groups message frames into multipart messages by their MORE flag.
fn messages(frames: &[Frame]) -> Vec<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    let mut current = Vec::new();
    for f in frames.iter().filter(|f| f.flags & COMMAND == 0) {
        current.push(f.body.clone());
        if f.flags & MORE == 0 {
            out.push(std::mem::take(&mut current));
        }
    }
    assert!(current.is_empty(), "a capture ends mid-message");
    out
}

/// The wire bytes of `frames` after the handshake (everything but the greeting and the
/// READY command).
fn after_handshake(stream: &[u8]) -> &[u8] {
    let rest = &stream[64..];
    let ready_len = if rest[0] & LONG != 0 {
        9 + usize::try_from(u64::from_be_bytes(rest[1..9].try_into().expect("8 bytes")))
            .expect("fits")
    } else {
        2 + usize::from(rest[1])
    };
    &rest[ready_len..]
}

async fn read_frame(tcp: &mut TcpStream) -> Frame {
    let flags = tcp.read_u8().await.expect("frame flags");
    let len = if flags & LONG != 0 {
        usize::try_from(tcp.read_u64().await.expect("long length")).expect("fits")
    } else {
        usize::from(tcp.read_u8().await.expect("short length"))
    };
    let mut body = vec![0; len];
    tcp.read_exact(&mut body).await.expect("frame body");
    Frame { flags, body }
}

/// Reads a greeting and checks what any ZMTP 3 peer must send: the signature, major
/// version 3 and the NULL mechanism, as a client (`as-server` 0).
async fn read_greeting(tcp: &mut TcpStream) -> [u8; 64] {
    let mut greeting = [0u8; 64];
    tcp.read_exact(&mut greeting).await.expect("greeting");
    assert_eq!(greeting[0], 0xff, "signature starts with ff");
    assert_eq!(greeting[9], 0x7f, "signature ends with 7f");
    assert_eq!(greeting[10], 3, "ZMTP major version 3");
    assert_eq!(&greeting[12..16], b"NULL", "NULL mechanism");
    assert!(
        greeting[16..32].iter().all(|&b| b == 0),
        "mechanism padding"
    );
    assert_eq!(greeting[32], 0, "as-server is 0 for NULL");
    greeting
}

/// Parses a READY command body into its properties.
fn ready_properties(frame: &Frame) -> HashMap<String, Vec<u8>> {
    assert!(
        frame.flags & COMMAND != 0,
        "expected a command, got {frame:?}"
    );
    let body = &frame.body;
    let name_len = usize::from(body[0]);
    assert_eq!(&body[1..1 + name_len], b"READY");
    let mut rest = &body[1 + name_len..];
    let mut props = HashMap::new();
    while !rest.is_empty() {
        let n = usize::from(rest[0]);
        let name = String::from_utf8(rest[1..1 + n].to_vec()).expect("property names are ASCII");
        let v = u32::from_be_bytes(rest[1 + n..5 + n].try_into().expect("4 bytes")) as usize;
        props.insert(name, rest[5 + n..5 + n + v].to_vec());
        rest = &rest[5 + n + v..];
    }
    props
}

fn tcp_addr(endpoint: &str) -> &str {
    endpoint.strip_prefix("tcp://").expect("a tcp:// endpoint")
}

/// LMCache's DEALER (the whole captured client stream, unchanged) against kvx's ROUTER: the
/// golden payloads arrive under the golden identity, and kvx's replies are framed on the
/// wire exactly as LMCache's ROUTER framed them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_dealer_stream_against_our_router() {
    let c2s = golden("zmtp_alloc_conn0_c2s.hex");
    let s2c = golden("zmtp_alloc_conn0_s2c.hex");
    // libzmq put identity_len + 1 in the last padding byte; the replay keeps it.
    assert_eq!(c2s[8], GOLDEN_IDENTITY.len() as u8 + 1);
    let (_, c2s_frames) = parse_stream(&c2s);
    let (_, s2c_frames) = parse_stream(&s2c);
    let requests = messages(&c2s_frames);
    let replies = messages(&s2c_frames);
    assert_eq!(requests.len(), 6, "the capture holds six requests");
    assert_eq!(replies.len(), 6, "and six replies");
    // Cross-check the capture against the single-message vectors.
    assert_eq!(
        requests[0],
        [vec![], golden("alloc_request_first_batch.hex")]
    );
    assert_eq!(
        requests[1],
        [vec![], golden("alloc_request_later_batch.hex")]
    );
    assert_eq!(
        requests[2],
        [vec![], golden("alloc_request_last_batch.hex")]
    );
    assert_eq!(requests[4], [vec![], golden("cancel_notif.hex")]);
    assert_eq!(requests[5], [vec![], golden("alloc_request_oversized.hex")]);
    assert_eq!(replies[0], [vec![], golden("alloc_response_ok.hex")]);
    assert_eq!(
        replies[4],
        [vec![], golden("alloc_response_cancel_ack.hex")]
    );
    assert_eq!(replies[5], [vec![], golden("alloc_response_minus1.hex")]);

    let t = ZmqTransport::default();
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let mut tcp = TcpStream::connect(tcp_addr(server.local_endpoint()))
        .await
        .expect("tcp connect");
    tcp.write_all(&c2s).await.expect("replay the client stream");

    let mut peer = None;
    for (i, request) in requests.iter().enumerate() {
        let (from, payload) = step("request", server.recv()).await.expect("server open");
        assert_eq!(payload, Bytes::from(request[1].clone()), "request {i}");
        assert_eq!(
            *peer.get_or_insert(from),
            from,
            "one peer id for the connection"
        );
    }
    let peer = peer.expect("requests arrived");
    assert_eq!(
        t.peer_identity(peer).as_deref(),
        Some(GOLDEN_IDENTITY),
        "the peer is the identity from the READY command"
    );
    for reply in &replies {
        server
            .send(peer, Bytes::from(reply[1].clone()))
            .await
            .expect("reply");
    }

    step("greeting", read_greeting(&mut tcp)).await;
    let ready = step("READY", read_frame(&mut tcp)).await;
    let props = ready_properties(&ready);
    assert_eq!(
        props.get("Socket-Type").map(Vec::as_slice),
        Some(&b"ROUTER"[..])
    );
    // libzmq's ROUTER also sends an empty Identity; an absent one means the same.
    assert!(props.get("Identity").is_none_or(Vec::is_empty));
    let expected = after_handshake(&s2c);
    let mut wire = vec![0u8; expected.len()];
    step("replies", tcp.read_exact(&mut wire))
        .await
        .expect("reply bytes");
    assert_eq!(
        hex::encode(&wire),
        hex::encode(expected),
        "replies framed as LMCache's ROUTER framed them"
    );
}

/// Frames of 256 bytes or more use ZMTP long frames in both directions; a request without
/// the empty delimiter is accepted, as LMCache accepts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_frames_and_a_missing_delimiter() {
    let c2s = golden("zmtp_alloc_conn0_c2s.hex");
    let handshake = &c2s[..c2s.len() - after_handshake(&c2s).len()];
    let t = ZmqTransport::default();
    let mut server = t.serve("tcp://127.0.0.1:0").await.expect("serve");
    let mut tcp = TcpStream::connect(tcp_addr(server.local_endpoint()))
        .await
        .expect("tcp connect");
    let long: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
    let mut bytes = handshake.to_vec();
    bytes.extend_from_slice(&[MORE, 0, LONG]);
    bytes.extend_from_slice(&300u64.to_be_bytes());
    bytes.extend_from_slice(&long);
    bytes.extend_from_slice(&[0, 5]);
    bytes.extend_from_slice(b"hello");
    tcp.write_all(&bytes).await.expect("write");

    let (peer, payload) = step("long request", server.recv()).await.expect("open");
    assert_eq!(payload, Bytes::from(long.clone()));
    let (peer2, payload) = step("bare request", server.recv()).await.expect("open");
    assert_eq!((peer2, payload), (peer, Bytes::from_static(b"hello")));

    let short = vec![0x5a; 255];
    server
        .send(peer, Bytes::from(short.clone()))
        .await
        .expect("reply");
    server
        .send(peer, Bytes::from(long.clone()))
        .await
        .expect("reply");
    step("greeting", read_greeting(&mut tcp)).await;
    let _ready = step("READY", read_frame(&mut tcp)).await;
    let mut expected = vec![MORE, 0, 0, 255];
    expected.extend_from_slice(&short);
    expected.extend_from_slice(&[MORE, 0, LONG]);
    expected.extend_from_slice(&300u64.to_be_bytes());
    expected.extend_from_slice(&long);
    let mut wire = vec![0u8; expected.len()];
    step("replies", tcp.read_exact(&mut wire))
        .await
        .expect("read");
    assert_eq!(hex::encode(wire), hex::encode(expected));
}

/// LMCache's PUSH (captured stream, unchanged) against kvx's PULL; kvx's PULL handshake is
/// byte for byte libzmq's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_push_stream_against_our_pull() {
    let c2s = golden("zmtp_proxy_conn0_c2s.hex");
    let s2c = golden("zmtp_proxy_conn0_s2c.hex");
    let t = ZmqTransport::default();
    let mut source = t.notify_source("tcp://127.0.0.1:0").await.expect("bind");
    let mut tcp = TcpStream::connect(tcp_addr(source.local_endpoint()))
        .await
        .expect("tcp connect");
    tcp.write_all(&c2s).await.expect("replay");
    let notice = step("notice", source.recv()).await.expect("open");
    assert_eq!(notice, Bytes::from(golden("proxy_notif.hex")));

    step("greeting", read_greeting(&mut tcp)).await;
    let ready = step("READY", read_frame(&mut tcp)).await;
    let (_, golden_frames) = parse_stream(&s2c);
    assert_eq!(ready, golden_frames[0], "READY as libzmq's PULL sends it");
}

/// A listener that plays the server side of a golden capture against a kvx client: it
/// checks the client's greeting, sends the captured greeting and READY, and returns the
/// stream and the client's READY properties.
async fn golden_server_handshake(
    listener: &TcpListener,
    s2c: &[u8],
) -> (TcpStream, HashMap<String, Vec<u8>>) {
    let (mut tcp, _) = listener.accept().await.expect("accept");
    let handshake = &s2c[..s2c.len() - after_handshake(s2c).len()];
    tcp.write_all(handshake).await.expect("server handshake");
    read_greeting(&mut tcp).await;
    let ready = read_frame(&mut tcp).await;
    (tcp, ready_properties(&ready))
}

/// kvx's DEALER against LMCache's captured ROUTER: its READY carries the identity as
/// libzmq's does, its requests are the captured bytes exactly, and the captured replies are
/// delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_dealer_against_lmcache_router_stream() {
    let c2s = golden("zmtp_alloc_conn0_c2s.hex");
    let s2c = golden("zmtp_alloc_conn0_s2c.hex");
    let requests = messages(&parse_stream(&c2s).1);
    let replies = messages(&parse_stream(&s2c).1);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("tcp://{}", listener.local_addr().expect("addr"));
    let s2c_for_server = s2c.clone();
    let server = tokio::spawn(async move {
        let (tcp, props) = golden_server_handshake(&listener, &s2c_for_server).await;
        (tcp, props, listener)
    });
    let identity = std::str::from_utf8(GOLDEN_IDENTITY).expect("ASCII");
    let t = ZmqTransport::default();
    let mut client = step("connect", t.connect(&endpoint, identity))
        .await
        .expect("connect");
    let (mut tcp, props, _listener) = step("handshake", server).await.expect("server task");
    assert_eq!(
        props.get("Socket-Type").map(Vec::as_slice),
        Some(&b"DEALER"[..])
    );
    assert_eq!(
        props.get("Identity").map(Vec::as_slice),
        Some(GOLDEN_IDENTITY)
    );

    for request in &requests {
        client
            .send(Bytes::from(request[1].clone()))
            .await
            .expect("send");
    }
    let expected = after_handshake(&c2s);
    let mut wire = vec![0u8; expected.len()];
    step("requests", tcp.read_exact(&mut wire))
        .await
        .expect("read");
    assert_eq!(
        hex::encode(&wire),
        hex::encode(expected),
        "requests framed as LMCache's DEALER framed them"
    );

    tcp.write_all(after_handshake(&s2c)).await.expect("replies");
    for reply in &replies {
        let event = step("reply", client.recv()).await.expect("client open");
        assert_eq!(event, ClientEvent::Message(Bytes::from(reply[1].clone())));
    }
}

/// kvx's PUSH against LMCache's captured PULL: the notice is the captured bytes exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_push_against_lmcache_pull_stream() {
    let c2s = golden("zmtp_proxy_conn0_c2s.hex");
    let s2c = golden("zmtp_proxy_conn0_s2c.hex");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("tcp://{}", listener.local_addr().expect("addr"));
    let server = tokio::spawn(async move {
        let (tcp, props) = golden_server_handshake(&listener, &s2c).await;
        (tcp, props, listener)
    });
    let t = ZmqTransport::default();
    let sink = step("connect", t.notify_sink(&endpoint))
        .await
        .expect("sink");
    let (mut tcp, props, _listener) = step("handshake", server).await.expect("server task");
    assert_eq!(
        props.get("Socket-Type").map(Vec::as_slice),
        Some(&b"PUSH"[..])
    );
    sink.send(Bytes::from(golden("proxy_notif.hex")))
        .await
        .expect("notify");
    let expected = after_handshake(&c2s);
    let mut wire = vec![0u8; expected.len()];
    step("notice", tcp.read_exact(&mut wire))
        .await
        .expect("read");
    assert_eq!(hex::encode(&wire), hex::encode(expected));
}
