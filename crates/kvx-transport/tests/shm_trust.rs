//! The shm fabric's same-host trust model across users (`docs/spec/fabrics.md` §4): a
//! receiver refuses a staging offer from a process of a user it does not trust, and accepts
//! one once that user is in `trusted_uids`; a sender refuses to hand its staging to a
//! handoff socket bound by an untrusted user. The other user is `nobody` (65534), played by
//! this test binary re-run as that user (`untrusted_peer`).
//!
//! That needs root (to switch users) and a copy of this binary that `nobody` may execute:
//! the checkout, and so the binary, may lie in a directory only its owner can enter (a home
//! directory, a `mktemp -d`), so each test copies the binary into a fresh directory of its
//! own under the first of `/tmp`, `/var/tmp`, `/dev/shm` where `nobody` runs it, and removes
//! it after. Where either is impossible the tests say why and skip, unless
//! `KVX_REQUIRE_CROSS_USER=1` (CI), under which a skip fails.
//! `cross_user_checks_run_from_a_private_directory` runs them from a 0700 directory.

mod fabric_common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use fabric_common::{port_of, raw};
use kvx_io::SlotGeometry;
use kvx_io::{Fabric, FabricCredential, FabricError};
use kvx_transport::shm_fabric::{ShmFabric, ShmFabricConfig};

const NOBODY: u32 = 65534;
const EP: &str = "127.0.0.1:0";
/// Where a copy of the binary may go: world-searchable directories, usually without `noexec`.
const PLACES: [&str; 3] = ["/tmp", "/var/tmp", "/dev/shm"];

/// Skips a cross-user check with `why`, or fails it under `KVX_REQUIRE_CROSS_USER=1`.
fn skip(why: &str) {
    assert!(
        std::env::var("KVX_REQUIRE_CROSS_USER").as_deref() != Ok("1"),
        "KVX_REQUIRE_CROSS_USER=1, but the cross-user checks cannot run: {why}"
    );
    eprintln!("the cross-user checks are skipped: {why}");
}

/// A copy of this test binary that `nobody` can execute, in a directory of its own that is
/// removed on drop.
struct PeerBinary {
    dir: PathBuf,
    exe: PathBuf,
}

impl PeerBinary {
    /// The copy, or why there can be none (then the test skips through [`skip`]).
    fn place() -> Result<PeerBinary, String> {
        if !rustix::process::geteuid().is_root() {
            return Err("not root: cannot run a peer as another user".into());
        }
        let original = std::env::current_exe().map_err(|e| format!("this binary's path: {e}"))?;
        let mut tried = Vec::new();
        for place in PLACES {
            match PeerBinary::copy_into(Path::new(place), &original) {
                Ok(peer) => return Ok(peer),
                Err(why) => tried.push(format!("{place}: {why}")),
            }
        }
        Err(format!(
            "nowhere for nobody to run this binary from ({})",
            tried.join("; ")
        ))
    }

