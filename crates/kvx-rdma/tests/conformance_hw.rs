//! The kvx-io conformance bodies against `RdmaFabric` on a real device (feature `rdma`).
//! Skipped, with a message, where no device can be opened (no libibverbs, no NIC, no
//! Soft-RoCE). `KVX_RDMA_DEVICE` / `KVX_RDMA_GID_INDEX` pick the device and GID; the side
//! channel runs on 127.0.0.1, so both ends of each test share the one device (loopback
//! through the NIC). `KVX_REQUIRE_RDMA=1` turns a skip into a failure (for machines that have
//! a device and must test it). `scripts/rdma-first-run.sh` runs these on a first machine.
#![cfg(feature = "rdma")]

use std::time::Duration;

use kvx_io::SlotGeometry;
use kvx_io::{conformance, Fabric, FabricConn, FabricListener, PostWrite, SlotMemory};
use kvx_proto::{PeerId, SlotIndex, StagingSlot, WriteId, WriteTag};
use kvx_rdma::verbs::Verbs;
use kvx_rdma::{IbvFabric, PathMtu, RdmaConfig, RdmaError, RdmaFabric, RdmaMemory};

const STEP: Duration = Duration::from_secs(20);

fn open() -> Option<IbvFabric> {
    open_with(None)
}

