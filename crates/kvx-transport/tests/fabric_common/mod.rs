//! Test bodies both socket fabrics run (`fabric_tcp.rs`, `fabric_shm.rs`), beyond kvx-io's
//! conformance suite: concurrent senders, a connection cut mid-stream, large slots, a
//! dropped listener, and a hand-written peer that checks the receiver's bounds. Every wait
//! is bounded by `STEP`; every loop by a count.

#![allow(dead_code)]

use std::time::Duration;

use kvx_io::{Completion, Fabric, FabricConn, FabricError, FabricListener, PostWrite, SlotMemory};
use kvx_proto::{SlotIndex, StagingSlot, WriteId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const STEP: Duration = Duration::from_secs(20);

pub async fn step<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(STEP, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not happen within {STEP:?}"),
    }
}

/// Bytes that differ for every (tag, offset), so a misplaced or torn write shows.
pub fn pattern(tag: u32, len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(tag.wrapping_mul(97)) as u8
        })
        .collect();
    let head = tag.to_le_bytes();
    let n = head.len().min(len);
    v[..n].copy_from_slice(&head[..n]);
    v
}

pub async fn completion(conn: &mut FabricConn, what: &str) -> Completion {
    step(what, conn.next_completion())
        .await
        .unwrap_or_else(|| panic!("{what}: connection closed"))
}

fn write(id: u64, local: u32, remote: u32, len: usize, imm: Option<u32>) -> PostWrite {
    PostWrite {
        id: WriteId(id),
        local: StagingSlot(local),
        remote: SlotIndex(remote),
        len,
        imm,
    }
}

/// One sender's stream of `rounds` writes through a window of `window` staging slots into
/// remote slots `base..base+window`, each tagged `tag << 16 | round`; checks its completions.
async fn stream_writes<F: Fabric>(
    f: &F,
    endpoint: &str,
    tag: u32,
    base: u32,
    window: u32,
    rounds: u32,
    slot_bytes: usize,
) {
    let staging = f.allocate_staging(window, slot_bytes).expect("staging");
    let mut conn = step("connect", f.connect(endpoint, staging.clone()))
        .await
        .expect("connect");
    let mut next_done = 0u32;
    for r in 0..rounds {
        if r >= window {
            let c = completion(&mut conn, "windowed completion").await;
            assert_eq!(c.id, WriteId(u64::from(next_done)), "completions in order");
            assert_eq!(c.result, Ok(()), "sender {tag} write {next_done}");
            next_done += 1;
        }
        let k = r % window;
        staging.write_slot(k, &pattern(tag << 16 | r, slot_bytes));
        conn.post(write(
            u64::from(r),
            k,
            base + k,
            slot_bytes,
            Some(tag << 16 | r),
        ))
        .expect("post");
    }
    while next_done < rounds {
        let c = completion(&mut conn, "final completion").await;
        assert_eq!(c.id, WriteId(u64::from(next_done)), "completions in order");
        assert_eq!(c.result, Ok(()), "sender {tag} write {next_done}");
        next_done += 1;
    }
}

/// Checks that remote slot `base + k` holds the last round written through staging slot k.
fn check_last_rounds<M: SlotMemory>(
    memory: &M,
    tag: u32,
    base: u32,
    window: u32,
    rounds: u32,
    slot_bytes: usize,
) {
    let mut got = vec![0u8; slot_bytes];
    for k in 0..window.min(rounds) {
        let last = (0..rounds)
            .rev()
            .find(|r| r % window == k)
            .expect("a round");
        memory.read_slot(base + k, &mut got);
        assert!(
            got == pattern(tag << 16 | last, slot_bytes),
            "slot {} holds sender {tag}'s round {last}",
            base + k
        );
    }
}

