//! Which principal each control peer belongs to, so that admission counts shares per
//! principal, not per identity (`docs/spec/protocol.md` §Principals).
//!
//! A transport tells the ledger who stands behind a peer (`ReceiverLedger::bind_principal`):
//! a CURVE client's public key, or the address a plain peer connects from. Admission then
//! counts that peer's reservations, quarantined slots and waiters under the principal's
//! `share_key`, so a sender that opens more identities gets no more share and no longer
//! queue. A peer no transport bound counts under its own id, as before (the simulation, the
//! in-memory transport).
//!
//! A binding is kept while its peer holds anything (a request in any phase, or a slot in
//! quarantine): admission gives back what a peer holds under the key it took it under, so
//! the key must not change under it. A peer that holds nothing may be bound anew (it
//! reconnected from elsewhere). Bindings of peers that hold nothing are forgotten whenever
//! the map has doubled since the last such sweep, so it stays as small as the set of active
//! peers (amortised: a sweep scans the requests and the slots once).

use std::collections::BTreeMap;

use crate::ids::{PeerId, Principal};

#[derive(Debug, Clone)]
pub(crate) struct Principals {
    bound: BTreeMap<PeerId, Principal>,
    /// The map's size at which the next sweep runs.
    sweep_at: usize,
}

impl Default for Principals {
    fn default() -> Self {
        Self {
            bound: BTreeMap::new(),
            sweep_at: SWEEP_MIN,
        }
    }
}

/// Bindings kept before the first sweep.
const SWEEP_MIN: usize = 64;

impl Principals {
    /// The key admission counts `peer`'s share under.
    pub(crate) fn share_key(&self, peer: PeerId) -> PeerId {
        self.bound.get(&peer).map_or(peer, |p| p.share_key())
    }

    /// Binds `peer` to `principal` unless it is bound to another one and `holds(peer)`.
    /// Returns whether `peer` is now bound to `principal`.
    pub(crate) fn bind(
        &mut self,
        peer: PeerId,
        principal: Principal,
        holds: impl Fn(PeerId) -> bool,
    ) -> bool {
        match self.bound.get(&peer) {
            Some(&p) if p == principal => return true,
            Some(_) if holds(peer) => return false,
            // Unbound and holding something: it took that under its own id, which it keeps
            // until it holds nothing.
            None if holds(peer) => return false,
            _ => {}
        }
        self.bound.insert(peer, principal);
        if self.bound.len() >= self.sweep_at {
            self.bound.retain(|&p, _| p == peer || holds(p));
            self.sweep_at = (2 * self.bound.len()).max(SWEEP_MIN);
        }
        true
    }

    /// Bindings held now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.bound.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_binding_changes_only_while_its_peer_holds_nothing() {
        let mut p = Principals::default();
        let (a, b) = (Principal::new(1), Principal::new(2));
        let peer = PeerId(7);
        assert_eq!(p.share_key(peer), peer, "unbound: its own id");
        assert!(!p.bind(peer, a, |_| true), "holding under its own id");
        assert!(p.bind(peer, a, |_| false));
        assert_eq!(p.share_key(peer), a.share_key());
        assert_ne!(a.share_key(), peer, "a principal's key is no peer's id");
        assert!(!p.bind(peer, b, |_| true), "kept while it holds something");
        assert_eq!(p.share_key(peer), a.share_key());
        assert!(p.bind(peer, b, |_| false), "rebound once it holds nothing");
        assert_eq!(p.share_key(peer), b.share_key());
    }

    #[test]
    fn bindings_of_idle_peers_are_swept_as_the_map_doubles() {
        let mut p = Principals::default();
        // Every tenth peer holds something once bound; the others go idle.
        let busy = |q: PeerId| q.0.is_multiple_of(10);
        let mut most = 0;
        for i in 0..10_000u64 {
            assert!(p.bind(PeerId(i), Principal::new(i % 3), |q| q != PeerId(i)
                && busy(q)));
            most = most.max(p.len());
        }
        assert!(
            most <= 2 * 1_000 + SWEEP_MIN,
            "bounded by twice the busy peers: {most}"
        );
        assert_eq!(p.share_key(PeerId(9_990)), Principal::new(0).share_key());
    }
}
