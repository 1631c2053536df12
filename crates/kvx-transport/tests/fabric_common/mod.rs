//! Test bodies both socket fabrics run (`fabric_tcp.rs`, `fabric_shm.rs`), beyond kvx-io's
//! conformance suite: concurrent senders, a connection cut mid-stream, large slots, a
//! dropped listener; (`budget`) floods of idle connections against a listener's budget; and
//! (`raw_peer`) a hand-written peer that checks the receiver's bounds and
//! grants. Every wait is bounded by `STEP`; every loop by a count.

#![allow(dead_code)]

use std::time::Duration;

use std::sync::Arc;

use kvx_io::SlotGeometry;
use kvx_io::{
    Completion, Fabric, FabricAccess, FabricConn, FabricCredential, FabricError, FabricListener,
    PostWrite, SlotMemory,
};
use kvx_proto::{PeerId, SlotIndex, StagingSlot, WriteId, WriteTag};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod budget;
// Each test binary uses a part of them (authenticated idlers: TCP only).
#[allow(unused_imports)]
pub use budget::{
    a_silent_or_slow_hello_is_cut_off, authenticated_idlers_never_lock_a_writer_out,
    idle_connections_never_lock_a_sender_out,
};

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
        checksum: None,
    }
}

/// The immediate of slot `slot`'s grant `generation`.
pub fn imm(slot: u32, generation: u32) -> Option<u32> {
    Some(
        WriteTag {
            slot: SlotIndex(slot),
            generation,
        }
        .to_imm(),
    )
}

/// Grants `slot` to `peer` under `generation` (as a receiver's ledger would before its reply
/// goes out) and returns the write that uses the grant, with the checksum of `bytes`.
fn granted(
    access: &FabricAccess,
    peer: PeerId,
    id: u64,
    local: u32,
    slot: u32,
    generation: u32,
    bytes: &[u8],
) -> PostWrite {
    access.grant(slot, peer, generation);
    PostWrite {
        checksum: Some(kvx_io::chunk_checksum(bytes)),
        ..write(id, local, slot, bytes.len(), imm(slot, generation))
    }
}

/// Notices collected so far, per peer (`collect_landed` counts, `stream_writes` waits).
pub type Seen = Arc<[std::sync::atomic::AtomicU32; 4]>;

