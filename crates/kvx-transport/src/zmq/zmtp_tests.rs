//! `zmtp.rs`'s unit tests: greetings, READY, the frame reader's limits and budgets, the
//! sealer, ERROR commands.

use super::*;
use tokio::io::AsyncWriteExt;

use crate::zmq::frames::{
    encode_message, error_command, ping_body, pong_body, COMMAND, LONG, MORE,
};

fn limits(max: usize, refuse: usize) -> ReadLimits {
    ReadLimits {
        message_max_bytes: max as u64,
        refuse_above_bytes: refuse as u64,
        message_timeout: Duration::from_secs(5),
    }
}

async fn read_all(stream: &[u8], max: usize, refuse: usize) -> Vec<io::Result<Incoming>> {
    let mut r = FrameReader::new(stream, limits(max, refuse));
    let mut out = Vec::new();
    loop {
        let next = r.next().await;
        let end = matches!(next, Ok(Incoming::Closed) | Err(_));
        out.push(next);
        if end {
            return out;
        }
    }
}

/// An ERROR command reads back as the reason it carries; a long one is cut to 255 bytes at
/// a character boundary. A READY is no ERROR.
#[tokio::test]
async fn error_commands_carry_their_reason() {
    let read = |frame: Vec<u8>| async move {
        let mut r = FrameReader::new(&frame[..], limits(1024, 1024));
        r.handshake_command().await.expect("one command")
    };
    let reason = "identity refused: another connection holds it";
    let body = read(error_command(reason)).await;
    assert_eq!(parse_error(&body).as_deref(), Some(reason));
    let body = read(error_command(&"é".repeat(200))).await;
    assert_eq!(body[6], 254, "127 two-byte characters");
    assert_eq!(
        parse_error(&body)
            .expect("an ERROR")
            .matches("\\xc3\\xa9")
            .count(),
        127
    );
    assert_eq!(parse_error(&ready("ROUTER", None, None)[2..]), None);
}

#[tokio::test]
async fn messages_commands_and_oversize_frames() {
    let mut s = Vec::new();
    encode_message(&[b"", b"hello"], &mut s);
    s.extend_from_slice(&[COMMAND, 4, b'P', b'I', b'N', b'G']);
    encode_message(&[b"", &[7u8; 300]], &mut s); // over a 256-byte limit: skipped
    encode_message(&[&[9u8; 256]], &mut s); // exactly the limit, a long frame
    s.push(COMMAND | LONG); // an oversize command: skipped, still a command
    s.extend_from_slice(&300u64.to_be_bytes());
    s.extend_from_slice(&[0u8; 300]);
    let mut ping = b"\x04PING\x00\x32".to_vec(); // a TTL of 5 s and a context
    ping.extend_from_slice(b"ctx-0123456789abcdef"); // cut to 16 bytes
    s.extend_from_slice(&command_frame(&ping));
    s.extend_from_slice(&command_frame(&pong_body(b"ctx")));
    s.extend_from_slice(&command_frame(&ping_body(Duration::from_secs(4))));
    let got = read_all(&s, 256, 1024).await;
    let got: Vec<_> = got.into_iter().map(|r| r.expect("ok")).collect();
    assert_eq!(
        got,
        [
            Incoming::Message(vec![Bytes::new(), Bytes::from_static(b"hello")]),
            Incoming::Command,
            Incoming::Oversize(300),
            Incoming::Message(vec![Bytes::from(vec![9u8; 256])]),
            Incoming::Command,
            Incoming::Ping(Bytes::from_static(b"ctx-0123456789ab")),
            Incoming::Pong,
            Incoming::Ping(Bytes::new()),
            Incoming::Closed,
        ]
    );
}

#[tokio::test]
async fn a_terabyte_announced_ends_the_stream_without_buffering() {
    let mut s = vec![LONG];
    s.extend_from_slice(&(1u64 << 40).to_be_bytes());
    let got = read_all(&s, 1 << 20, 16 << 20).await;
    let err = got.last().expect("one").as_ref().expect_err("refused");
    assert_eq!(err.kind(), io::ErrorKind::InvalidData);
}

