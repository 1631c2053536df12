//! What a landed write must prove before its request can be ready (`receiver/landing.rs`),
//! and what becomes of a sender that proves nothing (LMCache's own, no `seq`). Each test is
//! one of the defects a hostile review found, at the ledger: forged landings, landings from
//! another peer or for another slot, empty, short, long or corrupt chunks, and legacy requests
//! that were ready before anything was written.

use kvx_proto::receiver::{
    ChecksumCheck, Failure, LandedWrite, LandingVerdict, Outcome, ReceiverEvent, ReceiverLedger,
};
use kvx_proto::slots::{GrantChange, SlotGrant};
use kvx_proto::wire::{AllocRequest, Message};
use kvx_proto::{Instant, LegacySenders, PeerId, ReceiverConfig, ReqId, ReqKey, WriteTag};

const OWNER: PeerId = PeerId(1);
const OTHER: PeerId = PeerId(2);
/// Every chunk's declared length, and what a whole landing brings.
const CHUNK: u64 = 4096;

fn ledger(cfg: ReceiverConfig) -> ReceiverLedger {
    ReceiverLedger::new(ReceiverConfig {
        buffer_slots: 4,
        ..cfg
    })
    .expect("config")
}

fn batch(id: &str, keys: usize, seq: Option<u64>) -> Message {
    Message::AllocRequest(AllocRequest {
        keys: (0..keys).map(|i| format!("k{i}")).collect(),
        fmt: 1,
        shape: vec![1],
        dtype: "bfloat16".into(),
        last_chunk_toks: 1,
        req_id: id.into(),
        is_last_batch: true,
        total_chunks: keys as u32,
        seq,
        chunk_bytes: seq.map(|_| vec![CHUNK; keys]),
        claim: None,
    })
}

fn key(peer: PeerId, id: &str) -> ReqKey {
    ReqKey {
        peer,
        req_id: ReqId(id.into()),
    }
}

/// A kvx sender's one-batch request of `keys` chunks; returns its grants.
fn granted(l: &mut ReceiverLedger, id: &str, keys: usize) -> Vec<WriteTag> {
    l.handle_message(Instant::ZERO, OWNER, batch(id, keys, Some(1)));
    while l.poll_transmit().is_some() {}
    let tags = l.request_slots(&key(OWNER, id)).expect("tracked").to_vec();
    assert_eq!(tags.len(), keys);
    tags
}

fn landed(peer: PeerId, tag: WriteTag) -> LandedWrite {
    LandedWrite {
        peer,
        slot: tag.slot,
        tag,
        bytes: CHUNK,
        checksum: ChecksumCheck::Match,
    }
}

fn events(l: &mut ReceiverLedger) -> Vec<ReceiverEvent> {
    std::iter::from_fn(|| l.poll_event()).collect()
}

fn is_ready(evs: &[ReceiverEvent]) -> bool {
    evs.iter().any(|e| matches!(e, ReceiverEvent::Ready { .. }))
}

fn failure(evs: &[ReceiverEvent]) -> Option<Failure> {
    evs.iter().find_map(|e| match e {
        ReceiverEvent::Ended {
            outcome: Outcome::Failed(f),
            ..
        } => Some(f.clone()),
        _ => None,
    })
}

#[test]
fn a_landing_from_another_peer_is_refused_and_never_makes_the_request_ready() {
    let mut l = ledger(ReceiverConfig::default());
    let tags = granted(&mut l, "r", 1);
    // Defect 1: an empty write naming the victim's slot and generation, and a full one.
    for forged in [
        LandedWrite {
            bytes: 0,
            ..landed(OTHER, tags[0])
        },
        landed(OTHER, tags[0]),
    ] {
        let v = l.handle_chunk_landed(Instant::ZERO, forged);
        assert!(matches!(v, LandingVerdict::Refused(_)), "{v:?}");
        assert!(!is_ready(&events(&mut l)), "a forged landing made it ready");
    }
    assert_eq!(l.stats().refused_landings, 2);
    l.check_invariants();
    // The owner's own landing does.
    assert_eq!(
        l.handle_chunk_landed(Instant::ZERO, landed(OWNER, tags[0])),
        LandingVerdict::Accepted
    );
    assert!(is_ready(&events(&mut l)));
}

