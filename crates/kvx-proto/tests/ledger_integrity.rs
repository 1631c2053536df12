//! What a landed write must prove before its request can be ready (`receiver/landing.rs`),
//! and what becomes of a sender that proves nothing (LMCache's own, no `seq`). Each test is
//! one of the defects a hostile review found, at the ledger: forged landings, landings from
//! another peer or for another slot, empty or corrupt chunks, and legacy requests that were
//! ready before anything was written.

use kvx_proto::receiver::{
    ChecksumCheck, Failure, LandedWrite, LandingVerdict, Outcome, ReceiverEvent, ReceiverLedger,
};
use kvx_proto::slots::{GrantChange, SlotGrant};
use kvx_proto::wire::{AllocRequest, Message};
use kvx_proto::{Instant, LegacySenders, PeerId, ReceiverConfig, ReqId, ReqKey, WriteTag};

const OWNER: PeerId = PeerId(1);
const OTHER: PeerId = PeerId(2);

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
        bytes: 4096,
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
                generation: tags[0].generation
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
