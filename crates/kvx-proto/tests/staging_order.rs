//! The sender's staging order and its memory of outcomes (`SenderFlow`): a freed staging slot
//! goes to the oldest request waiting for one (S9); a request that holds unsubmitted staging
//! is told to submit it rather than queued behind an older waiter, which may be waiting for
//! exactly that staging; and each request's outcome is readable from the moment it is known,
//! for `outcomes_kept` ended requests.

use kvx_proto::sender::{ChunkSpec, SendError, SendFailure, SenderFlow, WriteOp};
use kvx_proto::{ReqId, SenderConfig, StagingSlot};

mod granting;

use granting::{spec, R, T0};

/// A sender with `staging` slots whose requests `ids` (of `total` chunks each, begun in this
/// order) are all admitted; every message it sends is answered at once, granting slots
/// 0, 1, 2, … in turn.
struct Sender {
    flow: SenderFlow,
    next_slot: i64,
}

impl Sender {
    fn with(staging: u32, cfg: SenderConfig, ids: &[(&str, u32)]) -> Sender {
        let cfg = SenderConfig {
            staging_slots: staging,
            ..cfg
        };
        let mut s = Sender {
            flow: SenderFlow::new(cfg).expect("config"),
            next_slot: 0,
        };
        for &(id, total) in ids {
            s.flow.handle_begin(T0, spec(id, total)).expect("begin");
            s.answer();
        }
        for &(id, _) in ids {
            assert!(s.flow.is_admitted(&ReqId(id.into())), "{id} admitted");
        }
        s
    }

    /// Answers every message sent so far: probes with an empty grant, batches with a slot per
    /// key.
    fn answer(&mut self) {
        granting::answer(&mut self.flow, R, &mut self.next_slot);
    }

    fn submit(&mut self, id: &str, slot: StagingSlot, chunk: u32, last: bool) {
        let c = ChunkSpec {
            key: format!("{id}@{chunk}"),
            staging: slot,
            tokens: 1,
            bytes: 64,
        };
        self.flow
            .handle_submit(T0, &ReqId(id.into()), vec![c], last)
            .expect("submit");
        self.answer();
    }

    /// Completes every posted write.
    fn complete_writes(&mut self) -> Vec<WriteOp> {
        let mut done = Vec::new();
        while let Some(w) = self.flow.poll_write() {
            self.flow.handle_write_done(T0, w.id, Ok(()));
            done.push(w);
        }
        self.answer();
        done
    }

    fn allocate(&mut self, id: &str) -> Result<StagingSlot, SendError> {
        self.flow.try_allocate(&ReqId(id.into()))
    }
}

#[test]
fn a_freed_slot_goes_to_the_oldest_request_waiting() {
    let mut s = Sender::with(1, SenderConfig::default(), &[("a", 1), ("b", 1), ("c", 1)]);
    let slot = s.allocate("a").expect("a takes the only slot");
    assert_eq!(s.allocate("b"), Err(SendError::WouldBlock));
    assert_eq!(s.allocate("c"), Err(SendError::WouldBlock));
    // c registers first; b is older all the same.
    let c_age = s.flow.wait_for_staging(&ReqId("c".into())).expect("waits");
    let b_age = s.flow.wait_for_staging(&ReqId("b".into())).expect("waits");
    assert!(b_age < c_age);
    s.submit("a", slot, 0, true);
    s.complete_writes();
    assert_eq!(s.flow.staging_free(), 1);
    assert_eq!(
        s.allocate("c"),
        Err(SendError::WouldBlock),
        "b is older and waits"
    );
    let slot = s.allocate("b").expect("b's turn");
    assert!(
        s.flow.stop_waiting_for_staging(b_age),
        "b was the oldest waiting"
    );
    s.submit("b", slot, 0, true);
    s.complete_writes();
    s.allocate("c").expect("c's turn now");
    s.flow.check_invariants();
}

/// Older requests' waiting calls come first for free slots, but only for as many as they
/// are: a slot beyond them goes to a younger caller at once. Refusing it would leave the
/// slot free while that caller sleeps until the older ones have taken theirs, and wake it
/// then for nothing it could not have had before.
#[test]
fn slots_beyond_the_older_waiting_calls_go_to_a_younger_request_at_once() {
    let mut s = Sender::with(2, SenderConfig::default(), &[("a", 2), ("b", 1), ("c", 2)]);
    let first = s.allocate("a").expect("a");
    let second = s.allocate("a").expect("a again");
    let b_age = s
        .flow
        .wait_for_staging(&ReqId("b".into()))
        .expect("b waits");
    s.submit("a", first, 0, false);
    s.submit("a", second, 1, true);
    s.complete_writes();
    assert_eq!(s.flow.staging_free(), 2);
    s.allocate("c")
        .expect("one free slot is b's, the other nobody older waits for");
    assert_eq!(
        s.allocate("c"),
        Err(SendError::WouldBlock),
        "the last free slot is b's"
    );
    s.allocate("b").expect("b's slot waited for it");
    s.flow.stop_waiting_for_staging(b_age);
    s.flow.check_invariants();
}