#[test]
fn an_immediate_naming_another_slot_is_refused() {
    let mut l = ledger(ReceiverConfig::default());
    let tags = granted(&mut l, "r", 2);
    let crossed = LandedWrite {
        slot: tags[1].slot,
        ..landed(OWNER, tags[0])
    };
    assert!(matches!(
        l.handle_chunk_landed(Instant::ZERO, crossed),
        LandingVerdict::Refused(_)
    ));
    assert!(!is_ready(&events(&mut l)));
    assert_eq!(l.stats().refused_landings, 1);
}

#[test]
fn an_empty_or_corrupt_chunk_fails_its_request() {
    for (what, said, bad) in [
        ("empty", "landed with no bytes", |t| LandedWrite {
            bytes: 0,
            ..landed(OWNER, t)
        }),
        (
            "corrupt",
            "checksum mismatch (the sender computed 00000001, the landed bytes give 00000002)",
            |t| LandedWrite {
                checksum: ChecksumCheck::Mismatch {
                    carried: 1,
                    computed: 2,
                },
                ..landed(OWNER, t)
            },
        ),
        ("without a checksum", "carried no checksum", |t| {
            LandedWrite {
                checksum: ChecksumCheck::Absent,
                ..landed(OWNER, t)
            }
        }),
    ] as [(&str, &str, fn(WriteTag) -> LandedWrite); 3]
    {
        let mut l = ledger(ReceiverConfig::default());
        let tags = granted(&mut l, "r", 2);
        let v = l.handle_chunk_landed(Instant::ZERO, bad(tags[1]));
        // The reason names the chunk and what is wrong with it.
        assert!(
            matches!(&v, LandingVerdict::Corrupt(why) if why.contains("chunk 1 ") && why.contains(said)),
            "{what}: {v:?}"
        );
        let evs = events(&mut l);
        assert!(!is_ready(&evs), "{what}");
        assert!(
            matches!(failure(&evs), Some(Failure::Integrity(_))),
            "{what}: {evs:?}"
        );
        // The other chunk's write may still come: its slot is quarantined, the landed one
        // is free.
        assert_eq!((l.quarantined_slots(), l.free_slots()), (1, 3), "{what}");
        assert_eq!(l.stats().corrupt_chunks, 1, "{what}: counted");
        l.check_invariants();
    }
}

/// A short write left the rest of the slot as the previous request wrote it, and it counted
/// as the whole chunk: the decoder read the old bytes. A chunk counts only at the length its
/// batch declared; any other length fails the request.
#[test]
fn a_landing_of_another_length_than_declared_fails_its_request() {
    for (what, bytes) in [
        ("one byte", 1),
        ("half", CHUNK / 2),
        ("one byte short", CHUNK - 1),
        ("one byte long", CHUNK + 1),
        ("twice", 2 * CHUNK),
    ] {
        let mut l = ledger(ReceiverConfig::default());
        let tags = granted(&mut l, "r", 2);
        assert_eq!(
            l.handle_chunk_landed(Instant::ZERO, landed(OWNER, tags[0])),
            LandingVerdict::Accepted,
            "{what}"
        );
        let v = l.handle_chunk_landed(
            Instant::ZERO,
            LandedWrite {
                bytes,
                ..landed(OWNER, tags[1])
            },
        );
        let said = format!("landed {bytes} bytes but its batch declared {CHUNK}");
        assert!(
            matches!(&v, LandingVerdict::Corrupt(why) if why.contains("chunk 1 ") && why.contains(&said)),
            "{what}: {v:?}"
        );
        let evs = events(&mut l);
        assert!(
            !is_ready(&evs),
            "{what}: a partial chunk made the request ready"
        );
        assert!(
            matches!(failure(&evs), Some(Failure::Integrity(why)) if why.contains(&said)),
            "{what}: {evs:?}"
        );
        assert!(
            l.handle_acquire(&key(OWNER, "r")).is_err(),
            "{what}: nothing to read"
        );
        // The same write announced again (or its other half) finds no grant to complete.
        assert_eq!(
            l.handle_chunk_landed(Instant::ZERO, landed(OWNER, tags[1])),
            LandingVerdict::Stale,
            "{what}"
        );
        assert!(!is_ready(&events(&mut l)), "{what}");
        assert_eq!(l.stats().corrupt_chunks, 1, "{what}: counted");
        l.check_invariants();
    }
}

