//! `TcpFabric` on loopback: kvx-io's fabric conformance bodies, then concurrency, a cut
//! connection, 1 MiB slots, a dropped listener, handshake refusals, and the receiver's own
//! bounds checks against a hand-written sender.

mod fabric_common;

use std::time::Duration;

use kvx_io::conformance;
use kvx_io::SlotGeometry;
use kvx_transport::tcp_fabric::{TcpFabric, TcpFabricConfig};

const EP: &str = "127.0.0.1:0";

#[tokio::test]
async fn tcp_fabric_writes_land_in_order() {
    conformance::fabric_writes_land_in_order(&TcpFabric::new(), EP, 8, 4096).await;
}

#[tokio::test]
async fn tcp_fabric_reset_flushes() {
    conformance::fabric_reset_flushes(&TcpFabric::new(), EP).await;
}

#[tokio::test]
async fn tcp_fabric_rejects_out_of_bounds() {
    conformance::fabric_rejects_out_of_bounds(&TcpFabric::new(), EP).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_two_senders_concurrently() {
    fabric_common::two_senders_concurrently(&TcpFabric::new(), EP).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_one_mib_slots() {
    fabric_common::one_mib_slots(&TcpFabric::new(), EP).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_cut_mid_stream() {
    const SLOT: usize = 256 << 10;
    // Hello (32 bytes), three whole writes (header 32 + payload), half of the fourth.
    let cut = 32 + 3 * (32 + SLOT) + SLOT / 2;
    fabric_common::cut_mid_stream(&TcpFabric::new(), EP, SLOT, cut).await;
}

#[tokio::test]
async fn tcp_dropped_listener_stops_serving() {
    fabric_common::dropped_listener_stops_serving(&TcpFabric::new(), EP).await;
}

#[tokio::test]
async fn tcp_refuses_other_chunk_sizes() {
    fabric_common::refuses_other_chunk_sizes(&TcpFabric::new(), EP).await;
}

#[tokio::test]
async fn tcp_nothing_exposed() {
    fabric_common::nothing_exposed(&TcpFabric::new()).await;
}

#[tokio::test]
async fn tcp_receiver_checks_bounds() {
    fabric_common::receiver_checks_bounds(
        &TcpFabric::new(),
        EP,
        b"KVXT",
        fabric_common::Raw::Inline,
    )
    .await;
}

#[tokio::test]
async fn tcp_receiver_bounds_runs() {
    fabric_common::receiver_bounds_runs(&TcpFabric::new(), EP, b"KVXT", fabric_common::Raw::Inline)
        .await;
}

#[tokio::test]
async fn tcp_reset_is_bounded_when_the_receiver_stalls() {
    let f = TcpFabric::with_config(TcpFabricConfig {
        fence_timeout: Duration::from_millis(300),
        ..TcpFabricConfig::default()
    });
    fabric_common::reset_is_bounded_when_the_receiver_stalls(&f, b"KVXT", b"").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_restart_at_the_same_endpoint() {
    fabric_common::restart_at_the_same_endpoint(&TcpFabric::new()).await;
}

/// The zero-copy send path (`zero_copy: true`, Linux) conforms too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_zero_copy_sends_one_mib_slots() {
    fabric_common::one_mib_slots(&zero_copy(), EP).await;
}

/// The zero-copy path through two senders at once and a connection cut mid-stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_zero_copy_two_senders_and_a_cut() {
    fabric_common::two_senders_concurrently(&zero_copy(), EP).await;
    const SLOT: usize = 256 << 10;
    let cut = 32 + 3 * (32 + SLOT) + SLOT / 2;
    fabric_common::cut_mid_stream(&zero_copy(), EP, SLOT, cut).await;
}

fn zero_copy() -> TcpFabric {
    TcpFabric::with_config(TcpFabricConfig {
        zero_copy: true,
        ..TcpFabricConfig::default()
    })
}

/// Zero-copy sends hand the kernel references to staging pages, so a slot rewritten as soon
/// as its write completes would corrupt the landed bytes if a completion ever came before the
/// receiver had read them. One staging slot, rewritten right after every completion, feeds 32
/// distinct remote slots: each must hold its own round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_staging_rewritten_right_after_completion_never_changes_landed_bytes() {
    use kvx_io::{Fabric, PostWrite, SlotMemory};
    use kvx_proto::{PeerId, SlotIndex, StagingSlot, WriteId};
    const MIB: usize = 1 << 20;
    const ROUNDS: u32 = 32;
    let f = zero_copy();
    let listener = f
        .expose(EP, SlotGeometry::new(ROUNDS, MIB).expect("a geometry"))
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(1, MIB).expect("a geometry"))
        .expect("staging");
    let peer = PeerId(1);
    let credential = listener.access.credential_for(peer);
    let mut conn = fabric_common::step(
        "connect",
        f.connect(&listener.local_endpoint, staging.clone(), credential),
    )
    .await
    .expect("connect");
    for r in 0..ROUNDS {
        let bytes = fabric_common::pattern(r, MIB);
        staging.write_slot(0, &bytes);
        listener.access.grant(r, peer, 1);
        conn.post(PostWrite {
            id: WriteId(u64::from(r)),
            local: StagingSlot(0),
            remote: SlotIndex(r),
            len: MIB,
            imm: fabric_common::imm(r, 1),
            checksum: Some(kvx_io::chunk_checksum(&bytes)),
        })
        .expect("post");
        let c = fabric_common::completion(&mut conn, "completion").await;
        assert_eq!(c.result, Ok(()));
    }
    // Overwrite once more, then read every remote slot.
    staging.write_slot(0, &vec![0xEE; MIB]);
    let mut got = vec![0u8; MIB];
    for r in 0..ROUNDS {
        listener.memory.read_slot(r, &mut got);
        assert!(
            got == fabric_common::pattern(r, MIB),
            "remote slot {r} holds its own round"
        );
    }
}

