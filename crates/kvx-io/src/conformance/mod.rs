//! The conformance suite: test bodies that every `Transport` and `Fabric` implementation runs
//! in its own tests (in-memory here; ZMQ, TCP and shared memory in `kvx-transport`; the
//! simulated ones in `sim/`; RDMA where hardware exists). Each body panics with a message
//! naming the broken rule. Every wait is bounded by `STEP_TIMEOUT`.
//!
//! Endpoints are passed in, because their form is transport-specific; a port of 0 is fine:
//! the bodies connect to `local_endpoint()`.

use std::time::Duration;

use kvx_proto::receiver::{ChecksumCheck, LandedWrite};
use kvx_proto::{PeerId, SlotIndex, StagingSlot, WriteId, WriteTag};

use crate::access::FabricCredential;
use crate::checksum::chunk_checksum;
use crate::fabric::{Completion, Fabric, FabricError, FabricListener, PostWrite, SlotMemory};
use crate::geometry::SlotGeometry;

mod runs;
mod transport;
pub use runs::fabric_runs_land_as_their_pieces;
pub use transport::{transport_notices, transport_request_reply};

/// The longest any single step of a conformance body may take.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(10);

async fn step<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(STEP_TIMEOUT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("conformance: {what} did not happen within {STEP_TIMEOUT:?}"),
    }
}

fn pattern(slot: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(slot * 7) as u8)
        .collect()
}

async fn next_completion(conn: &mut crate::fabric::FabricConn, what: &str) -> Completion {
    step(what, conn.next_completion())
        .await
        .expect("conformance: connection open")
}

/// The generation the bodies grant slots under (any value works; not 0, to catch a fabric
/// that ignores it).
const GEN: u32 = 5;

fn imm(slot: u32) -> Option<u32> {
    Some(
        WriteTag {
            slot: SlotIndex(slot),
            generation: GEN,
        }
        .to_imm(),
    )
}

/// Grants every slot of `listener` to `peer` (what a receiver's ledger would do for its
/// requests) and returns the credential that peer attaches with.
fn grant_all<M>(listener: &FabricListener<M>, peer: PeerId) -> FabricCredential {
    for slot in 0..listener.access.slots() {
        listener.access.grant(slot, peer, GEN);
    }
    listener.access.credential_for(peer)
}

/// A write of staging slot `local` into remote slot `remote` under its grant, with the
/// checksum of `bytes` (the staging slot's content).
fn granted_write(id: u64, local: u32, remote: u32, bytes: &[u8]) -> PostWrite {
    PostWrite {
        id: WriteId(id),
        local: StagingSlot(local),
        remote: SlotIndex(remote),
        len: bytes.len(),
        imm: imm(remote),
        checksum: Some(chunk_checksum(bytes)),
    }
}

