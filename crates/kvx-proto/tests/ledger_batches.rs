//! What the receiver's ledger takes from a batch: the weight of a first batch waiting for
//! admission (against `queued_bytes_max`), the bounds on its shape and dtype, and the token
//! count its last chunk carries to the decoder.

use kvx_proto::receiver::{Failure, Outcome, ReceiverEvent, ReceiverLedger};
use kvx_proto::wire::{AllocRequest, Message};
use kvx_proto::{Instant, PeerId, ReceiverConfig};

fn batch(id: &str, keys: &[&str], total: u32, shape: Vec<u64>, dtype: &str) -> AllocRequest {
    AllocRequest {
        keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        chunk_bytes: Some(vec![64; keys.len()]),
        claim: None,
        fmt: 1,
        shape,
        dtype: dtype.into(),
        last_chunk_toks: 7,
        req_id: id.into(),
        is_last_batch: true,
        total_chunks: total,
        seq: Some(1),
    }
}

fn failures(l: &mut ReceiverLedger) -> Vec<Failure> {
    std::iter::from_fn(|| l.poll_event())
        .filter_map(|e| match e {
            ReceiverEvent::Ended {
                outcome: Outcome::Failed(f),
                ..
            } => Some(f),
            _ => None,
        })
        .collect()
}

/// A waiting first batch weighs 128 bytes, its id, its dtype, 8 bytes per dimension of its
/// shape and each key with 24 bytes of overhead. A bound one byte short of two such batches
/// lets one wait; a bound of exactly two lets two wait; the third is refused either way.
#[test]
fn a_waiting_first_batch_weighs_its_strings_lists_and_overhead() {
    let shape = vec![2, 2, 256, 64];
    let weight = 128 + "r0".len() + "bfloat16".len() + shape.len() * 8 + 2 * (2 + 24);
    for (bound, waiting) in [(2 * weight - 1, 1), (2 * weight, 2)] {
        let mut l = ReceiverLedger::new(ReceiverConfig {
            buffer_slots: 4,
            peer_share_percent: 100,
            queued_bytes_max: bound,
            ..ReceiverConfig::default()
        })
        .expect("config");
        let full = AllocRequest {
            is_last_batch: false, // holds its reservation of the whole buffer
            ..batch("full", &[], 4, shape.clone(), "bfloat16")
        };
        l.handle_message(Instant::ZERO, PeerId(1), Message::AllocRequest(full));
        for id in ["r0", "r1", "r2"] {
            let b = batch(id, &["k0", "k1"], 2, shape.clone(), "bfloat16");
            l.handle_message(Instant::ZERO, PeerId(2), Message::AllocRequest(b));
        }
        l.check_invariants();
        assert_eq!(l.admission_queue_len(), waiting, "bound {bound}");
        assert_eq!(l.queued_bytes(), waiting * weight, "what the waiters weigh");
        assert_eq!(l.reserved_total(), 4, "the full request's reservation");
        assert!(
            !l.is_quiescent(),
            "requests are tracked though every slot is free"
        );
        let refused = failures(&mut l);
        assert_eq!(refused.len(), 3 - waiting, "{refused:?}");
        assert!(refused
            .iter()
            .all(|f| matches!(f, Failure::TooLarge(w) if w.contains("queued_bytes_max"))));
    }
}

/// A shape of more than 16 dimensions or a dtype of more than 64 bytes is refused before
/// anything is kept; 16 and 64 are taken.
#[test]
fn shapes_and_dtypes_over_their_bounds_are_refused() {
    let cases = [
        (vec![1; 16], "d".repeat(64), true),
        (vec![1; 17], "bfloat16".into(), false),
        (vec![1], "d".repeat(65), false),
    ];
    for (i, (shape, dtype, taken)) in cases.into_iter().enumerate() {
        let mut l = ReceiverLedger::new(ReceiverConfig::default()).expect("config");
        let dims = shape.len();
        let b = batch(&format!("r{i}"), &["k0"], 1, shape, &dtype);
        l.handle_message(Instant::ZERO, PeerId(1), Message::AllocRequest(b));
        let (_, reply) = l.poll_transmit().expect("a reply");
        assert_eq!(
            !reply.is_refusal(),
            taken,
            "{dims} dimensions, dtype of {} bytes",
            dtype.len()
        );
        l.check_invariants();
    }
}

/// The token count a batch names (`last_chunk_toks`) belongs to its last chunk alone; the
/// decoder reads the others as full chunks.
#[test]
fn the_ready_event_gives_the_token_count_to_the_last_chunk_alone() {
    let mut l = ReceiverLedger::new(ReceiverConfig {
        legacy_senders: kvx_proto::LegacySenders::AfterProxy,
        ..ReceiverConfig::default()
    })
    .expect("config");
    let key = kvx_proto::ReqKey {
        peer: PeerId(1),
        req_id: kvx_proto::ReqId("r".into()),
    };
    let b = AllocRequest {
        seq: None, // an LMCache-style sender: ready when the application says so
        chunk_bytes: None,
        claim: None,
        ..batch("r", &["k0", "k1", "k2"], 3, vec![1], "bfloat16")
    };
    l.handle_message(Instant::ZERO, PeerId(1), Message::AllocRequest(b));
    l.handle_external_ready(Instant::ZERO, &key)
        .expect("allocated");
    let tokens = std::iter::from_fn(|| l.poll_event()).find_map(|e| match e {
        ReceiverEvent::Ready { tokens, .. } => Some(tokens),
        _ => None,
    });
    assert_eq!(tokens, Some(vec![None, None, Some(7)]));
}

/// A request's later batch must declare the same total as its first: a change is a protocol
/// violation, and the request is rolled back.
#[test]
fn a_batch_that_changes_the_declared_total_is_a_violation() {
    let mut l = ReceiverLedger::new(ReceiverConfig::default()).expect("config");
    let first = AllocRequest {
        is_last_batch: false,
        ..batch("r", &["k0"], 2, vec![1], "bfloat16")
    };
    l.handle_message(Instant::ZERO, PeerId(1), Message::AllocRequest(first));
    let (_, reply) = l.poll_transmit().expect("a grant");
    assert!(!reply.is_refusal());
    let second = batch("r", &["k1"], 3, vec![1], "bfloat16");
    l.handle_message(Instant::ZERO, PeerId(1), Message::AllocRequest(second));
    let failed = failures(&mut l);
    assert!(
        matches!(&failed[..], [Failure::ProtocolViolation(why)] if why.contains("total_chunks changed")),
        "{failed:?}"
    );
    l.check_invariants();
}
