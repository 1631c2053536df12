//! The conformance body for runs of writes (`WriteRun`), which every fabric runs whether it
//! carries a run as one write or posts its pieces.

use kvx_proto::receiver::ChecksumCheck;
use kvx_proto::{PeerId, WriteId};

use super::{granted_write, lent, next_completion, pattern, step, GEN};
use crate::fabric::{Fabric, FabricError, SlotMemory, WriteRun};
use crate::geometry::SlotGeometry;

/// A run (`WriteRun`) is exactly its pieces: each completes in posting order and is
/// announced on its own, with its own grant, checksum and bytes, whether the fabric carries
/// the run as one write or not. A piece without a grant is refused while the run's other
/// pieces land; a piece whose checksum does not match fails alone; a shorter last piece
/// lands whole; a lone write after the runs still lands (the stream stays in step). With
/// `lent`, the same over staging in two parts (a run across them goes all the same).
pub async fn fabric_runs_land_as_their_pieces<F: Fabric>(f: &F, endpoint: &str, lent_parts: bool) {
    const SLOTS: u32 = 24;
    const BYTES: usize = 4096;
    let mut listener = f
        .expose(
            endpoint,
            SlotGeometry::new(SLOTS, BYTES).expect("a geometry"),
        )
        .await
        .expect("conformance: expose");
    let peer = PeerId(9);
    for slot in (0..SLOTS).filter(|&s| s != 5) {
        listener.access.grant(slot, peer, GEN);
    }
    let staging = if lent_parts {
        let (a, _keep_a) = lent(SLOTS / 2, BYTES);
        let (b, _keep_b) = lent(SLOTS / 2, BYTES);
        let joined = crate::ExternalRegion::join(vec![a, b]).expect("conformance: join");
        f.staging_in(joined).expect("conformance: staging_in")
    } else {
        f.allocate_staging(SlotGeometry::new(SLOTS, BYTES).expect("a geometry"))
            .expect("conformance: staging")
    };
    for s in 0..SLOTS {
        staging.write_slot(s, &pattern(s, BYTES));
    }
    let mut conn = f
        .connect(
            &listener.local_endpoint,
            staging,
            listener.access.credential_for(peer),
        )
        .await
        .expect("conformance: connect");
    let run_of = |ids: std::ops::Range<u64>, local: u32, remote: u32, last_len: usize| {
        let n = (ids.end - ids.start) as u32;
        let mut pieces = (0..n).map(|i| {
            let len = if i + 1 == n { last_len } else { BYTES };
            granted_write(
                ids.start + u64::from(i),
                local + i,
                remote + i,
                &pattern(local + i, BYTES)[..len],
            )
        });
        let mut run = WriteRun::new(pieces.next().expect("a piece"));
        for w in pieces {
            run.push(w, BYTES)
                .expect("conformance: the pieces continue the run");
        }
        run
    };
    // 1: four whole slots, 0..4 into 8..12. 2: 4..7 into 4..7, slot 5 ungranted. 3: 12..15
    // into 12..15 with a short last piece and a wrong checksum on its middle piece. 4:
    // 10..14 into 0..4 (across the parts' boundary when `lent_parts`). 5: two 100-byte
    // pieces joined as if slots were 100 bytes: not a run of these slots (`WriteRun::fits`),
    // so a fabric that carries runs sends them one by one.
    let mut corrupt = run_of(30..33, 12, 12, 100).into_pieces();
    corrupt[1].checksum = corrupt[1].checksum.map(|c| c ^ 1);
    let mut third = WriteRun::new(corrupt[0]);
    for w in &corrupt[1..] {
        third.push(*w, BYTES).expect("conformance: continues");
    }
    let mut short_pieces = WriteRun::new(granted_write(60, 16, 16, &pattern(16, BYTES)[..100]));
    short_pieces
        .push(granted_write(61, 17, 17, &pattern(17, BYTES)[..100]), 100)
        .expect("conformance: consecutive");
    let runs = [
        run_of(10..14, 0, 8, BYTES),
        run_of(20..23, 4, 4, BYTES),
        third,
        run_of(40..44, 10, 0, BYTES),
        short_pieces,
    ];
    for run in runs {
        conn.post_run(run)
            .map_err(|(e, _)| e)
            .expect("conformance: post_run");
    }
    conn.post(granted_write(50, 15, 15, &pattern(15, BYTES)))
        .expect("conformance: post");
    let expected: Vec<(u64, &str)> = vec![
        (10, "ok"),
        (11, "ok"),
        (12, "ok"),
        (13, "ok"),
        (20, "ok"),
        (21, "refused"),
        (22, "ok"),
        (30, "ok"),
        (31, "corrupt"),
        (32, "ok"),
        (40, "ok"),
        (41, "ok"),
        (42, "ok"),
        (43, "ok"),
        (60, "ok"),
        (61, "ok"),
        (50, "ok"),
    ];
    for (id, what) in &expected {
        let c = next_completion(&mut conn, "a run's piece completion").await;
        assert_eq!(
            c.id,
            WriteId(*id),
            "conformance: pieces complete in posting order"
        );
        let as_expected = match *what {
            "ok" => c.result.is_ok(),
            "refused" => matches!(c.result, Err(FabricError::Refused(_))),
            _ => matches!(c.result, Err(FabricError::Corrupt(_))),
        };
        assert!(
            as_expected,
            "conformance: piece {id} should be {what}: {c:?}"
        );
    }
    // Every piece but the refused one is announced, once, for its own slot and length.
    let mut announced = Vec::new();
    for _ in 0..expected.len() - 1 {
        let n = step("a piece's landed notice", listener.landed.recv())
            .await
            .expect("conformance: listener open");
        assert_eq!(n.peer, peer);
        announced.push((n.slot.0, n.bytes, n.checksum == ChecksumCheck::Match));
    }
    announced.sort_unstable();
    let mut want: Vec<(u32, u64, bool)> = [8, 9, 10, 11, 4, 6, 12, 14, 0, 1, 2, 3, 15]
        .iter()
        .map(|&s| (s, if s == 14 { 100 } else { BYTES as u64 }, true))
        .collect();
    want.push((13, BYTES as u64, false));
    want.extend([(16, 100, true), (17, 100, true)]);
    want.sort_unstable();
    assert_eq!(
        announced, want,
        "conformance: each piece announced for its slot"
    );
    let landed = |slot: u32, len: usize| {
        let mut got = vec![0u8; len];
        listener.memory.read_slot(slot, &mut got);
        got
    };
    for (remote, local) in [
        (8, 0),
        (9, 1),
        (10, 2),
        (11, 3),
        (4, 4),
        (6, 6),
        (0, 10),
        (3, 13),
        (15, 15),
    ] {
        assert!(
            landed(remote, BYTES) == pattern(local, BYTES),
            "conformance: remote slot {remote} holds staging slot {local}"
        );
    }
    assert!(
        landed(14, 100) == pattern(14, BYTES)[..100],
        "conformance: the short last piece"
    );
    for s in [16, 17] {
        assert!(
            landed(s, 100) == pattern(s, BYTES)[..100],
            "conformance: the short piece into slot {s}"
        );
    }
}