/// A partial last chunk (LMCache's `last_chunk_toks` tokens) is declared shorter, and lands
/// whole at that length; at the full length it is refused like any other.
#[test]
fn a_partial_last_chunk_lands_whole_at_its_shorter_length() {
    let partial = |bytes_of_last: u64| {
        let mut l = ledger(ReceiverConfig::default());
        let msg = AllocRequest {
            keys: vec!["k0".into(), "k1".into()],
            fmt: 1,
            shape: vec![2, 1, 256, 4],
            dtype: "bfloat16".into(),
            last_chunk_toks: 100,
            req_id: "r".into(),
            is_last_batch: true,
            total_chunks: 2,
            seq: Some(1),
            chunk_bytes: Some(vec![CHUNK, CHUNK * 100 / 256]),
            claim: None,
        };
        l.handle_message(Instant::ZERO, OWNER, Message::AllocRequest(msg));
        while l.poll_transmit().is_some() {}
        let tags = l.request_slots(&key(OWNER, "r")).expect("tracked").to_vec();
        l.handle_chunk_landed(Instant::ZERO, landed(OWNER, tags[0]));
        let v = l.handle_chunk_landed(
            Instant::ZERO,
            LandedWrite {
                bytes: bytes_of_last,
                ..landed(OWNER, tags[1])
            },
        );
        (v, events(&mut l))
    };
    let (v, evs) = partial(CHUNK * 100 / 256);
    assert_eq!(v, LandingVerdict::Accepted);
    let tokens = evs.iter().find_map(|e| match e {
        ReceiverEvent::Ready { tokens, .. } => Some(tokens.clone()),
        _ => None,
    });
    assert_eq!(tokens, Some(vec![None, Some(100)]), "{evs:?}");
    let (v, evs) = partial(CHUNK);
    assert!(matches!(v, LandingVerdict::Corrupt(_)), "{v:?}");
    assert!(!is_ready(&evs));
}

/// A kvx sender's batch says how long each chunk is; one that does not is refused before
/// anything is granted, so no write into its slots could count without a length to check.
#[test]
fn a_kvx_batch_must_declare_each_chunks_length() {
    for (what, chunk_bytes) in [
        ("none", None),
        ("fewer than keys", Some(vec![CHUNK])),
        ("more than keys", Some(vec![CHUNK; 3])),
        ("a zero", Some(vec![CHUNK, 0])),
    ] {
        let mut l = ledger(ReceiverConfig::default());
        let msg = match batch("r", 2, Some(1)) {
            Message::AllocRequest(m) => AllocRequest { chunk_bytes, ..m },
            _ => unreachable!(),
        };
        l.handle_message(Instant::ZERO, OWNER, Message::AllocRequest(msg));
        let (_, reply) = l.poll_transmit().expect("a reply");
        assert!(reply.is_refusal(), "{what}: {reply:?}");
        assert!(
            matches!(failure(&events(&mut l)), Some(Failure::ProtocolViolation(why)) if why.contains("chunk_bytes") || why.contains("0 bytes")),
            "{what}"
        );
        assert_eq!(l.free_slots(), 4, "{what}: nothing granted");
        l.check_invariants();
    }
}

#[test]
fn checksums_are_optional_when_not_required() {
    let mut l = ledger(ReceiverConfig {
        require_checksums: false,
        ..ReceiverConfig::default()
    });
    let tags = granted(&mut l, "r", 1);
    let plain = LandedWrite {
        checksum: ChecksumCheck::Absent,
        ..landed(OWNER, tags[0])
    };
    assert_eq!(
        l.handle_chunk_landed(Instant::ZERO, plain),
        LandingVerdict::Accepted
    );
    assert!(is_ready(&events(&mut l)));
}

