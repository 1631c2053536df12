//! `SendEngine` against a recording queue pair: ordering, error flushing, the fence.

use super::*;
use crate::route::wr_id;
use crate::verbs::{RemoteAccess, RtrParams, Transition, VerbsError, WcKind};
use crate::wire::QpAddr;
use kvx_proto::{SlotIndex, StagingSlot, WriteId, WriteTag};

#[derive(Debug, Clone, PartialEq, Eq)]
struct Posted {
    wr_id: u64,
    local_slot: u32,
    len: u32,
    remote_addr: u64,
    rkey: u32,
    imm: Option<u32>,
}

#[derive(Debug, Default)]
struct Nic {
    posted: Vec<Posted>,
    modifies: Vec<Transition>,
    refuse_posts: bool,
}

impl VerbsQp for Nic {
    fn qpn(&self) -> u32 {
        42
    }
    fn modify(&mut self, to: Transition) -> Result<(), VerbsError> {
        self.modifies.push(to);
        Ok(())
    }
    fn post_write(&mut self, wr: &WriteWr<'_>) -> Result<(), VerbsError> {
        if self.refuse_posts {
            return Err(VerbsError::new("post_send", "ENOMEM"));
        }
        self.posted.push(Posted {
            wr_id: wr.wr_id,
            local_slot: wr.local_slot,
            len: wr.len,
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
            imm: wr.imm,
        });
        Ok(())
    }
    fn post_recv(&mut self, _wr_id: u64) -> Result<(), VerbsError> {
        Ok(())
    }
}

const KEY: u32 = 5;
const SLOT: usize = 64;

fn engine() -> SendEngine<Nic> {
    let mut qp = Qp::new(Nic::default());
    qp.modify(Transition::Init(RemoteAccess::None))
        .expect("init");
    qp.modify(Transition::Rtr(RtrParams {
        remote: QpAddr::default(),
        mtu: 5,
    }))
    .expect("rtr");
    qp.modify(Transition::Rts { psn: 1 }).expect("rts");
    let staging = Arc::new(
        RdmaMemory::anonymous(SlotGeometry::new(4, SLOT).expect("a geometry")).expect("staging"),
    );
    let remote = RemoteBuffer {
        geometry: SlotGeometry {
            slots: 8,
            slot_bytes: SLOT as u64,
        },
        addr: 0x1000,
        rkey: 7,
    };
    SendEngine::new(qp, staging, remote, KEY)
}

fn w(id: u64, remote: u32) -> PostWrite {
    PostWrite {
        id: WriteId(id),
        local: StagingSlot((id % 4) as u32),
        remote: SlotIndex(remote),
        len: SLOT,
        imm: None,
        checksum: None,
    }
}

fn wc(seq: u32, status: WcStatus) -> Wc {
    Wc {
        wr_id: wr_id(KEY, seq),
        status,
        kind: WcKind::Write,
    }
}

const RETRY_EXCEEDED: WcStatus = WcStatus::Failed {
    code: 12,
    name: "retry counter exceeded",
    vendor: 0x81,
};

fn drain(e: &mut SendEngine<Nic>) -> Vec<(u64, Result<(), FabricError>)> {
    std::iter::from_fn(|| e.poll_completion())
        .map(|c| (c.id.0, c.result))
        .collect()
}

fn ids(v: &[(u64, Result<(), FabricError>)]) -> Vec<u64> {
    v.iter().map(|(id, _)| *id).collect()
}

#[test]
fn a_write_carries_its_address_key_and_immediate() {
    let mut e = engine();
    let tag = WriteTag {
        slot: SlotIndex(3),
        generation: 5,
    };
    e.handle_post(PostWrite {
        imm: Some(tag.to_imm()),
        len: 10,
        ..w(2, 3)
    });
    let posted = &e.qp().inner_for_tests().posted;
    assert_eq!(
        posted[..],
        [Posted {
            wr_id: wr_id(KEY, 0),
            local_slot: 2,
            len: 10,
            remote_addr: 0x1000 + 3 * SLOT as u64,
            rkey: 7,
            imm: Some(tag.to_imm()),
        }]
    );
    assert_eq!(
        WriteTag::from_imm(posted[0].imm.unwrap_or(0)).slot,
        SlotIndex(3)
    );
    assert!(
        drain(&mut e).is_empty(),
        "nothing before the work completion"
    );
    e.handle_wc(&wc(0, WcStatus::Success));
    assert_eq!(drain(&mut e), vec![(2, Ok(()))]);
}

#[test]
fn completions_leave_in_posting_order_around_local_failures() {
    let mut e = engine();
    e.handle_post(w(1, 0));
    e.handle_post(w(2, 8)); // remote slot 8 of 8: out of bounds, never posted
    e.handle_post(PostWrite {
        len: SLOT + 1,
        ..w(3, 1)
    }); // too long for either slot
    e.handle_post(w(4, 1));
    assert_eq!(e.qp().inner_for_tests().posted.len(), 2);
    assert!(drain(&mut e).is_empty(), "write 1 is still outstanding");
    e.handle_wc(&wc(0, WcStatus::Success));
    let out = drain(&mut e);
    assert_eq!(ids(&out), vec![1, 2, 3]);
    assert!(matches!(out[1].1, Err(FabricError::OutOfBounds(2, _))));
    assert!(matches!(out[2].1, Err(FabricError::OutOfBounds(3, _))));
    e.handle_wc(&wc(3, WcStatus::Success));
    assert_eq!(drain(&mut e), vec![(4, Ok(()))]);
    assert_eq!(
        e.phase(),
        Phase::Live,
        "local failures do not fail the connection"
    );
}

