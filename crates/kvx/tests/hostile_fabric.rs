//! Hostile peers against real `kvx receiver`, `kvx proxy` and `kvx sender` processes, at the
//! fabric and the protocol (the ZMTP layer is `hostile_zmtp.rs`). The defects a hostile review
//! found, each as an attack that must now fail while a legitimate sender keeps working:
//!
//! - forged landings and cross-sender overwrites through the fabric port, during a real
//!   transfer whose every byte the receiver's decoder verifies;
//! - first batches that amplify into a gigabyte of memory while they wait for admission;
//! - a sender whose chunk size differs from the receiver's;
//! - writes that would complete a chunk without bringing all of it: one byte, the halves of a
//!   split write, a longer write than the chunk, a write cut mid-payload;
//! - fabric hellos of the old version, with a credential the receiver never issued, or junk;
//! - a write that outlives its grant: stopped half-way, its slot let go and granted to another
//!   sender, then finished after that sender's chunk landed.
//!
//! Everything runs on 127.0.0.1 with ports the OS picks; every wait is bounded.

mod hostile;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hostile::fabric::{self, FabricPeer};
use hostile::zmtp::Peer;
use hostile::{fresh_identity, legit_round_trip, Kvx};
use kvx_io::FabricCredential;
use kvx_proto::wire::{self, AllocRequest, CancelNotif, Message};
use kvx_proto::PeerId;

const CHUNK: u64 = 64 << 10;
const BUFFER: u32 = 64;

/// A kvx-style (with `seq`) first batch: `keys`, of a request of `total` chunks, each
/// declared `chunk` bytes long (`None`: no lengths declared).
fn first_batch(req: &str, keys: Vec<String>, total: u32, seq: u64, chunk: Option<u64>) -> Vec<u8> {
    wire::encode(&Message::AllocRequest(AllocRequest {
        chunk_bytes: chunk.map(|c| vec![c; keys.len()]),
        keys,
        fmt: 1,
        shape: vec![2, 2, 16, 32],
        dtype: "bfloat16".into(),
        last_chunk_toks: 16,
        req_id: req.into(),
        is_last_batch: false,
        total_chunks: total,
        seq: Some(seq),
        claim: None,
    }))
}

fn reply(bytes: &[u8]) -> kvx_proto::wire::AllocResponse {
    hostile::lmcache::alloc_response(bytes)
}

/// Connects as a control peer of its own and reads the fabric credential the receiver
/// issues it (as any kvx sender does): an attacker can always be *somebody*.
fn own_credential(receiver: &Kvx) -> (Peer, FabricCredential) {
    let mut peer = Peer::dealer(receiver.addr(), Some(&fresh_identity("attacker")))
        .expect("the attacker connects");
    let r = reply(
        &peer
            .request(&first_batch("attacker-probe", vec![], 1, 1, None))
            .expect("its probe is answered"),
    );
    assert!(!r.is_refusal(), "{r:?}");
    let text = r
        .fabric_credential
        .expect("a kvx sender is given a credential");
    (
        peer,
        FabricCredential::from_text(&text).expect("a well-formed credential"),
    )
}

