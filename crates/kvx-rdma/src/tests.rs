//! `RdmaFabric` end to end over the in-process NIC model (`fake`): the kvx-io conformance
//! bodies, and the failure paths that hardware exercises rarely — a work request failing
//! mid-stream, the receiver going away, a dropped connection.

use std::sync::Arc;
use std::time::Duration;

use kvx_io::conformance;
use kvx_io::SlotGeometry;
use kvx_io::{Fabric, FabricAccess, FabricConn, FabricError, PostWrite, SlotMemory};
use kvx_proto::{PeerId, SlotIndex, StagingSlot, WriteId, WriteTag};

use crate::fake::FakeVerbs;
use crate::{PathMtu, RdmaConfig, RdmaFabric};

pub(crate) const STEP: Duration = Duration::from_secs(10);

pub(crate) fn fabric() -> (RdmaFabric<FakeVerbs>, FakeVerbs) {
    let verbs = FakeVerbs::new();
    let config = RdmaConfig {
        fence_timeout: Duration::from_secs(2),
        ..RdmaConfig::default()
    };
    let f = RdmaFabric::with_verbs(verbs.clone(), config).expect("poller starts");
    (f, verbs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_writes_land_in_order() {
    let (f, _) = fabric();
    conformance::fabric_writes_land_in_order(&f, "127.0.0.1:0", 16, 4096).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_reset_flushes() {
    let (f, _) = fabric();
    conformance::fabric_reset_flushes(&f, "127.0.0.1:0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_uses_memory_the_caller_owns() {
    let (f, _) = fabric();
    conformance::fabric_uses_memory_the_caller_owns(&f, "127.0.0.1:0", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_rejects_out_of_bounds() {
    let (f, _) = fabric();
    conformance::fabric_rejects_out_of_bounds(&f, "tcp://127.0.0.1:0").await;
}

/// Over RDMA the NIC writes before anyone checks, so a write outside the grants lands bytes;
/// what the access rules guarantee is that it is never announced (and counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_outside_the_grants_is_never_announced() {
    let (f, _) = fabric();
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let (victim, intruder) = (PeerId(1), PeerId(2));
    listener.access.grant(0, victim, 3);
    let staging = f
        .allocate_staging(SlotGeometry::new(4, 1024).expect("a geometry"))
        .expect("staging");
    let credential = listener.access.credential_for(intruder);
    let mut conn = f
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("connect");
    conn.post(write(1, 0, 3)).expect("post");
    assert_eq!(completions(&mut conn, 1).await, vec![(1, Ok(()))]);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), listener.landed.recv())
            .await
            .is_err(),
        "the intruder's write is not announced"
    );
    assert_eq!(listener.access.refused(), 1);
    // A credential this buffer did not issue does not get a queue pair at all.
    let forged = FabricAccess::new(4, [1; 16]).credential_for(victim);
    let e = f
        .connect(&listener.local_endpoint, staging, forged)
        .await
        .expect_err("a forged credential");
    assert!(matches!(e, FabricError::Unauthorized(..)), "{e}");
}

pub(crate) fn write(id: u64, slot: u32, generation: u32) -> PostWrite {
    PostWrite {
        id: WriteId(id),
        local: StagingSlot(slot % 4),
        remote: SlotIndex(slot),
        len: 1024,
        imm: Some(
            WriteTag {
                slot: SlotIndex(slot),
                generation,
            }
            .to_imm(),
        ),
        checksum: None,
    }
}

/// The peer every test sender is, and its credential at `listener`, with `slots` granted
/// to it under `generation`.
pub(crate) fn attach<M>(
    listener: &kvx_io::FabricListener<M>,
    slots: std::ops::Range<u32>,
    generation: u32,
) -> kvx_io::FabricCredential {
    for slot in slots {
        listener.access.grant(slot, PeerId(1), generation);
    }
    listener.access.credential_for(PeerId(1))
}

pub(crate) async fn completions(
    conn: &mut FabricConn,
    n: usize,
) -> Vec<(u64, Result<(), FabricError>)> {
    let mut out = Vec::new();
    for _ in 0..n {
        let c = tokio::time::timeout(STEP, conn.next_completion())
            .await
            .expect("a completion in time")
            .expect("connection open");
        out.push((c.id.0, c.result));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_error_mid_stream_flushes_the_rest_in_order_and_later_posts_too() {
    let (f, verbs) = fabric();
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(8, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(4, 1024).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..8, 1);
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    verbs.fail_write_after(2);
    for i in 0..6 {
        conn.post(write(i, i as u32, 1)).expect("post");
    }
    let out = completions(&mut conn, 6).await;
    let ids: Vec<u64> = out.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, vec![0, 1, 2, 3, 4, 5], "completions in posting order");
    assert_eq!(out[0].1, Ok(()));
    assert_eq!(out[1].1, Ok(()));
    assert!(
        matches!(&out[2].1, Err(FabricError::Io(m)) if m.contains("retry counter exceeded")),
        "{:?}",
        out[2]
    );
    assert!(out[3..]
        .iter()
        .all(|(_, r)| *r == Err(FabricError::Flushed)));
    // The receiver heard of exactly the writes that landed, with their tags.
    for slot in 0..2 {
        let landed = tokio::time::timeout(STEP, listener.landed.recv())
            .await
            .expect("notice")
            .expect("listener open");
        let tag = landed.tag;
        assert_eq!((tag.slot, tag.generation), (SlotIndex(slot), 1));
        assert_eq!((landed.peer, landed.bytes), (PeerId(1), 1024));
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(200), listener.landed.recv())
            .await
            .is_err(),
        "nothing else landed"
    );
    conn.post(write(6, 0, 2))
        .expect("a dead connection still takes posts");
    assert_eq!(
        completions(&mut conn, 1).await,
        vec![(6, Err(FabricError::Flushed))]
    );
    assert_eq!(verbs.writes_applied(), 2);
    drop(conn);
    // Both queue pairs are gone: the sender's with its task, the receiver's after the fence.
    wait_until(|| verbs.live_qps() == 0).await;
}

async fn wait_until(mut f: impl FnMut() -> bool) {
    tokio::time::timeout(STEP, async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("condition reached in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_listener_fails_the_writes_of_its_senders() {
    let (f, verbs) = fabric();
    let listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(4, 1024).expect("a geometry"))
        .expect("staging");
    staging.write_slot(0, &[9; 1024]);
    let credential = attach(&listener, 0..4, 1);
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    conn.post(write(0, 0, 1)).expect("post");
    assert_eq!(completions(&mut conn, 1).await, vec![(0, Ok(()))]);
    let mut got = [0u8; 1024];
    listener.memory.read_slot(0, &mut got);
    assert_eq!(got, [9; 1024], "the bytes landed");
    drop(listener);
    wait_until(|| verbs.live_qps() == 1).await;
    conn.post(write(1, 1, 1)).expect("post");
    let out = completions(&mut conn, 1).await;
    assert!(
        out[0].1.is_err(),
        "a write to a gone receiver fails: {out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_refusals_and_mismatches_are_clear_errors() {
    let (f, _) = fabric();
    let small = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(2, 512).expect("a geometry"),
        )
        .await
        .expect("expose");
    let credential = attach(&small, 0..0, 1);
    for bytes in [1024, 256] {
        let staging = f
            .allocate_staging(SlotGeometry::new(2, bytes).expect("a geometry"))
            .expect("staging");
        let e = f
            .connect(&small.local_endpoint, staging, credential)
            .await
            .expect_err("staging slots of another size than the receiver's");
        assert!(
            matches!(&e, FabricError::Incompatible { why, .. } if why.contains(&bytes.to_string()) && why.contains("512")),
            "{e}"
        );
    }
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 1024).expect("a geometry"))
        .expect("staging");
    let (other, _) = fabric();
    let foreign = other
        .allocate_staging(SlotGeometry::new(2, 512).expect("a geometry"))
        .expect("staging");
    let e = f
        .connect(&small.local_endpoint, foreign, credential)
        .await
        .expect_err("staging of another device");
    assert!(
        e.to_string().contains("not allocated by this RdmaFabric"),
        "{e}"
    );
    drop(small);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let nothing = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let endpoint = nothing.local_addr().expect("addr").to_string();
    drop(nothing);
    assert_eq!(
        f.connect(&endpoint, staging, credential).await.err(),
        Some(FabricError::NotExposed(endpoint))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_endpoint_times_out_instead_of_hanging() {
    let verbs = FakeVerbs::new();
    let config = RdmaConfig {
        connect_timeout: Duration::from_millis(200),
        ..RdmaConfig::default()
    };
    let f = RdmaFabric::with_verbs(verbs, config).expect("fabric");
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let endpoint = silent.local_addr().expect("addr").to_string();
    let staging = f
        .allocate_staging(SlotGeometry::new(1, 64).expect("a geometry"))
        .expect("staging");
    let credential = FabricAccess::new(1, [0; 16]).credential_for(PeerId(1));
    let e = tokio::time::timeout(STEP, f.connect(&endpoint, staging, credential))
        .await
        .expect("bounded")
        .expect_err("no welcome");
    assert!(e.to_string().contains("frame"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_writes_through_a_small_window_with_receives_reposted() {
    let (f, _) = fabric();
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 256).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging: Arc<_> = f
        .allocate_staging(SlotGeometry::new(2, 256).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..0, 1);
    let mut conn = f
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("connect");
    // Far more writes with immediate than receives were first posted (2 + 16).
    for i in 0..200u64 {
        let slot = (i % 2) as u32;
        staging.write_slot(slot, &[i as u8; 256]);
        listener.access.grant((i % 4) as u32, PeerId(1), i as u32);
        conn.post(PostWrite {
            len: 256,
            local: StagingSlot(slot),
            ..write(i, (i % 4) as u32, i as u32)
        })
        .expect("post");
        assert_eq!(completions(&mut conn, 1).await, vec![(i, Ok(()))]);
        let landed = tokio::time::timeout(STEP, listener.landed.recv())
            .await
            .expect("notice")
            .expect("open");
        assert_eq!(landed.slot, SlotIndex((i % 4) as u32));
        let mut got = [0u8; 256];
        listener.memory.read_slot((i % 4) as u32, &mut got);
        assert_eq!(got, [i as u8; 256]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_beyond_the_posted_receives_waits_for_reposts_and_loses_nothing() {
    let (f, _) = fabric();
    // 100 slots, each granted once: a grant admits one write.
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(100, 128).expect("a geometry"),
        )
        .await
        .expect("expose");
    // 2 staging slots: the receiver posts 2 + 16 receives; 100 writes go out at once.
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 128).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..100, 7);
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    for i in 0..100u64 {
        conn.post(PostWrite {
            len: 128,
            local: StagingSlot((i % 2) as u32),
            ..write(i, i as u32, 7)
        })
        .expect("post");
    }
    let out = completions(&mut conn, 100).await;
    assert!(out
        .iter()
        .enumerate()
        .all(|(i, c)| *c == (i as u64, Ok(()))));
    for i in 0..100u32 {
        let landed = tokio::time::timeout(STEP, listener.landed.recv())
            .await
            .expect("notice")
            .expect("open");
        assert_eq!((landed.slot, landed.tag.generation), (SlotIndex(i), 7));
    }
}

/// A path-MTU cap on the receiver alone: both queue pairs must run at the capped MTU, or the
/// receiver's NIC rejects every write longer than one packet (the model does, as rxe does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mtu_cap_on_one_side_is_the_path_mtu_of_both() {
    let sender_nic = FakeVerbs::new();
    let receiver_nic = sender_nic.another_device();
    let config = RdmaConfig {
        fence_timeout: Duration::from_secs(2),
        ..RdmaConfig::default()
    };
    let rx = RdmaFabric::with_verbs(
        receiver_nic,
        RdmaConfig {
            mtu: Some(PathMtu::Mtu1024),
            ..config.clone()
        },
    )
    .expect("receiver's fabric");
    let tx = RdmaFabric::with_verbs(sender_nic, config).expect("sender's fabric");
    let mut listener = rx
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 4096).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = tx
        .allocate_staging(SlotGeometry::new(4, 4096).expect("a geometry"))
        .expect("staging");
    staging.write_slot(0, &[0x5A; 4096]);
    let credential = attach(&listener, 0..4, 1);
    let mut conn = tx
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    conn.post(PostWrite {
        len: 4096,
        ..write(1, 0, 1)
    })
    .expect("post");
    assert_eq!(completions(&mut conn, 1).await, vec![(1, Ok(()))]);
    let landed = tokio::time::timeout(STEP, listener.landed.recv())
        .await
        .expect("notice")
        .expect("open");
    assert_eq!((landed.slot, landed.bytes), (SlotIndex(0), 4096));
    let mut got = vec![0u8; 4096];
    listener.memory.read_slot(0, &mut got);
    assert!(got.iter().all(|&b| b == 0x5A));
}

/// Writes the sender saw succeed are announced even when their receive completions still
/// wait in the receiver's completion queue as the fence comes: the receiver drains its queue
/// pair before destroying it (destroying it would purge them, as mlx5 does, and the model).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_still_announces_the_writes_that_landed_before_it() {
    let mut held = four_writes_held_at_the_receiver().await;
    // The fence: the receiver's queue pair goes to ERROR with the four receive completions
    // still in its queue.
    drop(held.conn.take());
    held.announced_after_release().await;
}

/// Four writes that completed at the sender, their receive completions held in the
/// receiver's completion queue (two devices on one wire: `hold_completions` holds the
/// receiver's only).
struct HeldWrites {
    receiver_nic: FakeVerbs,
    listener: kvx_io::FabricListener<crate::RdmaMemory>,
    /// The sender's connection; dropping it fences.
    conn: Option<FabricConn>,
    _fabrics: (RdmaFabric<FakeVerbs>, RdmaFabric<FakeVerbs>),
}

async fn four_writes_held_at_the_receiver() -> HeldWrites {
    let sender_nic = FakeVerbs::new();
    let receiver_nic = sender_nic.another_device();
    let config = RdmaConfig {
        fence_timeout: Duration::from_secs(2),
        ..RdmaConfig::default()
    };
    let rx = RdmaFabric::with_verbs(receiver_nic.clone(), config.clone()).expect("fabric");
    let tx = RdmaFabric::with_verbs(sender_nic, config).expect("fabric");
    let listener = rx
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = tx
        .allocate_staging(SlotGeometry::new(4, 1024).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..4, 1);
    let mut conn = tx
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    receiver_nic.hold_completions(true);
    for i in 0..4 {
        conn.post(write(i, i as u32, 1)).expect("post");
    }
    let done = completions(&mut conn, 4).await;
    assert!(done.iter().all(|(_, r)| r.is_ok()), "{done:?}");
    HeldWrites {
        receiver_nic,
        listener,
        conn: Some(conn),
        _fabrics: (rx, tx),
    }
}

impl HeldWrites {
    /// After whatever broke the connection has had its effect, the completions go on to
    /// the receiver: each of the four writes is announced.
    async fn announced_after_release(mut self) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.receiver_nic.hold_completions(false);
        for slot in 0..4 {
            let landed = tokio::time::timeout(STEP, self.listener.landed.recv())
                .await
                .expect("every write that landed is announced")
                .expect("open");
            assert_eq!(landed.slot, SlotIndex(slot));
        }
    }
}

/// After an idle spell the poller is parked; a write posted then completes, and is announced,
/// at once, because the post wakes the poller: with parks of 3 s, within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_after_an_idle_spell_completes_at_once() {
    let long = Duration::from_secs(3);
    let idle = crate::wake::IdleWait {
        short: long,
        short_for: Duration::ZERO,
        long,
    };
    let f = RdmaFabric::with_verbs_idling(FakeVerbs::new(), RdmaConfig::default(), idle)
        .expect("fabric");
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 1024).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..4, 1);
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    tokio::time::sleep(Duration::from_millis(200)).await; // the poller parks
    conn.post(write(1, 0, 1)).expect("post");
    let done = tokio::time::timeout(Duration::from_secs(1), conn.next_completion())
        .await
        .expect("completed well within the poller's park")
        .expect("open");
    assert_eq!((done.id.0, done.result), (1, Ok(())));
    let landed = tokio::time::timeout(Duration::from_secs(1), listener.landed.recv())
        .await
        .expect("announced well within the poller's park")
        .expect("open");
    assert_eq!(landed.slot, SlotIndex(0));
}