#[test]
fn a_failed_write_moves_the_qp_to_error_and_flushes_the_rest_after_the_fence() {
    let mut e = engine();
    for id in 1..=4 {
        e.handle_post(w(id, id as u32));
    }
    e.handle_wc(&wc(0, WcStatus::Success));
    assert_eq!(drain(&mut e), vec![(1, Ok(()))]);
    e.handle_wc(&wc(1, RETRY_EXCEEDED));
    assert_eq!(e.qp().state(), crate::verbs::QpState::Error);
    assert!(e.needs_fence());
    assert!(e.failure().is_some_and(|f| f.contains("retry")));
    e.handle_wc(&wc(2, WcStatus::Flushed));
    e.handle_wc(&wc(3, WcStatus::Flushed));
    e.handle_post(w(5, 5));
    assert_eq!(
        e.qp().inner_for_tests().posted.len(),
        4,
        "nothing posted after the error"
    );
    assert!(drain(&mut e).is_empty(), "errors wait for the fence");
    e.handle_fenced();
    let out = drain(&mut e);
    assert_eq!(ids(&out), vec![2, 3, 4, 5]);
    assert!(matches!(&out[0].1, Err(FabricError::Io(m)) if m.contains("retry counter exceeded")));
    assert!(out[1..]
        .iter()
        .all(|(_, r)| *r == Err(FabricError::Flushed)));
    assert_eq!(e.phase(), Phase::Dead);
    e.handle_post(w(6, 1));
    assert_eq!(drain(&mut e), vec![(6, Err(FabricError::Flushed))]);
}

#[test]
fn a_reset_lets_earlier_successes_out_and_waits_for_flushes_or_the_deadline() {
    let mut e = engine();
    for id in 1..=3 {
        e.handle_post(w(id, 0));
    }
    e.handle_reset();
    assert!(e
        .qp()
        .inner_for_tests()
        .modifies
        .contains(&Transition::Error));
    e.handle_wc(&wc(0, WcStatus::Success));
    assert_eq!(
        drain(&mut e),
        vec![(1, Ok(()))],
        "it landed before the flush"
    );
    e.handle_wc(&wc(1, WcStatus::Flushed));
    e.handle_fenced();
    assert!(
        drain(&mut e).is_empty(),
        "write 3's flush completion is still due"
    );
    assert_eq!(e.posted(), 1);
    e.handle_flush_deadline();
    let out = drain(&mut e);
    assert_eq!(ids(&out), vec![2, 3]);
    assert_eq!(e.phase(), Phase::Dead);
    e.handle_wc(&wc(2, WcStatus::Flushed));
    assert!(
        drain(&mut e).is_empty(),
        "a late flush completes nothing twice"
    );
}

#[test]
fn a_failed_post_fails_the_connection() {
    let mut e = engine();
    e.qp_mut_for_tests().refuse_posts = true;
    e.handle_post(w(1, 0));
    e.handle_post(w(2, 0));
    assert!(e.needs_fence());
    e.handle_fenced();
    let out = drain(&mut e);
    assert!(matches!(&out[0], (1, Err(FabricError::Io(m))) if m.contains("ENOMEM")));
    assert_eq!(out[1], (2, Err(FabricError::Flushed)));
}

#[test]
fn a_completion_out_of_order_fails_the_connection_but_loses_nothing() {
    let mut e = engine();
    e.handle_post(w(1, 0));
    e.handle_post(w(2, 1));
    e.handle_wc(&wc(1, WcStatus::Success));
    assert!(e.needs_fence());
    e.handle_wc(&wc(0, WcStatus::Success));
    assert_eq!(drain(&mut e), vec![(1, Ok(())), (2, Ok(()))]);
    e.handle_wc(&wc(9, WcStatus::Success));
    e.handle_fenced();
    assert!(drain(&mut e).is_empty());
    assert_eq!(e.phase(), Phase::Dead);
}

#[test]
fn sequence_numbers_wrap() {
    let mut e = engine();
    e.set_next_seq_for_tests(u32::MAX);
    e.handle_post(w(1, 0));
    e.handle_post(w(2, 1));
    let posted: Vec<u64> = e
        .qp()
        .inner_for_tests()
        .posted
        .iter()
        .map(|p| p.wr_id)
        .collect();
    assert_eq!(posted, vec![wr_id(KEY, u32::MAX), wr_id(KEY, 0)]);
    e.handle_wc(&wc(u32::MAX, WcStatus::Success));
    e.handle_wc(&wc(0, WcStatus::Success));
    assert_eq!(ids(&drain(&mut e)), vec![1, 2]);
}
