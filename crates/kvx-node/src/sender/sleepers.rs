//! The calls waiting on the sender, each registered with a wake-up of its own (a blocked
//! thread's condition variable, an async call's task waker), so that a change wakes the
//! calls it concerns and no others, which would only go back to sleep:
//!
//! - an allocate call waits for its request's staging turn: a freed slot wakes the call
//!   whose turn it is (the core's order: the oldest request waiting); a request admitted
//!   wakes the calls that were waiting for their request's admission;
//! - an `admitted`/`outcome` call waits for one request: an event of that request wakes it;
//! - staging held by unsubmitted chunks alone wakes the calls whose attempt can submit
//!   some (`Sleepers::for_staging`);
//! - a change that concerns them all (a request failed, a connection reset, a stop) wakes
//!   them all.
//!
//! A call registers under the core's lock, and every wake-up is decided under the same
//! lock and delivered after it (`Wakes`): a blocked thread waits with that lock
//! (`Condvar::wait_timeout` releases it atomically), an async call registers before it
//! returns `Pending` and takes its registration back on its next poll, so a wake-up cannot
//! fall between a call's last look at the core and its sleep.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar};
use std::task::Waker;

use kvx_proto::sender::{Age, SenderFlow};
use kvx_proto::ReqId;

/// How a waiting call is woken.
#[derive(Debug, Clone)]
pub(super) enum Wake {
    /// A thread blocked in `allocate_blocking`.
    Thread(Arc<Condvar>),
    /// An async call's task (a Python thread blocked on kvx's runtime is one too).
    Task(Waker),
}

impl Wake {
    fn wake(&self) {
        match self {
            Wake::Thread(cv) => cv.notify_one(),
            Wake::Task(waker) => waker.wake_by_ref(),
        }
    }
}

/// The waiting calls.
#[derive(Debug, Default)]
pub(super) struct Sleepers {
    next: u64,
    /// Allocate calls: (their request's staging age, or `None` while it waits for
    /// admission rather than staging; a registration number) → how to wake the call, and
    /// whether it holds chunks it staged outside the core (its `held` batch).
    by_turn: BTreeMap<(Option<Age>, u64), (Wake, bool)>,
    /// `admitted`/`outcome` calls: (their request; a registration number) → its waker.
    by_request: BTreeMap<(ReqId, u64), Wake>,
}

/// One call's registration; `Sleepers::leave` takes it back.
#[derive(Debug)]
pub(super) enum Sleeper {
    Turn((Option<Age>, u64)),
    Request((ReqId, u64)),
}

impl Sleepers {
    /// Registers an allocate call about to wait for `turn` (its request's staging age, or
    /// `None` while its request is not admitted); `holding`: its caller's `held` batch is
    /// not empty.
    pub(super) fn join(&mut self, turn: Option<Age>, holding: bool, wake: Wake) -> Sleeper {
        self.next += 1;
        let key = (turn, self.next);
        self.by_turn.insert(key, (wake, holding));
        Sleeper::Turn(key)
    }

    /// Registers a call about to wait for a change of `req_id`'s state.
    pub(super) fn join_request(&mut self, req_id: &ReqId, wake: Wake) -> Sleeper {
        self.next += 1;
        let key = (req_id.clone(), self.next);
        self.by_request.insert(key.clone(), wake);
        Sleeper::Request(key)
    }

    pub(super) fn leave(&mut self, sleeper: &Sleeper) {
        match sleeper {
            Sleeper::Turn(key) => drop(self.by_turn.remove(key)),
            Sleeper::Request(key) => drop(self.by_request.remove(key)),
        }
    }

