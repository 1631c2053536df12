//! Hostile peers against real `kvx receiver` and `kvx proxy` processes, at the ZMTP layer
//! (`docs/spec/zmq.md` §3, §5, §8): identity takeover, identities a ROUTER must refuse,
//! connection floods, slow trickles, and malformed streams. Every test ends by checking that
//! the process is alive and still serves a legitimate peer.
//!
//! Everything runs on 127.0.0.1; every wait is bounded (`zmtp::WAIT` and the bounds below),
//! every loop bounded in count.

mod hostile;

use std::time::{Duration, Instant};

use hostile::lmcache::{alloc_request, alloc_response, cancel, granted};
use hostile::zmtp::{self, Peer, COMMAND, MORE};
use hostile::{legit_notice, legit_round_trip, legit_round_trip_on, Kvx};

/// The ZMQ limits `kvx receiver` and `kvx proxy` run with (their defaults).
fn defaults() -> kvx_transport::zmq::ZmqConfig {
    kvx_transport::zmq::ZmqConfig::default()
}

/// How long a refused connection may take to be closed: "at once", with room for a debug
/// build on a loaded host.
const AT_ONCE: Duration = Duration::from_secs(2);

/// Log lines a burst of refusals may cause: the first eight, then powers of two.
const LOG_LINES_PER_BURST: usize = 16;

// ---------------------------------------------------------------------------------------
// Identities (§3)

/// A peer that knows (or guesses) a sender's identity connects with it again and again and
/// tries to cancel the sender's request. Each impostor is refused; the sender keeps its
/// connection and its request.
#[test]
fn an_impostor_with_a_senders_identity_is_refused_and_the_sender_keeps_working() {
    let mut rx = Kvx::receiver();
    // What kvx senders' identities used to be: guessable from a pid.
    let identity = b"kvx-sender-0-pid4242-rank0-to-tcp://127.0.0.1:8400";
    let mut sender = Peer::dealer(rx.addr(), Some(identity)).expect("the sender connects");
    let reply = sender
        .request(&alloc_request("victim", 0..2, 4))
        .expect("first batch answered");
    assert!(granted(&reply, 2), "{:?}", alloc_response(&reply));

    for attempt in 0..20 {
        // Refused in its handshake: no message of it is ever read.
        let why = Peer::refused_dealer(rx.addr(), Some(identity));
        assert!(
            why.contains("identity refused"),
            "impostor {attempt} is refused, with the reason: {why}"
        );
        if attempt % 5 == 0 {
            legit_round_trip_on(&mut sender, &mut rx);
        }
    }
    // The sender's request was never cancelled: its last batch is granted.
    let reply = sender
        .request(&alloc_request("victim", 2..4, 4))
        .expect("last batch answered on the sender's own connection");
    assert!(granted(&reply, 2), "{:?}", alloc_response(&reply));
    assert!(
        rx.log_count("identity") <= LOG_LINES_PER_BURST,
        "refusals are logged sparsely: {:?}",
        rx.lines()
    );
    legit_round_trip(&mut rx);
}

/// A sender's identity is a secret of its own (its random part is what keeps others from
/// claiming it): a receiver logging everything at debug level, through a connection under
/// the identity, impostors under it, and a request cancelled, never writes any of its
/// random part; the duplicate's line names it by its keyed label.
#[test]
fn a_senders_identity_never_reaches_the_log() {
    let mut rx = Kvx::receiver_logging("debug");
    let secret = "9f3c1a7e5b2d4c6e8a0b1d3f5e7a9c2b";
    // The random part first, where a prefix of the identity would show it.
    let identity = format!("{secret}-kvx-py-4242-7");
    let mut sender = Peer::dealer(rx.addr(), Some(identity.as_bytes())).expect("connects");
    let reply = sender
        .request(&alloc_request("secretive", 0..2, 2))
        .expect("first batch answered");
    assert!(granted(&reply, 2), "{:?}", alloc_response(&reply));
    for _ in 0..3 {
        Peer::refused_dealer(rx.addr(), Some(identity.as_bytes()));
    }
    let _ = sender.request(&cancel("secretive", 0..2));
    legit_round_trip(&mut rx);
    assert!(
        rx.wait_for_log("identity refused", Duration::from_secs(5)),
        "the duplicate is logged: {:?}",
        rx.lines()
    );
    for line in rx.lines() {
        for start in 0..=secret.len() - 8 {
            let piece = &secret[start..start + 8];
            assert!(
                !line.contains(piece),
                "a log line shows part of the identity's random part ({piece}): {line}"
            );
        }
    }
}

