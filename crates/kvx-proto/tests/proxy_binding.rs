//! Notices count only from the request's own senders (`ProxyTracker`, `docs/spec/protocol.md`
//! §Proxy): a request binds to the principal of its first notice (under CURVE, a key), so
//! another allowed key can neither make it ready nor fail it; and one connection speaks for
//! at most `ranks_per_connection` ranks of it, so a connection's repeated notice is refused
//! rather than counted as another TP rank. Each refusal is counted by reason. The binding
//! holds the same for a request awaited and for one whose notices came early.

use std::time::Duration;

use kvx_proto::proxy::{
    NoticeFrom, NoticeRefusal, ProxyEvent, ProxyFailure, ProxyTracker, Refused,
};
use kvx_proto::wire::{FailNotif, Message, ProxyNotif};
use kvx_proto::{Instant, Principal, ProxyConfig, ReqId};

const T0: Instant = Instant::ZERO;

fn notif(id: &str) -> Message {
    Message::ProxyNotif(ProxyNotif { req_id: id.into() })
}

fn failed(id: &str) -> Message {
    Message::FailNotif(FailNotif {
        req_id: id.into(),
        reason: "forged".into(),
    })
}

/// Connection `c` without CURVE.
fn null(c: u64) -> NoticeFrom {
    NoticeFrom::connection(c)
}

/// Connection `c` under CURVE, of the key whose principal is `key`.
fn curve(c: u64, key: u64) -> NoticeFrom {
    NoticeFrom {
        connection: c,
        principal: Some(Principal::new(key)),
    }
}

fn tracker(cfg: ProxyConfig) -> ProxyTracker {
    ProxyTracker::new(cfg).expect("valid config")
}

fn ready(id: &str) -> Option<ProxyEvent> {
    Some(ProxyEvent::Ready { req_id: id.into() })
}

fn refused(why: NoticeRefusal, id: &str, bound_to: Option<u64>) -> Option<Refused> {
    Some(Refused {
        why,
        req_id: ReqId::from(id),
        bound_to: bound_to.map(Principal::new),
    })
}

/// Without CURVE, one connection's two notices for a request awaited from two ranks count
/// once: the second is refused (counted) and the request is not ready until another
/// connection speaks for the other rank.
#[test]
fn one_connections_notices_count_for_one_rank() {
    let mut p = tracker(ProxyConfig::default());
    p.handle_expect(T0, "r".into(), 2).expect("fresh id");
    assert_eq!(p.handle_message(T0, null(1), notif("r")), None);
    assert_eq!(
        p.handle_message(T0, null(1), notif("r")),
        refused(NoticeRefusal::RankRepeated, "r", None)
    );
    assert_eq!(p.poll_event(), None, "one rank of two, not two");
    assert_eq!(p.refused_notices(NoticeRefusal::RankRepeated), 1);
    p.check_invariants();
    assert_eq!(p.handle_message(T0, null(2), notif("r")), None);
    assert_eq!(p.poll_event(), ready("r"));
    p.check_invariants();

    // A connection configured to speak for two ranks (one process sending both ranks'
    // notices over one PUSH) makes it ready alone, and no more: its third is refused.
    let mut p = tracker(ProxyConfig {
        ranks_per_connection: 2,
        ..ProxyConfig::default()
    });
    p.handle_expect(T0, "r".into(), 3).expect("fresh id");
    for _ in 0..2 {
        assert_eq!(p.handle_message(T0, null(1), notif("r")), None);
    }
    assert_eq!(
        p.handle_message(T0, null(1), notif("r")),
        refused(NoticeRefusal::RankRepeated, "r", None)
    );
    assert_eq!(p.poll_event(), None, "two ranks of three");
    p.handle_message(T0, null(2), notif("r"));
    assert_eq!(p.poll_event(), ready("r"));
    p.check_invariants();
}

/// The attack as an allowed CURVE key makes it: B's notices and failure for A's request are
/// refused (counted as `other_principal`), A's request is neither ready nor failed by them,
/// and A's own notices, on any of its connections, still count.
#[test]
fn under_curve_another_keys_notices_neither_ready_nor_fail_a_request() {
    const A: u64 = 0xA;
    const B: u64 = 0xB;
    let mut p = tracker(ProxyConfig::default());
    p.handle_expect(T0, "a-req".into(), 2).expect("fresh id");
    assert_eq!(p.handle_message(T0, curve(1, A), notif("a-req")), None);
    assert_eq!(
        p.handle_message(T0, curve(2, B), notif("a-req")),
        refused(NoticeRefusal::OtherPrincipal, "a-req", Some(A))
    );
    assert_eq!(
        p.handle_message(T0, curve(2, B), failed("a-req")),
        refused(NoticeRefusal::OtherPrincipal, "a-req", Some(A))
    );
    assert_eq!(p.poll_event(), None, "B made it neither ready nor failed");
    assert_eq!(p.awaited(), 1);
    assert_eq!(p.refused_notices(NoticeRefusal::OtherPrincipal), 2);
    p.check_invariants();
    // A's second rank, on its own connection, completes it.
    assert_eq!(p.handle_message(T0, curve(3, A), notif("a-req")), None);
    assert_eq!(p.poll_event(), ready("a-req"));

    // A request whose first notice is A's can be failed by A's other rank, not by B.
    p.handle_expect(T0, "a-fails".into(), 2).expect("fresh id");
    p.handle_message(T0, curve(1, A), notif("a-fails"));
    p.handle_message(T0, curve(2, B), failed("a-fails"));
    assert_eq!(p.poll_event(), None);
    p.handle_message(T0, curve(3, A), failed("a-fails"));
    assert!(matches!(
        p.poll_event(),
        Some(ProxyEvent::Failed { req_id, failure: ProxyFailure::Reported(_) }) if req_id.0 == "a-fails"
    ));
    assert_eq!(p.refused_notices(NoticeRefusal::OtherPrincipal), 3);
    assert_eq!(p.refused_notices(NoticeRefusal::RankRepeated), 0);
    p.check_invariants();
}

