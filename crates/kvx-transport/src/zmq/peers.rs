//! ZMQ routing identities ↔ kvx `PeerId`s.
//!
//! The protocol keys a receiver's requests by `(PeerId, req_id)`, so a sender must keep its
//! `PeerId` when its DEALER reconnects: the table maps each identity to one id for as long as
//! it remembers the identity. It is shared by every server a `ZmqTransport` makes, so ids are
//! unique across them too.
//!
//! It is bounded: a DEALER without an identity gets a fresh random one from the ROUTER on
//! every connection, so anonymous peers that come and go would otherwise grow it forever.
//! When full, the identity heard from least recently is forgotten; replies to its id are then
//! dropped as unroutable, as replies to any departed peer are.

use std::collections::HashMap;

use bytes::Bytes;
use kvx_proto::PeerId;

#[derive(Debug)]
struct Entry {
    id: PeerId,
    /// When the identity was last heard from, in `PeerTable::clock` ticks.
    last_seen: u64,
}

#[derive(Debug)]
pub(crate) struct PeerTable {
    by_identity: HashMap<Bytes, Entry>,
    by_id: HashMap<PeerId, Bytes>,
    next_id: u64,
    /// A logical clock: one tick per lookup, so eviction order needs no system time.
    clock: u64,
    max: usize,
}

impl PeerTable {
    /// `max` is at least 1 (`ZmqConfig::validate`).
    pub(crate) fn new(max: usize) -> Self {
        Self {
            by_identity: HashMap::new(),
            by_id: HashMap::new(),
            next_id: 1,
            clock: 0,
            max: max.max(1),
        }
    }

    /// The id of `identity`, assigning a new one the first time it is heard from.
    pub(crate) fn peer_for(&mut self, identity: &Bytes) -> PeerId {
        self.clock += 1;
        if let Some(entry) = self.by_identity.get_mut(identity) {
            entry.last_seen = self.clock;
            return entry.id;
        }
        if self.by_identity.len() >= self.max {
            self.evict_oldest();
        }
        let id = PeerId(self.next_id);
        self.next_id += 1;
        self.by_identity.insert(
            identity.clone(),
            Entry {
                id,
                last_seen: self.clock,
            },
        );
        self.by_id.insert(id, identity.clone());
        id
    }

    /// The routing identity behind `id`, if it is still remembered.
    pub(crate) fn identity_of(&self, id: PeerId) -> Option<Bytes> {
        self.by_id.get(&id).cloned()
    }

    /// A linear scan: it runs only when a new identity arrives at a full table, which a
    /// well-sized `peers_max` makes rare, and it keeps the per-message path a single lookup.
    fn evict_oldest(&mut self) {
        let oldest = self
            .by_identity
            .iter()
            .min_by_key(|(_, e)| e.last_seen)
            .map(|(identity, e)| (identity.clone(), e.id));
        if let Some((identity, id)) = oldest {
            self.by_identity.remove(&identity);
            self.by_id.remove(&id);
            tracing::debug!(peer = %id, "peer table full; forgot the least recently heard identity");
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_identity.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    #[test]
    fn one_stable_id_per_identity() {
        let mut t = PeerTable::new(8);
        let a = t.peer_for(&b("a"));
        let c = t.peer_for(&b("c"));
        assert_ne!(a, c);
        assert_eq!(t.peer_for(&b("a")), a);
        assert_eq!(t.identity_of(a), Some(b("a")));
        assert_eq!(t.identity_of(PeerId(999)), None);
    }

    #[test]
    fn bounded_forgetting_the_least_recently_heard() {
        let mut t = PeerTable::new(2);
        let a = t.peer_for(&b("a"));
        let c = t.peer_for(&b("c"));
        assert_eq!(t.peer_for(&b("a")), a); // a is now more recent than c
        let d = t.peer_for(&b("d"));
        assert_eq!(t.len(), 2);
        assert_eq!(t.identity_of(c), None, "c was heard from least recently");
        assert_eq!(t.identity_of(a), Some(b("a")));
        assert_eq!(t.identity_of(d), Some(b("d")));
        // A forgotten identity that returns gets a new id: ids are never reused.
        let c2 = t.peer_for(&b("c"));
        assert!(c2 != c && c2 != a && c2 != d);
    }
}
