//! Unit tests of `SenderFlow` that reach its private state: the checker shown to catch
//! what it exists for, and the failure kinds as metric labels.

use super::{RequestSpec, SendFailure, SenderFlow};
use crate::{Instant, PeerId, ReqId, SenderConfig};

/// The checker catches what it is there for: a request's write count out of step with
/// the writes posted.
#[test]
fn check_invariants_catches_a_miscounted_write() {
    let mut flow = SenderFlow::new(SenderConfig::default()).expect("config");
    let id = ReqId("r".into());
    let spec = RequestSpec {
        req_id: id.clone(),
        receiver: PeerId(1),
        total_chunks: 1,
        fmt: 1,
        shape: vec![1],
        dtype: "bfloat16".into(),
        claim: None,
    };
    flow.handle_begin(Instant::ZERO, spec).expect("begin");
    flow.check_invariants();
    if let Some(req) = flow.requests.get_mut(&id) {
        req.writes_in_flight += 1;
    }
    let caught = crate::testing::panic_message(|| flow.check_invariants());
    assert!(caught.is_some(), "a miscounted write is caught");

    // A staging waiter for a request not admitted yet (S8).
    if let Some(req) = flow.requests.get_mut(&id) {
        req.writes_in_flight -= 1;
    }
    flow.check_invariants();
    let age = flow.age(&id).expect("r runs");
    flow.waiters.add(age, &id);
    let caught = crate::testing::panic_message(|| flow.check_invariants());
    assert!(caught.is_some(), "a waiter not admitted is caught");
}

/// The kinds are metric labels: one per variant, distinct, short snake_case.
#[test]
fn every_failure_kind_is_a_distinct_label() {
    let all = [
        SendFailure::Cancelled,
        SendFailure::Refused(String::new()),
        SendFailure::BadReply(String::new()),
        SendFailure::ReplyTimeout,
        SendFailure::ChannelLost,
        SendFailure::WriteFailed(String::new()),
        SendFailure::WriteTimeout,
        SendFailure::Misuse(String::new()),
        SendFailure::Stopped,
    ];
    let kinds: std::collections::BTreeSet<_> = all.iter().map(SendFailure::kind).collect();
    assert_eq!(kinds.len(), all.len(), "{kinds:?}");
    for kind in kinds {
        assert!(
            !kind.is_empty() && kind.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
            "{kind:?}"
        );
    }
}