/// Writes land byte for byte, completions come back in posting order, and each write is
/// announced once, with the peer its connection authenticated as, its slot, its immediate,
/// its length and how its checksum compared (a fabric that carries none says `Absent`). A
/// write without an immediate names no grant and is never announced.
pub async fn fabric_writes_land_in_order<F: Fabric>(
    f: &F,
    endpoint: &str,
    slots: u32,
    slot_bytes: usize,
) {
    let mut listener = f
        .expose(
            endpoint,
            SlotGeometry::new(slots, slot_bytes).expect("a geometry"),
        )
        .await
        .expect("conformance: expose");
    let peer = PeerId(41);
    let credential = grant_all(&listener, peer);
    let staging = f
        .allocate_staging(SlotGeometry::new(slots, slot_bytes).expect("a geometry"))
        .expect("conformance: staging");
    let mut conn = f
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("conformance: connect");
    for s in 0..slots {
        staging.write_slot(s, &pattern(s, slot_bytes));
    }
    // A write without an immediate first: refused, nothing lands.
    let bare = PostWrite {
        imm: None,
        ..granted_write(100, 0, 0, &pattern(0, slot_bytes))
    };
    conn.post(bare).expect("conformance: post");
    // Staging slot s goes to remote slot (slots-1-s).
    for s in 0..slots {
        let w = granted_write(u64::from(s), s, slots - 1 - s, &pattern(s, slot_bytes));
        conn.post(w).expect("conformance: post");
    }
    // A fabric that checks before writing refuses it; RDMA, where the NIC writes first, lets
    // it land unannounced. Either way no notice follows (checked below: the notices are
    // exactly the granted writes').
    let c = next_completion(&mut conn, "first completion").await;
    assert_eq!(
        c.id,
        WriteId(100),
        "conformance: completions in posting order"
    );
    assert!(
        matches!(c.result, Err(FabricError::Refused(_)) | Ok(())),
        "conformance: a write without an immediate: {c:?}"
    );
    for s in 0..slots {
        let c = next_completion(&mut conn, "write completion").await;
        assert_eq!(
            c.id,
            WriteId(u64::from(s)),
            "conformance: completions in posting order"
        );
        assert_eq!(c.result, Ok(()), "conformance: write {s} succeeds");
    }
    for s in 0..slots {
        let landed = step("landed notice", listener.landed.recv())
            .await
            .expect("conformance: listener open");
        let remote = slots - 1 - s;
        let expected = LandedWrite {
            peer,
            slot: SlotIndex(remote),
            tag: WriteTag::from_imm(imm(remote).expect("set")),
            bytes: slot_bytes as u64,
            checksum: landed.checksum,
        };
        assert_eq!(
            landed, expected,
            "conformance: one notice per write, in order, saying who wrote what"
        );
        assert!(
            matches!(
                landed.checksum,
                ChecksumCheck::Match | ChecksumCheck::Absent
            ),
            "conformance: a sound write's checksum matches, or was not carried: {landed:?}"
        );
    }
    let mut got = vec![0u8; slot_bytes];
    for s in 0..slots {
        listener.memory.read_slot(slots - 1 - s, &mut got);
        assert!(
            got == pattern(s, slot_bytes),
            "conformance: slot {} holds staging slot {s}'s bytes",
            slots - 1 - s
        );
    }
}

/// Bytes a test lends a fabric, which it reads and writes through the `Arc` it keeps (the
/// region's owner holds another clone): a caller's own memory.
struct LentBytes(Vec<std::cell::UnsafeCell<u8>>);

// SAFETY: the bytes are only reached through the region (its locks) and, after the fabric is
// done with them, by the test thread alone.
#[allow(unsafe_code)]
unsafe impl Send for LentBytes {}
// SAFETY: as for `Send`.
#[allow(unsafe_code)]
unsafe impl Sync for LentBytes {}

impl LentBytes {
    /// A pointer to byte `i`, which the test may read or write when nothing else does.
    fn at(&self, i: usize) -> *mut u8 {
        self.0[i].get()
    }
}

/// A region over `slots × slot_bytes` lent bytes, and the test's handle on them.
#[allow(unsafe_code)] // lending memory is `unsafe` by contract (`ExternalRegion::new`)
fn lent(slots: u32, slot_bytes: usize) -> (crate::ExternalRegion, std::sync::Arc<LentBytes>) {
    let bytes = std::sync::Arc::new(LentBytes(
        (0..slots as usize * slot_bytes)
            .map(|_| std::cell::UnsafeCell::new(0))
            .collect(),
    ));
    let ptr = std::cell::UnsafeCell::raw_get(bytes.0.as_ptr());
    // SAFETY: `ptr` is valid for the vector's length while the owner (an `Arc` clone) keeps
    // the vector alive; the test touches it only through the region until the fabric is done.
    let region = unsafe {
        crate::ExternalRegion::new(ptr, bytes.0.len(), slot_bytes, Box::new(bytes.clone()))
    }
    .expect("conformance: a valid region");
    (region, bytes)
}