/// Without CURVE a failure counts from any connection: a rank not heard from yet may be the
/// one that failed, and nothing tells it from another. (What NULL trusts: `protocol.md`.)
#[test]
fn without_curve_a_failure_counts_from_a_rank_not_heard_from_yet() {
    let mut p = tracker(ProxyConfig::default());
    p.handle_expect(T0, "r".into(), 2).expect("fresh id");
    p.handle_message(T0, null(1), notif("r"));
    assert_eq!(p.handle_message(T0, null(2), failed("r")), None);
    assert!(matches!(p.poll_event(), Some(ProxyEvent::Failed { .. })));
    p.check_invariants();
}

/// Notices kept before the request is awaited are bound the same way: a connection's repeat
/// is refused, another key's notice and failure are refused, and what was kept counts when
/// the request is awaited.
#[test]
fn early_notices_are_bound_as_awaited_ones_are() {
    let mut p = tracker(ProxyConfig::default());
    assert_eq!(p.handle_message(T0, null(1), notif("e")), None);
    assert_eq!(
        p.handle_message(T0, null(1), notif("e")),
        refused(NoticeRefusal::RankRepeated, "e", None)
    );
    p.check_invariants();
    p.handle_expect(T0, "e".into(), 2).expect("fresh id");
    assert_eq!(p.poll_event(), None, "one rank kept, not two");
    p.handle_message(T0, null(2), notif("e"));
    assert_eq!(p.poll_event(), ready("e"));

    const A: u64 = 1;
    const B: u64 = 2;
    p.handle_message(T0, curve(1, A), notif("k"));
    assert_eq!(
        p.handle_message(T0, curve(2, B), notif("k")),
        refused(NoticeRefusal::OtherPrincipal, "k", Some(A))
    );
    assert_eq!(
        p.handle_message(T0, curve(2, B), failed("k")),
        refused(NoticeRefusal::OtherPrincipal, "k", Some(A))
    );
    p.check_invariants();
    p.handle_expect(T0, "k".into(), 2).expect("fresh id");
    assert_eq!(p.poll_event(), None, "B's failure was not kept");
    p.handle_message(T0, curve(3, A), notif("k"));
    assert_eq!(p.poll_event(), ready("k"));
    assert_eq!(p.refused_notices(NoticeRefusal::OtherPrincipal), 2);
    assert_eq!(p.refused_notices(NoticeRefusal::RankRepeated), 1);
    p.check_invariants();
}

/// `kvx proxy` on its own (`await_on_first_notice`) as the probe found it: one connection's
/// two notices stood for both TP ranks. Now the request waits for the other rank, and times
/// out saying one of two reported.
#[test]
fn a_standalone_proxy_waits_for_another_connection() {
    let mut p = tracker(ProxyConfig {
        await_on_first_notice: Some(2),
        kv_ready_timeout: Duration::from_secs(1),
        ..ProxyConfig::default()
    });
    p.handle_message(T0, null(7), notif("s"));
    p.handle_message(T0, null(7), notif("s"));
    assert_eq!(p.poll_event(), None);
    let at = p.poll_timeout().expect("s's deadline");
    p.handle_timeout(at);
    assert_eq!(
        p.poll_event(),
        Some(ProxyEvent::Failed {
            req_id: "s".into(),
            failure: ProxyFailure::TimedOut { seen: 1, ranks: 2 },
        })
    );
    p.check_invariants();
}

/// The refusals are metric labels: one per kind, distinct, short snake_case.
#[test]
fn every_refusal_kind_is_a_distinct_label() {
    let kinds: std::collections::BTreeSet<_> =
        NoticeRefusal::ALL.iter().map(|r| r.kind()).collect();
    assert_eq!(kinds.len(), NoticeRefusal::ALL.len());
    for kind in kinds {
        assert!(
            !kind.is_empty() && kind.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
            "{kind:?}"
        );
    }
    assert!(
        ProxyTracker::new(ProxyConfig {
            ranks_per_connection: 0,
            ..ProxyConfig::default()
        })
        .is_err(),
        "a connection that may speak for no rank is refused"
    );
}