#[test]
fn a_request_holding_staging_is_told_to_submit_while_an_older_one_waits() {
    let mut s = Sender::with(1, SenderConfig::default(), &[("older", 2), ("younger", 2)]);
    let held = s.allocate("younger").expect("nobody waits yet");
    assert_eq!(s.allocate("older"), Err(SendError::WouldBlock));
    s.flow
        .wait_for_staging(&ReqId("older".into()))
        .expect("waits");
    // Waiting behind the older request would never end: it waits for this very slot.
    assert_eq!(
        s.allocate("younger"),
        Err(SendError::StagingHeldByCaller(1))
    );
    s.submit("younger", held, 0, false);
    s.complete_writes();
    s.allocate("older")
        .expect("the freed slot goes to the older request");
}

#[test]
fn a_waiting_request_that_fails_stops_holding_back_younger_ones() {
    let mut s = Sender::with(1, SenderConfig::default(), &[("a", 1), ("b", 1), ("c", 1)]);
    let slot = s.allocate("a").expect("a");
    s.flow
        .wait_for_staging(&ReqId("b".into()))
        .expect("b waits");
    s.submit("a", slot, 0, true);
    s.complete_writes();
    s.flow
        .handle_cancel(T0, &ReqId("b".into()))
        .expect("b cancelled");
    assert!(s.flow.staging_waiters().is_empty(), "b's wait went with it");
    s.allocate("c").expect("c goes ahead");
    s.flow.check_invariants();
}

#[test]
fn outcomes_are_readable_from_when_they_are_known_for_outcomes_kept_requests() {
    let cfg = SenderConfig {
        outcomes_kept: 2,
        ..SenderConfig::default()
    };
    let mut s = Sender::with(4, cfg, &[("a", 1), ("b", 1), ("c", 1), ("d", 1)]);
    let id = |x: &str| ReqId(x.into());
    assert_eq!(s.flow.outcome(&id("a")), None, "running");
    for (n, x) in ["a", "b", "c"].into_iter().enumerate() {
        let slot = s.allocate(x).expect("staging");
        s.submit(x, slot, 0, true);
        let written = s.complete_writes();
        assert_eq!(written.len(), 1, "{n}");
        assert_eq!(s.flow.outcome(&id(x)), Some(Ok(())), "{x} delivered");
    }
    assert!(
        !s.flow.knows(&id("a")),
        "the oldest outcome is forgotten beyond outcomes_kept"
    );
    assert_eq!(s.flow.outcome(&id("b")), Some(Ok(())));
    s.flow.handle_cancel(T0, &id("d")).expect("cancel");
    assert_eq!(s.flow.outcome(&id("d")), Some(Err(SendFailure::Cancelled)));
    assert_eq!(
        s.allocate("d"),
        Err(SendError::Failed(id("d"), SendFailure::Cancelled))
    );
    s.flow.check_invariants();
}

/// `allocate_or_submit`: when a request's own unsubmitted chunks hold every staging slot, the
/// call submits the caller's batch (not as the last) instead of answering
/// `StagingHeldByCaller`, and the next slot comes once those writes complete; with nothing
/// held it answers as `try_allocate` does; with slots free it submits nothing.
#[test]
fn allocate_or_submit_submits_the_callers_batch_when_it_alone_holds_staging() {
    let mut s = Sender::with(2, SenderConfig::default(), &[("a", 4)]);
    let a = ReqId("a".into());
    let mut held = Vec::new();
    for chunk in 0..2 {
        let slot = s
            .flow
            .allocate_or_submit(T0, &a, &mut held)
            .expect("a free slot");
        held.push(ChunkSpec {
            key: format!("a@{chunk}"),
            staging: slot,
            tokens: 1,
            bytes: 64,
        });
    }
    assert_eq!(held.len(), 2, "nothing submitted while slots were free");
    assert_eq!(
        s.flow.allocate_or_submit(T0, &a, &mut Vec::new()),
        Err(SendError::StagingHeldByCaller(2)),
        "nothing held by this call: told, as try_allocate tells"
    );
    assert_eq!(
        s.flow.allocate_or_submit(T0, &a, &mut held),
        Err(SendError::WouldBlock),
        "the batch went out; its writes free staging"
    );
    assert!(held.is_empty(), "the held batch was submitted");
    s.answer();
    let written = s.complete_writes();
    assert_eq!(written.len(), 2, "both held chunks written");
    s.flow
        .allocate_or_submit(T0, &a, &mut held)
        .expect("a slot once the writes completed");
    assert_eq!(
        s.flow.outcome(&a),
        None,
        "still running: that batch was not the last"
    );
    s.flow.check_invariants();
}
