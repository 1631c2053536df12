//! The sender's staging pool: a fixed number of chunk slots, each owned by at most one
//! request. Only admitted requests may take a slot (`docs/spec/protocol.md` §Sender), so
//! staging is only ever held by requests whose receiver slots are guaranteed, and finite
//! staging cannot close a wait cycle.
//!
//! `StagingWaiters`: who gets a freed slot when several requests wait for one — the oldest
//! (the first begun). A request is useful to its decoder only once every chunk has landed,
//! so spreading staging evenly over every request a sender prefills stretches all of them,
//! while serving the oldest first finishes each sooner at the same throughput (the demo's
//! latency in `docs/PERFORMANCE.md`). Only calls that found no free slot wait; a request that
//! holds unsubmitted staging is never made to wait behind an older one, since the older one
//! may be waiting for exactly that staging (it is told to submit instead).
//!
//! With caller staging (`SenderConfig::staging_placement = Caller`) the slots are the
//! application's memory, where its bytes already are: nothing is allocated, and the pool
//! only counts the submitted chunks that read each slot until their writes complete, so that
//! the sender can say when a request no longer reads any.

use std::collections::BTreeMap;

use crate::ids::{ReqId, StagingSlot};

/// The staging slots and the request holding each. It checks nothing about admission:
/// `SenderFlow` hands slots only to admitted requests.
#[derive(Debug, Clone)]
pub struct StagingPool {
    owner: Vec<Option<ReqId>>,
    free: Vec<StagingSlot>,
    /// Caller staging: how many submitted chunks read each slot (until their write completes,
    /// or until it is known never to be posted). `None`: kvx's pool.
    readers: Option<Vec<u32>>,
}

impl StagingPool {
    /// `slots` free slots.
    pub fn new(slots: u32) -> Self {
        // Reversed so that `pop` hands out slot 0 first.
        Self {
            owner: vec![None; slots as usize],
            free: (0..slots).rev().map(StagingSlot).collect(),
            readers: None,
        }
    }

    /// `slots` slots of the caller's memory, none read yet: none is ever handed out.
    pub fn callers(slots: u32) -> Self {
        Self {
            owner: vec![None; slots as usize],
            free: Vec::new(),
            readers: Some(vec![0; slots as usize]),
        }
    }

    /// Whether the slots are the caller's (nothing to allocate).
    pub fn is_callers(&self) -> bool {
        self.readers.is_some()
    }

    /// Caller staging: one more submitted chunk reads `slot`. Panics in kvx's pool, or when
    /// `slot` is out of range (`SenderFlow` checks both first).
    pub fn read(&mut self, slot: StagingSlot) {
        let readers = self
            .readers
            .as_mut()
            .expect("invariant: only caller staging is read in place");
        readers[slot.0 as usize] += 1;
    }

    /// Caller staging: the submitted chunks that read `slot` now (0 in kvx's pool).
    pub fn readers(&self, slot: StagingSlot) -> u32 {
        self.readers
            .as_ref()
            .and_then(|r| r.get(slot.0 as usize).copied())
            .unwrap_or(0)
    }

    /// Caller staging: every slot's readers, summed (0 in kvx's pool).
    pub fn reads(&self) -> u64 {
        self.readers
            .as_ref()
            .map_or(0, |r| r.iter().map(|&n| u64::from(n)).sum())
    }

    /// No slot held (kvx's pool) or read (caller staging).
    pub fn is_idle(&self) -> bool {
        match &self.readers {
            Some(readers) => readers.iter().all(|&n| n == 0),
            None => self.free.len() == self.owner.len(),
        }
    }

    /// Slots in the pool.
    pub fn capacity(&self) -> u32 {
        self.owner.len() as u32
    }

    /// Slots free now.
    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    /// A free slot for `req` (the slot freed last); `None` when none is free.
    pub fn take(&mut self, req: &ReqId) -> Option<StagingSlot> {
        let slot = self.free.pop()?;
        self.owner[slot.0 as usize] = Some(req.clone());
        Some(slot)
    }

    /// The request holding `slot`, if any.
    pub fn owner(&self, slot: StagingSlot) -> Option<&ReqId> {
        self.owner.get(slot.0 as usize).and_then(Option::as_ref)
    }

    /// A chunk is done with `slot`: its write completed, or will never be posted. In kvx's
    /// pool the slot is free again; with caller staging one read of it ended. Panics if it
    /// is out of range, already free, or not read.
    pub fn give_back(&mut self, slot: StagingSlot) {
        if let Some(readers) = &mut self.readers {
            let n = readers
                .get_mut(slot.0 as usize)
                .expect("invariant: staging slot in range");
            assert!(*n > 0, "invariant: staging slot {} read no more", slot.0);
            *n -= 1;
            return;
        }
        let owner = self
            .owner
            .get_mut(slot.0 as usize)
            .expect("invariant: staging slot in range");
        assert!(
            owner.is_some(),
            "invariant: staging slot {} freed twice",
            slot.0
        );
        *owner = None;
        self.free.push(slot);
    }

