//! The shm fabric's same-host trust model across users (`docs/spec/fabrics.md` §4): a
//! receiver refuses a staging offer from a process of a user it does not trust, and accepts
//! one once that user is in `trusted_uids`; a sender refuses to hand its staging to a
//! handoff socket bound by an untrusted user. The other user is `nobody` (65534), played by
//! this test binary re-run as that user (`untrusted_peer`), so these tests need root to
//! switch users; without it they say so and pass without checking.

mod fabric_common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fabric_common::{port_of, raw};
use kvx_io::SlotGeometry;
use kvx_io::{Fabric, FabricCredential, FabricError};
use kvx_transport::shm_fabric::{ShmFabric, ShmFabricConfig};

const NOBODY: u32 = 65534;
const EP: &str = "127.0.0.1:0";

fn root() -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    eprintln!("not root: cannot run a peer as another user; the cross-user checks are skipped");
    false
}

/// This test binary, re-run as `nobody`, playing `role` against `port`.
fn as_nobody(role: &str, port: u16, credential: Option<&FabricCredential>) -> Child {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args(["--exact", "untrusted_peer", "--ignored", "--nocapture"])
        .env("KVX_SHM_TRUST_ROLE", role)
        .env("KVX_SHM_TRUST_PORT", port.to_string())
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(Stdio::piped());
    if let Some(c) = credential {
        cmd.env("KVX_SHM_TRUST_CREDENTIAL", hex::encode(c.to_bytes()));
    }
    cmd.spawn().expect("spawn the untrusted peer")
}

/// The first line the child prints that starts with `prefix`, without it (bounded by the
/// child's output: it prints a handful of lines and exits).
fn line_from(child: &mut Child, prefix: &str) -> String {
    let out = child.stdout.as_mut().expect("piped");
    let mut lines = BufReader::new(out).lines();
    for line in lines.by_ref().take(64) {
        let line = line.expect("child output");
        if let Some(rest) = line.strip_prefix(prefix) {
            return rest.to_owned();
        }
    }
    panic!("the untrusted peer printed no {prefix:?}");
}

/// A receiver trusts its own uid only: `nobody`'s offer, with a valid credential and a
/// valid sealed memfd, is refused as unauthorized, naming the uid; listed in
/// `trusted_uids`, the same offer is accepted.
#[tokio::test]
async fn shm_receiver_refuses_an_untrusted_user() {
    if !root() {
        return;
    }
    for (trusted, expect) in [(vec![], 2u16), (vec![NOBODY], 0)] {
        let f = ShmFabric::with_config(ShmFabricConfig {
            trusted_uids: trusted.clone(),
            ..ShmFabricConfig::default()
        });
        let listener = f
            .expose(EP, SlotGeometry::new(2, 4096).expect("a geometry"))
            .await
            .expect("expose");
        let credential = listener.access.credential_for(kvx_proto::PeerId(1));
        let port = port_of(&listener.local_endpoint);
        let child = tokio::task::spawn_blocking(move || {
            let mut child = as_nobody("offer", port, Some(&credential));
            let answer = line_from(&mut child, "ANSWER ");
            let _ = child.wait();
            answer
        });
        let answer = tokio::time::timeout(Duration::from_secs(30), child)
            .await
            .expect("bounded")
            .expect("child task");
        let (status, reason) = answer.split_once(' ').expect("status reason");
        assert_eq!(status, expect.to_string(), "trusted {trusted:?}: {reason}");
        if expect == 2 {
            assert!(reason.contains("uid 65534 may not attach"), "{reason}");
        }
    }
}