#[tokio::test]
async fn long_messages_are_skipped_past_the_frame_limit() {
    let mut s = Vec::new();
    let many: Vec<&[u8]> = vec![b"frame"; 10_000];
    encode_message(&many, &mut s);
    encode_message(&[b"", b"after"], &mut s);
    // 50,000 bytes in all, under the limit: it is the frame count that refuses them.
    let got = read_all(&s, 1 << 20, 1 << 20).await;
    let got: Vec<_> = got.into_iter().map(|r| r.expect("ok")).collect();
    assert_eq!(
        got,
        [
            Incoming::TooManyFrames(10_000),
            Incoming::Message(vec![Bytes::new(), Bytes::from_static(b"after")]),
            Incoming::Closed,
        ]
    );
    let mut r = FrameReader::new(&s[..], limits(1 << 20, 1 << 20));
    assert!(matches!(r.next().await, Ok(Incoming::TooManyFrames(_))));
    assert!(
        r.buf.capacity() <= READ_CHUNK,
        "the skipped frames were not buffered"
    );
}

/// What one connection holds is bounded by the message, not per frame: four frames of
/// the limit each used to be buffered (4 MiB with the default limit, about 7 MiB with
/// the buffer's growth); now the bytes past the limit stream past.
#[tokio::test]
async fn a_message_is_held_to_the_limit_in_total() {
    let max = 1 << 20;
    let full = vec![7u8; max];
    let mut s = Vec::new();
    encode_message(&[&full, &full, &full, &full], &mut s);
    encode_message(&[b"", &full], &mut s); // exactly the limit in total
    let mut r = FrameReader::new(&s[..], limits(max, 16 << 20));
    assert_eq!(
        r.next().await.expect("read"),
        Incoming::Oversize(2 * max as u64)
    );
    assert!(r.buf.capacity() <= READ_CHUNK, "{}", r.buf.capacity());
    let Incoming::Message(frames) = r.next().await.expect("read") else {
        panic!("the next message arrives");
    };
    assert_eq!(frames[1].len(), max);
    assert!(r.buf.capacity() <= READ_CHUNK, "{}", r.buf.capacity());
    assert_eq!(r.next().await.expect("read"), Incoming::Closed);
}

/// Many small messages in a row: the read buffer never grows past one chunk.
#[tokio::test]
async fn the_read_buffer_stays_one_chunk() {
    let mut s = Vec::new();
    for i in 0..10_000u32 {
        encode_message(&[b"", &i.to_be_bytes()[..(i % 5) as usize]], &mut s);
    }
    let mut r = FrameReader::new(&s[..], limits(64, 1024));
    for _ in 0..10_000 {
        assert!(matches!(r.next().await, Ok(Incoming::Message(_))));
        assert!(r.buf.capacity() <= READ_CHUNK, "{}", r.buf.capacity());
    }
}

/// A message that has begun must end within `message_timeout`; a connection may idle
/// between messages for as long as it likes.
#[tokio::test]
async fn a_message_trickled_past_its_timeout_is_cut_off() {
    let (mut peer, ours) = tokio::io::duplex(1 << 16);
    let mut r = FrameReader::new(
        ours,
        ReadLimits {
            message_timeout: Duration::from_millis(200),
            ..limits(1 << 20, 16 << 20)
        },
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut s = Vec::new();
    encode_message(&[b"", b"after an idle while"], &mut s);
    peer.write_all(&s).await.expect("write");
    assert!(matches!(r.next().await, Ok(Incoming::Message(_))));

    // A long frame of 1000 bytes, of which 10 ever arrive.
    peer.write_all(&[MORE, 0, LONG]).await.expect("write");
    peer.write_all(&1000u64.to_be_bytes()).await.expect("write");
    peer.write_all(&[1u8; 10]).await.expect("write");
    let began = tokio::time::Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(5), r.next())
        .await
        .expect("cut off within 5 s, not waiting for the rest forever")
        .expect_err("cut off");
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert!(began.elapsed() >= Duration::from_millis(150));
}

/// The READY command is held to `READY_MAX_BYTES` from its header: a peer announcing a
/// longer one is refused before any of it is buffered.
#[tokio::test]
async fn a_ready_over_its_limit_is_refused_from_its_header() {
    let mut s = vec![COMMAND | LONG];
    s.extend_from_slice(&(1u64 << 20).to_be_bytes());
    let mut r = FrameReader::new(&s[..], limits(1 << 20, 16 << 20));
    let err = r.handshake_command().await.expect_err("refused");
    assert_eq!(err.kind(), io::ErrorKind::InvalidData);

    let body = vec![b'x'; READY_MAX_BYTES as usize];
    let mut s = vec![COMMAND | LONG];
    s.extend_from_slice(&(body.len() as u64).to_be_bytes());
    s.extend_from_slice(&body);
    let mut r = FrameReader::new(&s[..], limits(1 << 20, 16 << 20));
    assert_eq!(r.handshake_command().await.expect("at the limit"), body);

    let mut r = FrameReader::new(&[0u8, 0][..], limits(1 << 20, 16 << 20));
    assert!(
        r.handshake_command().await.is_err(),
        "a message is no READY"
    );
}