/// Drains landed notices into per-sender lists of rounds, until `want` arrived.
async fn collect_landed<M>(listener: &mut FabricListener<M>, want: usize) -> Vec<Vec<u32>> {
    let mut by_tag: Vec<Vec<u32>> = vec![Vec::new(); 4];
    for _ in 0..want {
        let l = step("landed", listener.landed.recv())
            .await
            .expect("listener open");
        by_tag[(l.imm >> 16) as usize].push(l.imm & 0xFFFF);
    }
    by_tag
}

/// Two senders stream into disjoint halves of one buffer at once; both get every completion
/// in order, every notice arrives (each sender's in order), and the bytes are right.
pub async fn two_senders_concurrently<F: Fabric>(f: &F, endpoint: &str) {
    const SLOT: usize = 64 << 10;
    const ROUNDS: u32 = 64;
    let mut listener = f.expose(endpoint, 8, SLOT).await.expect("expose");
    let ep = listener.local_endpoint.clone();
    tokio::join!(
        stream_writes(f, &ep, 1, 0, 4, ROUNDS, SLOT),
        stream_writes(f, &ep, 2, 4, 4, ROUNDS, SLOT),
    );
    let by_tag = collect_landed(&mut listener, 2 * ROUNDS as usize).await;
    for tag in [1, 2] {
        let want: Vec<u32> = (0..ROUNDS).collect();
        assert_eq!(by_tag[tag], want, "sender {tag}'s notices, in order");
    }
    check_last_rounds(&*listener.memory, 1, 0, 4, ROUNDS, SLOT);
    check_last_rounds(&*listener.memory, 2, 4, 4, ROUNDS, SLOT);
}

/// 1 MiB slots: the conformance body, then 48 MiB streamed through a window of 4.
pub async fn one_mib_slots<F: Fabric>(f: &F, endpoint: &str) {
    const MIB: usize = 1 << 20;
    kvx_io::conformance::fabric_writes_land_in_order(f, endpoint, 4, MIB).await;
    let mut listener = f.expose(endpoint, 4, MIB).await.expect("expose");
    let ep = listener.local_endpoint.clone();
    stream_writes(f, &ep, 3, 0, 4, 48, MIB).await;
    let by_tag = collect_landed(&mut listener, 48).await;
    assert_eq!(by_tag[3].len(), 48);
    check_last_rounds(&*listener.memory, 3, 0, 4, 48, MIB);
}

/// A man in the middle: forwards connections both ways, and cuts the first one (drops both
/// sockets) once `cut_after` sender-to-receiver bytes went through it. Later connections
/// (the sender's fence) are forwarded whole.
pub async fn cutting_proxy(upstream: String, cut_after: usize) -> String {
    let proxy = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
    let addr = proxy.local_addr().expect("proxy addr").to_string();
    tokio::spawn(async move {
        for i in 0..8 {
            let Ok((down, _)) = proxy.accept().await else {
                return;
            };
            let Ok(up) = TcpStream::connect(upstream.clone()).await else {
                return;
            };
            let limit = if i == 0 { cut_after } else { usize::MAX };
            tokio::spawn(forward(down, up, limit));
        }
    });
    addr
}

async fn forward(down: TcpStream, up: TcpStream, limit: usize) {
    let (mut down_r, mut down_w) = down.into_split();
    let (mut up_r, mut up_w) = up.into_split();
    let there = async {
        let mut left = limit;
        let mut buf = vec![0u8; 64 << 10];
        while left > 0 {
            let take = buf.len().min(left);
            match down_r.read(&mut buf[..take]).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if up_w.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                    left -= n;
                }
            }
        }
    };
    let back = async {
        let _ = tokio::io::copy(&mut up_r, &mut down_w).await;
    };
    // The cut (or either side closing): everything is dropped at once.
    tokio::select! {
        () = there => {}
        () = back => {}
    }
}

