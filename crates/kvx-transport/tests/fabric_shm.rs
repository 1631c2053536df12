//! `ShmFabric` with its control channel on loopback: kvx-io's fabric conformance bodies, then
//! concurrency, a cut control connection, 1 MiB slots, a dropped listener (and its file),
//! handshake refusals, the receiver's checks on notices, and a sender that refuses to map a
//! file a receiver should not name.

mod fabric_common;

use std::path::PathBuf;
use std::time::Duration;

use kvx_io::conformance;
use kvx_io::{Fabric, FabricError, SlotMemory};
use kvx_transport::shm_fabric::{ShmFabric, ShmFabricConfig};
use kvx_transport::tcp_fabric::{TcpFabric, TcpFabricConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const EP: &str = "127.0.0.1:0";

#[tokio::test]
async fn shm_fabric_writes_land_in_order() {
    conformance::fabric_writes_land_in_order(&ShmFabric::new(), EP, 8, 4096).await;
}

#[tokio::test]
async fn shm_fabric_reset_flushes() {
    conformance::fabric_reset_flushes(&ShmFabric::new(), EP).await;
}

#[tokio::test]
async fn shm_fabric_rejects_out_of_bounds() {
    conformance::fabric_rejects_out_of_bounds(&ShmFabric::new(), EP).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_two_senders_concurrently() {
    fabric_common::two_senders_concurrently(&ShmFabric::new(), EP).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_one_mib_slots() {
    fabric_common::one_mib_slots(&ShmFabric::new(), EP).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_cut_mid_stream() {
    // Hello (32 bytes), three whole notices (32 bytes each), half of the fourth.
    let cut = 32 + 3 * 32 + 16;
    fabric_common::cut_mid_stream(&ShmFabric::new(), EP, 64 << 10, cut).await;
}

#[tokio::test]
async fn shm_dropped_listener_stops_serving() {
    fabric_common::dropped_listener_stops_serving(&ShmFabric::new(), EP).await;
}

#[tokio::test]
async fn shm_refuses_other_chunk_sizes() {
    fabric_common::refuses_other_chunk_sizes(&ShmFabric::new(), EP).await;
}

#[tokio::test]
async fn shm_nothing_exposed() {
    fabric_common::nothing_exposed(&ShmFabric::new()).await;
}

#[tokio::test]
async fn shm_receiver_checks_bounds() {
    fabric_common::receiver_checks_bounds(&ShmFabric::new(), EP, b"KVXS", false).await;
}

#[tokio::test]
async fn shm_reset_is_bounded_when_the_receiver_stalls() {
    // A stalled receiver that names a real buffer file, so the sender can map it.
    let listener = ShmFabric::new().expose(EP, 2, 4096).await.expect("expose");
    let path = listener
        .memory
        .path()
        .expect("file")
        .to_str()
        .expect("utf-8");
    let path: &'static str = Box::leak(path.to_owned().into_boxed_str());
    let f = ShmFabric::with_config(ShmFabricConfig {
        link: TcpFabricConfig {
            fence_timeout: Duration::from_millis(300),
            ..TcpFabricConfig::default()
        },
        ..ShmFabricConfig::default()
    });
    fabric_common::reset_is_bounded_when_the_receiver_stalls(&f, b"KVXS", path.as_bytes()).await;
}

#[tokio::test]
async fn shm_file_is_removed_with_the_listener() {
    let f = ShmFabric::new();
    let listener = f.expose(EP, 2, 4096).await.expect("expose");
    let path: PathBuf = listener.memory.path().expect("a file").to_owned();
    assert!(path.starts_with("/dev/shm"), "{path:?}");
    assert_eq!(
        std::fs::metadata(&path).expect("the file exists").len(),
        2 * 4096
    );
    // A connected sender does not keep the name alive.
    let staging = f.allocate_staging(2, 4096).expect("staging");
    let credential = listener.access.credential_for(kvx_proto::PeerId(1));
    let _conn = f
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("connect");
    assert!(staging.path().is_none(), "staging is anonymous");
    drop(listener);
    assert!(!path.exists(), "{path:?} removed when the listener dropped");
}

#[tokio::test]
async fn shm_and_tcp_senders_do_not_mix() {
    let shm = ShmFabric::new()
        .expose(EP, 2, 4096)
        .await
        .expect("expose shm");
    let tcp_staging = TcpFabric::new().allocate_staging(2, 4096).expect("staging");
    let credential = shm.access.credential_for(kvx_proto::PeerId(1));
    let r = TcpFabric::new()
        .connect(&shm.local_endpoint, tcp_staging, credential)
        .await;
    assert!(matches!(r, Err(FabricError::Endpoint { .. })), "{r:?}");

    let tcp = TcpFabric::new()
        .expose(EP, 2, 4096)
        .await
        .expect("expose tcp");
    let shm_staging = ShmFabric::new().allocate_staging(2, 4096).expect("staging");
    let credential = tcp.access.credential_for(kvx_proto::PeerId(1));
    let r = ShmFabric::new()
        .connect(&tcp.local_endpoint, shm_staging, credential)
        .await;
    assert!(matches!(r, Err(FabricError::Endpoint { .. })), "{r:?}");
}

/// A receiver that names a file of its choosing: the sender maps only kvx files in its own
/// shm directory, so it cannot be made to write into anything else.
#[tokio::test]
async fn shm_sender_maps_only_kvx_files() {
    // A real file in /dev/shm without the kvx prefix, the right size.
    let foreign = PathBuf::from(format!("/dev/shm/not-kvx-{}", std::process::id()));
    std::fs::write(&foreign, vec![0u8; 2 * 4096]).expect("foreign file");
    for named in [
        "/etc/passwd",
        foreign.to_str().expect("utf-8"),
        "/dev/shm/kvx-shm-../../etc/passwd",
    ] {
        let fake = TcpListener::bind(EP).await.expect("bind");
        let ep = fake.local_addr().expect("addr").to_string();
        let sent = named.to_owned();
        let server = tokio::spawn(async move {
            let named = sent;
            let (mut s, _) = fake.accept().await.expect("accept");
            let mut hello = [0u8; 64];
            s.read_exact(&mut hello).await.expect("hello");
            let w = fabric_common::raw::welcome_bytes(b"KVXS", 2, 4096, 1, named.as_bytes());
            s.write_all(&w).await.expect("welcome");
            // Hold the connection until the sender gives up.
            let mut b = [0u8; 64];
            let _ = tokio::time::timeout(fabric_common::STEP, s.read(&mut b)).await;
        });
        let f = ShmFabric::new();
        let staging = f.allocate_staging(2, 4096).expect("staging");
        let credential = kvx_io::FabricAccess::new(1, [0; 16]).credential_for(kvx_proto::PeerId(1));
        let r = fabric_common::step("connect", f.connect(&ep, staging, credential)).await;
        assert!(
            matches!(r, Err(FabricError::Endpoint { .. })),
            "a receiver naming {named:?}: {r:?}"
        );
        server.await.expect("fake receiver");
    }
    let untouched = std::fs::read(&foreign).expect("read back");
    std::fs::remove_file(&foreign).expect("cleanup");
    assert!(untouched.iter().all(|b| *b == 0));
}

#[tokio::test]
async fn shm_staging_memory_round_trips() {
    let staging = ShmFabric::new().allocate_staging(3, 100).expect("staging");
    staging.write_slot(2, &[7; 100]);
    staging.write_slot(1, &[5; 10]);
    let mut out = [0u8; 100];
    staging.read_slot(2, &mut out);
    assert_eq!(out, [7; 100]);
    staging.read_slot(1, &mut out[..20]);
    assert_eq!(&out[..10], &[5; 10]);
    assert_eq!(&out[10..20], &[0; 10]);
    assert!(ShmFabric::new().allocate_staging(0, 100).is_err());
    assert!(ShmFabric::new().allocate_staging(1, 0).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_restart_at_the_same_endpoint() {
    fabric_common::restart_at_the_same_endpoint(&ShmFabric::new()).await;
}

#[tokio::test]
async fn shm_fabric_refuses_writes_outside_grants() {
    conformance::fabric_refuses_writes_outside_grants(&ShmFabric::new(), EP, false).await;
}

#[tokio::test]
async fn shm_fabric_checks_checksums() {
    conformance::fabric_checks_checksums(&ShmFabric::new(), EP).await;
}

#[tokio::test]
async fn shm_receiver_checks_grants() {
    fabric_common::receiver_checks_grants(&ShmFabric::new(), EP, b"KVXS", false).await;
}
