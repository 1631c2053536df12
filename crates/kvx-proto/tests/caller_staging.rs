//! Caller staging (`SenderConfig::staging_placement = Caller`, `docs/spec/protocol.md`
//! §Caller staging): the staging slots are the application's memory, where its bytes already
//! are (a vLLM prefill engine's paged KV). A batch names the slots its chunks are read from;
//! nothing is allocated, added or released; several requests may read one slot at once (a
//! prefix block two decoders want); and the sender says when a request no longer reads any:
//! `Delivered`, or `Drained` after `Failed` once its last posted write has completed (S13).

use kvx_proto::sender::{ChunkSpec, SendError, SenderEvent, SenderFlow};
use kvx_proto::{Placement, ReqId, SenderConfig, StagingSlot};

mod granting;

use granting::{spec, R, T0};

fn chunk(id: &str, i: u32, slot: u32) -> ChunkSpec {
    ChunkSpec {
        key: format!("{id}@{i}"),
        staging: StagingSlot(slot),
        tokens: 1,
        bytes: 64,
    }
}

fn id(s: &str) -> ReqId {
    ReqId(s.into())
}

/// A caller-staging sender of `slots` slots, whose receiver grants every batch at once
/// (`answer`) unless told to hold its replies.
struct Sender {
    flow: SenderFlow,
    next_slot: i64,
}

impl Sender {
    fn new(slots: u32) -> Sender {
        let cfg = SenderConfig {
            staging_slots: slots,
            staging_placement: Placement::Caller,
            ..SenderConfig::default()
        };
        Sender {
            flow: SenderFlow::new(cfg).expect("config"),
            next_slot: 0,
        }
    }

    fn begin(&mut self, id: &str, total: u32) {
        self.flow.handle_begin(T0, spec(id, total)).expect("begin");
        self.answer();
        assert!(self.flow.is_admitted(&ReqId(id.into())), "{id} admitted");
    }

    /// Answers every message sent so far: probes with an empty grant, batches with a
    /// receiver slot per key.
    fn answer(&mut self) {
        granting::answer(&mut self.flow, R, &mut self.next_slot);
        self.flow.check_invariants();
    }

    /// Completes every posted write, `Ok` or failed with `error`.
    fn complete_writes(&mut self, error: Option<&str>) -> usize {
        let mut n = 0;
        while let Some(w) = self.flow.poll_write() {
            let result = error.map_or(Ok(()), |e| Err(e.to_owned()));
            self.flow.handle_write_done(T0, w.id, result);
            self.flow.check_invariants();
            n += 1;
        }
        self.answer();
        n
    }

    fn events(&mut self) -> Vec<SenderEvent> {
        std::iter::from_fn(|| self.flow.poll_event()).collect()
    }

    fn readers(&self, slot: u32) -> u32 {
        self.flow.staging_readers(StagingSlot(slot))
    }
}

#[test]
fn nothing_is_allocated_added_or_released_from_the_callers_staging() {
    let mut s = Sender::new(8);
    s.begin("a", 2);
    let refused = s.flow.try_allocate(&id("a"));
    assert!(
        matches!(&refused, Err(SendError::Misuse { why, .. }) if why.contains("staging_placement = caller")),
        "{refused:?}"
    );
    let said = refused.expect_err("refused").to_string();
    assert!(
        !said.contains("cancelled"),
        "a refused allocate changes nothing: {said}"
    );
    let refused = s.flow.release_staging(&id("a"), StagingSlot(0));
    assert!(
        matches!(refused, Err(SendError::Misuse { .. })),
        "{refused:?}"
    );
    assert_eq!(s.flow.staging_free(), 0, "no slot is ever free to take");
    let refused = s.flow.handle_add(T0, &id("a"), chunk("a", 0, 0));
    assert!(
        matches!(&refused, Err(SendError::Misuse { why, .. }) if why.ends_with("(the request was cancelled)")),
        "a refused chunk cancels the request, and says so: {refused:?}"
    );
    assert!(
        !s.flow.is_admitted(&id("a")),
        "a misused request fails, as in the pool"
    );
    s.flow.check_invariants();
}

#[test]
fn a_batch_names_its_slots_and_they_are_read_until_the_writes_complete() {
    let mut s = Sender::new(8);
    s.begin("a", 3);
    s.flow
        .handle_submit(
            T0,
            &id("a"),
            vec![chunk("a", 0, 5), chunk("a", 1, 6)],
            false,
        )
        .expect("any slots of the caller's");
    assert_eq!(
        (s.readers(5), s.readers(6)),
        (1, 1),
        "read from the submit on"
    );
    s.answer();
    assert_eq!(s.complete_writes(None), 2);
    assert_eq!(
        (s.readers(5), s.readers(6)),
        (0, 0),
        "written: read no more"
    );
    s.flow
        .handle_submit(T0, &id("a"), vec![chunk("a", 2, 5)], true)
        .expect("a slot again");
    s.answer();
    s.complete_writes(None);
    let events = s.events();
    assert!(
        events.contains(&SenderEvent::Delivered { req_id: id("a") }),
        "{events:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, SenderEvent::Drained { .. })),
        "a delivered request is not drained: Delivered says it"
    );
    assert!(s.flow.is_quiescent());
}

