//! `ShmFabric` with its control channel on loopback: kvx-io's fabric conformance bodies, then
//! concurrency, a cut control connection, 1 MiB slots, a dropped listener, the sealed staging
//! memfd, handshake refusals, the receiver's checks on headers, and a receiver that refuses
//! every staging descriptor it must not map (unsealed, short, oversized, beyond its bound,
//! not a memfd) and every ticket that names no staging of the hello's peer and geometry.

mod fabric_common;

use std::os::fd::OwnedFd;
use std::time::Duration;

use fabric_common::raw;
use kvx_io::conformance;
use kvx_io::SlotGeometry;
use kvx_io::{Fabric, FabricError, SlotMemory};
use kvx_transport::shm_fabric::{ShmFabric, ShmFabricConfig, ShmMemory};
use kvx_transport::tcp_fabric::{TcpFabric, TcpFabricConfig};
use rustix::fs::{MemfdFlags, SealFlags};
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

/// A raw peer's staging: a sealed memfd of one slot of `slot_bytes` that the receiver may map.
fn raw_staging(slot_bytes: usize) -> std::sync::Arc<ShmMemory> {
    ShmFabric::new()
        .allocate_staging(SlotGeometry::new(1, slot_bytes).expect("a geometry"))
        .expect("staging")
}

#[tokio::test]
async fn shm_receiver_checks_bounds() {
    let staging = raw_staging(1024);
    let raw = fabric_common::Raw::Staged(&staging);
    fabric_common::receiver_checks_bounds(&ShmFabric::new(), EP, b"KVXS", raw).await;
}

#[tokio::test]
async fn shm_receiver_refuses_runs() {
    let staging = raw_staging(1024);
    let raw = fabric_common::Raw::Staged(&staging);
    fabric_common::receiver_bounds_runs(&ShmFabric::new(), EP, b"KVXS", raw).await;
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

const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::FUTURE_WRITE)
    .union(SealFlags::SEAL);

/// A sender's staging is a memfd sealed against shrinking, growing, writes other than
/// through its existing mapping, and resealing, of exactly the geometry and backed
/// throughout: resizing it or punching a hole in it fails (so no receiver's mapping can lose
/// a page), its mapping still takes writes, and nothing of it appears in `/dev/shm`. The exposed buffer has no
/// descriptor at all.
#[tokio::test]
async fn shm_staging_is_a_sealed_memfd() {
    let f = ShmFabric::new();
    let listener = f
        .expose(EP, SlotGeometry::new(2, 4096).expect("a geometry"))
        .await
        .expect("expose");
    assert!(listener.memory.memfd().is_none(), "the buffer is anonymous");
    let shm_before = shm_entries();
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 4096).expect("a geometry"))
        .expect("staging");
    let fd = staging.memfd().expect("a staging memfd");
    let seals = rustix::fs::fcntl_get_seals(fd).expect("F_GET_SEALS");
    assert!(seals.contains(SEALS), "{seals:?}");
    assert!(
        !seals.contains(SealFlags::WRITE),
        "the sender writes into it: {seals:?}"
    );
    let file = std::fs::File::from(fd.try_clone_to_owned().expect("dup"));
    assert_eq!(file.metadata().expect("fstat").len(), 2 * 4096);
    for len in [4096, 3 * 4096, 0] {
        let r = file.set_len(len);
        assert_eq!(
            r.as_ref().map_err(std::io::Error::raw_os_error),
            Err(Some(1)),
            "resizing to {len} fails with EPERM: {r:?}"
        );
    }
    assert_eq!(file.metadata().expect("fstat").len(), 2 * 4096);
    let punched = rustix::fs::fallocate(
        &file,
        rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
        0,
        4096,
    );
    assert_eq!(
        punched,
        Err(rustix::io::Errno::PERM),
        "no hole can be punched"
    );
    assert_eq!(
        rustix::fs::seek(&file, rustix::fs::SeekFrom::Hole(0)),
        Ok(2 * 4096),
        "backed throughout"
    );
    staging.write_slot(1, &[9; 4096]);
    let mut back = [0u8; 4096];
    staging.read_slot(1, &mut back);
    assert_eq!(back, [9; 4096], "the sender's mapping still takes writes");
    let link = std::fs::read_link(format!(
        "/proc/self/fd/{}",
        rustix::fd::AsRawFd::as_raw_fd(&file)
    ))
    .expect("fd link");
    assert!(link.to_string_lossy().starts_with("/memfd:"), "{link:?}");
    assert_eq!(shm_entries(), shm_before, "nothing created in /dev/shm");
    let credential = listener.access.credential_for(kvx_proto::PeerId(1));
    let conn = f
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("connect");
    drop(conn);
}

