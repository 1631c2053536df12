//! Who gets a freed staging slot when several requests wait for one: the oldest request.
//!
//! Why: a request is useful to its decoder only once every chunk has landed, so spreading
//! staging evenly over every request a sender prefills (what a free-for-all wake-up does)
//! stretches all of them, while serving the oldest first finishes each sooner at the same
//! throughput (shortest makespan per request, the same total). Measured in
//! `docs/PERFORMANCE.md` (the demo's latency). Only requests that are admitted and found
//! staging full count as waiting: a request still waiting for admission never holds back one
//! that could stage now.

use std::collections::BTreeMap;

use kvx_proto::sender::SendError;
use kvx_proto::{ReqId, StagingSlot};

use super::{Core, Shared};

/// A request's age: the order in which the sender began it.
pub(crate) type Age = u64;

/// The ages of the allocations blocked on a full staging pool.
#[derive(Debug, Default)]
pub(crate) struct StagingQueue {
    next_age: Age,
    /// Age → how many allocate calls of requests of that age are waiting.
    waiting: BTreeMap<Age, u32>,
}

impl StagingQueue {
    /// The age of a request begun now.
    pub(crate) fn next_age(&mut self) -> Age {
        let age = self.next_age;
        self.next_age += 1;
        age
    }

    /// True when an allocate call of a request of `age` may try to take a slot: no older
    /// request is waiting.
    pub(crate) fn may_take(&self, age: Age) -> bool {
        self.waiting
            .keys()
            .next()
            .is_none_or(|&oldest| oldest >= age)
    }

    pub(crate) fn enqueue(&mut self, age: Age) {
        *self.waiting.entry(age).or_insert(0) += 1;
    }

    /// Removes one waiting call of `age`; true when it was the oldest (younger ones may now
    /// go ahead, so they need waking).
    pub(crate) fn dequeue(&mut self, age: Age) -> bool {
        let was_oldest = self.waiting.keys().next() == Some(&age);
        if let Some(n) = self.waiting.get_mut(&age) {
            *n -= 1;
            if *n == 0 {
                self.waiting.remove(&age);
            }
        }
        was_oldest
    }
}

/// One allocate call's place in the staging queue (`staging_order`): it may take a slot only
/// when no older request waits for one, and it waits in the queue only while staging is full
/// for its admitted request. Leaving the queue as its oldest wakes the calls it held back.
pub(super) struct StagingTurn<'a> {
    shared: &'a Shared,
    age: Age,
    queued: bool,
    wake: bool,
}

impl<'a> StagingTurn<'a> {
    pub(super) fn new(shared: &'a Shared, req_id: &ReqId) -> Self {
        // An unknown request gets age 0: it tries at once and gets the core's error.
        let age = shared.lock().status.get(req_id).map_or(0, |s| s.age);
        Self {
            shared,
            age,
            queued: false,
            wake: false,
        }
    }

    /// `Some` when the call is over (a slot or an error); `None`: wait for a core event.
    pub(super) fn attempt(
        &mut self,
        core: &mut Core,
        req_id: &ReqId,
    ) -> Option<Result<StagingSlot, SendError>> {
        if !core.staging.may_take(self.age) {
            return None;
        }
        match core.flow.try_allocate(req_id) {
            Err(SendError::WouldBlock) => {
                if !self.queued {
                    core.staging.enqueue(self.age);
                    self.queued = true;
                }
                None
            }
            Err(SendError::NotAdmitted(_)) => {
                self.leave(core);
                None
            }
            other => {
                self.leave(core);
                Some(other)
            }
        }
    }

    pub(super) fn leave(&mut self, core: &mut Core) {
        if std::mem::take(&mut self.queued) && core.staging.dequeue(self.age) {
            self.wake = true;
        }
    }
}

impl Drop for StagingTurn<'_> {
    fn drop(&mut self) {
        if self.queued {
            let mut core = self.shared.lock();
            self.leave(&mut core);
        }
        if self.wake {
            self.shared.version.send_modify(|v| *v += 1);
            self.shared.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_waiter_goes_first_and_its_leaving_lets_younger_ones_go() {
        let mut q = StagingQueue::default();
        let (a, b, c) = (q.next_age(), q.next_age(), q.next_age());
        assert!(q.may_take(c), "nobody waits: anyone may take");
        q.enqueue(b);
        assert!(!q.may_take(c), "an older request waits");
        assert!(q.may_take(b) && q.may_take(a));
        q.enqueue(b);
        assert!(q.dequeue(b));
        assert!(!q.may_take(c), "a second call of b still waits");
        assert!(q.dequeue(b));
        assert!(q.may_take(c));
        q.enqueue(c);
        q.enqueue(a);
        assert!(!q.dequeue(c), "c was not the oldest");
        assert!(q.dequeue(a));
    }
}
