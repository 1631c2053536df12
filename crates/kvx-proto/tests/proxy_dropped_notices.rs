//! `ProxyTracker::dropped_notices`, which the proxy exports as a metric: every notice the
//! tracker cannot use is counted exactly once, whichever way it is dropped — an id longer
//! than any it awaits, a message that is no notice, an early notice pushed out of the full
//! early table. An operator reads it as "notices lost", so it may neither miss one nor go
//! backwards.

use kvx_proto::proxy::{NoticeFrom, ProxyEvent, ProxyTracker};
use kvx_proto::wire::{AllocRequest, FailNotif, Message, ProxyNotif};
use kvx_proto::{Instant, ProxyConfig};

fn notif(id: &str) -> Message {
    Message::ProxyNotif(ProxyNotif { req_id: id.into() })
}

#[test]
fn every_dropped_notice_is_counted_once() {
    let cfg = ProxyConfig {
        early_notices_max: 2,
        ..ProxyConfig::default()
    };
    let long = "x".repeat(cfg.req_id_bytes_max + 1);
    let mut p = ProxyTracker::new(cfg).expect("valid config");
    let now = Instant::ZERO;
    // One sender's connection: each id below has one notice, one rank.
    let from = NoticeFrom::connection(1);

    p.handle_message(now, from, notif(&long));
    assert_eq!(p.dropped_notices, 1, "a ProxyNotif with an over-long id");
    p.handle_message(
        now,
        from,
        Message::FailNotif(FailNotif {
            req_id: long.clone(),
            reason: "r".into(),
        }),
    );
    assert_eq!(p.dropped_notices, 2, "a FailNotif with an over-long id");
    let not_a_notice = AllocRequest {
        keys: vec!["k".into()],
        chunk_bytes: None,
        claim: None,
        fmt: 1,
        shape: vec![1],
        dtype: "bfloat16".into(),
        last_chunk_toks: 1,
        req_id: "r".into(),
        is_last_batch: true,
        total_chunks: 1,
        seq: None,
    };
    p.handle_message(now, from, Message::AllocRequest(not_a_notice));
    assert_eq!(p.dropped_notices, 3, "a message that is no notice");

    // Two early notices fit; a third pushes the oldest out.
    p.handle_message(now, from, notif("a"));
    p.handle_message(now, from, notif("b"));
    assert_eq!(p.dropped_notices, 3, "kept, not dropped");
    p.handle_message(now, from, notif("c"));
    assert_eq!(p.dropped_notices, 4, "the oldest early notice pushed out");
    p.check_invariants();

    // What was kept still counts; what was dropped does not.
    p.handle_expect(now, "c".into(), 1).expect("fresh id");
    assert_eq!(
        p.poll_event(),
        Some(ProxyEvent::Ready { req_id: "c".into() })
    );
    p.handle_expect(now, "a".into(), 1).expect("fresh id");
    assert_eq!(p.poll_event(), None, "a's notice was dropped");
}