/// Sender A goes through a proxy that cuts its connection mid-stream: its writes complete
/// in order, successes first, then errors, and later posts fail too. Sender B, connected
/// directly, keeps writing throughout, and a sender C connecting after the cut is served.
/// C writes into a slot of A's once A has its flushes: nothing of A's may land after them.
/// `cut_after` is where to cut A's byte stream (fabric-specific: it must fall inside the
/// fourth write).
pub async fn cut_mid_stream<F: Fabric>(f: &F, endpoint: &str, slot_bytes: usize, cut_after: usize) {
    const A_WRITES: u32 = 12;
    // Slots 0..4 are A's, 4..8 B's.
    let mut listener = f.expose(endpoint, 8, slot_bytes).await.expect("expose");
    let ep = listener.local_endpoint.clone();

    let via = cutting_proxy(ep.clone(), cut_after).await;
    let a_staging = f.allocate_staging(A_WRITES, slot_bytes).expect("staging a");
    let mut a = step("connect a", f.connect(&via, a_staging.clone()))
        .await
        .expect("connect a");
    for i in 0..A_WRITES {
        a_staging.write_slot(i, &pattern(1 << 16 | i, slot_bytes));
        a.post(write(u64::from(i), i, i % 4, slot_bytes, Some(1 << 16 | i)))
            .expect("post a");
    }

    // B streams while A's connection is being cut.
    let b = stream_writes(f, &ep, 2, 4, 4, 64, slot_bytes);
    let a_checks = async {
        let mut oks = 0u32;
        let mut failed = false;
        for i in 0..A_WRITES {
            let c = completion(&mut a, "a completion").await;
            assert_eq!(c.id, WriteId(u64::from(i)), "a: completions in order");
            match c.result {
                Ok(()) => {
                    assert!(!failed, "a: no success after an error");
                    oks += 1;
                }
                Err(_) => failed = true,
            }
        }
        assert!(failed, "a: the cut fails the writes behind it");
        assert!(
            oks <= 3,
            "a: only writes before the cut can succeed ({oks})"
        );
        // The connection is unusable now: a new write fails (or is refused outright).
        if a.post(write(99, 0, 0, slot_bytes, None)).is_ok() {
            let c = completion(&mut a, "a completion after the cut").await;
            assert_eq!(c.id, WriteId(99));
            assert!(c.result.is_err(), "a: a write after the cut fails");
        }
        oks
    };
    let ((), a_oks) = tokio::join!(b, a_checks);

    // The receiver still serves: C connects after the cut and lands a write, into A's slot 0.
    let c_staging = f.allocate_staging(1, slot_bytes).expect("staging c");
    c_staging.write_slot(0, &pattern(3 << 16, slot_bytes));
    let mut c = step("connect c", f.connect(&ep, c_staging))
        .await
        .expect("connect c");
    c.post(write(0, 0, 0, slot_bytes, Some(3 << 16)))
        .expect("post c");
    assert_eq!(completion(&mut c, "c completion").await.result, Ok(()));

    // Notices: every one of B's, C's, and at least A's acknowledged ones (A's cut writes may
    // or may not have landed before the cut; none lands after).
    let mut seen = [0u32; 4];
    let mut b_rounds = Vec::new();
    let mut a_seen = Vec::new();
    for _ in 0..(A_WRITES + 64 + 1) {
        let got = tokio::time::timeout(Duration::from_millis(500), listener.landed.recv()).await;
        let Ok(Some(l)) = got else { break };
        let tag = (l.imm >> 16) as usize;
        seen[tag] += 1;
        match tag {
            1 => a_seen.push(l.imm & 0xFFFF),
            2 => b_rounds.push(l.imm & 0xFFFF),
            _ => {}
        }
        if seen[2] == 64 && seen[3] == 1 && seen[1] >= a_oks {
            break;
        }
    }
    assert_eq!(
        b_rounds,
        (0..64).collect::<Vec<_>>(),
        "b: every notice, in order"
    );
    assert_eq!(seen[3], 1, "c: its notice");
    assert!(
        seen[1] >= a_oks,
        "a: every acknowledged write was announced"
    );
    assert!(
        a_seen.iter().enumerate().all(|(i, r)| *r == i as u32),
        "a: notices in order, none skipped ({a_seen:?})"
    );
    check_last_rounds(&*listener.memory, 2, 4, 4, 64, slot_bytes);
    let mut got = vec![0u8; slot_bytes];
    // Let anything of A's that could still land do so; then C's bytes must be intact.
    tokio::time::sleep(Duration::from_millis(200)).await;
    listener.memory.read_slot(0, &mut got);
    assert!(
        got == pattern(3 << 16, slot_bytes),
        "c's write landed, and nothing of A's landed after A's flush"
    );
}