#[test]
fn two_requests_may_read_one_slot_at_once() {
    let mut s = Sender::new(4);
    s.begin("a", 1);
    s.begin("b", 1);
    s.flow
        .handle_submit(T0, &id("a"), vec![chunk("a", 0, 2)], true)
        .expect("a");
    s.flow
        .handle_submit(T0, &id("b"), vec![chunk("b", 0, 2)], true)
        .expect("b reads the same block");
    assert_eq!(s.readers(2), 2);
    s.answer();
    s.complete_writes(None);
    assert_eq!(s.readers(2), 0);
    assert!(s.flow.is_quiescent());
}

#[test]
fn a_slot_out_of_range_or_named_twice_in_a_batch_is_misuse() {
    let mut s = Sender::new(4);
    s.begin("a", 2);
    let refused = s
        .flow
        .handle_submit(T0, &id("a"), vec![chunk("a", 0, 4)], false);
    assert!(
        matches!(refused, Err(SendError::Misuse { .. })),
        "{refused:?}"
    );
    s.begin("b", 2);
    let refused =
        s.flow
            .handle_submit(T0, &id("b"), vec![chunk("b", 0, 1), chunk("b", 1, 1)], true);
    assert!(
        matches!(refused, Err(SendError::Misuse { .. })),
        "{refused:?}"
    );
    assert_eq!(s.readers(1), 0, "a refused batch reads nothing");
    s.answer();
    assert_eq!(s.flow.tracked_requests(), 0, "both failed and left");
}

/// The application may reuse a failed request's slots only once no posted write reads
/// them: `Failed` comes at once, `Drained` after the last write completed.
#[test]
fn a_failed_request_is_drained_only_once_its_posted_writes_completed() {
    let mut s = Sender::new(8);
    s.begin("a", 3);
    s.flow
        .handle_submit(
            T0,
            &id("a"),
            vec![chunk("a", 0, 0), chunk("a", 1, 1)],
            false,
        )
        .expect("submitted");
    s.answer();
    let posted: Vec<_> = std::iter::from_fn(|| s.flow.poll_write()).collect();
    assert_eq!(posted.len(), 2, "two writes posted");
    s.events();
    s.flow.handle_cancel(T0, &id("a")).expect("cancelled");
    s.flow.check_invariants();
    let events = s.events();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, SenderEvent::Failed { .. })),
        "{events:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, SenderEvent::Drained { .. })),
        "posted writes still read slots 0 and 1: {events:?}"
    );
    assert_eq!((s.readers(0), s.readers(1)), (1, 1));
    s.flow
        .handle_write_done(T0, posted[0].id, Err("flushed".into()));
    assert_eq!((s.readers(0), s.readers(1)), (0, 1));
    assert!(s.events().is_empty(), "one write still reads slot 1");
    s.flow
        .handle_write_done(T0, posted[1].id, Err("flushed".into()));
    s.flow.check_invariants();
    assert_eq!((s.readers(0), s.readers(1)), (0, 0));
    let events = s.events();
    assert_eq!(
        events,
        [SenderEvent::Drained { req_id: id("a") }],
        "drained once the last write completed"
    );
    assert_eq!(s.flow.tracked_requests(), 0, "it left with its last write");
}

/// A batch whose writes were never posted (its grant never came) ends its reads when the
/// request fails: drained at once.
#[test]
fn a_request_failed_before_its_grant_is_drained_at_once() {
    let mut s = Sender::new(8);
    s.begin("a", 2);
    s.flow
        .handle_submit(T0, &id("a"), vec![chunk("a", 0, 3)], false)
        .expect("submitted, not yet answered");
    assert_eq!(s.readers(3), 1);
    s.flow.handle_cancel(T0, &id("a")).expect("cancelled");
    assert_eq!(s.readers(3), 0, "its write will never be posted");
    let events = s.events();
    let failed = events
        .iter()
        .position(|e| matches!(e, SenderEvent::Failed { .. }));
    let drained = events
        .iter()
        .position(|e| *e == SenderEvent::Drained { req_id: id("a") });
    assert!(
        failed.is_some() && drained > failed,
        "Failed, then Drained: {events:?}"
    );
    s.answer();
    s.flow.check_invariants();
}

/// The pool's senders never hear `Drained`: a failed request's slots come back to kvx's
/// pool, not to an application.
#[test]
fn a_pool_sender_is_never_drained() {
    let cfg = SenderConfig {
        staging_slots: 2,
        ..SenderConfig::default()
    };
    let mut flow = SenderFlow::new(cfg).expect("config");
    flow.handle_begin(T0, spec("a", 1)).expect("begin");
    flow.handle_cancel(T0, &id("a")).expect("cancelled");
    let events: Vec<_> = std::iter::from_fn(|| flow.poll_event()).collect();
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, SenderEvent::Drained { .. })),
        "{events:?}"
    );
}