/// A caller's own memory as staging and as the receive buffer (`staging_in`, `expose_in`):
/// writes go from the caller's staging bytes into the caller's buffer bytes, and kvx lets go
/// of both regions' owners once the fabric is dropped. A fabric that needs memory of its own
/// kind refuses both with `FabricError::ExternalMemory` (`accepts == false`).
#[allow(unsafe_code)] // the test is the caller: it writes and reads its own bytes directly
pub async fn fabric_uses_memory_the_caller_owns<F: Fabric>(f: &F, endpoint: &str, accepts: bool) {
    const SLOTS: u32 = 4;
    const BYTES: usize = 4096;
    let (buffer, buffer_bytes) = lent(SLOTS, BYTES);
    let (staging_region, staging_bytes) = lent(SLOTS, BYTES);
    if !accepts {
        let refused = f.expose_in(endpoint, buffer).await;
        assert!(
            matches!(refused, Err(FabricError::ExternalMemory(_))),
            "conformance: this fabric refuses a caller's buffer: {refused:?}"
        );
        let refused = f.staging_in(staging_region);
        assert!(
            matches!(refused, Err(FabricError::ExternalMemory(_))),
            "conformance: this fabric refuses a caller's staging: {refused:?}"
        );
        assert_eq!(
            std::sync::Arc::strong_count(&buffer_bytes),
            1,
            "conformance: owner dropped"
        );
        return;
    }
    let mut listener = f
        .expose_in(endpoint, buffer)
        .await
        .expect("conformance: expose_in");
    assert_eq!(
        (listener.memory.slots(), listener.memory.slot_bytes()),
        (SLOTS, BYTES)
    );
    let peer = PeerId(43);
    let credential = grant_all(&listener, peer);
    let staging = f
        .staging_in(staging_region)
        .expect("conformance: staging_in");
    // The caller fills its staging through its own pointer, as a framework writes its tensor.
    for s in 0..SLOTS {
        let p = pattern(s, BYTES);
        for (i, b) in p.iter().enumerate() {
            // SAFETY: no write is posted yet; the test thread alone touches these bytes.
            unsafe { *staging_bytes.at(s as usize * BYTES + i) = *b };
        }
    }
    let mut conn = f
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("conformance: connect");
    for s in 0..SLOTS {
        conn.post(granted_write(
            u64::from(s),
            s,
            SLOTS - 1 - s,
            &pattern(s, BYTES),
        ))
        .expect("conformance: post");
    }
    for _ in 0..SLOTS {
        let c = next_completion(&mut conn, "write completion").await;
        assert_eq!(c.result, Ok(()), "conformance: {c:?}");
        step("landed notice", listener.landed.recv())
            .await
            .expect("conformance: listener open");
    }
    for s in 0..SLOTS {
        let remote = (SLOTS - 1 - s) as usize;
        // SAFETY: every write has landed and been announced; nothing writes the buffer now.
        let got: Vec<u8> = (0..BYTES)
            .map(|i| unsafe { *buffer_bytes.at(remote * BYTES + i) })
            .collect();
        assert!(
            got == pattern(s, BYTES),
            "conformance: the caller's buffer slot {remote} holds its staging slot {s}"
        );
    }
    drop(conn);
    drop(staging);
    drop(listener);
    // The fabric's tasks let go of the memory once they end: give them a moment, bounded.
    for _ in 0..200 {
        if std::sync::Arc::strong_count(&staging_bytes) == 1
            && std::sync::Arc::strong_count(&buffer_bytes) == 1
        {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("conformance: kvx still holds a region's owner two seconds after the fabric went");
}

/// A write lands only under its connection's peer's current grant, once: another peer's
/// write into a granted slot, a write naming another slot or an old generation, and a second
/// write of one grant are refused and never announced; a credential the buffer did not issue
/// cannot attach, nor can staging of another chunk size. `checked_before_writing`: the
/// fabric checks before a byte reaches the slot (TCP, memory), so refused writes also change
/// no byte; a fabric whose sender writes the receiver's memory itself (shared memory, RDMA)
/// can only refuse to announce.
pub async fn fabric_refuses_writes_outside_grants<F: Fabric>(
    f: &F,
    endpoint: &str,
    checked_before_writing: bool,
) {
    const BYTES: usize = 1024;
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(4, BYTES).expect("a geometry"))
        .await
        .expect("conformance: expose");
    let (owner, intruder) = (PeerId(1), PeerId(2));
    listener.access.grant(0, owner, GEN);
    listener.access.grant(1, intruder, GEN);
    let staging = f
        .allocate_staging(SlotGeometry::new(4, BYTES).expect("a geometry"))
        .expect("conformance: staging");
    let junk = vec![0xEEu8; BYTES];
    staging.write_slot(0, &junk);
    let mut bad = f
        .connect(
            &listener.local_endpoint,
            staging.clone(),
            listener.access.credential_for(intruder),
        )
        .await
        .expect("conformance: the intruder attaches (it holds a credential of its own)");
    // Into the owner's slot under the owner's grant; into its own slot naming another
    // slot; into its own slot under another generation.
    let stale = WriteTag {
        slot: SlotIndex(1),
        generation: GEN + 1,
    };
    let attempts = [
        granted_write(1, 0, 0, &junk),
        PostWrite {
            imm: imm(0),
            ..granted_write(2, 0, 1, &junk)
        },
        PostWrite {
            imm: Some(stale.to_imm()),
            ..granted_write(3, 0, 1, &junk)
        },
    ];
    for w in attempts {
        bad.post(w).expect("conformance: post");
    }
    for id in 1..=3 {
        let c = next_completion(&mut bad, "refused write's completion").await;
        assert_eq!(c.id, WriteId(id));
        assert!(
            matches!(c.result, Err(FabricError::Refused(_))),
            "conformance: write {id} outside the intruder's grants is refused: {c:?}"
        );
    }
    // The owner's own write lands; its second write under the same grant does not.
    let mine = pattern(9, BYTES);
    let owner_staging = f
        .allocate_staging(SlotGeometry::new(4, BYTES).expect("a geometry"))
        .expect("conformance: staging");
    owner_staging.write_slot(0, &mine);
    let mut good = f
        .connect(
            &listener.local_endpoint,
            owner_staging.clone(),
            listener.access.credential_for(owner),
        )
        .await
        .expect("conformance: connect");
    good.post(granted_write(10, 0, 0, &mine))
        .expect("conformance: post");
    assert_eq!(
        next_completion(&mut good, "owner's write").await.result,
        Ok(())
    );
    good.post(granted_write(11, 0, 0, &mine))
        .expect("conformance: post");
    assert!(
        matches!(
            next_completion(&mut good, "second write of a grant")
                .await
                .result,
            Err(FabricError::Refused(_))
        ),
        "conformance: a grant admits one write"
    );
    let landed = step("owner's notice", listener.landed.recv())
        .await
        .expect("conformance: listener open");
    assert_eq!(
        (landed.peer, landed.slot),
        (owner, SlotIndex(0)),
        "conformance: the first notice is the owner's write; no refused write is announced"
    );
    let mut got = vec![0u8; BYTES];
    listener.memory.read_slot(0, &mut got);
    assert!(got == mine, "conformance: slot 0 holds the owner's bytes");
    listener.memory.read_slot(1, &mut got);
    assert!(
        !checked_before_writing || got.iter().all(|&b| b == 0),
        "conformance: refused writes changed no byte"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(100), listener.landed.recv())
            .await
            .is_err(),
        "conformance: nothing else is announced"
    );
    assert!(
        listener.access.refused() >= 4,
        "conformance: refusals are counted"
    );
    // A credential of another buffer (another key) does not attach.
    let other = crate::access::FabricAccess::new(4, [7; 16]).credential_for(owner);
    let refused = f
        .connect(&listener.local_endpoint, owner_staging.clone(), other)
        .await;
    assert!(
        matches!(refused, Err(FabricError::Unauthorized(..))),
        "conformance: a credential the buffer did not issue is refused: {refused:?}"
    );
    // Nor does staging with another chunk size.
    let small = f
        .allocate_staging(SlotGeometry::new(4, BYTES / 2).expect("a geometry"))
        .expect("conformance: staging");
    let refused = f
        .connect(
            &listener.local_endpoint,
            small,
            listener.access.credential_for(owner),
        )
        .await;
    assert!(
        refused.is_err(),
        "conformance: staging of another chunk size is refused"
    );
}