    /// Copies `original` into a new directory under `place` (0755, as root) and checks that
    /// `nobody` runs it there (a directory it cannot enter, `noexec`, ... fail the probe).
    fn copy_into(place: &Path, original: &Path) -> Result<PeerBinary, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = place.join(format!(
            "kvx-shm-trust-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir).map_err(|e| e.to_string())?;
        // From here on the directory goes with `peer`, whatever fails.
        let peer = PeerBinary {
            exe: dir.join("shm_trust_peer"),
            dir,
        };
        std::fs::set_permissions(&peer.dir, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        std::fs::copy(original, &peer.exe).map_err(|e| e.to_string())?;
        std::fs::set_permissions(&peer.exe, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        let probe = output_of_fresh_copy(peer.command("probe", 0).stderr(Stdio::null()))
            .map_err(|e| format!("nobody cannot start it: {e}"))?;
        let said = String::from_utf8_lossy(&probe.stdout);
        if !said.lines().any(|l| l == "PROBE") {
            return Err(format!("nobody cannot run it ({})", probe.status));
        }
        Ok(peer)
    }

    /// The copy run as `nobody`, playing `role` against `port`, from its own directory.
    fn command(&self, role: &str, port: u16) -> Command {
        let mut cmd = Command::new(&self.exe);
        cmd.args(["--exact", "untrusted_peer", "--ignored", "--nocapture"])
            .env("KVX_SHM_TRUST_ROLE", role)
            .env("KVX_SHM_TRUST_PORT", port.to_string())
            .current_dir(&self.dir)
            .uid(NOBODY)
            .gid(NOBODY)
            .stdout(Stdio::piped());
        cmd
    }

    /// The copy started as `nobody`, playing `role` against `port`.
    fn spawn(&self, role: &str, port: u16, credential: Option<&FabricCredential>) -> Child {
        let mut cmd = self.command(role, port);
        if let Some(c) = credential {
            cmd.env("KVX_SHM_TRUST_CREDENTIAL", hex::encode(c.to_bytes()));
        }
        cmd.spawn().expect("spawn the untrusted peer")
    }
}

impl Drop for PeerBinary {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `cmd`'s output, where its program was copied just now: while the copy was open for
/// writing, a process that another test thread forked may hold it open until that process
/// execs, and exec fails with ETXTBSY meanwhile. Retried, bounded (2 s).
fn output_of_fresh_copy(cmd: &mut Command) -> std::io::Result<std::process::Output> {
    for _ in 0..100 {
        match cmd.output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(Duration::from_millis(20));
            }
            done => return done,
        }
    }
    cmd.output()
}

/// The peer binary, or `None` after saying why the test skips.
fn peer_binary() -> Option<PeerBinary> {
    PeerBinary::place().map_err(|why| skip(&why)).ok()
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
    let Some(peer) = peer_binary() else {
        return;
    };
    let peer = std::sync::Arc::new(peer);
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
        let peer = peer.clone();
        let child = tokio::task::spawn_blocking(move || {
            let mut child = peer.spawn("offer", port, Some(&credential));
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
    let Some(peer) = peer_binary() else {
        return;
    };
    // The control port: a listener that never answers (the handoff comes first).
    let control = tokio::net::TcpListener::bind(EP).await.expect("bind");
    let ep = control.local_addr().expect("addr").to_string();
    let port = port_of(&ep);
    let child = tokio::task::spawn_blocking(move || {
        let mut child = peer.spawn("squat", port, None);
        assert_eq!(line_from(&mut child, "BOUND"), "");
        (child, peer)
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
    let (mut child, peer) = child;
    let got = tokio::task::spawn_blocking(move || {
        let got = line_from(&mut child, "DESCRIPTORS ");
        let _ = child.wait();
        drop(peer);
        got
    })
    .await
    .expect("child");
    assert_eq!(got, "0", "nobody received no descriptor");
}

/// The untrusted peer, run by the tests above as `nobody` (does nothing when run directly).
/// `offer`: offers a sealed memfd of 2 × 4096 bytes and prints `ANSWER <status> <reason>`.
/// `probe`: prints `PROBE` (the copy runs as `nobody`).
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
        "probe" => println!("PROBE"),
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

/// The checkout in a private directory (a home directory, a `mktemp -d`): this binary,
/// copied into a 0700 directory and run from there under `KVX_REQUIRE_CROSS_USER=1`, runs
/// both cross-user checks and passes them (a skip would fail them).
#[test]
fn cross_user_checks_run_from_a_private_directory() {
    // Root, and somewhere `nobody` may run this binary from: otherwise skipped as the checks are.
    let Some(_peer) = peer_binary() else {
        return;
    };
    let private =
        std::env::temp_dir().join(format!("kvx-shm-trust-private-{}", std::process::id()));
    std::fs::create_dir(&private).expect("a private directory");
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).expect("0700");
    let exe = private.join("shm_trust");
    std::fs::copy(std::env::current_exe().expect("this binary"), &exe).expect("copy");
    let out = output_of_fresh_copy(
        Command::new(&exe)
            .args([
                "--exact",
                "shm_receiver_refuses_an_untrusted_user",
                "shm_sender_refuses_a_socket_of_an_untrusted_user",
            ])
            .env("KVX_REQUIRE_CROSS_USER", "1")
            .current_dir(&private),
    )
    .expect("run the copy");
    let _ = std::fs::remove_dir_all(&private);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "from a 0700 directory: {said}");
    assert!(said.contains("2 passed"), "both checks ran: {said}");
}
