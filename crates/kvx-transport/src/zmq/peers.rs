//! ZMQ routing identities ↔ kvx `PeerId`s.
//!
//! The protocol keys a receiver's requests by `(PeerId, req_id)`, so a sender must keep its
//! `PeerId` when its DEALER reconnects: the table maps each identity to one id for as long as
//! it remembers the identity. It is shared by every server a `ZmqTransport` makes, so ids are
//! unique across them too.
//!
//! It is bounded: a DEALER without an identity gets a fresh random one from the ROUTER on
//! every connection, so anonymous peers that come and go would otherwise grow it forever.
//! When full, the identity heard from least recently that no connection holds is forgotten;
//! replies to its id are then dropped as unroutable, as replies to any departed peer are.
//!
//! Which identities a ROUTER takes from the wire is decided here too (`announced_identity`,
//! `docs/spec/zmq.md` §3): libzmq's rules for an identity (1 to 255 bytes, not beginning with
//! a zero byte), held to a peer's READY as well as to kvx's own DEALER.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use bytes::Bytes;
use kvx_proto::PeerId;

/// The longest routing identity (libzmq's `ZMQ_ROUTING_ID`: 1 to 255 bytes).
pub(crate) const IDENTITY_MAX_BYTES: usize = 255;

/// Why `identity` cannot be a routing identity, if it cannot: empty, longer than 255 bytes,
/// or beginning with a zero byte (reserved for the identities a ROUTER makes up for
/// anonymous peers; one from a peer could claim an anonymous peer's id and act under its
/// `PeerId`).
pub(crate) fn check_identity(identity: &[u8]) -> Result<(), &'static str> {
    match identity.first() {
        None => Err("an identity must not be empty"),
        Some(_) if identity.len() > IDENTITY_MAX_BYTES => {
            Err("an identity must be at most 255 bytes")
        }
        Some(0) => Err("an identity must not begin with a zero byte (reserved for the ROUTER)"),
        Some(_) => Ok(()),
    }
}

/// The identity a peer announced in its READY properties: `None` when it announced none or
/// an empty one (an anonymous peer, which the ROUTER names itself); an error when it is one
/// `check_identity` refuses.
pub(crate) fn announced_identity(props: &[(String, Bytes)]) -> Result<Option<Bytes>, &'static str> {
    let announced = props
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("Identity"))
        .map(|(_, v)| v);
    match announced {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => check_identity(v).map(|()| Some(v.clone())),
    }
}

/// Who holds a connection: its source address, and under CURVE the long-term public key it
/// proved (`ZmqTransport::peer_public_key`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Principal {
    pub(crate) source: IpAddr,
    pub(crate) key: Option<[u8; 32]>,
}

#[derive(Debug)]
struct Entry {
    id: PeerId,
    /// When the identity was last heard from, in `PeerTable::clock` ticks (unique).
    last_seen: u64,
    /// Under CURVE, the key that first presented the identity: the identity, and so its
    /// `PeerId` and every right bound to it (fabric credential, grants, requests, cancels),
    /// belong to that key for as long as the identity is remembered (`bind_key`).
    key: Option<[u8; 32]>,
    /// The epoch its last connection announced (`X-Kvx-Epoch`): the sender process's
    /// incarnation (`docs/spec/protocol.md` §Restarts and epochs).
    epoch: Option<u64>,
}

/// An identity that a CURVE key other than its own presented (`PeerTable::bind_key`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BoundToAnotherKey;