/// This process's entries in `/dev/shm` (none is the fabric's).
fn shm_entries() -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.retain(|p| p.to_string_lossy().contains("kvx"));
    v.sort();
    v
}

/// A memfd of `len` bytes, written in full, with `seals` added.
fn memfd(len: u64, sealable: bool, seals: SealFlags) -> OwnedFd {
    memfd_of(len, sealable, true, seals)
}

/// `memfd`, or with `filled` false a sparse one (nothing written: one hole throughout).
fn memfd_of(len: u64, sealable: bool, filled: bool, seals: SealFlags) -> OwnedFd {
    let flags = if sealable {
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING
    } else {
        MemfdFlags::CLOEXEC
    };
    let fd = rustix::fs::memfd_create("hostile", flags).expect("memfd");
    rustix::fs::ftruncate(&fd, len).expect("ftruncate");
    if filled {
        let zeros = vec![0u8; 1 << 16];
        let mut at = 0;
        while at < len {
            let n = rustix::io::pwrite(&fd, &zeros[..(len - at).min(1 << 16) as usize], at)
                .expect("fill");
            at += n as u64;
        }
    }
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).expect("seals");
    }
    fd
}

/// A hostile peer (the right credential, this user) offers descriptors the receiver must
/// not map; each is refused over the handoff socket (status 1) with a reason naming the
/// check, and the buffer still serves a fabric sender afterwards. The geometry announced is
/// 2 slots of 4096 bytes unless a case says otherwise.
#[tokio::test]
async fn shm_receiver_refuses_unsafe_staging_descriptors() {
    const LEN: u64 = 2 * 4096;
    let f = ShmFabric::new();
    let listener = f
        .expose(EP, SlotGeometry::new(2, 4096).expect("a geometry"))
        .await
        .expect("expose");
    let port = fabric_common::port_of(&listener.local_endpoint);
    let credential = listener.access.credential_for(kvx_proto::PeerId(1));
    let regular = std::env::temp_dir().join(format!("kvx-hostile-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&regular)
        .expect("regular file");
    file.set_len(LEN).expect("size");
    std::fs::remove_file(&regular).expect("unlink");
    let (socket, _other_end) = std::os::unix::net::UnixStream::pair().expect("socket pair");
    // A sealable memfd without seals, one sealed only against shrinking (it could still
    // grow), one open to hole punching, a sparse one, and one never sealable.
    let cases: Vec<(&str, Vec<OwnedFd>, u32, &str)> = vec![
        (
            "an unsealed memfd",
            vec![memfd(LEN, true, SealFlags::empty())],
            2,
            "not sealed",
        ),
        (
            "a memfd sealed against shrinking only",
            vec![memfd(LEN, true, SealFlags::SHRINK)],
            2,
            "not sealed",
        ),
        (
            "a memfd open to hole punching",
            vec![memfd(
                LEN,
                true,
                SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
            )],
            2,
            "not sealed",
        ),
        // Sealed and of the geometry's size, but never written: one hole throughout.
        (
            "a sparse sealed memfd",
            vec![memfd_of(LEN, true, false, SEALS)],
            2,
            "has a hole at byte 0",
        ),
        (
            "a memfd that cannot be sealed",
            vec![memfd(LEN, false, SealFlags::empty())],
            2,
            "not sealed",
        ),
        (
            "a sealed memfd shorter than the geometry",
            vec![memfd(LEN - 4096, true, SEALS)],
            2,
            "holds 4096 bytes",
        ),
        (
            "a sealed memfd larger than the geometry",
            vec![memfd(LEN + 4096, true, SEALS)],
            2,
            "holds 12288 bytes",
        ),
        // 128 GiB of sparse memfd, exactly as announced: beyond the receiver's 64 GiB bound,
        // refused before it is mapped.
        (
            "a huge sparse memfd",
            vec![memfd_of(128 << 30, true, false, SEALS)],
            (128u64 << 30).div_ceil(4096) as u32,
            "exceed",
        ),
        ("a regular file", vec![file.into()], 2, ""),
        ("a socket", vec![socket.into()], 2, "not a memfd"),
        ("no descriptor", vec![], 2, "carries 0 descriptors"),
        (
            "two descriptors",
            vec![memfd(LEN, true, SEALS), memfd(LEN, true, SEALS)],
            2,
            "carries 2 descriptors",
        ),
    ];
    for (what, fds, slots, why) in cases {
        let (status, ticket, reason) = raw::offer(port, fds, slots, 4096, &credential).await;
        assert_eq!((status, ticket), (1, 0), "{what} refused: {reason}");
        assert!(reason.contains(why), "{what}: {reason:?} names {why:?}");
    }
    // A made-up credential: refused before the descriptor is looked at.
    let stranger = kvx_io::FabricAccess::new(1, [3; 16]).credential_for(kvx_proto::PeerId(1));
    let (status, _, reason) =
        raw::offer(port, vec![memfd(LEN, true, SEALS)], 2, 4096, &stranger).await;
    assert_eq!(status, 2, "{reason}");
    // A sealed memfd of the announced geometry is accepted.
    let (status, ticket, reason) =
        raw::offer(port, vec![memfd(LEN, true, SEALS)], 2, 4096, &credential).await;
    assert_eq!(status, 0, "{reason}");
    assert_ne!(ticket, 0);
    // And fabric senders are still served.
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 4096).expect("a geometry"))
        .expect("staging");
    f.connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect after the refusals");
}