#[tokio::test]
async fn tcp_fabric_refuses_writes_outside_grants() {
    conformance::fabric_refuses_writes_outside_grants(&TcpFabric::new(), EP, true).await;
}

#[tokio::test]
async fn tcp_fabric_lands_only_whole_chunks() {
    conformance::fabric_lands_only_whole_chunks(&TcpFabric::new(), EP, true).await;
}

#[tokio::test]
async fn tcp_fabric_checks_checksums() {
    conformance::fabric_checks_checksums(&TcpFabric::new(), EP).await;
}

/// A run goes as one write (its headers, then its payload); each piece still lands on its
/// own grant and checksum, from staging in one part and across two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_fabric_runs_land_as_their_pieces() {
    conformance::fabric_runs_land_as_their_pieces(&TcpFabric::new(), EP, false).await;
    conformance::fabric_runs_land_as_their_pieces(&TcpFabric::new(), EP, true).await;
    conformance::fabric_runs_land_as_their_pieces(&zero_copy(), EP, false).await;
}

#[tokio::test]
async fn tcp_receiver_checks_grants() {
    fabric_common::receiver_checks_grants(
        &TcpFabric::new(),
        EP,
        b"KVXT",
        fabric_common::Raw::Inline,
    )
    .await;
}

#[tokio::test]
async fn tcp_write_never_outlives_its_grant() {
    fabric_common::a_write_never_outlives_its_grant(&TcpFabric::new(), EP, b"KVXT").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_fabric_uses_memory_the_caller_owns() {
    conformance::fabric_uses_memory_the_caller_owns(&TcpFabric::new(), EP, true).await;
}

/// Caps small enough to flood in a test: 8 connections, 4 from one address, and a hello
/// deadline long enough that only the caps close the silent ones.
fn capped() -> TcpFabricConfig {
    TcpFabricConfig {
        connections_max: 8,
        connections_per_source_max: 4,
        hello_timeout: Duration::from_secs(20),
        ..TcpFabricConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_idle_connections_never_lock_a_sender_out() {
    fabric_common::idle_connections_never_lock_a_sender_out(&TcpFabric::with_config(capped()), EP)
        .await;
}

#[tokio::test]
async fn tcp_a_silent_or_slow_hello_is_cut_off() {
    let f = TcpFabric::with_config(TcpFabricConfig {
        hello_timeout: Duration::from_millis(300),
        ..TcpFabricConfig::default()
    });
    fabric_common::a_silent_or_slow_hello_is_cut_off(&f, EP).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_authenticated_idlers_never_lock_a_writer_out() {
    fabric_common::authenticated_idlers_never_lock_a_writer_out(
        &TcpFabric::with_config(capped()),
        EP,
    )
    .await;
}

/// A run larger than the socket's buffers (64 pieces of 64 KiB): the receiver acks its first
/// pieces while the sender is still sending the last ones, and every piece completes and
/// lands whole, copying sends and zero-copy alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_a_run_larger_than_the_socket_buffers_lands_whole() {
    for zero_copy in [false, true] {
        let small_buffers = TcpFabricConfig {
            socket_buffer: Some(64 << 10),
            zero_copy,
            ..TcpFabricConfig::default()
        };
        a_long_run_lands(&TcpFabric::with_config(small_buffers)).await;
    }
}

async fn a_long_run_lands(fabric: &TcpFabric) {
    use kvx_io::{chunk_checksum, Fabric, PostWrite, SlotMemory, WriteRun};
    use kvx_proto::{PeerId, SlotIndex, StagingSlot, WriteId};

    const PIECES: u32 = 64;
    const BYTES: usize = 64 << 10;
    let geometry = SlotGeometry::new(PIECES, BYTES).expect("a geometry");
    let mut listener = fabric.expose(EP, geometry).await.expect("expose");
    let peer = PeerId(4);
    for slot in 0..PIECES {
        listener.access.grant(slot, peer, 2);
    }
    let staging = fabric.allocate_staging(geometry).expect("staging");
    let mut run: Option<WriteRun> = None;
    for slot in 0..PIECES {
        let bytes = fabric_common::pattern(slot, BYTES);
        staging.write_slot(slot, &bytes);
        let w = PostWrite {
            id: WriteId(u64::from(slot)),
            local: StagingSlot(slot),
            remote: SlotIndex(slot),
            len: BYTES,
            imm: fabric_common::imm(slot, 2),
            checksum: Some(chunk_checksum(&bytes)),
        };
        match run.as_mut() {
            None => run = Some(WriteRun::new(w)),
            Some(r) => r.push(w, BYTES).expect("consecutive"),
        }
    }
    let mut conn = fabric
        .connect(
            &listener.local_endpoint,
            staging,
            listener.access.credential_for(peer),
        )
        .await
        .expect("connect");
    assert_eq!(
        conn.post_run(run.expect("a run")).ok(),
        Some(1),
        "one write"
    );
    for id in 0..u64::from(PIECES) {
        let c = fabric_common::completion(&mut conn, "a piece's completion").await;
        assert_eq!((c.id, c.result), (WriteId(id), Ok(())));
    }
    let mut got = vec![0u8; BYTES];
    for slot in 0..PIECES {
        fabric_common::step("a landed notice", listener.landed.recv())
            .await
            .expect("listener open");
        listener.memory.read_slot(slot, &mut got);
        assert!(got == fabric_common::pattern(slot, BYTES), "slot {slot}");
    }
}