/// A grant that names its chunk's length (as a ledger's do) admits a write of exactly that
/// length: a short write (one byte, half), a long one, and the halves of a split write are
/// refused and never announced, and the grant stays open for the whole chunk, which lands
/// once and is announced with its length. `checked_before_writing` as in
/// `fabric_refuses_writes_outside_grants`.
pub async fn fabric_lands_only_whole_chunks<F: Fabric>(
    f: &F,
    endpoint: &str,
    checked_before_writing: bool,
) {
    const BYTES: usize = 1024;
    const CHUNK: usize = 600;
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(2, BYTES).expect("a geometry"))
        .await
        .expect("conformance: expose");
    let peer = PeerId(4);
    listener.access.apply(kvx_proto::slots::GrantChange {
        slot: SlotIndex(0),
        grant: Some(kvx_proto::slots::SlotGrant {
            peer,
            generation: GEN,
            bytes: Some(CHUNK as u64),
        }),
    });
    let staging = f
        .allocate_staging(SlotGeometry::new(2, BYTES).expect("a geometry"))
        .expect("conformance: staging");
    let bytes = pattern(3, BYTES);
    staging.write_slot(0, &bytes);
    let mut conn = f
        .connect(
            &listener.local_endpoint,
            staging,
            listener.access.credential_for(peer),
        )
        .await
        .expect("conformance: connect");
    let wrong = [1, CHUNK / 2, CHUNK / 2, CHUNK - 1, CHUNK + 1, BYTES];
    for (i, &len) in wrong.iter().enumerate() {
        conn.post(granted_write(i as u64 + 1, 0, 0, &bytes[..len]))
            .expect("conformance: post");
    }
    for (i, &len) in wrong.iter().enumerate() {
        let c = next_completion(&mut conn, "a partial write's completion").await;
        assert_eq!(c.id, WriteId(i as u64 + 1));
        assert!(
            matches!(c.result, Err(FabricError::Refused(_))),
            "conformance: a write of {len} bytes into a chunk of {CHUNK} is refused: {c:?}"
        );
    }
    let mut got = vec![0u8; BYTES];
    listener.memory.read_slot(0, &mut got);
    assert!(
        !checked_before_writing || got.iter().all(|&b| b == 0),
        "conformance: refused partial writes changed no byte"
    );
    conn.post(granted_write(10, 0, 0, &bytes[..CHUNK]))
        .expect("conformance: post");
    assert_eq!(
        next_completion(&mut conn, "the whole chunk's write")
            .await
            .result,
        Ok(())
    );
    let landed = step("the whole chunk's notice", listener.landed.recv())
        .await
        .expect("conformance: listener open");
    assert_eq!(
        (landed.slot, landed.bytes),
        (SlotIndex(0), CHUNK as u64),
        "conformance: the one notice is the whole chunk's, with its length"
    );
    listener.memory.read_slot(0, &mut got);
    assert!(
        got[..CHUNK] == bytes[..CHUNK],
        "conformance: the chunk landed"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(100), listener.landed.recv())
            .await
            .is_err(),
        "conformance: no partial write is announced"
    );
    assert!(
        listener.access.refused() >= wrong.len() as u64,
        "conformance: refusals are counted"
    );
}