/// Runs `kvx sender` with `args` to completion (bounded) and returns its JSON summary and
/// its stderr.
fn run_sender(receiver: &Kvx, proxy: &Kvx, args: &[&str]) -> (serde_json::Value, String) {
    let alloc = receiver.addr().port().to_string();
    let fabric = receiver.fabric_addr().port().to_string();
    let proxy = proxy.addr().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args(["sender", "--alloc-ports", &alloc, "--fabric-ports", &fabric])
        .args(["--proxy", &proxy, "--json", "--timeout-s", "60"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("kvx sender runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let summary = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("kvx sender's JSON: {e}; stderr: {stderr}"));
    (summary, stderr)
}

/// Forged landings (defect 1) and overwrites of another sender's slots (defect 2), aimed at
/// every slot under the generations a short run uses, while a real sender transfers 200
/// requests whose every byte the receiver's decoder checks. Before the fix the same attack
/// made 31 (forged landings) and 104 (overwrites) chunks of a 300-request run corrupt, with
/// every request reported fine. Now every attempt is refused, no chunk is corrupt, every
/// request is delivered, and the refusals cost a log line a second, not one each.
#[test]
fn forged_landings_and_overwrites_are_refused_during_a_real_transfer() {
    let chunk = CHUNK.to_string();
    let mut receiver = Kvx::receiver_verifying(BUFFER, CHUNK);
    let proxy = Kvx::proxy();
    let fabric_addr = receiver.fabric_addr();
    let (_control, credential) = own_credential(&receiver);

    let stop = Arc::new(AtomicBool::new(false));
    let attack = {
        let stop = stop.clone();
        std::thread::spawn(move || attack_the_fabric(fabric_addr, credential, &stop))
    };
    let started = Instant::now();
    let (summary, stderr) = run_sender(
        &receiver,
        &proxy,
        &[
            "--chunk-bytes",
            &chunk,
            "--requests",
            "200",
            "--chunks",
            "1..4",
        ],
    );
    stop.store(true, Ordering::Relaxed);
    let (refused, other) = attack.join().expect("the attack ran");
    let elapsed = started.elapsed();

    assert_eq!(
        summary["requests_completed"], summary["requests_total"],
        "every request delivered: {summary} {stderr}"
    );
    assert!(refused > 1_000, "the attack ran: {refused} writes refused");
    assert_eq!(other, 0, "no attacking write was accepted");
    receiver.assert_alive();
    // The decoder read and verified every request (the twin of the check below, which
    // would pass as well if it read nothing).
    assert!(
        receiver.wait_verified("", 200, Duration::from_secs(10)),
        "the decoder verified all 200 requests: {:?}",
        receiver.lines()
    );
    assert_eq!(
        receiver.log_count("decoder read corrupt bytes"),
        0,
        "{:?}",
        receiver.lines()
    );
    let refusal_lines = receiver.log_count("fabric write refused");
    assert!(refusal_lines >= 1, "refusals are logged");
    assert!(
        refusal_lines as u64 <= elapsed.as_secs() + 2,
        "{refusal_lines} log lines in {elapsed:?}: refusals are logged at most once a second"
    );
    legit_round_trip(&mut receiver);
}

/// The attacker's fabric connection, authenticated as itself: empty writes naming every
/// slot under generations 1..=32 (a forged landing each), and full chunks into every slot
/// (an overwrite each), in rounds until `stop`. Returns (writes refused, writes answered
/// otherwise).
fn attack_the_fabric(
    addr: SocketAddr,
    credential: FabricCredential,
    stop: &AtomicBool,
) -> (u64, u64) {
    let mut peer = FabricPeer::connect(addr).expect("the attacker reaches the fabric port");
    peer.send(&fabric::hello(1, CHUNK, &credential))
        .expect("hello");
    assert_eq!(
        peer.welcome().expect("welcome").status,
        0,
        "it attaches as itself"
    );
    let junk = vec![0xEEu8; CHUNK as usize];
    let (mut refused, mut other, mut id) = (0u64, 0u64, 0u64);
    // Bounded: at most 20 rounds, each of 64 × 32 forged landings and 64 overwrites.
    for _ in 0..20 {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        for slot in 0..BUFFER {
            let mut burst = Vec::new();
            for generation in 1..=32 {
                id += 1;
                burst.extend(fabric::header(
                    id,
                    slot,
                    0,
                    Some(fabric::imm(slot, generation)),
                    None,
                ));
            }
            id += 1;
            burst.extend(fabric::header(
                id,
                slot,
                CHUNK,
                Some(fabric::imm(slot, 1 + (id % 8) as u32)),
                None,
            ));
            burst.extend_from_slice(&junk);
            peer.send(&burst).expect("the attack is read");
            for _ in 0..33 {
                match peer.ack().expect("every write is acked").1 {
                    2 => refused += 1,
                    _ => other += 1,
                }
            }
        }
    }
    (refused, other)
}

/// Memory amplification (defect 3): 40 first batches of about 1 MiB of keys for a request of
/// 768 chunks, sent while the buffer is held so that each would wait. They used to be kept
/// whole until admission, and 40 took a receiver from 7 MB to 1.05 GB. Now a list longer than
/// `LIST_ENTRIES_MAX` is refused by the decoder (half the frames: 500 000 one-byte keys), and
/// keys beyond the declared total are refused before anything is kept (the other half: 55 000
/// keys of 15 bytes, with their chunk lengths). The receiver's RSS stays within 64 MiB of where it started, and it
/// still serves.
#[test]
fn first_batches_cannot_amplify_into_memory() {
    let mut receiver = Kvx::receiver();
    std::thread::sleep(Duration::from_millis(300));
    let before = receiver.rss_kib();
    // A hog holds 768 of the 1024 slots (its share), so the flood's requests would wait.
    let mut hog = Peer::dealer(receiver.addr(), Some(&fresh_identity("hog"))).expect("hog");
    let r = reply(
        &hog.request(&first_batch("hold", vec![], 768, 1, None))
            .expect("held"),
    );
    assert!(!r.is_refusal(), "{r:?}");
    let tiny: Vec<String> = (0..500_000)
        .map(|i| ((b'a' + (i % 26) as u8) as char).to_string())
        .collect();
    let many: Vec<String> = (0..55_000).map(|i| format!("{i:0>15}")).collect();
    for p in 0..8 {
        let mut peer =
            Peer::dealer(receiver.addr(), Some(&fresh_identity("flood"))).expect("flood");
        for i in 0..5u64 {
            // The tiny keys' list is refused before any other field is read; the many keys
            // come with their lengths, as a kvx sender's do (1 byte each, to fit a frame).
            let (keys, chunk) = if (p + i) % 2 == 0 {
                (&tiny, None)
            } else {
                (&many, Some(1))
            };
            let frame = first_batch(&format!("flood-{p}-{i}"), keys.clone(), 768, i + 1, chunk);
            assert!(frame.len() <= 1 << 20, "{} bytes fit a frame", frame.len());
            let r = reply(&peer.request(&frame).expect("answered"));
            assert!(r.is_refusal(), "refused at once: {r:?}");
        }
    }
    receiver.assert_alive();
    let after = receiver.rss_kib();
    eprintln!("receiver RSS: {before} KiB before, {after} KiB after the flood");
    assert!(
        after < before + 64 * 1024,
        "RSS {before} KiB before, {after} KiB after 40 MiB of first batches"
    );
    // The hog lets go; a legitimate sender is served.
    let cancel = wire::encode(&Message::CancelNotif(CancelNotif {
        req_id: "hold".into(),
        keys: vec![],
        seq: Some(2),
        drained: Some(true),
    }));
    hog.request(&cancel).expect("cancel acknowledged");
    legit_round_trip(&mut receiver);
}

/// A sender whose chunks are smaller than the receiver's slots (defect 7) was accepted and
/// its chunks arrived corrupt. It is refused at the fabric handshake, with both sizes named,
/// and every request fails instead of arriving short.
#[test]
fn a_sender_with_another_chunk_size_is_refused_naming_both() {
    let receiver = Kvx::receiver_with(BUFFER, 4096, &[]);
    let proxy = Kvx::proxy();
    let (summary, stderr) = run_sender(
        &receiver,
        &proxy,
        &[
            "--chunk-bytes",
            "2048",
            "--requests",
            "3",
            "--chunks",
            "1..2",
        ],
    );
    assert_eq!(summary["requests_completed"], 0, "{summary} {stderr}");
    assert!(
        stderr.contains("2048") && stderr.contains("4096"),
        "the refusal names both sizes: {stderr}"
    );
    assert_eq!(receiver.log_count("decoder read corrupt bytes"), 0);
}

/// Fabric hellos that must not attach: the old version (no credential), a credential the
/// receiver never issued (for each of the first few peer ids, which are guessable), and junk.
/// Each is answered with a refusal carrying no file path, or dropped; the receiver serves on.
#[test]
fn unauthenticated_fabric_hellos_are_refused() {
    let mut receiver = Kvx::receiver();
    let fabric_addr = receiver.fabric_addr();
    let mut old = FabricPeer::connect(fabric_addr).expect("connect");
    old.send(&fabric::hello_v1(1, 4096)).expect("hello");
    let w = old.welcome().expect("an answer");
    assert_eq!((w.status, w.extra_len), (1, 0), "version refused: {w:?}");
    for peer in 1..=8 {
        let forged = FabricCredential {
            peer: PeerId(peer),
            tag: [peer as u8; 16],
        };
        let mut p = FabricPeer::connect(fabric_addr).expect("connect");
        p.send(&fabric::hello(1, 4096, &forged)).expect("hello");
        let w = p.welcome().expect("an answer");
        assert_eq!(
            (w.status, w.extra_len),
            (4, 0),
            "forged credential refused: {w:?}"
        );
        assert!(p.closed(), "and the connection closed");
    }
    let mut junk = FabricPeer::connect(fabric_addr).expect("connect");
    junk.send(&[0xFF; 64]).expect("junk");
    assert!(junk.closed(), "junk is dropped");
    receiver.assert_alive();
    legit_round_trip(&mut receiver);
}

/// One batch, the request's last, of a kvx sender: chunk `0` of `req`, declared `bytes` long.
fn one_chunk(req: &str, bytes: u64, seq: u64) -> Vec<u8> {
    wire::encode(&Message::AllocRequest(AllocRequest {
        keys: vec![format!("{req}@0")],
        fmt: 1,
        shape: vec![2, 2, 16, 32],
        dtype: "bfloat16".into(),
        last_chunk_toks: 16,
        req_id: req.into(),
        is_last_batch: true,
        total_chunks: 1,
        seq: Some(seq),
        chunk_bytes: Some(vec![bytes]),
        claim: None,
    }))
}

/// A cancel of `req` claiming that nothing of it is in flight (`drained`), which frees its
/// slots at once.
fn cancel(req: &str, seq: u64) -> Vec<u8> {
    wire::encode(&Message::CancelNotif(CancelNotif {
        req_id: req.into(),
        keys: vec![],
        seq: Some(seq),
        drained: Some(true),
    }))
}

/// Asks for `req` on `control` and returns its slot and the immediate its write carries.
fn grant_of(control: &mut Peer, req: &str, bytes: u64, seq: u64) -> (u32, u32) {
    let r = reply(
        &control
            .request(&one_chunk(req, bytes, seq))
            .expect("answered"),
    );
    assert!(!r.is_refusal(), "{req} granted: {r:?}");
    let slot = u32::try_from(r.remote_indexes[0]).expect("a slot");
    let generation = r.generations.expect("a kvx sender gets generations")[0];
    (slot, fabric::imm(slot, generation))
}

/// A write of `payload` into `slot` under `imm`, with its checksum.
fn write(id: u64, slot: u32, imm: u32, payload: &[u8]) -> Vec<u8> {
    let sum = kvx_io::chunk_checksum(payload);
    let mut b = fabric::header(id, slot, payload.len() as u64, Some(imm), Some(sum));
    b.extend_from_slice(payload);
    b
}

fn attach(addr: SocketAddr, credential: &FabricCredential) -> FabricPeer {
    let mut peer = FabricPeer::connect(addr).expect("the fabric port answers");
    peer.send(&fabric::hello(1, CHUNK, credential))
        .expect("hello");
    assert_eq!(peer.welcome().expect("welcome").status, 0, "attached");
    peer
}

/// A short write completed a chunk: one byte into a granted slot was accepted as the whole
/// chunk, and the decoder read the previous request's bytes for the rest. Against a receiver
/// of one slot, whose decoder verifies every chunk it reads, the grant holder itself writes
/// one byte, the two halves of a split write and a write longer than the slot into the slot
/// that held the previous request's chunk; a whole slot into a partial chunk declared half as
/// long; and a write cut mid-payload. Each is refused with a status (ack 2) or ends its
/// connection, none makes its request ready (the whole chunk still lands after the refused
/// ones), and the decoder never reads a chunk that is not whole.
#[test]
fn a_chunk_lands_whole_or_not_at_all() {
    let mut receiver = Kvx::receiver_verifying(1, CHUNK);
    let addr = receiver.fabric_addr();
    let (mut control, credential) = own_credential(&receiver);
    // The probe that fetched the credential holds the only slot's reservation: let it go.
    control
        .request(&cancel("attacker-probe", 2))
        .expect("cancel acknowledged");
    let chunk = |req: &str| {
        let mut b = vec![0u8; CHUNK as usize];
        kvx_node::synthetic::chunk_bytes(req, 0, &mut b);
        b
    };
    let mut f = attach(addr, &credential);
    let ack = |f: &mut FabricPeer| f.ack().expect("every write is acked");

    // The previous request: its whole chunk fills the slot and is read.
    let old = chunk("old");
    let (slot, imm) = grant_of(&mut control, "old", CHUNK, 3);
    f.send(&write(1, slot, imm, &old)).expect("sent");
    assert_eq!(ack(&mut f), (1, 0), "a whole chunk lands");

    // A partial last chunk declared half a slot: a whole slot's write is longer than it.
    let (slot, imm) = grant_of(&mut control, "partial", CHUNK / 2, 4);
    f.send(&write(2, slot, imm, &chunk("partial")))
        .expect("sent");
    assert_eq!(
        ack(&mut f),
        (2, 2),
        "a write longer than its chunk is refused"
    );
    control
        .request(&cancel("partial", 5))
        .expect("cancel acknowledged");

    // The next request gets the same slot, still holding the old chunk.
    let new = chunk("new");
    let (slot, imm) = grant_of(&mut control, "new", CHUNK, 6);
    f.send(&write(3, slot, imm, &new[..1])).expect("sent");
    assert_eq!(ack(&mut f), (3, 2), "one byte is refused");
    let half = new.len() / 2;
    f.send(&write(4, slot, imm, &new[..half])).expect("sent");
    f.send(&write(5, slot, imm, &new[half..])).expect("sent");
    assert_eq!(
        ack(&mut f),
        (4, 2),
        "the first half of a split write is refused"
    );
    assert_eq!(ack(&mut f), (5, 2), "so is the second");
    // A header that declares more than the slot ends the connection.
    f.send(&fabric::header(6, slot, CHUNK + 1, Some(imm), None))
        .expect("sent");
    assert!(f.closed(), "a write beyond the slot ends its connection");
    assert!(
        receiver.wait_verified("old", 1, Duration::from_secs(5)),
        "the decoder read the whole chunk: {:?}",
        receiver.lines()
    );
    assert_eq!(
        receiver.log_count("decoder read corrupt bytes"),
        0,
        "no partial chunk was read: {:?}",
        receiver.lines()
    );
    // The whole chunk still lands: no refused write completed the chunk or used its grant.
    let mut f = attach(addr, &credential);
    f.send(&write(7, slot, imm, &new)).expect("sent");
    assert_eq!(ack(&mut f), (7, 0), "the whole chunk lands");
    assert!(
        receiver.wait_verified("new", 1, Duration::from_secs(5)),
        "the decoder read it whole: {:?}",
        receiver.lines()
    );

    // A write cut mid-payload never completes: its grant is used (admitted at its header),
    // nothing is announced, and the request is never ready (its lease runs out).
    let (slot, imm) = grant_of(&mut control, "cut", CHUNK, 7);
    let mut cut = attach(addr, &credential);
    let whole = write(8, slot, imm, &chunk("cut"));
    cut.send(&whole[..whole.len() / 2]).expect("sent");
    drop(cut);
    std::thread::sleep(Duration::from_millis(300));
    f.send(&write(9, slot, imm, &chunk("cut"))).expect("sent");
    assert_eq!(ack(&mut f), (9, 2), "the cut write's grant admits no other");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        receiver.log_count("decoder read corrupt bytes"),
        0,
        "the decoder read whole chunks only: {:?}",
        receiver.lines()
    );
    receiver.assert_alive();
}

/// A write outlived its grant (with a real `kvx sender` of 3,000 requests beside such a peer,
/// 188 corrupt chunks were read by the decoder, every request reported fine). Against a
/// receiver of one slot whose decoder verifies every chunk: the attacker starts a write into
/// its granted slot, stops half-way, and lets the slot go with a cancel claiming `drained`;
/// the slot is granted to a victim, whose whole chunk lands; then the attacker sends the rest.
/// The rest is refused (ack 2; it was acked 0 and landed in the victim's slot), and the
/// decoder reads no corrupt chunk. The outcome does not depend on timing: whatever part of the
/// first half the receiver had not read before the cancel is refused too.
#[test]
fn a_write_never_outlives_its_grant() {
    let mut receiver = Kvx::receiver_verifying(1, CHUNK);
    let addr = receiver.fabric_addr();
    let chunk = |req: &str| {
        let mut b = vec![0u8; CHUNK as usize];
        kvx_node::synthetic::chunk_bytes(req, 0, &mut b);
        b
    };
    // Two control peers, each with its credential; their probes hold the only slot in turn.
    let (mut attacker, attacker_credential) = own_credential(&receiver);
    attacker
        .request(&cancel("attacker-probe", 2))
        .expect("cancel acknowledged");
    let (mut victim, victim_credential) = own_credential(&receiver);
    victim
        .request(&cancel("attacker-probe", 2))
        .expect("cancel acknowledged");

    // The attacker writes half of its chunk into its granted slot and stops.
    let (slot, imm) = grant_of(&mut attacker, "attack", CHUNK, 3);
    let mut f = attach(addr, &attacker_credential);
    let whole = write(1, slot, imm, &vec![0xEE; CHUNK as usize]);
    let cut = whole.len() / 2;
    f.send(&whole[..cut]).expect("sent");
    std::thread::sleep(Duration::from_millis(200));
    // It lets the slot go, claiming nothing of its is in flight.
    attacker
        .request(&cancel("attack", 4))
        .expect("cancel acknowledged");

    // The victim is granted the same slot; its whole chunk lands and checks out.
    let (victim_slot, victim_imm) = grant_of(&mut victim, "victim", CHUNK, 3);
    assert_eq!(victim_slot, slot, "one slot");
    let mut v = attach(addr, &victim_credential);
    v.send(&write(1, victim_slot, victim_imm, &chunk("victim")))
        .expect("sent");
    assert_eq!(v.ack().expect("acked"), (1, 0), "the victim's chunk lands");

    // The rest of the attacker's write.
    f.send(&whole[cut..]).expect("sent");
    assert_eq!(
        f.ack().expect("acked"),
        (1, 2),
        "the rest of a write whose grant was revoked is refused"
    );
    assert!(
        receiver.wait_verified("victim", 1, Duration::from_secs(5)),
        "the decoder read the victim's chunk: {:?}",
        receiver.lines()
    );
    assert_eq!(
        receiver.log_count("decoder read corrupt bytes"),
        0,
        "the decoder read the victim's chunk whole: {:?}",
        receiver.lines()
    );
    receiver.assert_alive();
}