/// The side channel's budget: idle sockets past `connections_max` (some that never greet,
/// some that sent part of a hello) are closed for newcomers long before their hello deadline,
/// so at most `connections_max` stay open, a sender still attaches and its writes land, and
/// it is never closed for an idle newcomer afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_side_channel_connections_go_for_newcomers() {
    use tokio::io::AsyncWriteExt;
    let config = RdmaConfig {
        hello_timeout: Duration::from_secs(60),
        connections_max: 8,
        connections_per_source_max: 8,
        ..RdmaConfig::default()
    };
    let f = RdmaFabric::with_verbs(FakeVerbs::new(), config).expect("fabric");
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let addr = listener
        .local_endpoint
        .trim_start_matches("tcp://")
        .to_owned();
    let mut idle = Vec::new();
    for i in 0..24 {
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        if i % 2 == 1 {
            s.write_all(&[0u8; 3]).await.expect("part of a hello");
        }
        idle.push(s);
    }
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 1024).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..4, 1);
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("a sender attaches past idle sockets");
    conn.post(write(1, 0, 1)).expect("post");
    assert_eq!(completions(&mut conn, 1).await, vec![(1, Ok(()))]);
    let landed = tokio::time::timeout(STEP, listener.landed.recv())
        .await
        .expect("announced")
        .expect("open");
    assert_eq!(landed.slot, SlotIndex(0));
    // 25 connections came and 8 places exist: at least 17 idle ones were closed, well
    // before their 60 s hello deadline.
    let closed = closed_within(&mut idle, Duration::from_secs(2)).await;
    assert!(closed >= 17, "only {closed} of 24 idle connections closed");
    // More idle newcomers close idle ones, never the attached sender: it still writes.
    for _ in 0..16 {
        idle.push(
            tokio::net::TcpStream::connect(&addr)
                .await
                .expect("connect"),
        );
    }
    conn.post(write(2, 1, 1)).expect("post");
    assert_eq!(completions(&mut conn, 1).await, vec![(2, Ok(()))]);
}

