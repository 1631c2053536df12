//! Chunk checksums over `RdmaFabric` on the NIC model (`docs/spec/fabrics.md` §5b): the
//! sender's checksum travels in the write frame ahead of each write, and the receiver
//! announces how the landed bytes compare — `Match`, `Mismatch` for a byte the model flips
//! after the write landed, `Absent` for a write that carried none or whose frame never came.

use std::time::Duration;

use kvx_io::SlotGeometry;
use kvx_io::{ChecksumCheck, Fabric, LandedWrite, PostWrite, SlotMemory};
use kvx_proto::SlotIndex;

use crate::fake::FakeVerbs;
use crate::tests::{attach, completions, write};
use crate::verbs::{Qp, RemoteAccess, RtrParams, Transition, Verbs, WriteWr};
use crate::wire::{Hello, QpAddr, Welcome, WelcomeStatus, HELLO_LEN, VERSION, WELCOME_LEN};
use crate::{RdmaConfig, RdmaFabric};

const STEP: Duration = Duration::from_secs(10);

fn fabric(config: RdmaConfig) -> (RdmaFabric<FakeVerbs>, FakeVerbs) {
    let verbs = FakeVerbs::new();
    let f = RdmaFabric::with_verbs(verbs.clone(), config).expect("poller starts");
    (f, verbs)
}

/// Slot `slot`'s bytes: distinct per slot, so a write into the wrong one shows.
fn pattern(slot: u32) -> Vec<u8> {
    (0..1024u32).map(|i| (i * 31 + slot * 7) as u8).collect()
}

/// `write(id, slot, 1)` carrying the checksum of `pattern(slot)`.
fn summed(id: u64, slot: u32) -> PostWrite {
    PostWrite {
        checksum: Some(kvx_io::chunk_checksum(&pattern(slot))),
        ..write(id, slot, 1)
    }
}

