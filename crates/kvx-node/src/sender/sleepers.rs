//! Threads blocked in `allocate_blocking`, each on a condition variable of its own, so that
//! a freed staging slot wakes the thread whose turn it is (the core's order: the oldest
//! request waiting) instead of every blocked prefill thread, of which all but one would
//! only go back to sleep. A change that concerns them all (a request admitted or ended, a
//! stop, staging held by unsubmitted chunks alone) still wakes them all.
//!
//! A sleeper registers under the core's lock and waits on its condition variable with that
//! lock (`Condvar::wait_timeout` releases it atomically), and every wake-up is decided under
//! the same lock: a wake-up cannot fall between a thread's last look at the core and its
//! sleep.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar};

use kvx_proto::sender::{Age, SenderFlow};

/// The blocked threads, by the age of the request whose staging turn they wait for.
#[derive(Debug, Default)]
pub(super) struct Sleepers {
    next: u64,
    /// (the request's age, or `None` while it waits for admission rather than staging;
    /// a registration number) → its thread's condition variable.
    by_turn: BTreeMap<(Option<Age>, u64), Arc<Condvar>>,
}

/// One thread's registration; `Sleepers::leave` takes it back.
#[derive(Debug)]
pub(super) struct Sleeper {
    key: (Option<Age>, u64),
    pub(super) cv: Arc<Condvar>,
}

impl Sleepers {
    /// Registers a thread about to wait for `turn` (its request's staging age, or `None`).
    pub(super) fn join(&mut self, turn: Option<Age>) -> Sleeper {
        self.next += 1;
        let key = (turn, self.next);
        let cv = Arc::new(Condvar::new());
        self.by_turn.insert(key, cv.clone());
        Sleeper { key, cv }
    }

    pub(super) fn leave(&mut self, sleeper: &Sleeper) {
        self.by_turn.remove(&sleeper.key);
    }

    /// Wakes the threads that freed slots or a passed turn concern: those of the oldest
    /// requests waiting for staging, one request per free slot (the core's order: they are
    /// the ones it lets take them); all of them when unsubmitted chunks alone hold staging
    /// (the callers that hold some must submit them); none otherwise (a completing write
    /// frees a slot and wakes them then). A served request's call leaves the queue and
    /// wakes the next (`StagingTurn`), so a turn is passed on even when a wake-up found its
    /// thread already awake.
    pub(super) fn wake_for_staging(&self, flow: &SenderFlow) {
        let free = flow.staging_free() as usize;
        if free > 0 {
            for age in flow.staging_waiters().ages().take(free) {
                self.by_turn
                    .range((Some(age), 0)..=(Some(age), u64::MAX))
                    .for_each(|(_, cv)| cv.notify_one());
            }
        } else if flow.staging_held_by_callers() {
            self.wake_all();
        }
    }

    pub(super) fn wake_all(&self) {
        self.by_turn.values().for_each(|cv| cv.notify_one());
    }
}