/// A receiver whose `staging_bytes_max` is smaller than a sender's staging refuses it
/// before mapping, and the sender's `connect` reads why.
#[tokio::test]
async fn shm_staging_beyond_the_receivers_bound_is_refused() {
    let receiver = ShmFabric::with_config(ShmFabricConfig {
        staging_bytes_max: 4 * 4096,
        ..ShmFabricConfig::default()
    });
    let listener = receiver
        .expose(EP, SlotGeometry::new(2, 4096).expect("a geometry"))
        .await
        .expect("expose");
    let credential = listener.access.credential_for(kvx_proto::PeerId(1));
    let f = ShmFabric::new();
    let staging = f
        .allocate_staging(SlotGeometry::new(5, 4096).expect("a geometry"))
        .expect("staging");
    let r = f
        .connect(&listener.local_endpoint, staging, credential)
        .await;
    let Err(FabricError::Incompatible { why, .. }) = &r else {
        panic!("refused as incompatible: {r:?}");
    };
    assert!(why.contains("exceed the 16384"), "{why}");
    let staging = f
        .allocate_staging(SlotGeometry::new(4, 4096).expect("a geometry"))
        .expect("staging");
    f.connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("a staging within the bound attaches");
}

#[tokio::test]
async fn shm_and_tcp_senders_do_not_mix() {
    let shm = ShmFabric::new()
        .expose(EP, SlotGeometry::new(2, 4096).expect("a geometry"))
        .await
        .expect("expose shm");
    let tcp_staging = TcpFabric::new()
        .allocate_staging(SlotGeometry::new(2, 4096).expect("a geometry"))
        .expect("staging");
    let credential = shm.access.credential_for(kvx_proto::PeerId(1));
    let r = TcpFabric::new()
        .connect(&shm.local_endpoint, tcp_staging, credential)
        .await;
    assert!(matches!(r, Err(FabricError::Endpoint { .. })), "{r:?}");

    let tcp = TcpFabric::new()
        .expose(EP, SlotGeometry::new(2, 4096).expect("a geometry"))
        .await
        .expect("expose tcp");
    let shm_staging = ShmFabric::new()
        .allocate_staging(SlotGeometry::new(2, 4096).expect("a geometry"))
        .expect("staging");
    let credential = tcp.access.credential_for(kvx_proto::PeerId(1));
    let r = ShmFabric::new()
        .connect(&tcp.local_endpoint, shm_staging, credential)
        .await;
    assert!(matches!(r, Err(FabricError::Endpoint { .. })), "{r:?}");
}

