//! What kvx asks of the device, over the NIC model: its limits (`limits`; a geometry beyond
//! them is refused up front naming the limit, and a receiver posts no more receives than a
//! queue holds), least-privilege access rights (only a receiver's buffer and queue pair
//! take peers' writes), GIDs of one kind on both ends, verbs calls that block kept off the
//! runtime's workers, and the device's asynchronous events acted on.

use std::time::Duration;

use std::sync::Arc;

use kvx_io::SlotGeometry;
use kvx_io::{Fabric, FabricError, PostWrite, SlotMemory};
use kvx_proto::StagingSlot;

use crate::fake::FakeVerbs;
use crate::memory::RdmaMemory;
use crate::tests::{attach, completions, write};
use crate::verbs::{
    DeviceEvent, Qp, RemoteAccess, RtrParams, Transition, Verbs, WcKind, WcStatus, WriteWr,
};
use crate::wire::{GidKind, QpAddr};
use crate::{DeviceLimits, RdmaConfig, RdmaFabric};

const LIMITS: DeviceLimits = DeviceLimits {
    max_qp_wr: 8,
    max_cqe: 1024,
    cq_entries: 1024,
    max_msg_sz: 4096,
    max_mr_size: 64 * 4096,
    memlock_bytes: None,
};

fn fabric() -> RdmaFabric<FakeVerbs> {
    fabric_on(FakeVerbs::new().with_limits(LIMITS))
}

/// A fabric over `verbs` with a short fence timeout (a broken connection's flush is bounded
/// by it).
fn fabric_on(verbs: FakeVerbs) -> RdmaFabric<FakeVerbs> {
    let config = RdmaConfig {
        fence_timeout: Duration::from_secs(1),
        ..RdmaConfig::default()
    };
    RdmaFabric::with_verbs(verbs, config).expect("fabric")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_geometry_beyond_the_devices_limits_is_refused_naming_the_limit() {
    let f = fabric();
    let refused = |r: Result<_, kvx_io::FabricError>, limit: &str| {
        let e = r.expect_err("refused").to_string();
        assert!(e.contains(limit), "{e}");
    };
    refused(
        f.allocate_staging(SlotGeometry::new(9, 1024).expect("a geometry"))
            .map(|_| ()),
        "max_qp_wr",
    );
    refused(
        f.allocate_staging(SlotGeometry::new(2, 8192).expect("a geometry"))
            .map(|_| ()),
        "max_msg_sz",
    );
    refused(
        f.expose(
            "127.0.0.1:0",
            SlotGeometry::new(65, 4096).expect("a geometry"),
        )
        .await
        .map(|_| ()),
        "max_mr_size",
    );
    refused(
        f.expose(
            "127.0.0.1:0",
            SlotGeometry::new(1, 4097).expect("a geometry"),
        )
        .await
        .map(|_| ()),
        "max_msg_sz",
    );
    assert!(f
        .allocate_staging(SlotGeometry::new(8, 4096).expect("a geometry"))
        .is_ok());
    assert!(f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(64, 4096).expect("a geometry")
        )
        .await
        .is_ok());

    // A completion queue smaller than max_qp_wr allows (rxe: max_qp_wr 2^20, max_cqe
    // 32767): the staging is refused before anything is pinned, not at connect.
    let small_cq = fabric_on(FakeVerbs::new().with_limits(DeviceLimits {
        cq_entries: 6,
        ..LIMITS
    }));
    refused(
        small_cq
            .allocate_staging(SlotGeometry::new(6, 1024).expect("a geometry"))
            .map(|_| ()),
        "completion queue",
    );
    assert!(small_cq
        .allocate_staging(SlotGeometry::new(5, 1024).expect("a geometry"))
        .is_ok());

    // The process's locked-memory limit: the error says which limit and what to set.
    let memlock = fabric_on(FakeVerbs::new().with_limits(DeviceLimits {
        memlock_bytes: Some(16 * 4096),
        ..LIMITS
    }));
    refused(
        memlock
            .expose(
                "127.0.0.1:0",
                SlotGeometry::new(17, 4096).expect("a geometry"),
            )
            .await
            .map(|_| ()),
        "RLIMIT_MEMLOCK",
    );
    refused(
        memlock
            .allocate_staging(SlotGeometry::new(8, 4096).expect("a geometry"))
            .and(memlock.allocate_staging(SlotGeometry::new(5, 8192).expect("a geometry")))
            .map(|_| ()),
        "max_msg_sz",
    );
    assert!(memlock
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(16, 4096).expect("a geometry")
        )
        .await
        .is_ok());
}

