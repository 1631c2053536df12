//! Notices the proxy keeps for ids it does not await yet (`ProxyTracker`, `docs/spec/protocol.md`
//! §Proxy): one entry per id however many notices arrive for it, so what the proxy holds is
//! bounded by the table (`early_notices_max`, `early_notices_bytes_max`, which weighs every
//! connection an entry is bound to) and not by how many messages arrive within
//! `early_notice_ttl`; an entry pushed out of the full table counts the messages it held in
//! `dropped_notices` once, and nothing else does; and an id with more early notices than
//! ranks is ready once. Each rank's notice comes on its own connection (`from`), as one
//! sender process per rank sends it: a connection's repeats are refused
//! (`tests/proxy_binding.rs`).

use std::time::Duration;

use kvx_proto::proxy::{NoticeFrom, ProxyEvent, ProxyFailure, ProxyTracker};
use kvx_proto::wire::{FailNotif, Message, ProxyNotif};
use kvx_proto::{Instant, ProxyConfig};

fn notif(id: &str) -> Message {
    Message::ProxyNotif(ProxyNotif { req_id: id.into() })
}

/// A notice channel's connection `c` (NULL: no principal).
fn from(c: u64) -> NoticeFrom {
    NoticeFrom::connection(c)
}

fn at(secs: u64) -> Instant {
    Instant::ZERO + Duration::from_secs(secs)
}

/// 1,000 ranks' notices of an id the proxy then awaits and reports: nothing was lost, so
/// later evictions count only what they push out — not one drop per notice.
#[test]
fn repeats_of_a_notice_count_no_drop_once_their_id_is_used() {
    let cfg = ProxyConfig {
        early_notices_max: 2,
        ..ProxyConfig::default()
    };
    let mut p = ProxyTracker::new(cfg).expect("valid config");
    for c in 0..1_000 {
        p.handle_message(at(0), from(c), notif("a"));
    }
    p.check_invariants();
    p.handle_expect(at(0), "a".into(), 1_000).expect("fresh id");
    assert_eq!(
        p.poll_event(),
        Some(ProxyEvent::Ready { req_id: "a".into() })
    );
    assert_eq!(p.dropped_notices, 0);

    // Two ids fill the table; a third pushes the oldest (b, one notice) out.
    p.handle_message(at(0), from(1), notif("b"));
    p.handle_message(at(0), from(1), notif("c"));
    p.handle_message(at(0), from(1), notif("d"));
    assert_eq!(
        p.dropped_notices, 1,
        "b's one notice, and nothing of a's repeats"
    );
    p.check_invariants();
}

/// One id's notices keep one entry, whose time is its last notice's: the proxy's next timer
/// is then, not at the first notice's TTL, and the entry is forgotten only then.
#[test]
fn a_repeated_notice_is_one_entry_kept_from_its_last_repeat() {
    let cfg = ProxyConfig {
        early_notice_ttl: Duration::from_secs(60),
        ..ProxyConfig::default()
    };
    let mut p = ProxyTracker::new(cfg).expect("valid config");
    for s in 0..50 {
        p.handle_message(at(s), from(s), notif("a"));
        p.check_invariants();
    }
    assert_eq!(
        p.poll_timeout(),
        Some(at(49 + 60)),
        "one entry, as of its last notice"
    );
    p.handle_timeout(at(49 + 59));
    p.handle_expect(at(49 + 59), "a".into(), 50)
        .expect("fresh id");
    assert_eq!(
        p.poll_event(),
        Some(ProxyEvent::Ready { req_id: "a".into() }),
        "every repeat kept until the last one's TTL"
    );
    assert_eq!(p.poll_timeout(), None, "nothing kept, nothing awaited");
    p.check_invariants();
}

/// An entry pushed out of the full table counts every message it held, once: 1,000 notices of
/// one id lost are 1,000 notices lost, and the stale order entries the repeats once left
/// behind count nothing more.
#[test]
fn an_entry_pushed_out_counts_each_message_it_held_once() {
    let cfg = ProxyConfig {
        early_notices_max: 1,
        ..ProxyConfig::default()
    };
    let mut p = ProxyTracker::new(cfg).expect("valid config");
    for c in 0..1_000 {
        p.handle_message(at(0), from(c), notif("a"));
    }
    p.handle_message(
        at(0),
        from(0),
        Message::FailNotif(FailNotif {
            req_id: "a".into(),
            reason: "the receiver refused".into(),
        }),
    );
    p.handle_message(at(0), from(1), notif("b"));
    assert_eq!(
        p.dropped_notices, 1_001,
        "a's 1,000 notices and its failure"
    );
    p.handle_message(at(0), from(1), notif("c"));
    assert_eq!(p.dropped_notices, 1_002, "b's one notice");
    p.check_invariants();
}

/// More early notices than the request's ranks (from more connections than it has ranks: an
/// id reused) make it ready once; the tracker does not count notices for a request it has
/// reported.
#[test]
fn more_early_notices_than_ranks_make_it_ready_once() {
    let mut p = ProxyTracker::new(ProxyConfig::default()).expect("valid config");
    p.handle_message(at(0), from(1), notif("r"));
    p.handle_message(at(0), from(2), notif("r"));
    p.handle_message(at(0), from(3), notif("r"));
    p.handle_expect(at(0), "r".into(), 2).expect("fresh id");
    assert_eq!(
        p.poll_event(),
        Some(ProxyEvent::Ready { req_id: "r".into() })
    );
    assert_eq!(p.poll_event(), None);
    assert_eq!(p.awaited(), 0);
    p.check_invariants();
}

fn failed(id: &str, reason: &str) -> Message {
    Message::FailNotif(FailNotif {
        req_id: id.into(),
        reason: reason.into(),
    })
}