/// A hello's ticket must name a staging the same peer handed over with the hello's
/// geometry, once: a made-up ticket, another peer's, a geometry other than the offer's, a
/// ticket used twice and a hello carrying no ticket are refused (welcome status 5).
#[tokio::test]
async fn shm_receiver_attaches_only_staging_handed_over() {
    let f = ShmFabric::new();
    let listener = f
        .expose(EP, SlotGeometry::new(2, 4096).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let port = fabric_common::port_of(&ep);
    let (alice, mallory) = (
        listener.access.credential_for(kvx_proto::PeerId(1)),
        listener.access.credential_for(kvx_proto::PeerId(2)),
    );
    let staging = raw_staging(4096);
    let offer = |credential| {
        let fd = staging
            .memfd()
            .expect("memfd")
            .try_clone_to_owned()
            .expect("dup");
        raw::offer(port, vec![fd], 1, 4096, credential)
    };
    let (status, alices, _) = offer(&alice).await;
    assert_eq!(status, 0);
    let (status, later, _) = offer(&alice).await;
    assert_eq!(status, 0);
    let hello =
        |credential, slots, extra: &[u8]| raw::hello_with(b"KVXS", slots, 4096, credential, extra);
    for (what, bytes) in [
        (
            "a made-up ticket",
            hello(&alice, 1, &12345u64.to_le_bytes()),
        ),
        (
            "another peer's ticket",
            hello(&mallory, 1, &alices.to_le_bytes()),
        ),
        (
            "the ticket used twice",
            hello(&alice, 1, &alices.to_le_bytes()),
        ),
        ("another geometry", hello(&alice, 2, &later.to_le_bytes())),
        ("no ticket", hello(&alice, 1, b"")),
        ("a path", hello(&alice, 1, b"/dev/shm/kvx-shm-1-0-0")),
    ] {
        let mut s = tokio::net::TcpStream::connect(&ep).await.expect("connect");
        s.write_all(&bytes).await.expect("hello");
        let (status, ..) = fabric_common::raw::welcome(&mut s).await;
        assert_eq!(status, 5, "{what} is refused");
    }
}

#[tokio::test]
async fn shm_staging_memory_round_trips() {
    let staging = ShmFabric::new()
        .allocate_staging(SlotGeometry::new(3, 100).expect("a geometry"))
        .expect("staging");
    staging.write_slot(2, &[7; 100]);
    staging.write_slot(1, &[5; 10]);
    let mut out = [0u8; 100];
    staging.read_slot(2, &mut out);
    assert_eq!(out, [7; 100]);
    staging.read_slot(1, &mut out[..20]);
    assert_eq!(&out[..10], &[5; 10]);
    assert_eq!(&out[10..20], &[0; 10]);
    // An empty shape never reaches the fabric: `SlotGeometry::new` refuses it.
    assert!(SlotGeometry::new(0, 100).is_err() && SlotGeometry::new(1, 0).is_err());
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
async fn shm_fabric_runs_land_as_their_pieces() {
    conformance::fabric_runs_land_as_their_pieces(&ShmFabric::new(), EP, false).await;
}

#[tokio::test]
async fn shm_receiver_checks_grants() {
    let staging = raw_staging(1024);
    let raw = fabric_common::Raw::Staged(&staging);
    fabric_common::receiver_checks_grants(&ShmFabric::new(), EP, b"KVXS", raw).await;
}

#[tokio::test]
async fn shm_fabric_refuses_memory_the_caller_owns() {
    conformance::fabric_uses_memory_the_caller_owns(&ShmFabric::new(), EP, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_idle_connections_never_lock_a_sender_out() {
    let f = ShmFabric::with_config(ShmFabricConfig {
        link: TcpFabricConfig {
            connections_max: 8,
            connections_per_source_max: 4,
            hello_timeout: Duration::from_secs(20),
            ..TcpFabricConfig::default()
        },
        ..ShmFabricConfig::default()
    });
    fabric_common::idle_connections_never_lock_a_sender_out(&f, EP).await;
}

#[tokio::test]
async fn shm_a_silent_or_slow_hello_is_cut_off() {
    let f = ShmFabric::with_config(ShmFabricConfig {
        link: TcpFabricConfig {
            hello_timeout: Duration::from_millis(300),
            ..TcpFabricConfig::default()
        },
        ..ShmFabricConfig::default()
    });
    fabric_common::a_silent_or_slow_hello_is_cut_off(&f, EP).await;
}