/// A side-channel connection that sends part of its hello and then nothing is closed at
/// `hello_timeout`, however long `connect_timeout` is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_that_never_ends_is_closed_at_the_hello_deadline() {
    use tokio::io::AsyncWriteExt;
    let config = RdmaConfig {
        hello_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_secs(60),
        ..RdmaConfig::default()
    };
    let f = RdmaFabric::with_verbs(FakeVerbs::new(), config).expect("fabric");
    let listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let addr = listener
        .local_endpoint
        .trim_start_matches("tcp://")
        .to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    s.write_all(&[0u8; 3]).await.expect("part of a hello");
    let mut one = vec![s];
    assert_eq!(closed_within(&mut one, Duration::from_secs(5)).await, 1);
}

/// How many of `sockets` the other side has closed (EOF or reset) within `wait` in all.
async fn closed_within(sockets: &mut [tokio::net::TcpStream], wait: Duration) -> usize {
    use tokio::io::AsyncReadExt;
    let by = tokio::time::Instant::now() + wait;
    let mut closed = 0;
    for s in sockets {
        let mut b = [0u8; 64];
        let left = by.saturating_duration_since(tokio::time::Instant::now());
        if let Ok(Ok(0) | Err(_)) = tokio::time::timeout(left, s.read(&mut b)).await {
            closed += 1;
        }
    }
    closed
}