/// What a kept failure weighs against `early_notices_bytes_max`: its id twice (the map and
/// the order), its reason, 16 bytes for each connection it is bound to (here one), and 128
/// bytes of overhead. A table sized for exactly three such entries keeps three, and the
/// fourth pushes the oldest out (one message dropped).
#[test]
fn the_byte_bound_weighs_each_entry_as_its_id_twice_its_reason_its_connections_and_128_bytes() {
    let reason = "r".repeat(100);
    let entry = 2 * "early-0000".len() + reason.len() + 16 + 128;
    let cfg = ProxyConfig {
        early_notices_bytes_max: 3 * entry,
        ..ProxyConfig::default()
    };
    let mut p = ProxyTracker::new(cfg).expect("valid config");
    for i in 0..3 {
        p.handle_message(at(0), from(1), failed(&format!("early-{i:04}"), &reason));
        p.check_invariants();
    }
    assert_eq!(p.dropped_notices, 0, "three entries fit exactly");
    p.handle_message(at(0), from(1), failed("early-0003", &reason));
    p.check_invariants();
    assert_eq!(p.dropped_notices, 1, "the oldest entry pushed out");
    // The one pushed out is the oldest: early-0000 is no longer known, early-0001 is.
    p.handle_expect(at(0), "early-0001".into(), 1)
        .expect("fresh id");
    assert!(
        matches!(p.poll_event(), Some(ProxyEvent::Failed { .. })),
        "early-0001's failure was kept"
    );
    p.handle_expect(at(0), "early-0000".into(), 1)
        .expect("fresh id");
    assert_eq!(p.poll_event(), None, "early-0000's failure was dropped");

    // One byte short of three entries holds two: the third pushes the first out.
    let cfg = ProxyConfig {
        early_notices_bytes_max: 3 * entry - 1,
        ..ProxyConfig::default()
    };
    let mut p = ProxyTracker::new(cfg).expect("valid config");
    for i in 0..3 {
        p.handle_message(at(0), from(1), failed(&format!("early-{i:04}"), &reason));
    }
    p.check_invariants();
    assert_eq!(p.dropped_notices, 1, "two entries fit, not three");
}

/// An awaited request times out at its `kv_ready_timeout`, not a moment before, and a proxy
/// that looks only later still fails it then.
#[test]
fn an_awaited_request_times_out_at_its_deadline_and_not_before() {
    let cfg = ProxyConfig {
        kv_ready_timeout: Duration::from_secs(10),
        ..ProxyConfig::default()
    };
    let mut p = ProxyTracker::new(cfg).expect("valid config");
    p.handle_expect(at(0), "early".into(), 1).expect("fresh id");
    p.handle_expect(at(5), "late".into(), 1).expect("fresh id");
    assert_eq!(p.poll_timeout(), Some(at(10)));
    p.handle_timeout(at(9));
    assert_eq!(p.poll_event(), None, "nothing is due before its deadline");
    p.handle_timeout(at(12));
    assert!(
        matches!(p.poll_event(), Some(ProxyEvent::Failed { req_id, .. }) if req_id.0 == "early"),
        "overdue"
    );
    assert_eq!(p.poll_event(), None, "late's deadline is at 15");
    p.handle_timeout(at(60));
    assert!(
        matches!(p.poll_event(), Some(ProxyEvent::Failed { req_id, .. }) if req_id.0 == "late")
    );
    p.check_invariants();
}

/// A failure reason of exactly `reason_bytes_max` bytes is kept whole; one byte more is cut
/// to the bound, with a mark.
#[test]
fn a_reason_at_its_bound_is_kept_whole() {
    let cfg = ProxyConfig {
        reason_bytes_max: 16,
        ..ProxyConfig::default()
    };
    let mut p = ProxyTracker::new(cfg).expect("valid config");
    for (id, reason, want) in [
        ("whole", "x".repeat(16), "x".repeat(16)),
        ("cut", "y".repeat(17), format!("{}…", "y".repeat(16))),
    ] {
        p.handle_expect(at(0), id.into(), 1).expect("fresh id");
        p.handle_message(at(0), from(1), failed(id, &reason));
        match p.poll_event() {
            Some(ProxyEvent::Failed {
                failure: ProxyFailure::Reported(got),
                ..
            }) => assert_eq!(got, want, "{id}"),
            other => panic!("{id}: {other:?}"),
        }
    }
}

/// An entry larger than the whole table is not kept and pushes nothing out: its message is
/// counted dropped, once; a table of no entries drops every notice the same way.
#[test]
fn a_notice_larger_than_the_table_is_dropped_and_counted_once() {
    let cfg = ProxyConfig {
        early_notices_bytes_max: 200,
        ..ProxyConfig::default()
    };
    let mut p = ProxyTracker::new(cfg).expect("valid config");
    p.handle_message(at(0), from(1), notif("small"));
    p.handle_message(at(0), from(1), failed("large", &"r".repeat(100)));
    p.check_invariants();
    assert_eq!(p.dropped_notices, 1);
    p.handle_expect(at(0), "small".into(), 1).expect("fresh id");
    assert_eq!(
        p.poll_event(),
        Some(ProxyEvent::Ready {
            req_id: "small".into()
        }),
        "the small entry stayed"
    );

    let none = ProxyConfig {
        early_notices_max: 0,
        ..ProxyConfig::default()
    };
    let mut p = ProxyTracker::new(none).expect("valid config");
    p.handle_message(at(0), from(1), notif("a"));
    p.handle_message(at(0), from(1), failed("b", "why"));
    p.check_invariants();
    assert_eq!(p.dropped_notices, 2);
}