/// A write whose bytes do not match its checksum completes with `Corrupt` and is announced
/// as a mismatch, so the receiver fails its request.
pub async fn fabric_checks_checksums<F: Fabric>(f: &F, endpoint: &str) {
    const BYTES: usize = 4096;
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(2, BYTES).expect("a geometry"))
        .await
        .expect("conformance: expose");
    let peer = PeerId(3);
    let credential = grant_all(&listener, peer);
    let staging = f
        .allocate_staging(SlotGeometry::new(2, BYTES).expect("a geometry"))
        .expect("conformance: staging");
    let bytes = pattern(1, BYTES);
    staging.write_slot(0, &bytes);
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("conformance: connect");
    let mut w = granted_write(1, 0, 0, &bytes);
    let carried = w.checksum.expect("set") ^ 1;
    w.checksum = Some(carried);
    conn.post(w).expect("conformance: post");
    let c = next_completion(&mut conn, "corrupt write's completion").await;
    assert!(
        matches!(c.result, Err(FabricError::Corrupt(_))),
        "conformance: a checksum mismatch fails the write: {c:?}"
    );
    let landed = step("notice", listener.landed.recv())
        .await
        .expect("conformance: listener open");
    assert_eq!(
        landed.checksum,
        ChecksumCheck::Mismatch {
            carried,
            computed: chunk_checksum(&bytes)
        },
        "conformance: the notice says the checksum did not match"
    );
    // Without a checksum the write lands and says so.
    let mut w = granted_write(2, 0, 1, &bytes);
    w.checksum = None;
    conn.post(w).expect("conformance: post");
    assert_eq!(next_completion(&mut conn, "write").await.result, Ok(()));
    let landed = step("notice", listener.landed.recv())
        .await
        .expect("conformance: listener open");
    assert_eq!(landed.checksum, ChecksumCheck::Absent);
}

