//! Ids of ended requests, remembered for `tombstone_ttl` (at most `tombstones_max`, oldest
//! forgotten first), so a late batch of a failed or cancelled request gets an error reply
//! and is never admitted afresh (LMCache's zombie re-admission, W7).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use super::Outcome;
use crate::ids::ReqKey;
use crate::time::Instant;

#[derive(Debug, Clone)]
pub(super) struct Tombstones {
    ttl: Duration,
    max: usize,
    bytes_max: usize,
    /// What the remembered entries hold, about (`entry_bytes`).
    bytes: usize,
    ended: BTreeMap<ReqKey, (Instant, Outcome)>,
    order: VecDeque<(Instant, ReqKey)>,
}

/// What one remembered id holds in memory, about: the id twice (map and order), its outcome's
/// text, and the overhead of both entries.
fn entry_bytes(key: &ReqKey, outcome: &Outcome) -> usize {
    let text = match outcome {
        Outcome::Consumed => 0,
        Outcome::Failed(f) => f.to_string().len(),
    };
    2 * key.req_id.0.len() + text + 128
}

impl Tombstones {
    pub fn new(ttl: Duration, max: usize, bytes_max: usize) -> Self {
        Self {
            ttl,
            max,
            bytes_max,
            bytes: 0,
            ended: BTreeMap::new(),
            order: VecDeque::new(),
        }
    }

    pub fn insert(&mut self, now: Instant, key: ReqKey, outcome: Outcome) {
        let size = entry_bytes(&key, &outcome);
        if self.max == 0 || size > self.bytes_max {
            return;
        }
        while !self.order.is_empty()
            && (self.ended.len() >= self.max || self.bytes + size > self.bytes_max)
        {
            self.pop_oldest();
        }
        if let Some((_, old)) = self.ended.insert(key.clone(), (now, outcome)) {
            self.bytes -= entry_bytes(&key, &old);
        }
        self.bytes += size;
        self.order.push_back((now, key));
    }

    pub fn get(&self, key: &ReqKey) -> Option<&Outcome> {
        self.ended.get(key).map(|(_, o)| o)
    }

    pub fn contains(&self, key: &ReqKey) -> bool {
        self.ended.contains_key(key)
    }

    pub fn expire(&mut self, now: Instant) {
        while self
            .order
            .front()
            .is_some_and(|(at, _)| *at + self.ttl <= now)
        {
            self.pop_oldest();
        }
    }

    /// What the remembered ids hold, about.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        self.order.front().map(|(at, _)| *at + self.ttl)
    }

    /// The explorer's canonical encoding (feature `testing`). Outcomes are left out: a late
    /// batch's refusal quotes one only as text (`Failure::AlreadyEnded`), which its sender
    /// only words its failure with.
    #[cfg(feature = "testing")]
    pub(crate) fn canon(&self, enc: &mut crate::canon::Canon) {
        enc.len(self.ended.len());
        for (key, (at, _)) in &self.ended {
            enc.u(key.peer.0);
            enc.str(&key.req_id.0);
            enc.time(*at);
        }
        enc.len(self.order.len());
        for (at, key) in &self.order {
            enc.time(*at);
            enc.u(key.peer.0);
            enc.str(&key.req_id.0);
        }
    }

    fn pop_oldest(&mut self) {
        let Some((at, key)) = self.order.pop_front() else {
            return;
        };
        // A key ended twice has two queue entries; only the newest owns the map entry.
        if self.ended.get(&key).is_some_and(|(t, _)| *t == at) {
            if let Some((_, outcome)) = self.ended.remove(&key) {
                self.bytes -= entry_bytes(&key, &outcome);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Outcome, Tombstones};
    use crate::ids::{PeerId, ReqId, ReqKey};
    use crate::receiver::Failure;
    use crate::time::Instant;
    use std::time::Duration;

    fn key(id: &str) -> ReqKey {
        ReqKey {
            peer: PeerId(1),
            req_id: ReqId(id.into()),
        }
    }

    /// A remembered id weighs its id twice, its outcome's text and 128 bytes: a table sized
    /// for exactly three keeps three, the fourth forgets the oldest, and an entry larger
    /// than the whole table is not kept (and forgets nothing).
    #[test]
    fn the_byte_bound_weighs_the_id_twice_the_outcome_and_128_bytes() {
        let failed = Outcome::Failed(Failure::Cancelled);
        let entry = 2 * "id-0".len() + Failure::Cancelled.to_string().len() + 128;
        let mut t = Tombstones::new(Duration::from_secs(60), 100, 3 * entry);
        for id in ["id-0", "id-1", "id-2"] {
            t.insert(Instant::ZERO, key(id), failed.clone());
        }
        assert!(["id-0", "id-1", "id-2"]
            .iter()
            .all(|id| t.contains(&key(id))));
        t.insert(Instant::ZERO, key("id-3"), failed.clone());
        assert!(!t.contains(&key("id-0")), "the oldest is forgotten");
        // What the forgotten entry weighed went with it: the next one forgets one more.
        t.insert(Instant::ZERO, key("id-4"), failed.clone());
        assert!(!t.contains(&key("id-1")), "the next oldest is forgotten");
        assert!(["id-2", "id-3", "id-4"]
            .iter()
            .all(|id| t.contains(&key(id))));
        t.insert(
            Instant::ZERO,
            key(&"x".repeat(3 * entry)),
            Outcome::Consumed,
        );
        assert!(!t.contains(&key(&"x".repeat(3 * entry))));
        assert!(t.contains(&key("id-2")), "nothing was forgotten for it");
    }

    /// An entry of exactly the table's bound is kept (alone); the next deadline is the
    /// oldest entry's end of `ttl`, and there is none once nothing is remembered.
    #[test]
    fn an_entry_as_large_as_the_table_is_kept_until_its_ttl() {
        let entry = 2 * "id-0".len() + 128;
        let ttl = Duration::from_secs(60);
        let mut t = Tombstones::new(ttl, 100, entry);
        assert_eq!(t.next_deadline(), None);
        let at = Instant::ZERO + Duration::from_secs(5);
        t.insert(at, key("id-0"), Outcome::Consumed);
        assert!(t.contains(&key("id-0")), "exactly the bound");
        assert_eq!(t.next_deadline(), Some(at + ttl));
        t.expire(at + ttl);
        assert!(!t.contains(&key("id-0")));
        assert_eq!(t.next_deadline(), None);
    }

    /// An id remembered again replaces its entry and its weight: three ids fit in a table of
    /// three after one of them ended twice.
    #[test]
    fn an_id_remembered_again_weighs_once() {
        let failed = Outcome::Failed(Failure::Cancelled);
        let entry = 2 * "id-0".len() + Failure::Cancelled.to_string().len() + 128;
        let mut t = Tombstones::new(Duration::from_secs(60), 100, 3 * entry);
        let later = Instant::ZERO + Duration::from_secs(1);
        t.insert(Instant::ZERO, key("id-0"), failed.clone());
        t.insert(later, key("id-0"), failed.clone());
        t.insert(later, key("id-1"), failed.clone());
        t.insert(later, key("id-2"), failed.clone());
        assert!(["id-0", "id-1", "id-2"]
            .iter()
            .all(|id| t.contains(&key(id))));
    }
}