#[derive(Debug)]
pub(crate) struct PeerTable {
    by_identity: HashMap<Bytes, Entry>,
    by_id: HashMap<PeerId, Bytes>,
    /// Identities by when they were last heard from, oldest first: eviction takes the
    /// oldest without scanning the table (a peer cycling through new identities at a full
    /// table must not cost a scan of `max` entries per message, under the table's lock).
    by_age: BTreeMap<u64, Bytes>,
    /// Identities a connection holds now, with how many (a ROUTER holds each once; servers
    /// of one transport share the table). Never forgotten while held: a peer cycling through
    /// new identities must not make a connected sender lose its `PeerId` mid-request.
    held: HashMap<Bytes, u32>,
    /// Who holds each held identity's connection (the latest, should two servers share it).
    principals: HashMap<Bytes, Principal>,
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
            by_age: BTreeMap::new(),
            held: HashMap::new(),
            principals: HashMap::new(),
            next_id: 1,
            clock: 0,
            max: max.max(1),
        }
    }

    /// The id of `identity`, assigning a new one the first time it is heard from.
    pub(crate) fn peer_for(&mut self, identity: &Bytes) -> PeerId {
        self.clock += 1;
        if let Some(entry) = self.by_identity.get_mut(identity) {
            self.by_age.remove(&entry.last_seen);
            entry.last_seen = self.clock;
            self.by_age.insert(self.clock, identity.clone());
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
                key: None,
                epoch: None,
            },
        );
        self.by_id.insert(id, identity.clone());
        self.by_age.insert(self.clock, identity.clone());
        id
    }

    /// The routing identity behind `id`, if it is still remembered.
    pub(crate) fn identity_of(&self, id: PeerId) -> Option<Bytes> {
        self.by_id.get(&id).cloned()
    }

    /// Binds `identity` to the CURVE `key` a connection presenting it proved, the first
    /// time; refuses it to any other key while the identity is remembered (a forgotten
    /// identity comes back with a new `PeerId`, so no right outlives the binding). Without
    /// CURVE (`key` is `None`) there is nothing to bind.
    pub(crate) fn bind_key(
        &mut self,
        identity: &Bytes,
        key: Option<[u8; 32]>,
    ) -> Result<(), BoundToAnotherKey> {
        let Some(key) = key else { return Ok(()) };
        if identity.first() == Some(&0) {
            // Made up by the ROUTER for an anonymous peer: no peer can announce it.
            return Ok(());
        }
        self.peer_for(identity);
        let entry = self
            .by_identity
            .get_mut(identity)
            .expect("invariant: peer_for remembers the identity it was asked for");
        match entry.key {
            Some(bound) if bound != key => Err(BoundToAnotherKey),
            _ => {
                entry.key = Some(key);
                Ok(())
            }
        }
    }

    /// A connection announcing `epoch` now speaks for `identity`; whether the identity's
    /// previous connection announced another one (its sender process restarted).
    pub(crate) fn epoch_seen(&mut self, identity: &Bytes, epoch: Option<u64>) -> bool {
        let Some(epoch) = epoch else { return false };
        self.peer_for(identity);
        let entry = self
            .by_identity
            .get_mut(identity)
            .expect("invariant: peer_for remembers the identity it was asked for");
        let restarted = entry.epoch.is_some_and(|before| before != epoch);
        entry.epoch = Some(epoch);
        restarted
    }

    /// A connection of `principal` now holds `identity` (a ROUTER claimed it): it is not
    /// forgotten until `released`.
    pub(crate) fn held(&mut self, identity: &Bytes, principal: Principal) {
        *self.held.entry(identity.clone()).or_insert(0) += 1;
        self.principals.insert(identity.clone(), principal);
    }

    /// Who holds the connection of `id`'s identity now, if one does.
    pub(crate) fn principal_of(&self, id: PeerId) -> Option<Principal> {
        self.principals.get(self.by_id.get(&id)?).copied()
    }

    /// The connection holding `identity` ended.
    pub(crate) fn released(&mut self, identity: &Bytes) {
        if let Some(n) = self.held.get_mut(identity) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(identity);
                self.principals.remove(identity);
            }
        }
    }

    /// Forgets the identity heard from least recently that no connection holds; skips at
    /// most as many as are held (bounded by the servers' `connections_max`). Should every
    /// remembered identity be held (`peers_max` below the connections), the oldest goes.
    fn evict_oldest(&mut self) {
        let oldest = self
            .by_age
            .values()
            .find(|identity| !self.held.contains_key(*identity))
            .or_else(|| self.by_age.values().next())
            .cloned();
        let Some(identity) = oldest else { return };
        if let Some(entry) = self.by_identity.remove(&identity) {
            self.by_age.remove(&entry.last_seen);
            self.by_id.remove(&entry.id);
            tracing::debug!(peer = %entry.id, "peer table full; forgot the least recently heard identity");
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

    fn props(identity: Option<&[u8]>) -> Vec<(String, Bytes)> {
        let mut p = vec![("Socket-Type".to_owned(), Bytes::from_static(b"DEALER"))];
        if let Some(id) = identity {
            p.push(("Identity".to_owned(), Bytes::copy_from_slice(id)));
        }
        p
    }

    #[test]
    fn identities_from_the_wire_follow_libzmq_rules() {
        assert_eq!(announced_identity(&props(None)), Ok(None));
        assert_eq!(announced_identity(&props(Some(b""))), Ok(None));
        assert_eq!(
            announced_identity(&props(Some(b"s0-to-r0"))),
            Ok(Some(b("s0-to-r0")))
        );
        assert_eq!(
            announced_identity(&props(Some(&[b'x'; 255])))
                .ok()
                .flatten()
                .map(|i| i.len()),
            Some(255)
        );
        assert!(announced_identity(&props(Some(&[b'x'; 256]))).is_err());
        assert!(announced_identity(&props(Some(&[0, 0, 0, 0, 1]))).is_err());
        assert!(announced_identity(&props(Some(b"\0abc"))).is_err());
        let lower = vec![("identity".to_owned(), Bytes::from_static(b"\0x"))];
        assert!(
            announced_identity(&lower).is_err(),
            "names are case-insensitive"
        );
    }

    #[test]
    fn an_identity_belongs_to_the_key_that_first_presented_it() {
        let mut t = PeerTable::new(2);
        let (key_a, key_b) = ([1u8; 32], [2u8; 32]);
        assert_eq!(t.bind_key(&b("s0"), Some(key_a)), Ok(()));
        assert_eq!(
            t.bind_key(&b("s0"), Some(key_a)),
            Ok(()),
            "its own key again"
        );
        assert_eq!(t.bind_key(&b("s0"), Some(key_b)), Err(BoundToAnotherKey));
        assert_eq!(
            t.bind_key(&b("s1"), None),
            Ok(()),
            "nothing to bind without CURVE"
        );
        let first = t.peer_for(&b("s0"));
        // Forgotten (the table is full and s0 is the least recently heard), the identity is
        // free again, under a new id: nothing of the old binding's rights comes with it.
        t.peer_for(&b("x"));
        t.peer_for(&b("y"));
        assert_eq!(t.identity_of(first), None);
        assert_eq!(t.bind_key(&b("s0"), Some(key_b)), Ok(()));
        assert_ne!(t.peer_for(&b("s0")), first);
    }

    #[test]
    fn a_new_epoch_under_a_known_identity_is_a_restart() {
        let mut t = PeerTable::new(4);
        assert!(!t.epoch_seen(&b("s0"), Some(7)), "the first connection");
        assert!(
            !t.epoch_seen(&b("s0"), Some(7)),
            "a reconnect of the same process"
        );
        assert!(
            t.epoch_seen(&b("s0"), Some(8)),
            "another process under the identity"
        );
        assert!(
            !t.epoch_seen(&b("s0"), None),
            "a peer that announces none (libzmq)"
        );
        assert!(!t.epoch_seen(&b("s1"), Some(8)), "another identity");
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

    /// A peer cycling through new identities cannot push out one a connection holds, however
    /// long ago it was heard from; once released, it ages out as any other.
    #[test]
    fn identities_held_by_a_connection_are_never_forgotten() {
        let mut t = PeerTable::new(3);
        let who = Principal {
            source: IpAddr::from([127, 0, 0, 1]),
            key: Some([7; 32]),
        };
        t.held(&b("sender"), who);
        let id = t.peer_for(&b("sender"));
        assert_eq!(t.principal_of(id), Some(who));
        let sender = t.peer_for(&b("sender"));
        for i in 0..1000 {
            t.peer_for(&Bytes::from(format!("cycling-{i}")));
        }
        assert_eq!(t.len(), 3);
        assert_eq!(t.peer_for(&b("sender")), sender, "kept its PeerId");
        t.released(&b("sender"));
        assert_eq!(t.principal_of(id), None, "no connection holds it now");
        for i in 0..3 {
            t.peer_for(&Bytes::from(format!("later-{i}")));
        }
        assert_eq!(t.identity_of(sender), None, "forgotten once released");
    }

    /// Cycling identities through a full table costs a lookup each, not a scan of the table:
    /// 200,000 new identities through 65,536 entries (a scan each would be 10^10 steps).
    #[test]
    fn eviction_does_not_scan_the_table() {
        let mut t = PeerTable::new(65_536);
        let began = std::time::Instant::now();
        for i in 0..200_000u32 {
            t.peer_for(&Bytes::copy_from_slice(&i.to_be_bytes()));
            if i % 1024 == 0 {
                let spent = began.elapsed();
                assert!(spent.as_secs() < 20, "{i} identities took {spent:?}");
            }
        }
        assert_eq!(t.len(), 65_536);
    }
}