/// Identities beginning with a zero byte are the ones a ROUTER makes up for anonymous peers
/// (libzmq: 0x00 and a counter). One from the wire is refused, so nobody can claim an
/// anonymous peer's id, connected or gone, and act under its `PeerId`.
#[test]
fn an_identity_beginning_with_a_zero_byte_is_refused() {
    let mut rx = Kvx::receiver();
    let mut anonymous = Peer::dealer(rx.addr(), None).expect("an anonymous peer connects");
    let reply = anonymous
        .request(&alloc_request("anonymous", 0..2, 4))
        .expect("answered");
    assert!(granted(&reply, 2));
    for guess in [
        &[0u8, 0, 0, 0, 1][..],
        &[0, 0, 0, 0, 2],
        &[0, 0, 0, 0, 3],
        &[0, b'x'],
    ] {
        let why = Peer::refused_dealer(rx.addr(), Some(guess));
        assert!(
            why.contains("identity refused"),
            "identity {guess:02x?} is refused in the handshake: {why}"
        );
    }
    let reply = anonymous
        .request(&alloc_request("anonymous", 2..4, 4))
        .expect("the anonymous peer is still served");
    assert!(granted(&reply, 2), "its request was not cancelled");
    legit_round_trip(&mut rx);
}

/// libzmq's identities are 1 to 255 bytes. A longer one is refused, and a READY too long to
/// hold any legitimate identity is refused from its header, before its body is buffered (a
/// 1 MiB identity used to stay in the peer table after its connection closed).
#[test]
fn identities_longer_than_255_bytes_are_refused() {
    let mut rx = Kvx::receiver();
    let mut longest = Peer::dealer(rx.addr(), Some(&[b'i'; 255])).expect("connects");
    legit_round_trip_on(&mut longest, &mut rx);

    let why = Peer::refused_dealer(rx.addr(), Some(&[b'i'; 256]));
    assert!(why.contains("identity refused"), "{why}");

    // A READY announcing 1 MiB, of which only the start is sent: refused from the header.
    let mut huge = Peer::tcp(rx.addr()).expect("connects");
    let mut hello = zmtp::greeting().to_vec();
    hello.extend_from_slice(&zmtp::long_header(COMMAND, 1 << 20));
    hello.extend_from_slice(&zmtp::ready_body(b"DEALER", None));
    huge.send(&hello).expect("sent");
    let began = Instant::now();
    assert!(
        huge.closed_within(AT_ONCE),
        "a 1 MiB READY is refused before it arrives"
    );
    assert!(began.elapsed() < defaults().handshake_timeout);
    legit_round_trip(&mut rx);
}

// ---------------------------------------------------------------------------------------
// Floods and trickles (§5)