/// The receiver wants a receive per staging slot plus `recv_slack` (4 + 16) but the device
/// holds 8 per queue: it posts 8, and the writes beyond them wait for reposts (RNR).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_posts_no_more_receives_than_a_queue_holds() {
    let f = fabric();
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(40, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(4, 1024).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..40, 3);
    let mut conn = f
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("connect with a clamped receive queue");
    for i in 0..40u64 {
        staging.write_slot((i % 4) as u32, &[i as u8; 1024]);
        conn.post(PostWrite {
            local: StagingSlot((i % 4) as u32),
            ..write(i, i as u32, 3)
        })
        .expect("post");
        if i % 4 == 3 {
            let done = completions(&mut conn, 4).await;
            assert!(done.iter().all(|(_, r)| r.is_ok()), "{done:?}");
        }
    }
    for _ in 0..40 {
        tokio::time::timeout(Duration::from_secs(10), listener.landed.recv())
            .await
            .expect("notice")
            .expect("open");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_receivers_buffer_and_queue_pair_take_peers_writes() {
    let verbs = FakeVerbs::new();
    let f = RdmaFabric::with_verbs(verbs.clone(), RdmaConfig::default()).expect("fabric");
    let listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 1024).expect("a geometry"))
        .expect("staging");
    let rkey = |m: &RdmaMemory| m.keys().expect("registered").rkey;
    assert_eq!(
        verbs.registration_access(rkey(&staging)),
        Some(RemoteAccess::None)
    );
    assert_eq!(
        verbs.registration_access(rkey(&listener.memory)),
        Some(RemoteAccess::Write)
    );
    let credential = attach(&listener, 0..4, 1);
    let _conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    // The sender's queue pair is created first, the receiver's as it answers.
    assert_eq!(
        verbs.qp_access(),
        vec![RemoteAccess::None, RemoteAccess::Write]
    );
}

/// The model enforces what the test above checks kvx asks for: a write into memory, or
/// through a queue pair, without remote write access fails with a remote access error; and a
/// poll takes at most as many completions as it is asked for.
#[test]
fn the_model_refuses_writes_without_remote_access_and_bounds_a_poll() {
    const WRITES: u64 = 100;
    let verbs = FakeVerbs::new();
    let source = Arc::new(
        RdmaMemory::anonymous(SlotGeometry::new(1, 64).expect("a geometry")).expect("memory"),
    );
    verbs
        .register(&source, RemoteAccess::None)
        .expect("register");
    let outcome = |target_access: RemoteAccess, qp_access: RemoteAccess| {
        let target = Arc::new(
            RdmaMemory::anonymous(SlotGeometry::new(1, 64).expect("a geometry")).expect("memory"),
        );
        verbs.register(&target, target_access).expect("register");
        let mut a = Qp::new(verbs.create_qp(1, 1).expect("qp"));
        let mut b = Qp::new(verbs.create_qp(1, 1).expect("qp"));
        a.modify(Transition::Init(RemoteAccess::None))
            .expect("init");
        b.modify(Transition::Init(qp_access)).expect("init");
        let addr = |qpn| QpAddr {
            qpn,
            ..QpAddr::default()
        };
        let (qa, qb) = (a.qpn(), b.qpn());
        a.modify(Transition::Rtr(RtrParams {
            remote: addr(qb),
            mtu: 5,
        }))
        .expect("rtr");
        b.modify(Transition::Rtr(RtrParams {
            remote: addr(qa),
            mtu: 5,
        }))
        .expect("rtr");
        a.modify(Transition::Rts { psn: 0 }).expect("rts");
        let keys = target.keys().expect("keys");
        for wr_id in 7..7 + WRITES {
            a.post_write(&WriteWr {
                wr_id,
                staging: &source,
                local_slot: 0,
                len: 64,
                remote_addr: keys.addr,
                rkey: keys.rkey,
                imm: None,
            })
            .expect("post");
        }
        // A poll hands out at most what it is asked for; the rest waits for the next.
        let mut wcs = Vec::new();
        verbs.poll(&mut wcs, 64).expect("poll");
        let first = wcs.len();
        verbs.poll(&mut wcs, 64).expect("poll");
        let wc = wcs
            .iter()
            .find(|w| w.wr_id == 7)
            .copied()
            .expect("a completion");
        (wc.status, wc.kind, first, wcs.len())
    };
    // Writes that succeed leave one completion each (a failing one flushes the rest).
    let (status, kind, first, all) = outcome(RemoteAccess::Write, RemoteAccess::Write);
    assert_eq!((status, kind), (WcStatus::Success, WcKind::Write));
    assert_eq!((first, all), (64, WRITES as usize));
    for (memory, qp) in [
        (RemoteAccess::None, RemoteAccess::Write),
        (RemoteAccess::Write, RemoteAccess::None),
    ] {
        let (status, _, _, _) = outcome(memory, qp);
        assert!(
            matches!(
                status,
                WcStatus::Failed {
                    name: "remote access error",
                    ..
                }
            ),
            "{memory:?} memory through a {qp:?} queue pair: {status:?}"
        );
    }
}