/// A sender hands its staging only to a handoff socket of a trusted user: with `nobody`
/// holding the name for the port the sender reaches, `connect` fails naming the owner, and
/// `nobody` receives no descriptor.
#[tokio::test]
async fn shm_sender_refuses_a_socket_of_an_untrusted_user() {
    if !root() {
        return;
    }
    // The control port: a listener that never answers (the handoff comes first).
    let control = tokio::net::TcpListener::bind(EP).await.expect("bind");
    let ep = control.local_addr().expect("addr").to_string();
    let port = port_of(&ep);
    let mut child = tokio::task::spawn_blocking(move || {
        let mut child = as_nobody("squat", port, None);
        assert_eq!(line_from(&mut child, "BOUND"), "");
        child
    })
    .await
    .expect("child bound");
    let f = ShmFabric::new();
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 4096).expect("a geometry"))
        .expect("staging");
    let credential = kvx_io::FabricAccess::new(2, [0; 16]).credential_for(kvx_proto::PeerId(1));
    let r = f.connect(&ep, staging, credential).await;
    let Err(FabricError::Endpoint { why, .. }) = &r else {
        panic!("refused: {r:?}");
    };
    assert!(why.contains("belongs to uid 65534"), "{why}");
    let got = tokio::task::spawn_blocking(move || {
        let got = line_from(&mut child, "DESCRIPTORS ");
        let _ = child.wait();
        got
    })
    .await
    .expect("child");
    assert_eq!(got, "0", "nobody received no descriptor");
}

/// The untrusted peer, run by the tests above as `nobody` (does nothing when run directly).
/// `offer`: offers a sealed memfd of 2 × 4096 bytes and prints `ANSWER <status> <reason>`.
/// `squat`: binds the handoff name, prints `BOUND`, takes one connection and prints how many
/// descriptors came with what it read.
#[test]
#[ignore = "run by the cross-user tests as another user"]
fn untrusted_peer() {
    let (Ok(role), Ok(port)) = (
        std::env::var("KVX_SHM_TRUST_ROLE"),
        std::env::var("KVX_SHM_TRUST_PORT"),
    ) else {
        return;
    };
    let port: u16 = port.parse().expect("port");
    match role.as_str() {
        "offer" => {
            let hex_credential = std::env::var("KVX_SHM_TRUST_CREDENTIAL").expect("credential");
            let bytes: [u8; FabricCredential::LEN] = hex::decode(hex_credential)
                .expect("hex")
                .try_into()
                .expect("length");
            let credential = FabricCredential::from_bytes(&bytes);
            let fd = rustix::fs::memfd_create(
                "untrusted",
                rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
            )
            .expect("memfd");
            rustix::fs::ftruncate(&fd, 2 * 4096).expect("size");
            rustix::io::pwrite(&fd, &[0; 2 * 4096], 0).expect("fill");
            rustix::fs::fcntl_add_seals(
                &fd,
                rustix::fs::SealFlags::SHRINK
                    | rustix::fs::SealFlags::GROW
                    | rustix::fs::SealFlags::FUTURE_WRITE
                    | rustix::fs::SealFlags::SEAL,
            )
            .expect("seals");
            let offer = raw::offer_bytes(2, 4096, &credential);
            let (status, _, reason) = raw::blocking_offer(port, &[fd], &offer);
            println!("ANSWER {status} {reason}");
        }
        "squat" => {
            use std::os::linux::net::SocketAddrExt;
            let name = format!("kvx-shm-fabric.{port}");
            let addr =
                std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("name");
            let listener = std::os::unix::net::UnixListener::bind_addr(&addr).expect("bind");
            println!("BOUND");
            // Bounded (10 s): a parent that failed before connecting leaves no process behind.
            listener.set_nonblocking(true).expect("nonblocking");
            let s = (0..200)
                .find_map(|_| match listener.accept() {
                    Ok((s, _)) => Some(s),
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(50));
                        None
                    }
                })
                .expect("the sender connects");
            s.set_nonblocking(false).expect("blocking");
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let mut buf = [0u8; 64];
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
            // The sender hangs up without sending: 0 bytes, no descriptor.
            let _ = rustix::net::recvmsg(
                &s,
                &mut [std::io::IoSliceMut::new(&mut buf)],
                &mut control,
                rustix::net::RecvFlags::CMSG_CLOEXEC,
            );
            let n: usize = control
                .drain()
                .map(|m| match m {
                    rustix::net::RecvAncillaryMessage::ScmRights(fds) => fds.count(),
                    _ => 0,
                })
                .sum();
            println!("DESCRIPTORS {n}");
        }
        other => panic!("unknown role {other}"),
    }
}
