//! The shm handoff against a descriptor hoarder (`docs/spec/fabrics.md` §4): peers that
//! connect to the handoff socket and send their offers a byte at a time, four descriptors
//! with every byte, never finishing. The receiver takes no more than a few descriptors from
//! any of them at once (a peer's second descriptor already refuses its offer: each is
//! closed as it comes, and later reads leave no room for more), so it stays far below its
//! open-files limit, and a real sender's staging is still taken.

mod fabric_common;

use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

use fabric_common::{port_of, raw};
use kvx_io::{Fabric, SlotGeometry};
use kvx_transport::shm_fabric::ShmFabric;

const EP: &str = "127.0.0.1:0";
const HOARDERS: usize = 64;
/// The receiver's link allows 64 connections from one user (`connections_per_source_max`),
/// so every hoarder is served at once.
const FDS_PER_BYTE: usize = 4;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

fn memfd() -> OwnedFd {
    let fd = rustix::fs::memfd_create("hoard", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
    rustix::fs::ftruncate(&fd, 4096).expect("size");
    fd
}

/// Sends `byte` on `s` with `fds` attached; false once the receiver has closed the socket.
fn send_byte_with(s: &UnixStream, byte: u8, fds: &[OwnedFd]) -> bool {
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_BYTE))];
    let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
    assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&borrowed)));
    rustix::net::sendmsg(
        s,
        &[std::io::IoSlice::new(&[byte])],
        &mut control,
        rustix::net::SendFlags::NOSIGNAL,
    )
    .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_offers_with_descriptors_cost_the_receiver_none_and_a_sender_is_served() {
    let f = ShmFabric::new();
    let geometry = SlotGeometry::new(2, 4096).expect("a geometry");
    let listener = f.expose(EP, geometry).await.expect("expose");
    let port = port_of(&listener.local_endpoint);
    let credential = listener.access.credential_for(kvx_proto::PeerId(1));
    let offer = raw::offer_bytes(2, 4096, &credential);
    let before = open_fds();

    // The hoarders, each one byte short of a whole offer: 47 bytes, 188 descriptors sent.
    let (held, sent) = tokio::task::spawn_blocking(move || {
        let fds: Vec<OwnedFd> = (0..FDS_PER_BYTE).map(|_| memfd()).collect();
        let name = format!("kvx-shm-fabric.{port}");
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("name");
        let streams: Vec<UnixStream> = (0..HOARDERS)
            .map(|_| UnixStream::connect_addr(&addr).expect("connect"))
            .collect();
        let mut sent = 0usize;
        for &byte in &offer[..offer.len() - 1] {
            for s in &streams {
                if send_byte_with(s, byte, &fds) {
                    sent += FDS_PER_BYTE;
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        ((streams, fds), sent)
    })
    .await
    .expect("hoarders");
    // Let the receiver read what was sent (bounded: it reads as fast as it can).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = open_fds();
    // The hoarders' own: their sockets and the descriptors they send again and again.
    let receivers = during - before - HOARDERS - FDS_PER_BYTE;
    eprintln!("{sent} descriptors sent by {HOARDERS} hoarders; the receiver holds {receivers}");
    assert!(sent > 1000, "the attack sent its descriptors ({sent})");
    // At most the accepted sockets and, per connection, the first descriptor while it is the
    // only one (none here: each hoarder's first byte already came with four).
    assert!(
        receivers <= 2 * HOARDERS,
        "the receiver holds {receivers} descriptors for {HOARDERS} hoarders"
    );

    // A real sender's staging is taken, hoarders or not.
    let staging = f.allocate_staging(geometry).expect("staging");
    tokio::time::timeout(
        Duration::from_secs(10),
        f.connect(&listener.local_endpoint, staging, credential),
    )
    .await
    .expect("bounded")
    .expect("a sender is served beside the hoarders");
    drop(held);
}