#[test]
fn a_forged_landing_does_not_end_a_quarantine() {
    let mut l = ledger(ReceiverConfig::default());
    let tags = granted(&mut l, "r", 1);
    l.handle_message(
        Instant::ZERO,
        OWNER,
        Message::CancelNotif(kvx_proto::wire::CancelNotif {
            req_id: "r".into(),
            keys: vec![],
            seq: Some(2),
            drained: None,
        }),
    );
    assert_eq!(l.quarantined_slots(), 1);
    assert!(matches!(
        l.handle_chunk_landed(Instant::ZERO, landed(OTHER, tags[0])),
        LandingVerdict::Refused(_)
    ));
    assert_eq!(l.quarantined_slots(), 1, "still quarantined");
    assert_eq!(l.stats().refused_landings, 1, "counted");
    assert_eq!(
        l.handle_chunk_landed(Instant::ZERO, landed(OWNER, tags[0])),
        LandingVerdict::QuarantineCleared
    );
    assert_eq!(l.quarantined_slots(), 0);
    // The same write announced again is stale: ignored, and counted.
    assert_eq!(
        l.handle_chunk_landed(Instant::ZERO, landed(OWNER, tags[0])),
        LandingVerdict::Stale
    );
    assert_eq!(l.stats().stale_landings, 1);
    l.check_invariants();
}

#[test]
fn grant_changes_follow_grants_and_frees() {
    let mut l = ledger(ReceiverConfig::default());
    let tags = granted(&mut l, "r", 1);
    let changes: Vec<GrantChange> = std::iter::from_fn(|| l.poll_grant_change()).collect();
    assert_eq!(
        changes,
        vec![GrantChange {
            slot: tags[0].slot,
            grant: Some(SlotGrant {
                peer: OWNER,
                generation: tags[0].generation,
                bytes: Some(CHUNK),
            })
        }]
    );
    l.handle_chunk_landed(Instant::ZERO, landed(OWNER, tags[0]));
    events(&mut l);
    let k = key(OWNER, "r");
    l.handle_acquire(&k).expect("ready");
    l.handle_consume(Instant::ZERO, &k).expect("consumed");
    assert_eq!(
        l.poll_grant_change(),
        Some(GrantChange {
            slot: tags[0].slot,
            grant: None
        }),
        "a consumed slot has no grant"
    );
}

/// Defect 6: an LMCache sender's request was ready (and read, and its slots handed on) the
/// moment it was allocated, while that sender still wrote into them.
#[test]
fn a_legacy_sender_is_refused_by_default() {
    let mut l = ledger(ReceiverConfig::default());
    l.handle_message(Instant::ZERO, OWNER, batch("r", 2, None));
    let (_, reply) = l.poll_transmit().expect("a reply");
    assert_eq!(
        reply.remote_indexes,
        vec![-1, -1],
        "LMCache's refusal shape"
    );
    assert_eq!(
        reply.error, None,
        "an LMCache peer gets LMCache's bytes exactly"
    );
    let evs = events(&mut l);
    assert_eq!(failure(&evs), Some(Failure::LegacySender));
    assert_eq!(l.free_slots(), 4, "nothing was granted");
}

#[test]
fn a_legacy_request_is_ready_only_when_the_application_says_so() {
    let mut l = ledger(ReceiverConfig {
        legacy_senders: LegacySenders::AfterProxy,
        ..ReceiverConfig::default()
    });
    l.handle_message(Instant::ZERO, OWNER, batch("r", 2, None));
    let (_, reply) = l.poll_transmit().expect("a reply");
    assert_eq!(reply.remote_indexes.len(), 2);
    assert!(reply.remote_indexes.iter().all(|&i| i >= 0));
    assert!(
        !is_ready(&events(&mut l)),
        "allocated is not written: not ready"
    );
    let k = key(OWNER, "r");
    assert!(l.handle_acquire(&k).is_err(), "nothing to read yet");
    l.handle_external_ready(Instant::ZERO, &k)
        .expect("the proxy said so");
    assert!(is_ready(&events(&mut l)));
    // A kvx sender's request is ready by its landings only.
    let tags = granted(&mut l, "kvx", 1);
    assert!(l
        .handle_external_ready(Instant::ZERO, &key(OWNER, "kvx"))
        .is_err());
    assert_eq!(
        l.handle_chunk_landed(Instant::ZERO, landed(OWNER, tags[0])),
        LandingVerdict::Accepted
    );
    l.check_invariants();
}