/// A RoCE v1 sender and a RoCE v2 receiver cannot understand each other's packets (the model
/// drops them, and a write would end in "retry counter exceeded" after its retries): the
/// connection is refused at once, naming both kinds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gids_of_different_kinds_are_refused_naming_both() {
    let sender_nic = FakeVerbs::new().with_gid_kind(GidKind::RoceV1);
    let receiver_nic = sender_nic.another_device().with_gid_kind(GidKind::RoceV2);
    let rx = RdmaFabric::with_verbs(receiver_nic, RdmaConfig::default()).expect("fabric");
    let tx = RdmaFabric::with_verbs(sender_nic, RdmaConfig::default()).expect("fabric");
    let listener = rx
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = tx
        .allocate_staging(SlotGeometry::new(2, 1024).expect("a geometry"))
        .expect("staging");
    let credential = attach(&listener, 0..4, 1);
    match tx
        .connect(&listener.local_endpoint, staging, credential)
        .await
    {
        Ok(_) => panic!("a RoCE v1 sender connected to a RoCE v2 receiver"),
        Err(e @ FabricError::Incompatible { .. }) => {
            let why = e.to_string();
            assert!(why.contains("RoCE v1") && why.contains("RoCE v2"), "{why}");
        }
        Err(e) => panic!("refused, but not as incompatible: {e}"),
    }
}

/// The verbs calls that block on hardware run off the runtime's workers: with one worker,
/// and each such call taking 300 ms in the model, a task ticking every 10 ms on that worker
/// is never held up by as much while a buffer is exposed, staging allocated, a connection
/// made, another refused after its queue pair exists, the first dropped, and a staging's last
/// handle let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn blocking_verbs_calls_do_not_hold_up_the_runtime() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    let slow = Duration::from_millis(300);
    let f = RdmaFabric::with_verbs(
        FakeVerbs::new().with_slow_verbs(slow),
        RdmaConfig::default(),
    )
    .expect("fabric");
    let stop = Arc::new(AtomicBool::new(false));
    let ticker = tokio::spawn({
        let stop = stop.clone();
        async move {
            let (mut worst, mut last) = (Duration::ZERO, Instant::now());
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(10)).await;
                worst = worst.max(last.elapsed());
                last = Instant::now();
            }
            worst
        }
    });
    // On the runtime's one worker, as the drivers' tasks are: registration, a connection
    // (queue pairs created and moved to INIT, RTR and RTS on both sides), a handshake refused
    // after the sender's queue pair exists (destroyed on the error path), the connection's end
    // (ERROR, then destroy, on both sides) and the last handles of the memory (deregistered).
    tokio::spawn(async move {
        let listener = f
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
        let conn = f
            .connect(&listener.local_endpoint, staging, credential)
            .await
            .expect("connect");
        let other_size = f
            .allocate_staging(SlotGeometry::new(2, 512).expect("a geometry"))
            .expect("staging");
        assert!(f
            .connect(&listener.local_endpoint, other_size, credential)
            .await
            .is_err());
        drop(conn);
        tokio::time::sleep(Duration::from_secs(1)).await;
        // A staging whose one handle goes here: deregistered as it drops.
        drop(
            f.allocate_staging(SlotGeometry::new(1, 1024).expect("a geometry"))
                .expect("staging"),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    })
    .await
    .expect("the scenario ran");
    stop.store(true, Ordering::Relaxed);
    let worst = ticker.await.expect("ticker");
    assert!(
        worst < slow - Duration::from_millis(50),
        "the worker was held up for {worst:?}"
    );
}

/// A completion queue failure (CQ_ERR) breaks every connection and marks the device
/// unusable: later writes fail, and new connections and memory are refused naming why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_completion_queue_breaks_every_connection_and_the_device() {
    let verbs = FakeVerbs::new();
    let f = fabric_on(verbs.clone());
    let listener = f
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
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("connect");
    conn.post(write(1, 0, 1)).expect("post");
    assert_eq!(completions(&mut conn, 1).await, vec![(1, Ok(()))]);
    verbs.inject_event(DeviceEvent::CqError);
    let refused = refusal_once_unusable(&f).await;
    assert!(refused.contains("CQ_ERR"), "{refused}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    conn.post(write(2, 1, 1))
        .expect("a broken connection still takes posts");
    let later = completions(&mut conn, 1).await;
    assert!(later[0].1.is_err(), "{later:?}");
    let e = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("unusable"), "{e}");
}

