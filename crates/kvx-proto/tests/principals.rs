//! Shares per principal (`docs/spec/protocol.md` §Principals): a sender that opens more
//! control identities gets no more share. The hostile case: two identities of one sender hold
//! the whole buffer between them and each keeps a next request queued, so that whenever one
//! of its requests ends, its other identity's queued request — "holding nothing" as an
//! identity — is within its share and goes first. A third sender's one-slot request then
//! waits until the admission timeout. Bound to one principal, the two identities hold the
//! principal's share between them, and the third sender goes first.
//!
//! The same scenario is run with the identities unbound, where the third sender waits: that
//! run is what shows the test can fail.

use kvx_proto::receiver::{ReceiverEvent, ReceiverLedger};
use kvx_proto::wire::{AllocRequest, CancelNotif, Message};
use kvx_proto::{Instant, PeerId, Principal, ReceiverConfig};

const A1: PeerId = PeerId(1);
const A2: PeerId = PeerId(2);
const B: PeerId = PeerId(3);

fn probe(req: &str, total: u32, seq: u64) -> Message {
    Message::AllocRequest(AllocRequest {
        keys: vec![],
        chunk_bytes: None,
        claim: None,
        fmt: 1,
        shape: vec![2, 2, 256, 64],
        dtype: "bfloat16".into(),
        last_chunk_toks: 256,
        req_id: req.into(),
        is_last_batch: false,
        total_chunks: total,
        seq: Some(seq),
    })
}

fn cancel(req: &str, seq: u64) -> Message {
    Message::CancelNotif(CancelNotif {
        req_id: req.into(),
        keys: vec![],
        seq: Some(seq),
        drained: Some(true),
    })
}

/// The requests admitted, in order, once `a1` ends: 8 slots, the default 75 % share (6).
fn admitted_after_a_release(bind: bool) -> Vec<String> {
    let mut ledger = ReceiverLedger::new(ReceiverConfig {
        buffer_slots: 8,
        ..ReceiverConfig::default()
    })
    .expect("valid config");
    assert_eq!(ledger.config().peer_share_percent, 75, "the default share");
    if bind {
        let (one_sender, another) = (Principal::new(0xa), Principal::new(0xb));
        assert!(ledger.bind_principal(A1, one_sender));
        assert!(ledger.bind_principal(A2, one_sender));
        assert!(ledger.bind_principal(B, another));
    }
    let now = Instant::ZERO;
    ledger.handle_message(now, A1, probe("a1", 4, 1));
    ledger.handle_message(now, A2, probe("a2", 4, 1));
    ledger.handle_message(now, A1, probe("a1-next", 4, 2));
    ledger.handle_message(now, B, probe("b", 1, 1));
    ledger.handle_message(now, A2, probe("a2-next", 4, 2));
    ledger.check_invariants();
    let _ = std::iter::from_fn(|| ledger.poll_event()).count();
    ledger.handle_message(now, A1, cancel("a1", 3));
    ledger.check_invariants();
    std::iter::from_fn(|| ledger.poll_event())
        .filter_map(|e| match e {
            ReceiverEvent::Admitted { key, .. } => Some(key.req_id.0),
            _ => None,
        })
        .collect()
}

#[test]
fn extra_identities_of_one_principal_buy_no_extra_share() {
    assert_eq!(
        admitted_after_a_release(true),
        ["b"],
        "the third sender goes first; the principal's next request waits for room"
    );
    assert_eq!(
        admitted_after_a_release(false),
        ["a1-next"],
        "unbound, the identity that holds nothing goes first and the third sender waits"
    );
}

/// A peer's binding holds while it holds anything: a transport that reports another
/// principal for it (it reconnected from elsewhere) changes nothing until its requests end.
#[test]
fn a_peer_keeps_its_principal_while_it_holds_slots() {
    let mut ledger = ReceiverLedger::new(ReceiverConfig {
        buffer_slots: 8,
        ..ReceiverConfig::default()
    })
    .expect("valid config");
    let (p, q) = (Principal::new(1), Principal::new(2));
    assert!(ledger.bind_principal(A1, p));
    ledger.handle_message(Instant::ZERO, A1, probe("a1", 4, 1));
    assert!(!ledger.bind_principal(A1, q), "it holds 4 slots under p");
    ledger.handle_message(Instant::ZERO, A1, cancel("a1", 2));
    ledger.check_invariants();
    assert!(ledger.bind_principal(A1, q), "it holds nothing now");
    ledger.handle_message(Instant::ZERO, A1, probe("a1-again", 8, 3));
    ledger.check_invariants();
}