#[tokio::test]
async fn a_command_inside_a_message_is_an_error() {
    let mut s = vec![MORE, 1, b'a'];
    s.extend_from_slice(&[COMMAND, 4, b'P', b'I', b'N', b'G']);
    let got = read_all(&s, 64, 64).await;
    assert_eq!(
        got[0].as_ref().expect_err("refused").kind(),
        io::ErrorKind::InvalidData
    );
    let got = read_all(&[COMMAND | MORE, 1, b'x', 0, 0], 64, 64).await;
    assert!(got[0].is_err(), "a command with MORE");
}

#[tokio::test]
async fn reserved_flags_and_truncation_are_errors() {
    let got = read_all(&[0x80, 0], 64, 64).await;
    assert!(got[0].is_err());
    let got = read_all(&[MORE, 1, b'a'], 64, 64).await;
    assert_eq!(
        got[0].as_ref().expect_err("truncated").kind(),
        io::ErrorKind::UnexpectedEof
    );
}

#[test]
fn greeting_and_ready_round_trip() {
    assert_eq!(check_greeting(&greeting(NULL, false), NULL), Ok(()));
    let mut old = greeting(NULL, false);
    old[10] = 2;
    assert!(check_greeting(&old, NULL).is_err());
    let curve = greeting(CURVE, true);
    assert_eq!(&curve[12..18], b"CURVE\0");
    assert_eq!(curve[32], 1, "as-server");
    assert!(matches!(
        check_greeting(&curve, NULL),
        Err(HandshakeError::Unauthenticated(_))
    ));
    assert!(matches!(
        check_greeting(&greeting(NULL, false), CURVE),
        Err(HandshakeError::Unauthenticated(_))
    ));
    assert_eq!(check_greeting(&curve, CURVE), Ok(()));
    let frame = ready("ROUTER", None, None);
    assert_eq!(frame[0], COMMAND);
    let props = parse_ready(&frame[2..]).expect("parses");
    assert_eq!(
        props,
        [
            ("Socket-Type".to_owned(), Bytes::from_static(b"ROUTER")),
            ("X-Kvx-Heartbeat".to_owned(), Bytes::from_static(b"1")),
        ]
    );
    assert!(announces_heartbeats(&props));
    let pull = parse_ready(&ready("PULL", None, Some(7))[2..]).expect("parses");
    assert_eq!(announced_epoch(&pull), None, "a PULL announces no epoch");
    let router = parse_ready(&ready("ROUTER", None, Some(0xfeed))[2..]).expect("parses");
    assert_eq!(announced_epoch(&router), Some(0xfeed));
    let bad = [("X-Kvx-Epoch".to_owned(), Bytes::from_static(b"12"))];
    assert_eq!(announced_epoch(&bad), None, "not 16 hex digits");
    assert!(!announces_heartbeats(&pull), "a PULL answers no PING");
    let frame = ready("DEALER", Some(b"s0-to-r0"), None);
    let props = parse_ready(&frame[2..]).expect("parses");
    assert_eq!(
        props,
        [
            ("Socket-Type".to_owned(), Bytes::from_static(b"DEALER")),
            ("Identity".to_owned(), Bytes::from_static(b"s0-to-r0")),
            ("X-Kvx-Heartbeat".to_owned(), Bytes::from_static(b"1")),
        ]
    );
    // A 255-byte identity makes a READY too long for a short command frame.
    let frame = ready("DEALER", Some(&[b'x'; 255]), None);
    assert_eq!(frame[0], COMMAND | LONG);
    let props = parse_ready(&frame[9..]).expect("parses");
    assert_eq!(props[1].1.len(), 255);
    assert!(parse_ready(b"\x04PING").is_err());
    assert!(parse_ready(b"\x05READY\x0bSocket-Type\x00\x00\x00\x09ROUT").is_err());
}