async fn next_landed(landed: &mut tokio::sync::mpsc::Receiver<LandedWrite>) -> LandedWrite {
    tokio::time::timeout(STEP, landed.recv())
        .await
        .expect("a notice in time")
        .expect("listener open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_write_lands_with_its_checksum_compared() {
    let (f, verbs) = fabric(RdmaConfig::default());
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(8, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let staging = f
        .allocate_staging(SlotGeometry::new(4, 1024).expect("a geometry"))
        .expect("staging");
    for slot in 0..4 {
        staging.write_slot(slot, &pattern(slot));
    }
    let credential = attach(&listener, 0..8, 1);
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    // Writes 0..4 carry their checksums; write 4 carries none; the model flips byte 100 of
    // write 5 after it landed.
    for i in 0..4 {
        conn.post(summed(i, i as u32)).expect("post");
    }
    conn.post(write(4, 4, 1)).expect("post");
    assert!(completions(&mut conn, 5)
        .await
        .iter()
        .all(|(_, r)| r.is_ok()));
    for slot in 0..4 {
        let landed = next_landed(&mut listener.landed).await;
        assert_eq!(
            (landed.slot, landed.checksum),
            (SlotIndex(slot), ChecksumCheck::Match)
        );
    }
    let landed = next_landed(&mut listener.landed).await;
    assert_eq!(
        (landed.slot, landed.checksum),
        (SlotIndex(4), ChecksumCheck::Absent)
    );

    verbs.corrupt_write_after(0, 100);
    conn.post(PostWrite {
        remote: SlotIndex(5),
        imm: Some(
            kvx_proto::WriteTag {
                slot: SlotIndex(5),
                generation: 1,
            }
            .to_imm(),
        ),
        ..summed(5, 1)
    })
    .expect("post");
    assert_eq!(
        completions(&mut conn, 1).await,
        vec![(5, Ok(()))],
        "the NIC saw nothing wrong"
    );
    let landed = next_landed(&mut listener.landed).await;
    let mut flipped = pattern(1);
    flipped[100] ^= 0xFF;
    assert_eq!(landed.slot, SlotIndex(5));
    assert_eq!(
        landed.checksum,
        ChecksumCheck::Mismatch {
            carried: kvx_io::chunk_checksum(&pattern(1)),
            computed: kvx_io::chunk_checksum(&flipped),
        }
    );
}

/// A 4-slot buffer exposed by `rx` with standing grants for peer 1 (each slot written again
/// and again, as `kvx bench` runs), and `tx`'s connection to it as that peer, its staging
/// slot i holding `pattern(i)`.
async fn standing(
    rx: &RdmaFabric<FakeVerbs>,
    tx: &RdmaFabric<FakeVerbs>,
) -> (
    kvx_io::FabricListener<crate::RdmaMemory>,
    kvx_io::FabricConn,
) {
    let geometry = SlotGeometry::new(4, 1024).expect("a geometry");
    let listener = rx.expose("127.0.0.1:0", geometry).await.expect("expose");
    for slot in 0..4 {
        listener.access.grant_standing(slot, kvx_proto::PeerId(1));
    }
    let credential = listener.access.credential_for(kvx_proto::PeerId(1));
    let staging = tx.allocate_staging(geometry).expect("staging");
    for slot in 0..4 {
        staging.write_slot(slot, &pattern(slot));
    }
    let conn = tx
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    (listener, conn)
}

/// A steady stream of writes, each slot written again as soon as its last write completed
/// (standing grants, as `kvx bench` runs): the receiver's completions never pause, and every
/// write still pairs with its frame and is announced `Match` — none goes without its checksum
/// because the frames waited on the socket behind the completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_writes_pairs_every_write_with_its_frame() {
    let (f, _) = fabric(RdmaConfig::default());
    let (mut listener, mut conn) = standing(&f, &f).await;
    const WRITES: u64 = 3000;
    let (mut posted, mut done, mut matched) = (0u64, 0u64, 0u64);
    while matched < WRITES {
        while posted < WRITES && posted - done < 4 {
            let slot = (posted % 4) as u32;
            conn.post(PostWrite {
                imm: Some(
                    kvx_proto::WriteTag {
                        slot: SlotIndex(slot),
                        generation: 0,
                    }
                    .to_imm(),
                ),
                ..summed(posted, slot)
            })
            .expect("post");
            posted += 1;
        }
        tokio::select! {
            c = conn.next_completion() => {
                assert!(c.expect("open").result.is_ok());
                done += 1;
            }
            l = listener.landed.recv() => {
                let l = l.expect("open");
                assert_eq!(l.checksum, ChecksumCheck::Match, "write {matched}");
                matched += 1;
            }
            () = tokio::time::sleep(STEP) => panic!("stalled after {matched} announced"),
        }
    }
}

/// Writes that land faster than the receiver takes their completions (its completion queue
/// held): their frames come ahead of them, more than the buffer has slots (the same slots
/// written again, as standing grants allow) though no more than the receives it posted, and
/// every write still pairs with its frame and is announced `Match` once the completions come.
/// Bounding the frames by the slots alone (mutant `rdma-frames-bound-by-slots-alone`)
/// breaks the connection at the fifth frame, whatever the timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_ahead_of_held_completions_pair_beyond_the_buffers_slots() {
    let sender_nic = FakeVerbs::new();
    let receiver_nic = sender_nic.another_device();
    let rx = RdmaFabric::with_verbs(receiver_nic.clone(), RdmaConfig::default()).expect("fabric");
    let tx = RdmaFabric::with_verbs(sender_nic, RdmaConfig::default()).expect("fabric");
    let (mut listener, mut conn) = standing(&rx, &tx).await;
    receiver_nic.hold_completions(true);
    // Twice the buffer's slots, four at a time (the sender's staging).
    for round in 0..2u64 {
        for slot in 0..4u32 {
            let id = round * 4 + u64::from(slot);
            let tag = kvx_proto::WriteTag {
                slot: SlotIndex(slot),
                generation: 0,
            };
            conn.post(PostWrite {
                imm: Some(tag.to_imm()),
                ..summed(id, slot)
            })
            .expect("post");
        }
        let done = completions(&mut conn, 4).await;
        assert!(done.iter().all(|(_, r)| r.is_ok()), "{done:?}");
    }
    // Every frame reaches the receiver ahead of its held completion.
    tokio::time::sleep(Duration::from_millis(300)).await;
    receiver_nic.hold_completions(false);
    for n in 0..8 {
        let landed = next_landed(&mut listener.landed).await;
        assert_eq!(landed.checksum, ChecksumCheck::Match, "write {n}");
    }
}

/// A peer that speaks the side channel's handshake and then posts its writes and sends their
/// frames as a test says, in either order or not at all.
struct RawPeer {
    side: tokio::net::TcpStream,
    qp: Qp<crate::fake::FakeQp>,
    staging: std::sync::Arc<crate::RdmaMemory>,
    welcome: Welcome,
}