/// Waits (bounded) until `seen[tag]` reached `n`.
async fn wait_seen(seen: &Seen, tag: u32, n: u32) {
    use std::sync::atomic::Ordering;
    step("the collector to catch up", async {
        while seen[tag as usize].load(Ordering::Acquire) < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
}

/// One sender's stream of `rounds` writes through a window of `window` staging slots into
/// remote slots `base..base+window`, as peer `tag`, each round `r` under generation `r + 1`
/// of its slot (granted just before its write, once the slot's previous write completed
/// and, with `seen`, its notice was taken, as a receiver's ledger re-grants a slot only
/// after its landing); checks its completions.
#[allow(clippy::too_many_arguments)]
async fn stream_writes<F: Fabric>(
    f: &F,
    endpoint: &str,
    access: &Arc<FabricAccess>,
    seen: Option<&Seen>,
    tag: u32,
    base: u32,
    window: u32,
    rounds: u32,
    slot_bytes: usize,
) {
    let peer = PeerId(u64::from(tag));
    let staging = f
        .allocate_staging(SlotGeometry::new(window, slot_bytes).expect("a geometry"))
        .expect("staging");
    let credential = access.credential_for(peer);
    let mut conn = step("connect", f.connect(endpoint, staging.clone(), credential))
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
        if let (Some(seen), true) = (seen, r >= window) {
            wait_seen(seen, tag, r - window + 1).await;
        }
        let bytes = pattern(tag << 16 | r, slot_bytes);
        staging.write_slot(k, &bytes);
        conn.post(granted(
            access,
            peer,
            u64::from(r),
            k,
            base + k,
            r + 1,
            &bytes,
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

/// Drains landed notices into per-sender (per-peer) lists of rounds (generation − 1), until
/// `want` arrived; every one must have matched its checksum.
async fn collect_landed<M>(
    listener: &mut FabricListener<M>,
    want: usize,
    seen: &Seen,
) -> Vec<Vec<u32>> {
    let mut by_tag: Vec<Vec<u32>> = vec![Vec::new(); 4];
    for i in 0..want {
        let l = step(&format!("landed {i} of {want}"), listener.landed.recv())
            .await
            .expect("listener open");
        assert_eq!(l.checksum, kvx_io::ChecksumCheck::Match, "{l:?}");
        by_tag[l.peer.0 as usize].push(l.tag.generation - 1);
        seen[l.peer.0 as usize].fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }
    by_tag
}

/// Two senders stream into disjoint halves of one buffer at once; both get every completion
/// in order, every notice arrives (each sender's in order), and the bytes are right.
pub async fn two_senders_concurrently<F: Fabric>(f: &F, endpoint: &str) {
    const SLOT: usize = 64 << 10;
    const ROUNDS: u32 = 64;
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(8, SLOT).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let access = listener.access.clone();
    // Notices are drained while the writes go on, as a receiver's driver does (the notice
    // channel holds about two per slot).
    let seen = Seen::default();
    let ((), (), by_tag) = tokio::join!(
        stream_writes(f, &ep, &access, Some(&seen), 1, 0, 4, ROUNDS, SLOT),
        stream_writes(f, &ep, &access, Some(&seen), 2, 4, 4, ROUNDS, SLOT),
        collect_landed(&mut listener, 2 * ROUNDS as usize, &seen),
    );
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
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(4, MIB).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let access = listener.access.clone();
    let seen = Seen::default();
    let ((), by_tag) = tokio::join!(
        stream_writes(f, &ep, &access, Some(&seen), 3, 0, 4, 48, MIB),
        collect_landed(&mut listener, 48, &seen),
    );
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

/// For `ShmFabric` senders, which hand their staging over the Unix socket named after the
/// control port they reached (`@kvx-shm-fabric.<port>`): a thread that answers offers made at
/// `port`, relaying each one (bytes and descriptors) to the handoff of `upstream` when there
/// is one, or else accepting it with ticket 1 (a fake receiver). Serves 8 offers at most;
/// harmless for other fabrics, which never connect to it.
pub fn handoff_relay(port: u16, upstream: Option<u16>) {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
    let name = |p: u16| SocketAddr::from_abstract_name(format!("kvx-shm-fabric.{p}").as_bytes());
    let listener = UnixListener::bind_addr(&name(port).expect("name")).expect("handoff bind");
    std::thread::spawn(move || {
        for _ in 0..8 {
            let Ok((mut down, _)) = listener.accept() else {
                return;
            };
            let _ = down.set_read_timeout(Some(STEP));
            let mut offer = [0u8; 48];
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
            let Ok(msg) = rustix::net::recvmsg(
                &down,
                &mut [std::io::IoSliceMut::new(&mut offer)],
                &mut control,
                rustix::net::RecvFlags::CMSG_CLOEXEC,
            ) else {
                continue;
            };
            let mut fds = Vec::new();
            for m in control.drain() {
                if let rustix::net::RecvAncillaryMessage::ScmRights(r) = m {
                    fds.extend(r);
                }
            }
            if msg.bytes < 48 && down.read_exact(&mut offer[msg.bytes..]).is_err() {
                continue;
            }
            let mut reply = Vec::new();
            match upstream {
                None => {
                    reply.extend_from_slice(b"KVXD");
                    reply.extend_from_slice(&[0; 4]);
                    reply.extend_from_slice(&1u64.to_le_bytes());
                }
                Some(up_port) => {
                    let Ok(mut up) = UnixStream::connect_addr(&name(up_port).expect("name")) else {
                        continue;
                    };
                    let _ = up.set_read_timeout(Some(STEP));
                    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                    let mut space =
                        [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
                    let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
                    control.push(rustix::net::SendAncillaryMessage::ScmRights(&borrowed));
                    if rustix::net::sendmsg(
                        &up,
                        &[std::io::IoSlice::new(&offer)],
                        &mut control,
                        rustix::net::SendFlags::NOSIGNAL,
                    ) != Ok(48)
                    {
                        continue;
                    }
                    let _ = up.read_to_end(&mut reply);
                }
            }
            let _ = down.write_all(&reply);
        }
    });
}

/// Sender A goes through a proxy that cuts its connection mid-stream: its writes complete
/// in order, successes first, then errors, and later posts fail too. Sender B, connected
/// directly, keeps writing throughout, and a sender C connecting after the cut is served.
/// C writes into a slot of A's once A has its flushes: nothing of A's may land after them.
/// `cut_after` is where to cut A's byte stream (fabric-specific: it must fall inside the
/// fourth write).
pub async fn cut_mid_stream<F: Fabric>(f: &F, endpoint: &str, slot_bytes: usize, cut_after: usize) {
    const A_WRITES: u32 = 12;
    // Slots 0..12 are A's (one write each), 12..16 B's.
    let mut listener = f
        .expose(
            endpoint,
            SlotGeometry::new(16, slot_bytes).expect("a geometry"),
        )
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let access = listener.access.clone();
    let (pa, pc) = (PeerId(1), PeerId(3));

    let via = cutting_proxy(ep.clone(), cut_after).await;
    handoff_relay(port_of(&via), Some(port_of(&ep)));
    let a_staging = f
        .allocate_staging(SlotGeometry::new(A_WRITES, slot_bytes).expect("a geometry"))
        .expect("staging a");
    let a_conn = f.connect(&via, a_staging.clone(), access.credential_for(pa));
    let mut a = step("connect a", a_conn).await.expect("connect a");
    for i in 0..A_WRITES {
        let bytes = pattern(1 << 16 | i, slot_bytes);
        a_staging.write_slot(i, &bytes);
        a.post(granted(&access, pa, u64::from(i), i, i, 1, &bytes))
            .expect("post a");
    }

    // B streams while A's connection is being cut.
    // Its 64 notices (and A's 12, C's 1) fit the notice channel of 16 slots (96) untaken.
    let b = stream_writes(f, &ep, &access, None, 2, 12, 4, 64, slot_bytes);
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

    // The receiver still serves: C connects after the cut and lands a write into A's last
    // slot (A's write there never went out: the grant passes to C).
    let c_staging = f
        .allocate_staging(SlotGeometry::new(1, slot_bytes).expect("a geometry"))
        .expect("staging c");
    let c_bytes = pattern(3 << 16, slot_bytes);
    c_staging.write_slot(0, &c_bytes);
    let c_conn = f.connect(&ep, c_staging, access.credential_for(pc));
    let mut c = step("connect c", c_conn).await.expect("connect c");
    let last = A_WRITES - 1;
    c.post(granted(&access, pc, 0, 0, last, 2, &c_bytes))
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
        let who = l.peer.0 as usize;
        seen[who] += 1;
        match who {
            1 => a_seen.push(l.slot.0),
            2 => b_rounds.push(l.tag.generation - 1),
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
    check_last_rounds(&*listener.memory, 2, 12, 4, 64, slot_bytes);
    let mut got = vec![0u8; slot_bytes];
    // Let anything of A's that could still land do so; then C's bytes must be intact.
    tokio::time::sleep(Duration::from_millis(200)).await;
    listener.memory.read_slot(last, &mut got);
    assert!(
        got == c_bytes,
        "c's write landed, and nothing of A's landed after A's flush"
    );
}

/// Once the listener is dropped, the receiver stops serving: writes posted afterwards fail,
/// and no new sender gets in.
pub async fn dropped_listener_stops_serving<F: Fabric>(f: &F, endpoint: &str) {
    let listener = f
        .expose(endpoint, SlotGeometry::new(2, 4096).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 4096).expect("a geometry"))
        .expect("staging");
    let credential = listener.access.credential_for(PeerId(1));
    let access = listener.access.clone();
    let mut conn = step("connect", f.connect(&ep, staging.clone(), credential))
        .await
        .expect("connect");
    drop(listener);
    for i in 0..2u32 {
        // A post may be refused outright once the connection task has seen the close.
        let w = granted(&access, PeerId(1), u64::from(i), i, i, 1, &pattern(0, 4096));
        let _ = conn.post(w);
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
    let again = step("reconnect", f.connect(&ep, staging, credential)).await;
    assert!(
        again.is_err(),
        "no buffer is served after the listener dropped"
    );
}

/// A receiver restarted at the same endpoint right after the old one was dropped: exposing
/// succeeds at once (the old port is let go asynchronously), a new sender is served, and the
/// old sender's fence — naming a connection of the previous incarnation — hurts nobody.
pub async fn restart_at_the_same_endpoint<F: Fabric>(f: &F) {
    let first = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(2, 4096).expect("a geometry"),
        )
        .await
        .expect("expose");
    let ep = first.local_endpoint.clone();
    let old_staging = f
        .allocate_staging(SlotGeometry::new(2, 4096).expect("a geometry"))
        .expect("staging");
    let old_credential = first.access.credential_for(PeerId(1));
    let mut old = step("connect old", f.connect(&ep, old_staging, old_credential))
        .await
        .expect("connect old");
    drop(first);
    let mut second = step(
        "re-expose",
        f.expose(&ep, SlotGeometry::new(2, 4096).expect("a geometry")),
    )
    .await
    .expect("re-expose at the same endpoint");
    // The old incarnation's credential is void at the new one.
    let stale = f
        .allocate_staging(SlotGeometry::new(2, 4096).expect("a geometry"))
        .expect("staging");
    let refused = step("stale credential", f.connect(&ep, stale, old_credential)).await;
    assert!(
        matches!(refused, Err(FabricError::Unauthorized(..))),
        "a credential of the previous incarnation is refused: {refused:?}"
    );
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 4096).expect("a geometry"))
        .expect("staging");
    let access = second.access.clone();
    let credential = access.credential_for(PeerId(2));
    let mut new = step("connect new", f.connect(&ep, staging.clone(), credential))
        .await
        .expect("connect new");
    // The old connection is dead: its write fails (after its fence, which reaches the new
    // incarnation).
    let _ = old.post(write(1, 0, 0, 4096, None));
    let c = completion(&mut old, "old completion").await;
    assert!(c.result.is_err(), "{c:?}");
    for i in 0..8u32 {
        let bytes = pattern(i, 4096);
        staging.write_slot(i % 2, &bytes);
        let w = granted(
            &access,
            PeerId(2),
            u64::from(i),
            i % 2,
            i % 2,
            i + 1,
            &bytes,
        );
        new.post(w).expect("post new");
        let c = completion(&mut new, "new completion").await;
        assert_eq!(c.result, Ok(()), "the new connection is unharmed");
        let l = step("landed", second.landed.recv()).await.expect("open");
        assert_eq!(l.tag.generation, i + 1);
    }
}

/// Connecting staging whose slots are larger or smaller than the receiver's is refused at
/// the handshake, with both sizes in the message.
pub async fn refuses_other_chunk_sizes<F: Fabric>(f: &F, endpoint: &str) {
    let listener = f
        .expose(endpoint, SlotGeometry::new(2, 4096).expect("a geometry"))
        .await
        .expect("expose");
    let credential = listener.access.credential_for(PeerId(1));
    for bytes in [8192, 2048] {
        let staging = f
            .allocate_staging(SlotGeometry::new(2, bytes).expect("a geometry"))
            .expect("staging");
        let r = step(
            "connect",
            f.connect(&listener.local_endpoint, staging, credential),
        )
        .await;
        let Err(FabricError::Incompatible { why, .. }) = r else {
            panic!("{bytes}-byte staging refused: {r:?}");
        };
        assert!(
            why.contains(&bytes.to_string()) && why.contains("4096"),
            "the message names both sizes: {why}"
        );
    }
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
    handoff_relay(port_of(&ep), None);
    let server = tokio::spawn(async move {
        let mut held = Vec::new();
        // The attach, then the fence; both are answered with silence after the handshake.
        for i in 0..2 {
            let Ok(Ok((mut s, _))) = tokio::time::timeout(STEP, fake.accept()).await else {
                return;
            };
            let mut hello = [0u8; 64];
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
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 4096).expect("a geometry"))
        .expect("staging");
    let credential = FabricAccess::new(2, [0; 16]).credential_for(PeerId(1));
    let mut conn = step("connect", f.connect(&ep, staging, credential))
        .await
        .expect("connect");
    for i in 0..2u32 {
        conn.post(write(u64::from(i), i, i, 4096, imm(i, 1)))
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

/// The port of `host:port`.
pub fn port_of(endpoint: &str) -> u16 {
    endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("host:port")
}

/// Nothing listening: a prompt, typed error.
pub async fn nothing_exposed<F: Fabric>(f: &F) {
    // Bind and drop a socket to find a port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let staging = f
        .allocate_staging(SlotGeometry::new(1, 64).expect("a geometry"))
        .expect("staging");
    let credential = FabricAccess::new(1, [0; 16]).credential_for(PeerId(1));
    let r = step(
        "connect",
        f.connect(&format!("127.0.0.1:{port}"), staging, credential),
    )
    .await;
    assert!(
        matches!(r, Err(FabricError::NotExposed(_))),
        "connect to nothing: {r:?}"
    );
}

mod raw_peer;
#[allow(unused_imports)] // each test file uses its own part
pub use raw_peer::{
    a_write_never_outlives_its_grant, raw, receiver_bounds_runs, receiver_checks_bounds,
    receiver_checks_grants, Raw,
};