/// A queue pair's fatal error (QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR) breaks its own connection
/// only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_queue_pair_breaks_its_own_connection_only() {
    for event in [
        |qpn| DeviceEvent::QpFatal { qpn },
        |qpn| DeviceEvent::QpRequestError { qpn },
        |qpn| DeviceEvent::QpAccessError { qpn },
    ] {
        a_queue_pair_event_breaks_its_own_connection_only(event).await;
    }
}

async fn a_queue_pair_event_breaks_its_own_connection_only(event: fn(u32) -> DeviceEvent) {
    let verbs = FakeVerbs::new();
    let f = fabric_on(verbs.clone());
    let listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(8, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let credential = attach(&listener, 0..8, 1);
    let mut broken = f
        .connect(
            &listener.local_endpoint,
            f.allocate_staging(SlotGeometry::new(2, 1024).expect("a geometry"))
                .expect("staging"),
            credential,
        )
        .await
        .expect("connect");
    // The sender's queue pair is created before the receiver's.
    let broken_qpn = verbs.qpns()[0];
    let mut healthy = f
        .connect(
            &listener.local_endpoint,
            f.allocate_staging(SlotGeometry::new(2, 1024).expect("a geometry"))
                .expect("staging"),
            credential,
        )
        .await
        .expect("connect");
    verbs.inject_event(event(broken_qpn));
    tokio::time::sleep(Duration::from_millis(300)).await;
    broken.post(write(1, 0, 1)).expect("post");
    let out = completions(&mut broken, 1).await;
    assert!(out[0].1.is_err(), "{out:?}");
    healthy.post(write(2, 4, 1)).expect("post");
    assert_eq!(completions(&mut healthy, 1).await, vec![(2, Ok(()))]);
    assert!(
        f.allocate_staging(SlotGeometry::new(1, 64).expect("a geometry"))
            .is_ok(),
        "the device is still usable"
    );
}

/// A receiver whose device failed refuses a sender on another device with the reason, instead
/// of setting up a queue pair on the dead completion queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_on_a_failed_device_refuses_new_senders_saying_so() {
    let receiving = FakeVerbs::new();
    let sending = receiving.another_device();
    let r = fabric_on(receiving.clone());
    let s = fabric_on(sending);
    let listener = r
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let credential = attach(&listener, 0..4, 1);
    receiving.inject_event(DeviceEvent::DeviceFatal);
    refusal_once_unusable(&r).await;
    let staging = s
        .allocate_staging(SlotGeometry::new(2, 1024).expect("a geometry"))
        .expect("the sender's device is fine");
    let e = s
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("RDMA device failed"), "{e}");
}

/// A removed device's event channel fails at once, every time: the event reader marks the
/// device unusable and ends instead of asking again in a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_device_ends_its_event_reader_instead_of_spinning() {
    let verbs = FakeVerbs::new();
    let f = fabric_on(verbs.clone());
    verbs.remove();
    let refused = refusal_once_unusable(&f).await;
    assert!(refused.contains("removed"), "{refused}");
    let waits = verbs.event_waits();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        verbs.event_waits(),
        waits,
        "the event reader still asks a removed device"
    );
}

/// LID_CHANGE (and GID_CHANGE, SM_CHANGE) make the device read its port again: new
/// connections advertise the new address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lid_change_refreshes_what_new_connections_advertise() {
    let verbs = FakeVerbs::new();
    let _f = fabric_on(verbs.clone());
    assert_eq!(verbs.port().lid, 0);
    verbs.move_port(7, [0xBB; 16]);
    assert_eq!(verbs.port().lid, 0, "nothing read before the event");
    verbs.inject_event(DeviceEvent::LidChange { port: 1 });
    within_10_s("the port is read again", || verbs.port().lid == 7).await;
    assert_eq!(verbs.port().gid, [0xBB; 16]);
}

/// Waits (10 s at most) until `f`'s device is marked unusable; what a new staging is refused
/// with then.
async fn refusal_once_unusable(f: &RdmaFabric<FakeVerbs>) -> String {
    let mut refused = String::new();
    within_10_s("the device is marked unusable", || {
        match f.allocate_staging(SlotGeometry::new(1, 64).expect("a geometry")) {
            Err(e) => {
                refused = e.to_string();
                true
            }
            Ok(_) => false,
        }
    })
    .await;
    refused
}

/// Waits until `done` holds, 10 s at most (then fails saying `what`), looking every 5 ms.
async fn within_10_s(what: &str, mut done: impl FnMut() -> bool) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("not within 10 s: {what}"));
}