/// Once the listener is dropped, the receiver stops serving: writes posted afterwards fail,
/// and no new sender gets in.
pub async fn dropped_listener_stops_serving<F: Fabric>(f: &F, endpoint: &str) {
    let listener = f.expose(endpoint, 2, 4096).await.expect("expose");
    let ep = listener.local_endpoint.clone();
    let staging = f.allocate_staging(2, 4096).expect("staging");
    let mut conn = step("connect", f.connect(&ep, staging.clone()))
        .await
        .expect("connect");
    drop(listener);
    for i in 0..2u32 {
        // A post may be refused outright once the connection task has seen the close.
        let _ = conn.post(write(u64::from(i), i, i, 4096, Some(i)));
    }
    let mut completions = 0;
    while let Some(c) = step("completion after drop", conn.next_completion()).await {
        assert!(
            c.result.is_err(),
            "a write after the listener dropped fails: {c:?}"
        );
        completions += 1;
        if completions == 2 {
            break;
        }
    }
    let again = step("reconnect", f.connect(&ep, staging)).await;
    assert!(
        again.is_err(),
        "no buffer is served after the listener dropped"
    );
}

/// A receiver restarted at the same endpoint right after the old one was dropped: exposing
/// succeeds at once (the old port is let go asynchronously), a new sender is served, and the
/// old sender's fence — naming a connection of the previous incarnation — hurts nobody.
pub async fn restart_at_the_same_endpoint<F: Fabric>(f: &F) {
    let first = f.expose("127.0.0.1:0", 2, 4096).await.expect("expose");
    let ep = first.local_endpoint.clone();
    let old_staging = f.allocate_staging(2, 4096).expect("staging");
    let mut old = step("connect old", f.connect(&ep, old_staging))
        .await
        .expect("connect old");
    drop(first);
    let mut second = step("re-expose", f.expose(&ep, 2, 4096))
        .await
        .expect("re-expose at the same endpoint");
    let staging = f.allocate_staging(2, 4096).expect("staging");
    let mut new = step("connect new", f.connect(&ep, staging.clone()))
        .await
        .expect("connect new");
    // The old connection is dead: its write fails (after its fence, which reaches the new
    // incarnation).
    let _ = old.post(write(1, 0, 0, 4096, None));
    let c = completion(&mut old, "old completion").await;
    assert!(c.result.is_err(), "{c:?}");
    for i in 0..8u32 {
        staging.write_slot(i % 2, &pattern(i, 4096));
        new.post(write(u64::from(i), i % 2, i % 2, 4096, Some(i)))
            .expect("post new");
        let c = completion(&mut new, "new completion").await;
        assert_eq!(c.result, Ok(()), "the new connection is unharmed");
        let l = step("landed", second.landed.recv()).await.expect("open");
        assert_eq!(l.imm, i);
    }
}

/// Connecting staging with larger slots than the receiver's is refused at the handshake.
pub async fn refuses_larger_staging<F: Fabric>(f: &F, endpoint: &str) {
    let listener = f.expose(endpoint, 2, 4096).await.expect("expose");
    let staging = f.allocate_staging(2, 8192).expect("staging");
    let r = step("connect", f.connect(&listener.local_endpoint, staging)).await;
    assert!(
        matches!(r, Err(FabricError::Endpoint { .. })),
        "larger staging refused: {r:?}"
    );
}