/// The device, with the path MTU capped at `mtu` when given.
fn open_with(mtu: Option<PathMtu>) -> Option<IbvFabric> {
    let config = RdmaConfig {
        mtu,
        device: std::env::var("KVX_RDMA_DEVICE").ok(),
        gid_index: std::env::var("KVX_RDMA_GID_INDEX")
            .ok()
            .and_then(|s| s.parse().ok()),
        ..RdmaConfig::default()
    };
    match RdmaFabric::open(config) {
        Ok(f) => Some(f),
        Err(e @ RdmaError::NoDevice(_)) => {
            assert!(
                std::env::var("KVX_REQUIRE_RDMA").as_deref() != Ok("1"),
                "KVX_REQUIRE_RDMA=1 but {e}"
            );
            eprintln!("SKIPPED: RDMA conformance needs a device: {e}");
            None
        }
        Err(e) => panic!("an RDMA device is present but cannot be used: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_writes_land_in_order() {
    let Some(f) = open() else { return };
    conformance::fabric_writes_land_in_order(&f, "127.0.0.1:0", 16, 4096).await;
    conformance::fabric_writes_land_in_order(&f, "127.0.0.1:0", 8, 1 << 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_reset_flushes() {
    let Some(f) = open() else { return };
    conformance::fabric_reset_flushes(&f, "127.0.0.1:0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_uses_memory_the_caller_owns() {
    let Some(f) = open() else { return };
    conformance::fabric_uses_memory_the_caller_owns(&f, "127.0.0.1:0", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_rejects_out_of_bounds() {
    let Some(f) = open() else { return };
    conformance::fabric_rejects_out_of_bounds(&f, "127.0.0.1:0").await;
}

#[test]
fn without_a_device_open_says_so_and_does_not_panic() {
    // Whatever this machine has, opening is an answer, never a panic; a named device that is
    // not there is an error that lists what is.
    let named = RdmaFabric::open(RdmaConfig {
        device: Some("kvx-no-such-device".into()),
        ..RdmaConfig::default()
    });
    match named {
        Err(RdmaError::NoDevice(m)) => assert!(!m.is_empty()),
        Err(RdmaError::DeviceNotFound { name, .. }) => assert_eq!(name, "kvx-no-such-device"),
        other => panic!("unexpected {other:?}"),
    }
}

/// `slots` of the listener granted to the test's one sender under `generation`, and its
/// credential there.
fn attach(
    listener: &FabricListener<RdmaMemory>,
    slots: std::ops::Range<u32>,
    generation: u32,
) -> kvx_io::FabricCredential {
    for slot in slots {
        listener.access.grant(slot, PeerId(1), generation);
    }
    listener.access.credential_for(PeerId(1))
}

fn tagged(id: u64, local: u32, remote: u32, len: usize, generation: u32) -> PostWrite {
    PostWrite {
        id: WriteId(id),
        local: StagingSlot(local),
        remote: SlotIndex(remote),
        len,
        imm: Some(
            WriteTag {
                slot: SlotIndex(remote),
                generation,
            }
            .to_imm(),
        ),
        checksum: None,
    }
}

async fn all_ok(conn: &mut FabricConn, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        let c = tokio::time::timeout(STEP, conn.next_completion())
            .await
            .expect("a completion in time")
            .expect("connection open");
        assert!(c.result.is_ok(), "write {:?}: {:?}", c.id, c.result);
        ok += 1;
    }
    ok
}

/// An MTU cap on the receiver only, one step below the port's active MTU whatever it is (a
/// cap at or above it would change nothing: RoCE behind a 1500-byte netdev runs at 1024):
/// both queue pairs must run at it, or every chunk larger than one packet fails ("remote
/// invalid request").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_mtu_cap_on_the_receiver_only() {
    let Some(tx) = open() else { return };
    let active = tx.verbs().port().mtu;
    let Some(cap) = PathMtu::from_code(active.saturating_sub(1)) else {
        panic!("the port's active MTU (verbs code {active}) has no smaller MTU to cap at");
    };
    let Some(rx) = open_with(Some(cap)) else {
        return;
    };

    let mut listener = rx
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(8, 1 << 20).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = tx
        .allocate_staging(SlotGeometry::new(8, 1 << 20).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..8, 1);
    let mut conn = tx
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    for i in 0..8 {
        conn.post(tagged(i, i as u32, i as u32, 1 << 20, 1))
            .expect("post");
    }
    assert_eq!(all_ok(&mut conn, 8).await, 8);
    for _ in 0..8 {
        tokio::time::timeout(STEP, listener.landed.recv())
            .await
            .expect("landed")
            .expect("open");
    }
}

/// A staging pool of exactly the most slots the device takes — `max_qp_wr`, or fewer where
/// the completion queue is smaller (rxe: max_qp_wr 2^20, max_cqe 32767) — every slot's write
/// in flight at once; one slot more is refused naming the limit, before anything is pinned.
/// The receiver runs on a fabric of its own, so the sender's completion queue holds only the
/// sender's queue pair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_staging_at_the_devices_max_qp_wr() {
    let Some(f) = open() else { return };
    let Some(receiving) = open() else { return };
    let limits = f.verbs().limits();
    let max = limits.max_staging_slots();
    match f.allocate_staging(SlotGeometry::new(max + 1, 4096).expect("a geometry")) {
        Ok(_) => panic!("a staging of {} slots was accepted ({limits:?})", max + 1),
        Err(e) => {
            let e = e.to_string();
            assert!(
                e.contains("max_qp_wr") || e.contains("completion queue"),
                "{e}"
            );
        }
    }
    let listener = receiving
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(64, 4096).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(max, 4096).expect("a geometry"))
        .expect("staging at the most slots");
    let credential = attach(&listener, 0..0, 1);
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    // Without immediates: no receive consumed, nothing announced; the send queue is what is
    // tested.
    for i in 0..u64::from(max) {
        conn.post(PostWrite {
            imm: None,
            ..tagged(i, i as u32, (i % 64) as u32, 4096, 1)
        })
        .expect("post");
    }
    assert_eq!(all_ok(&mut conn, max as usize).await, max as usize);
}

/// After an idle spell (the poller asleep), a fence: every write the sender saw succeed is
/// announced by the receiver, none more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_fence_after_an_idle_receiver_announces_what_landed() {
    let Some(f) = open() else { return };
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(16, 65536).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(16, 65536).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..16, 1);
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    for i in 0..16 {
        conn.post(tagged(i, i as u32, i as u32, 65536, 1))
            .expect("post");
    }
    let ok = all_ok(&mut conn, 16).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    drop(conn);
    let mut landed = 0;
    while let Ok(Some(_)) =
        tokio::time::timeout(Duration::from_secs(3), listener.landed.recv()).await
    {
        landed += 1;
    }
    assert_eq!(landed, ok, "Landed notices against Ok completions");
}

/// A fence while writes are outstanding (a reset, which fences over the side channel; not a
/// close): every write the sender saw succeed is announced, its checksum matched. On hardware
/// a write can land while its requester is already in ERROR (its ACK lost to the flush), so a
/// flushed write may be announced too; an `Ok` one never goes unannounced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_fence_with_writes_outstanding_announces_every_ok_write() {
    let Some(f) = open() else { return };
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(16, 65536).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(16, 65536).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..16, 1);
    let mut conn = f
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("connect");
    for i in 0..16u32 {
        let bytes = vec![i as u8 + 1; 65536];
        staging.write_slot(i, &bytes);
        conn.post(PostWrite {
            checksum: Some(kvx_io::chunk_checksum(&bytes)),
            ..tagged(u64::from(i), i, i, 65536, 1)
        })
        .expect("post");
    }
    conn.reset();
    let mut ok = Vec::new();
    for _ in 0..16 {
        let c = tokio::time::timeout(STEP, conn.next_completion())
            .await
            .expect("a completion in time")
            .expect("connection open");
        if c.result.is_ok() {
            ok.push(c.id.0);
        }
    }
    let mut landed = Vec::new();
    while let Ok(Some(l)) =
        tokio::time::timeout(Duration::from_secs(3), listener.landed.recv()).await
    {
        assert_eq!(l.checksum, kvx_io::ChecksumCheck::Match, "{l:?}");
        landed.push(u64::from(l.slot.0));
    }
    assert!(
        ok.iter().all(|id| landed.contains(id)),
        "Landed {landed:?} against Ok {ok:?}"
    );
    assert!(landed.len() <= 16);
}