/// A queue pair's fatal error (QP_FATAL) still lets the receiver drain its receive queue: the
/// completion queue works, so every write the sender saw succeed before the error is
/// announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_queue_pair_still_announces_the_writes_that_landed_before_it() {
    let held = four_writes_held_at_the_receiver().await;
    // The receiver's queue pair fails with the four receive completions still queued.
    let receiving_qpn = held.receiver_nic.qpns()[0];
    held.receiver_nic
        .inject_event(crate::verbs::DeviceEvent::QpFatal { qpn: receiving_qpn });
    held.announced_after_release().await;
}

/// A fence while writes are outstanding — the sender's owner resets the connection (a stalled
/// write, say), which fences the receiver over the side channel (not a close) — with the
/// receiver's completions still held: every write the sender saw succeed is announced, with its
/// checksum matched, and none more. Thirty writes against 20 posted receives (4 staging slots
/// + 16 of slack) held unreposted: 20 land, 10 wait for a receive (RNR) and are flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_with_writes_outstanding_announces_exactly_what_completed_ok() {
    let sender_nic = FakeVerbs::new();
    let receiver_nic = sender_nic.another_device();
    let config = RdmaConfig {
        fence_timeout: Duration::from_secs(2),
        ..RdmaConfig::default()
    };
    let rx = RdmaFabric::with_verbs(receiver_nic.clone(), config.clone()).expect("fabric");
    let tx = RdmaFabric::with_verbs(sender_nic, config).expect("fabric");
    let mut listener = rx
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(32, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = tx
        .allocate_staging(SlotGeometry::new(4, 1024).expect("a geometry"))
        .expect("staging");
    for slot in 0..4 {
        staging.write_slot(slot, &[slot as u8 + 1; 1024]);
    }
    let credential = attach(&listener, 0..32, 1);
    let mut conn = tx
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    receiver_nic.hold_completions(true);
    for i in 0..30u64 {
        conn.post(PostWrite {
            checksum: Some(kvx_io::chunk_checksum(&[(i % 4) as u8 + 1; 1024])),
            ..write(i, i as u32, 1)
        })
        .expect("post");
    }
    let mut ok = completions(&mut conn, 20).await;
    assert!(ok.iter().all(|(_, r)| r.is_ok()), "{ok:?}");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), conn.next_completion())
            .await
            .is_err(),
        "ten writes are outstanding"
    );
    conn.reset();
    // The receiver answers the fence only after its drain, which waits for the held
    // completions: let them go a while after the fence reached it.
    let release = {
        let nic = receiver_nic.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            nic.hold_completions(false);
        })
    };
    let rest = completions(&mut conn, 10).await;
    assert!(
        rest.iter().all(|(_, r)| *r == Err(FabricError::Flushed)),
        "{rest:?}"
    );
    ok.retain(|(_, r)| r.is_ok());
    release.await.expect("released");
    let mut landed = Vec::new();
    while let Ok(Some(l)) =
        tokio::time::timeout(Duration::from_millis(500), listener.landed.recv()).await
    {
        assert_eq!(l.checksum, kvx_io::ChecksumCheck::Match, "{l:?}");
        landed.push(u64::from(l.slot.0));
    }
    let ok: Vec<u64> = ok.into_iter().map(|(id, _)| id).collect();
    assert_eq!(landed, ok, "Landed notices against Ok completions");
}

/// A receive buffer lent in parts that are separate allocations (per-layer tensors,
/// `ExternalRegion::join`) is refused with the reason: one registration covers one range.
/// (Parts of one allocation are one range: `tests_node`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(unsafe_code)] // the test lends its own memory (`ExternalRegion::new`)
async fn a_buffer_lent_in_parts_is_refused_saying_why() {
    let f = RdmaFabric::with_verbs(FakeVerbs::new(), RdmaConfig::default()).expect("fabric");
    let parts = (0..2)
        .map(|_| {
            let mut layer = vec![0u8; 4 * 1024].into_boxed_slice();
            let (ptr, len) = (layer.as_mut_ptr(), layer.len());
            // SAFETY: `ptr` is `layer`'s bytes, which the region keeps; refused before any use.
            unsafe { kvx_io::ExternalRegion::new(ptr, len, 1024, Box::new(layer)) }.expect("a part")
        })
        .collect();
    let joined = kvx_io::ExternalRegion::join(parts).expect("two equal parts");
    let refused = f.expose_in("127.0.0.1:0", joined).await;
    assert!(
        matches!(&refused, Err(FabricError::Allocation(why)) if why.contains("2 separate parts")),
        "{:?}",
        refused.map(|_| ())
    );
}