/// A receiver that stops reading (and never answers a fence): a reset still flushes every
/// write, within about the fence timeout. `fabric` must use a `fence_timeout` of 300 ms.
pub async fn reset_is_bounded_when_the_receiver_stalls<F: Fabric>(
    f: &F,
    magic: &'static [u8; 4],
    extra: &'static [u8],
) {
    let fake = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let ep = fake.local_addr().expect("addr").to_string();
    let server = tokio::spawn(async move {
        let mut held = Vec::new();
        // The attach, then the fence; both are answered with silence after the handshake.
        for i in 0..2 {
            let Ok(Ok((mut s, _))) = tokio::time::timeout(STEP, fake.accept()).await else {
                return;
            };
            let mut hello = [0u8; 32];
            if s.read_exact(&mut hello).await.is_err() {
                return;
            }
            if i == 0 {
                let w = raw::welcome_bytes(magic, 2, 4096, 1, extra);
                if s.write_all(&w).await.is_err() {
                    return;
                }
            }
            held.push(s);
        }
        tokio::time::sleep(STEP).await;
    });
    let staging = f.allocate_staging(2, 4096).expect("staging");
    let mut conn = step("connect", f.connect(&ep, staging))
        .await
        .expect("connect");
    for i in 0..2u32 {
        conn.post(write(u64::from(i), i, i, 4096, None))
            .expect("post");
    }
    let start = std::time::Instant::now();
    conn.reset();
    for i in 0..2u64 {
        let c = completion(&mut conn, "flushed completion").await;
        assert_eq!(c.id, WriteId(i));
        assert!(c.result.is_err(), "{c:?}");
    }
    let took = start.elapsed();
    assert!(took < Duration::from_secs(3), "the flush waited {took:?}");
    server.abort();
}

/// Nothing listening: a prompt, typed error.
pub async fn nothing_exposed<F: Fabric>(f: &F) {
    // Bind and drop a socket to find a port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let staging = f.allocate_staging(1, 64).expect("staging");
    let r = step("connect", f.connect(&format!("127.0.0.1:{port}"), staging)).await;
    assert!(
        matches!(r, Err(FabricError::NotExposed(_))),
        "connect to nothing: {r:?}"
    );
}

/// The wire, as `docs/spec/fabrics.md` gives it, for hand-written peers.
pub mod raw {
    use super::*;

    /// An attaching hello.
    pub fn hello(magic: &[u8; 4], slots: u32, slot_bytes: u64) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(magic);
        b.extend_from_slice(&1u16.to_le_bytes()); // version
        b.extend_from_slice(&0u16.to_le_bytes()); // kind: attach
        b.extend_from_slice(&slots.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&slot_bytes.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes()); // conn
        b
    }

    /// A welcome as a receiver sends it.
    pub fn welcome_bytes(
        magic: &[u8; 4],
        slots: u32,
        slot_bytes: u64,
        conn: u64,
        extra: &[u8],
    ) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(magic);
        b.extend_from_slice(&1u16.to_le_bytes()); // version
        b.extend_from_slice(&0u16.to_le_bytes()); // status: ok
        b.extend_from_slice(&slots.to_le_bytes());
        b.extend_from_slice(&(extra.len() as u32).to_le_bytes());
        b.extend_from_slice(&slot_bytes.to_le_bytes());
        b.extend_from_slice(&conn.to_le_bytes());
        b.extend_from_slice(extra);
        b
    }

    pub fn header(id: u64, remote: u32, len: u64, imm: Option<u32>) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&id.to_le_bytes());
        b.extend_from_slice(&remote.to_le_bytes());
        b.extend_from_slice(&u32::from(imm.is_some()).to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&imm.unwrap_or(0).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b
    }

    /// (status, slots, slot_bytes, extra)
    pub async fn welcome(s: &mut TcpStream) -> (u16, u32, u64, Vec<u8>) {
        let mut b = [0u8; 32];
        step("welcome", s.read_exact(&mut b))
            .await
            .expect("welcome");
        let status = u16::from_le_bytes([b[6], b[7]]);
        let slots = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        let extra_len = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
        let slot_bytes = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
        let mut extra = vec![0u8; extra_len as usize];
        step("welcome extra", s.read_exact(&mut extra))
            .await
            .expect("extra");
        (status, slots, slot_bytes, extra)
    }

    /// (id, status)
    pub async fn ack(s: &mut TcpStream) -> (u64, u32) {
        let mut b = [0u8; 16];
        step("ack", s.read_exact(&mut b)).await.expect("ack");
        (
            u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
        )
    }
}