    /// Slots each request owns, for the sender's invariant check.
    pub fn owned_by(&self, req: &ReqId) -> usize {
        self.owner
            .iter()
            .filter(|o| o.as_ref() == Some(req))
            .count()
    }

    /// The free stack in order (the explorer's canonical encoding, feature `testing`).
    #[cfg(feature = "testing")]
    pub(crate) fn canon_free(&self, enc: &mut crate::canon::Canon) {
        enc.len(self.free.len());
        self.free.iter().for_each(|&s| enc.staging(s));
        if let Some(readers) = &self.readers {
            readers.iter().for_each(|&n| enc.len(n as usize));
        }
    }

    /// Panics unless every slot is either held or on the free stack (kvx's pool), or none
    /// is held or free (caller staging: the slots are the caller's, only read).
    pub fn check_invariants(&self) {
        if self.readers.is_some() {
            assert!(
                self.free.is_empty() && self.owner.iter().all(Option::is_none),
                "invariant: caller staging is never handed out"
            );
            return;
        }
        let owned = self.owner.iter().filter(|o| o.is_some()).count();
        assert_eq!(
            owned + self.free.len(),
            self.owner.len(),
            "invariant: staging slots are owned or free"
        );
    }
}

/// A request's place in the staging order: the order in which the sender began it.
pub type Age = u64;

/// Allocate calls waiting for a free staging slot, by the age of their request.
#[derive(Debug, Clone, Default)]
pub struct StagingWaiters {
    /// Age → the request and how many of its calls wait.
    waiting: BTreeMap<Age, (ReqId, u32)>,
}

impl StagingWaiters {
    /// The age of the oldest request with a waiting call.
    pub fn oldest(&self) -> Option<Age> {
        self.waiting.keys().next().copied()
    }

    /// How many waiting calls belong to requests older than `age`: the free slots they
    /// come first for.
    pub fn calls_older_than(&self, age: Age) -> u32 {
        self.waiting.range(..age).map(|(_, (_, n))| n).sum()
    }

    /// The ages of the requests with waiting calls, oldest first: the order in which free
    /// slots go to them.
    pub fn ages(&self) -> impl Iterator<Item = Age> + '_ {
        self.waiting.keys().copied()
    }

    /// Registers one more waiting call of `req`, whose age is `age`.
    pub fn add(&mut self, age: Age, req: &ReqId) {
        self.waiting
            .entry(age)
            .or_insert_with(|| (req.clone(), 0))
            .1 += 1;
    }

    /// Removes one waiting call of `age`; true when its request was the oldest waiting
    /// (younger ones may go ahead now).
    pub fn remove_one(&mut self, age: Age) -> bool {
        let was_oldest = self.oldest() == Some(age);
        if let Some((_, n)) = self.waiting.get_mut(&age) {
            *n -= 1;
            if *n == 0 {
                self.waiting.remove(&age);
            }
            return was_oldest;
        }
        false
    }

    /// Forgets every waiting call of `age` (its request ended). No caller needs to know
    /// whether it was the oldest: a failure is an event that a driver answers by waking
    /// every wait, and a delivered request has no call left waiting (each chunk it declared
    /// had staging).
    pub fn remove_all(&mut self, age: Age) {
        self.waiting.remove(&age);
    }

    /// The waiting requests with their ages and call counts (invariants, canon).
    pub fn iter(&self) -> impl Iterator<Item = (Age, &ReqId, u32)> {
        self.waiting.iter().map(|(&age, (req, n))| (age, req, *n))
    }

    /// Whether no call waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checker catches a slot both free and held.
    #[test]
    fn check_invariants_catches_a_slot_free_and_held() {
        let mut pool = StagingPool::new(2);
        let slot = pool.take(&ReqId("r".into())).expect("a free slot");
        pool.check_invariants();
        pool.free.push(slot);
        let caught = crate::testing::panic_message(|| pool.check_invariants());
        assert!(caught.is_some(), "a slot free and held is caught");
    }

    /// Waiting requests are listed oldest first, each once however many of its calls wait,
    /// and leave the list with their last call.
    #[test]
    fn ages_lists_each_waiting_request_oldest_first() {
        let mut waiters = StagingWaiters::default();
        for (age, id) in [(7, "b"), (3, "a"), (7, "b"), (9, "c")] {
            waiters.add(age, &ReqId(id.into()));
        }
        assert_eq!(waiters.ages().collect::<Vec<_>>(), [3, 7, 9]);
        assert!(!waiters.remove_one(7), "7 was not the oldest");
        assert_eq!(waiters.ages().collect::<Vec<_>>(), [3, 7, 9]);
        assert!(!waiters.remove_one(7));
        assert!(waiters.remove_one(3), "3 was the oldest");
        assert_eq!(waiters.ages().collect::<Vec<_>>(), [9]);
    }
}