/// After `reset`, every write still outstanding or posted later completes with an error,
/// exactly once, in order; nothing is lost and nothing completes twice.
pub async fn fabric_reset_flushes<F: Fabric>(f: &F, endpoint: &str) {
    let listener = f
        .expose(endpoint, SlotGeometry::new(4, 4096).expect("a geometry"))
        .await
        .expect("conformance: expose");
    let credential = grant_all(&listener, PeerId(1));
    let staging = f
        .allocate_staging(SlotGeometry::new(4, 4096).expect("a geometry"))
        .expect("conformance: staging");
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("conformance: connect");
    let write = |i: u64| PostWrite {
        id: WriteId(i),
        local: StagingSlot((i % 4) as u32),
        remote: SlotIndex((i % 4) as u32),
        len: 4096,
        imm: imm((i % 4) as u32),
        checksum: None,
    };
    for i in 0..4 {
        conn.post(write(i)).expect("conformance: post");
    }
    conn.reset();
    for i in 4..8 {
        // A closed connection may refuse the post; then that write never existed.
        if conn.post(write(i)).is_err() {
            break;
        }
    }
    let mut last = None;
    let mut flushed_seen = false;
    while let Ok(Some(c)) = tokio::time::timeout(STEP_TIMEOUT, conn.next_completion()).await {
        assert!(
            last.is_none_or(|l| c.id > l),
            "conformance: completions in order, none twice"
        );
        last = Some(c.id);
        match c.result {
            Ok(()) => assert!(!flushed_seen, "conformance: no success after a flush"),
            Err(_) => flushed_seen = true,
        }
        if c.id == WriteId(7) {
            break;
        }
    }
    assert!(
        flushed_seen,
        "conformance: writes after a reset are flushed with an error"
    );
}

/// A write outside the registered memory completes with an error; it does not panic or
/// corrupt anything.
pub async fn fabric_rejects_out_of_bounds<F: Fabric>(f: &F, endpoint: &str) {
    let listener = f
        .expose(endpoint, SlotGeometry::new(2, 1024).expect("a geometry"))
        .await
        .expect("conformance: expose");
    let credential = grant_all(&listener, PeerId(1));
    let staging = f
        .allocate_staging(SlotGeometry::new(2, 1024).expect("a geometry"))
        .expect("conformance: staging");
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("conformance: connect");
    let w = PostWrite {
        id: WriteId(1),
        local: StagingSlot(0),
        remote: SlotIndex(2),
        len: 1024,
        imm: imm(2),
        checksum: None,
    };
    match conn.post(w) {
        Err(_) => {}
        Ok(()) => {
            let c = next_completion(&mut conn, "out-of-bounds completion").await;
            assert!(
                matches!(c.result, Err(FabricError::OutOfBounds(..))),
                "conformance: {c:?}"
            );
        }
    }
}