/// More connections than `connections_max`, each a complete DEALER handshake that then says
/// nothing, from five addresses: past the cap the quietest are closed (as many as the excess),
/// memory stays bounded, and while the flood is held a legitimate sender, which talks, is
/// served (a quiet flood connection makes room for it). Then one address alone floods: it is
/// held to `connections_per_source_max`, evicting its own connections.
#[test]
fn a_connection_flood_is_capped_and_never_locks_a_sender_out() {
    let cap = defaults().connections_max;
    let per_source = defaults().connections_per_source_max;
    let extra = 256;
    let sources = (cap + extra).div_ceil(per_source);
    assert!(sources * per_source >= cap + extra && sources <= 250);
    hostile::raise_open_files_limit(2 * (cap + extra + per_source) as u64 + 256);
    let mut rx = Kvx::receiver();
    legit_round_trip(&mut rx);
    // Let the legitimate connection's end reach the receiver before counting places.
    std::thread::sleep(Duration::from_millis(200));
    let before = rx.rss_kib();
    let mut flood = Vec::with_capacity(cap + extra);
    for i in 0..cap + extra {
        let source = [127, 0, 1, 1 + (i / per_source) as u8];
        let mut peer = Peer::tcp_from(rx.addr(), source).expect("TCP connects");
        let identity = format!("flood-{i}");
        let _ = peer.send(&zmtp::hello(b"DEALER", Some(identity.as_bytes())));
        flood.push(peer);
    }
    let closed = count_closed(&mut flood, extra);
    let during = rx.rss_kib();
    eprintln!(
        "connection flood of {} from {sources} addresses: {closed} closed; receiver RSS \
         {before} KiB before, {during} KiB during (+{} KiB)",
        cap + extra,
        during.saturating_sub(before)
    );
    assert_eq!(
        closed, extra,
        "as many connections as go past {cap} are closed"
    );
    assert!(
        during < before + 64 * 1024,
        "RSS grew by {} KiB (bound: 64 MiB)",
        during - before
    );
    assert!(
        rx.log_count("connection") <= LOG_LINES_PER_BURST,
        "evictions are logged sparsely: {} lines",
        rx.log_count("connection")
    );
    // The flood is still held: a legitimate sender connects and is served at once.
    let began = Instant::now();
    let mut sender = Peer::dealer(rx.addr(), Some(b"amid-the-flood")).expect("connects");
    let req = alloc_request(&hostile::fresh_req_id("amid"), 0..1, 1);
    let reply = sender.request(&req).expect("answered");
    assert!(granted(&reply, 1), "{:?}", alloc_response(&reply));
    eprintln!("a sender amid the flood: served in {:?}", began.elapsed());
    drop(flood);

    // One address alone: held to its own cap, its oldest silent connections closed first.
    std::thread::sleep(Duration::from_millis(300));
    let mut alone = Vec::with_capacity(per_source + 16);
    for i in 0..per_source + 16 {
        let mut peer = Peer::tcp_from(rx.addr(), [127, 0, 2, 1]).expect("TCP connects");
        let identity = format!("alone-{i}");
        let _ = peer.send(&zmtp::hello(b"DEALER", Some(identity.as_bytes())));
        alone.push(peer);
    }
    assert_eq!(
        count_closed(&mut alone, 16),
        16,
        "held to {per_source} from one address"
    );
    let mut sender = Peer::dealer(rx.addr(), Some(b"beside-one-address")).expect("connects");
    let reply = sender.request(&req).expect("answered");
    assert!(granted(&reply, 1), "{:?}", alloc_response(&reply));
    rx.assert_alive();
}