/// A hand-written sender checks the receiver's own bounds (a fabric sender checks first and
/// never sends such writes): an out-of-bounds write is acked as refused and announces
/// nothing, the next write lands, and an absurd length drops only that connection.
/// `inline`: payloads follow headers (TCP) or not (shm).
pub async fn receiver_checks_bounds<F: Fabric>(
    f: &F,
    endpoint: &str,
    magic: &[u8; 4],
    inline: bool,
) {
    let mut listener = f.expose(endpoint, 2, 1024).await.expect("expose");
    let ep = listener.local_endpoint.clone();
    let mut s = TcpStream::connect(&ep).await.expect("raw connect");
    s.write_all(&raw::hello(magic, 1, 1024))
        .await
        .expect("hello");
    let (status, slots, slot_bytes, _) = raw::welcome(&mut s).await;
    assert_eq!((status, slots, slot_bytes), (0, 2, 1024));

    let payload = pattern(7, 1024);
    let mut out = raw::header(1, 2, 1024, Some(11));
    if inline {
        out.extend_from_slice(&payload);
    }
    out.extend_from_slice(&raw::header(2, 1, 1024, Some(12)));
    if inline {
        out.extend_from_slice(&payload);
    }
    s.write_all(&out).await.expect("writes");
    assert_eq!(raw::ack(&mut s).await, (1, 1), "out of bounds: refused");
    assert_eq!(raw::ack(&mut s).await, (2, 0), "in bounds: landed");
    let l = step("landed", listener.landed.recv()).await.expect("open");
    assert_eq!(l.imm, 12, "only the landed write is announced");
    if inline {
        let mut got = vec![0u8; 1024];
        listener.memory.read_slot(1, &mut got);
        assert!(got == payload, "the payload landed whole");
    }

    // A length no slot can hold: the receiver hangs up on this sender (inline) or refuses
    // the write (shm, where nothing follows the header).
    s.write_all(&raw::header(3, 0, 1 << 40, Some(13)))
        .await
        .expect("bad header");
    let mut b = [0u8; 16];
    let r = step("answer to an absurd write", s.read(&mut b)).await;
    if inline {
        assert!(matches!(r, Ok(0) | Err(_)), "connection dropped: {r:?}");
    } else {
        assert_eq!(r.expect("ack"), 16);
        assert_eq!(u32::from_le_bytes(b[8..12].try_into().expect("4")), 1);
    }
    // Junk instead of a hello: dropped without an answer.
    let mut junk = TcpStream::connect(&ep).await.expect("junk connect");
    junk.write_all(&[0xFF; 64]).await.expect("junk");
    let r = step("answer to junk", junk.read(&mut b)).await;
    assert!(matches!(r, Ok(0) | Err(_)), "junk dropped: {r:?}");

    // The buffer still serves fabric senders.
    let staging = f.allocate_staging(1, 1024).expect("staging");
    staging.write_slot(0, &pattern(8, 1024));
    let mut conn = step("connect", f.connect(&ep, staging))
        .await
        .expect("connect");
    conn.post(write(5, 0, 0, 1024, Some(14))).expect("post");
    assert_eq!(completion(&mut conn, "completion").await.result, Ok(()));
    let l = step("landed", listener.landed.recv()).await.expect("open");
    assert_eq!(l.imm, 14);
    let mut got = vec![0u8; 1024];
    listener.memory.read_slot(0, &mut got);
    assert!(got == pattern(8, 1024));
}