impl RawPeer {
    /// Attached to `listener` (slots 0..4 granted to it under generation 1), on `verbs`.
    async fn attach(
        f: &RdmaFabric<FakeVerbs>,
        verbs: &FakeVerbs,
        listener: &kvx_io::FabricListener<crate::RdmaMemory>,
    ) -> RawPeer {
        let credential = attach(listener, 0..4, 1);
        let staging = f
            .allocate_staging(SlotGeometry::new(4, 1024).expect("a geometry"))
            .expect("staging");
        for slot in 0..4 {
            staging.write_slot(slot, &pattern(slot));
        }
        let addr = listener.local_endpoint.trim_start_matches("tcp://");
        let mut side = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let mut qp = Qp::new(verbs.create_qp(4, 1).expect("qp"));
        qp.modify(Transition::Init(RemoteAccess::None))
            .expect("init");
        let port = verbs.port();
        let hello: [u8; HELLO_LEN] = Hello {
            version: VERSION,
            staging: staging.geometry(),
            qp: QpAddr {
                qpn: qp.qpn(),
                psn: 1,
                lid: port.lid,
                mtu: port.mtu,
                gid: port.gid,
                gid_kind: port.gid_kind,
            },
            credential,
        }
        .encode();
        crate::link::write_frame(&mut side, &hello, STEP)
            .await
            .expect("hello");
        let welcome = crate::link::read_frame::<WELCOME_LEN>(&mut side, STEP)
            .await
            .expect("welcome");
        let welcome = Welcome::decode(&welcome).expect("a welcome");
        assert_eq!(welcome.status, WelcomeStatus::Ok);
        qp.modify(Transition::Rtr(RtrParams {
            remote: welcome.qp,
            mtu: welcome.qp.mtu,
        }))
        .and_then(|()| qp.modify(Transition::Rts { psn: 1 }))
        .expect("connected");
        RawPeer {
            side,
            qp,
            staging,
            welcome,
        }
    }

    /// Writes staging slot `slot` into the receiver's slot `slot`, with its immediate.
    fn post(&mut self, slot: u32) {
        self.qp
            .post_write(&WriteWr {
                wr_id: u64::from(slot),
                staging: &self.staging,
                local_slot: slot,
                len: 1024,
                remote_addr: self.welcome.addr + u64::from(slot) * 1024,
                rkey: self.welcome.rkey,
                imm: write(0, slot, 1).imm,
            })
            .expect("posted");
    }

    /// Sends the frame of the write into `slot`, with its checksum.
    async fn frame(&mut self, slot: u32) {
        let frame = crate::wire::WriteFrame {
            imm: write(0, slot, 1).imm.expect("an immediate"),
            len: 1024,
            checksum: Some(kvx_io::chunk_checksum(&pattern(slot))),
        };
        crate::link::write_frame(&mut self.side, &frame.encode(), STEP)
            .await
            .expect("frame");
    }
}

/// A write whose frame comes after it landed, within the bound, pairs with it: the receiver
/// holds the write until the frame comes, then announces it `Match`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_that_comes_after_its_write_landed_still_pairs() {
    let (f, verbs) = fabric(RdmaConfig::default());
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let mut peer = RawPeer::attach(&f, &verbs, &listener).await;
    peer.post(0);
    peer.post(1);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), listener.landed.recv())
            .await
            .is_err(),
        "nothing is announced before its frame"
    );
    peer.frame(0).await;
    peer.frame(1).await;
    for slot in 0..2 {
        let landed = next_landed(&mut listener.landed).await;
        assert_eq!(
            (landed.slot, landed.checksum),
            (SlotIndex(slot), ChecksumCheck::Match)
        );
    }
}

/// A write with immediate whose frame never comes (a peer that posts without one) is
/// announced without a checksum once the frame's bound (`connect_timeout`) has passed —
/// never held for ever — and the frame, should it come after all, changes nothing; the next
/// write, frame first, still pairs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_frame_never_comes_is_announced_without_a_checksum_after_the_bound() {
    let bound = Duration::from_millis(300);
    let (f, verbs) = fabric(RdmaConfig {
        connect_timeout: bound,
        ..RdmaConfig::default()
    });
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(4, 1024).expect("a geometry"),
        )
        .await
        .expect("expose");
    let mut peer = RawPeer::attach(&f, &verbs, &listener).await;
    let started = tokio::time::Instant::now();
    peer.post(0);
    let landed = next_landed(&mut listener.landed).await;
    assert_eq!(
        (landed.slot, landed.checksum),
        (SlotIndex(0), ChecksumCheck::Absent)
    );
    let waited = started.elapsed();
    assert!(
        waited >= bound && waited < bound + Duration::from_secs(3),
        "announced after {waited:?}, the bound {bound:?}"
    );
    // Its frame comes late: dropped, nothing more is announced, and the connection lives on.
    peer.frame(0).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(200), listener.landed.recv())
            .await
            .is_err(),
        "a late frame announces nothing"
    );
    peer.frame(1).await;
    peer.post(1);
    let landed = next_landed(&mut listener.landed).await;
    assert_eq!(
        (landed.slot, landed.checksum),
        (SlotIndex(1), ChecksumCheck::Match)
    );
}