/// Waits (bounded: 5 s, a pass each 50 ms) until `want` of `peers` are closed; how many are.
fn count_closed(peers: &mut [Peer], want: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut closed = vec![false; peers.len()];
    loop {
        for (peer, closed) in peers.iter_mut().zip(closed.iter_mut()) {
            *closed = *closed || peer.is_closed_now();
        }
        let n = closed.iter().filter(|c| **c).count();
        if n >= want || Instant::now() >= deadline {
            // A little longer, so that one closed too many would be seen.
            std::thread::sleep(Duration::from_millis(200));
            for (peer, closed) in peers.iter_mut().zip(closed.iter_mut()) {
                *closed = *closed || peer.is_closed_now();
            }
            return closed.iter().filter(|c| **c).count();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Connections that each leave a message of four frames of `frame_max_bytes` unfinished (the
/// last frame one byte short): each holds at most `frame_max_bytes` of it, not four times that
/// (about 7 MiB each with the buffer's growth, before the bound was per message).
#[test]
fn unfinished_messages_hold_at_most_frame_max_bytes_per_connection() {
    let mut rx = Kvx::receiver();
    legit_round_trip(&mut rx);
    let max = defaults().frame_max_bytes;
    let conns = 32;
    let full = vec![0x42u8; max];
    let mut unfinished = zmtp::frame(MORE, &full).repeat(3);
    unfinished.extend_from_slice(&zmtp::frame(0, &full));
    unfinished.pop();
    let before = rx.rss_kib();
    let mut peers = Vec::with_capacity(conns);
    for i in 0..conns {
        let identity = format!("unfinished-{i}");
        let mut peer = Peer::dealer(rx.addr(), Some(identity.as_bytes())).expect("connects");
        peer.send(&unfinished).expect("sent");
        peers.push(peer);
    }
    // Give the receiver a moment to read what was sent (well within `message_timeout`).
    std::thread::sleep(Duration::from_millis(500));
    let during = rx.rss_kib();
    let bound_kib = (conns * (max + (64 << 10)) / 1024) as u64 + 16 * 1024;
    eprintln!(
        "{conns} connections with unfinished 4 x {max}-byte messages: receiver RSS {before} \
         KiB before, {during} KiB during (+{} KiB; bound +{bound_kib} KiB)",
        during.saturating_sub(before)
    );
    assert!(
        during < before + bound_kib,
        "RSS grew by {} KiB (bound: {bound_kib} KiB)",
        during - before
    );
    drop(peers);
    legit_round_trip(&mut rx);
}

/// The proxy's PULL caps its connections the same way.
#[test]
fn a_connection_flood_against_the_proxy_is_capped() {
    let cap = defaults().connections_max;
    let extra = 64;
    hostile::raise_open_files_limit(2 * (cap + extra) as u64 + 256);
    let per_source = defaults().connections_per_source_max;
    let mut proxy = Kvx::proxy();
    let mut flood = Vec::with_capacity(cap + extra);
    for i in 0..cap + extra {
        let source = [127, 0, 1, 1 + (i / per_source) as u8];
        let mut peer = Peer::tcp_from(proxy.addr(), source).expect("TCP connects");
        let _ = peer.send(&zmtp::hello(b"PUSH", None));
        flood.push(peer);
    }
    assert_eq!(
        count_closed(&mut flood, extra),
        extra,
        "as many connections as go past {cap} are closed"
    );
    // While the flood is held, a legitimate notice gets through.
    legit_notice(&mut proxy);
    drop(flood);
}

/// A peer that starts a large frame and trickles it a byte at a time is cut off once the
/// message has taken `message_timeout`, instead of holding its buffer forever.
#[test]
fn a_frame_trickled_slowly_is_cut_off() {
    let mut rx = Kvx::receiver();
    let bound = defaults().message_timeout;
    let mut slow = Peer::dealer(rx.addr(), Some(b"slowloris")).expect("connects");
    let mut start = zmtp::frame(MORE, b"");
    start.extend_from_slice(&zmtp::long_header(0, 512 << 10));
    slow.send(&start).expect("sent");
    let began = Instant::now();
    let give_up = bound + Duration::from_secs(4);
    let mut cut_off = None;
    // Bounded: one byte per 100 ms until the cut-off or `give_up`.
    while began.elapsed() < give_up {
        if slow.send(&[0x55]).is_err() || slow.is_closed_now() {
            cut_off = Some(began.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let cut_off = cut_off.unwrap_or_else(|| panic!("still open after {give_up:?}"));
    eprintln!("slow trickle cut off after {cut_off:?} (bound {bound:?})");
    assert!(
        cut_off + Duration::from_millis(500) >= bound,
        "cut off by the bound, not before it: {cut_off:?}"
    );
    legit_round_trip(&mut rx);
}

/// A peer that trickles its greeting is closed once the handshake has taken
/// `handshake_timeout`; so is one that connects and says nothing.
#[test]
fn a_slow_or_silent_handshake_is_cut_off() {
    let mut rx = Kvx::receiver();
    let bound = defaults().handshake_timeout;
    let mut silent = Peer::tcp(rx.addr()).expect("connects");
    let mut slow = Peer::tcp(rx.addr()).expect("connects");
    let greeting = zmtp::greeting();
    let began = Instant::now();
    let give_up = bound + Duration::from_secs(4);
    let mut cut_off = None;
    for byte in greeting.iter().cycle().take(1000) {
        if began.elapsed() > give_up {
            break;
        }
        if slow.send(&[*byte]).is_err() || slow.is_closed_now() {
            cut_off = Some(began.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let cut_off = cut_off.unwrap_or_else(|| panic!("still open after {give_up:?}"));
    assert!(cut_off + Duration::from_millis(500) >= bound, "{cut_off:?}");
    assert!(
        silent.closed_within(Duration::from_secs(2)),
        "the silent one too"
    );
    legit_round_trip(&mut rx);
}

// ---------------------------------------------------------------------------------------
// Malformed streams: each is refused, and the receiver serves on.

/// Sends `attack` on a fresh connection and expects the receiver to close it at once; then
/// the receiver must be alive and serve a legitimate sender.
fn closed_at_once(attack: &[u8]) {
    let mut rx = Kvx::receiver();
    let mut attacker = Peer::tcp(rx.addr()).expect("connects");
    let _ = attacker.send(attack);
    assert!(attacker.closed_within(AT_ONCE), "the attacker is closed");
    legit_round_trip(&mut rx);
}

/// The greeting and READY of a DEALER, then `rest`.
fn after_handshake(rest: &[u8]) -> Vec<u8> {
    let mut out = zmtp::hello(b"DEALER", Some(b"attacker"));
    out.extend_from_slice(rest);
    out
}

#[test]
fn a_greeting_without_the_zmtp_signature_is_refused() {
    let mut http = b"GET / HTTP/1.1\r\nHost: kvx\r\n\r\n".to_vec();
    http.resize(64, b' ');
    closed_at_once(&http);
}

#[test]
fn a_greeting_of_an_older_zmtp_version_is_refused() {
    let mut g = zmtp::greeting();
    g[10] = 2;
    closed_at_once(&g);
}

#[test]
fn a_greeting_with_an_unknown_mechanism_is_refused() {
    let mut g = zmtp::greeting();
    g[12..17].copy_from_slice(b"PLAIN");
    closed_at_once(&g);
}

/// CURVE against a receiver started without CURVE keys: refused (an ERROR says why), closed.
#[test]
fn a_curve_greeting_against_a_null_receiver_is_refused() {
    let mut g = zmtp::greeting();
    g[12..17].copy_from_slice(b"CURVE");
    closed_at_once(&g);
}

#[test]
fn a_frame_header_announcing_a_terabyte_is_refused() {
    closed_at_once(&after_handshake(&zmtp::long_header(0, 1 << 40)));
}

#[test]
fn a_command_inside_a_message_is_refused() {
    let mut rest = zmtp::frame(MORE, b"");
    rest.extend_from_slice(&zmtp::frame(COMMAND, b"\x04PING"));
    closed_at_once(&after_handshake(&rest));
}

#[test]
fn garbage_after_the_handshake_is_refused() {
    closed_at_once(&after_handshake(&[0xf8; 64]));
}

/// A message of more frames than any shape has is dropped without being buffered; the
/// connection is kept, and a request after it is answered.
#[test]
fn a_message_of_too_many_frames_is_dropped_and_the_connection_kept() {
    let mut rx = Kvx::receiver();
    let mut peer = Peer::dealer(rx.addr(), Some(b"many-frames")).expect("connects");
    let frames: Vec<&[u8]> = vec![b"frame"; 1000];
    peer.send(&zmtp::message(&frames)).expect("sent");
    legit_round_trip_on(&mut peer, &mut rx);
}

/// A frame over `frame_max_bytes` (but under the refusal limit) is skipped as it streams past;
/// the connection is kept.
#[test]
fn an_oversize_frame_is_skipped_and_the_connection_kept() {
    let mut rx = Kvx::receiver();
    let mut peer = Peer::dealer(rx.addr(), Some(b"oversize")).expect("connects");
    let big = vec![0x42u8; defaults().frame_max_bytes + 1];
    peer.send(&zmtp::message(&[b"", &big])).expect("sent");
    legit_round_trip_on(&mut peer, &mut rx);
}

/// The same malformed streams against the proxy's PULL.
#[test]
fn the_proxy_refuses_malformed_streams_and_serves_on() {
    let mut proxy = Kvx::proxy();
    let push = |rest: &[u8]| {
        let mut out = zmtp::hello(b"PUSH", None);
        out.extend_from_slice(rest);
        out
    };
    let mut http = b"GET / HTTP/1.1\r\n\r\n".to_vec();
    http.resize(64, b' ');
    let mut command_inside = zmtp::frame(MORE, b"x");
    command_inside.extend_from_slice(&zmtp::frame(COMMAND, b"\x04PING"));
    for attack in [
        http,
        push(&zmtp::long_header(0, 1 << 40)),
        push(&command_inside),
        push(&[0xf8; 16]),
        zmtp::hello(b"DEALER", None), // a DEALER cannot talk to a PULL
    ] {
        let mut attacker = Peer::tcp(proxy.addr()).expect("connects");
        let _ = attacker.send(&attack);
        assert!(
            attacker.closed_within(AT_ONCE),
            "closed: {:02x?}",
            &attack[..16]
        );
        proxy.assert_alive();
    }
    legit_notice(&mut proxy);
}