    /// The allocate calls that freed slots or a passed turn concern: the oldest calls
    /// waiting for staging, one per free slot (the core's order, S9: they are the ones it
    /// lets take them). When no slot is free and unsubmitted chunks hold every
    /// one, only their callers can free staging: the waiting calls that hold a batch of
    /// their own (their attempt submits it) and, while the core keeps pending batches, the
    /// oldest call waiting for staging (its attempt submits them all, S11). None otherwise:
    /// a completing write frees a slot and wakes them then, and a caller filling a slot
    /// hands it on when it adds, submits or releases it. A served request's call leaves the
    /// queue and wakes the next (`StagingTurn`), so a turn is passed on even when a wake-up
    /// found its call already awake.
    pub(super) fn for_staging(&self, flow: &SenderFlow) -> Wakes {
        let free = flow.staging_free() as usize;
        let woken = if free > 0 {
            // As many of the oldest waiting calls as slots are free (S9): the calls of one
            // request count one each.
            let mut left = free;
            let turns = flow.staging_waiters().iter().take_while(|&(_, _, calls)| {
                let served = left > 0;
                left = left.saturating_sub(calls as usize);
                served
            });
            turns
                .flat_map(|(age, _, _)| self.by_turn.range((Some(age), 0)..=(Some(age), u64::MAX)))
                .map(|(_, (wake, _))| wake.clone())
                .collect()
        } else if flow.staging_held_by_callers() {
            let flushing = flow.has_pending_batches();
            let oldest = self.by_turn.keys().find(|(turn, _)| turn.is_some());
            self.by_turn
                .iter()
                .filter(|&(key, &(_, holding))| holding || (flushing && Some(key) == oldest))
                .map(|(_, (wake, _))| wake.clone())
                .collect()
        } else {
            Vec::new()
        };
        Wakes(woken)
    }

    /// The allocate calls whose request was not yet admitted when they went to sleep.
    pub(super) fn unadmitted(&self) -> Wakes {
        let waiting = self.by_turn.range((None, 0)..=(None, u64::MAX));
        Wakes(waiting.map(|(_, (wake, _))| wake.clone()).collect())
    }

    /// The calls waiting for `req_id`'s state.
    pub(super) fn for_request(&self, req_id: &ReqId) -> Wakes {
        let waiting = self
            .by_request
            .range((req_id.clone(), 0)..=(req_id.clone(), u64::MAX));
        Wakes(waiting.map(|(_, wake)| wake.clone()).collect())
    }

    /// Every waiting call.
    pub(super) fn all(&self) -> Wakes {
        let turns = self.by_turn.values().map(|(wake, _)| wake);
        Wakes(turns.chain(self.by_request.values()).cloned().collect())
    }
}

/// Wake-ups decided under the core's lock and delivered after it is released: a call
/// woken while the waker still held the lock ran at once (Linux lets a woken thread take
/// the core from its waker) and went straight back to sleep on that lock, one more context
/// switch for every wake-up (a third of the prefill threads' sleeps on 2 cores).
#[derive(Debug, Default)]
#[must_use = "deliver the wake-ups with `wake`, after releasing the core's lock"]
pub(super) struct Wakes(Vec<Wake>);

impl Wakes {
    pub(super) fn and(mut self, more: Wakes) -> Self {
        self.0.extend(more.0);
        self
    }

    pub(super) fn wake(self) {
        self.0.iter().for_each(Wake::wake);
    }
}

/// An async call's registration, taken back when the call's future is dropped while it
/// waits (a timeout, the driver's end, a cancelled await).
pub(super) struct TaskSleeper<'a> {
    shared: &'a super::Shared,
    pub(super) sleeper: Option<Sleeper>,
}

impl<'a> TaskSleeper<'a> {
    /// Not registered yet: the call's first poll registers it if it must wait.
    pub(super) fn new(shared: &'a super::Shared) -> Self {
        Self {
            shared,
            sleeper: None,
        }
    }

    /// Takes the registration back, under the core's lock (`core`).
    pub(super) fn leave(&mut self, sleepers: &mut Sleepers) {
        if let Some(sleeper) = self.sleeper.take() {
            sleepers.leave(&sleeper);
        }
    }
}

impl Drop for TaskSleeper<'_> {
    fn drop(&mut self) {
        if let Some(sleeper) = self.sleeper.take() {
            self.shared.lock().sleepers.leave(&sleeper);
        }
    }
}
