//! `ShmFabric` with its control channel on loopback: kvx-io's fabric conformance bodies, then
//! concurrency, a cut control connection, 1 MiB slots, a dropped listener, staging files and
//! their lifetime, handshake refusals, the receiver's checks on headers, and a receiver that
//! refuses to map a file a sender should not name.

mod fabric_common;

use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::Duration;

use kvx_io::conformance;
use kvx_io::{Fabric, FabricError, SlotMemory};
use kvx_transport::shm_fabric::{ShmFabric, ShmFabricConfig, ShmMemory};
use kvx_transport::tcp_fabric::{TcpFabric, TcpFabricConfig};
use tokio::io::AsyncWriteExt;

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

/// A raw peer's staging: a file of one slot of `slot_bytes` that the receiver may map.
fn raw_staging(slot_bytes: usize) -> std::sync::Arc<ShmMemory> {
    ShmFabric::new()
        .allocate_staging(1, slot_bytes)
        .expect("staging")
}

#[tokio::test]
async fn shm_receiver_checks_bounds() {
    let staging = raw_staging(1024);
    let raw = fabric_common::Raw::Staged {
        path: staging.path().expect("a file").as_os_str().as_bytes(),
        memory: &*staging,
    };
    fabric_common::receiver_checks_bounds(&ShmFabric::new(), EP, b"KVXS", raw).await;
}

#[tokio::test]
async fn shm_reset_is_bounded_when_the_receiver_stalls() {
    let f = ShmFabric::with_config(ShmFabricConfig {
        link: TcpFabricConfig {
            fence_timeout: Duration::from_millis(300),
            ..TcpFabricConfig::default()
        },
        ..ShmFabricConfig::default()
    });
    fabric_common::reset_is_bounded_when_the_receiver_stalls(&f, b"KVXS", b"").await;
}

/// A sender's staging is a file in the fabric's directory, mode 0600, removed when the
/// staging is dropped (a connection does not keep the name alive); the exposed buffer is
/// private memory with no file at all.
#[tokio::test]
async fn shm_staging_files_live_as_long_as_the_staging() {
    use std::os::unix::fs::PermissionsExt;
    let f = ShmFabric::new();
    let listener = f.expose(EP, 2, 4096).await.expect("expose");
    assert!(listener.memory.path().is_none(), "the buffer is anonymous");
    let staging = f.allocate_staging(2, 4096).expect("staging");
    let path: PathBuf = staging.path().expect("a staging file").to_owned();
    assert!(path.starts_with("/dev/shm"), "{path:?}");
    let meta = std::fs::metadata(&path).expect("the file exists");
    assert_eq!(meta.len(), 2 * 4096);
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let credential = listener.access.credential_for(kvx_proto::PeerId(1));
    let conn = f
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("connect");
    drop(conn);
    drop(staging);
    assert!(!path.exists(), "{path:?} removed with the staging");
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

/// A sender that names a staging file of its choosing: the receiver maps only kvx files in
/// its own shm directory, of the declared size, so it cannot be made to read anything else;
/// it refuses the others (welcome status 5) and leaves them untouched.
#[tokio::test]
async fn shm_receiver_maps_only_kvx_staging_files() {
    let foreign = PathBuf::from(format!("/dev/shm/not-kvx-{}", std::process::id()));
    std::fs::write(&foreign, vec![0u8; 4096]).expect("foreign file");
    let f = ShmFabric::new();
    let listener = f.expose(EP, 2, 4096).await.expect("expose");
    let credential = listener.access.credential_for(kvx_proto::PeerId(1));
    let short = f
        .allocate_staging(1, 2048)
        .expect("a kvx staging of another size");
    let short_path = short
        .path()
        .expect("file")
        .to_str()
        .expect("utf-8")
        .to_owned();
    for named in [
        "/etc/passwd",
        foreign.to_str().expect("utf-8"),
        "/dev/shm/kvx-shm-../../etc/passwd",
        // A real kvx staging file, but not of the geometry the hello declares.
        short_path.as_str(),
    ] {
        let mut s = tokio::net::TcpStream::connect(&listener.local_endpoint)
            .await
            .expect("connect");
        let hello = fabric_common::raw::hello_with(b"KVXS", 1, 4096, &credential, named.as_bytes());
        s.write_all(&hello).await.expect("hello");
        let (status, ..) = fabric_common::raw::welcome(&mut s).await;
        assert_eq!(status, 5, "a sender naming {named:?} is refused");
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
    conformance::fabric_refuses_writes_outside_grants(&ShmFabric::new(), EP, true).await;
}

#[tokio::test]
async fn shm_fabric_lands_only_whole_chunks() {
    conformance::fabric_lands_only_whole_chunks(&ShmFabric::new(), EP, true).await;
}

#[tokio::test]
async fn shm_fabric_checks_checksums() {
    conformance::fabric_checks_checksums(&ShmFabric::new(), EP).await;
}

#[tokio::test]
async fn shm_receiver_checks_grants() {
    let staging = raw_staging(1024);
    let raw = fabric_common::Raw::Staged {
        path: staging.path().expect("a file").as_os_str().as_bytes(),
        memory: &*staging,
    };
    fabric_common::receiver_checks_grants(&ShmFabric::new(), EP, b"KVXS", raw).await;
}

#[tokio::test]
async fn shm_fabric_refuses_memory_the_caller_owns() {
    conformance::fabric_uses_memory_the_caller_owns(&ShmFabric::new(), EP, false).await;
}
