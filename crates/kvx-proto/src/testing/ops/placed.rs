//! The decoding application of the byte-driven world under caller placement
//! (`OpWorld::placed`, `docs/spec/protocol.md` §Caller placement): it owns the buffer's
//! slots, as a vLLM decode engine's scheduler owns its KV blocks, and lends each begun
//! request's slots when it has enough (`Event::Reserve`; with `OpWorld::placed_holding`, it
//! holds the first chunk of every longer request already, as a local prefix hit), takes a reservation back
//! (`Event::Withdraw`, an abort on the decode side), and gets its slots back from the
//! ledger's `Returned`.
//!
//! Checked here, besides every state machine's invariants and the checker's rule that a
//! write lands only in a live grant of its own request or in quarantine: `Returned` gives
//! back exactly the slots reserved for that id, once; and at the end every reservation came back
//! and the application holds the whole buffer again.

use std::collections::{BTreeMap, BTreeSet};

use super::{Event, OpWorld};
use crate::canon::Canon;
use crate::ids::{ReqId, SlotIndex};
use crate::receiver::Outcome;

/// The application's side of the buffer.
#[derive(Debug, Clone)]
pub(super) struct App {
    /// The slots it holds, as a stack: a reservation takes from the top, a return pushes
    /// in the reservation's order. The choice depends on the order alone, never on slot
    /// numbers, so the explorer's renaming of slots stays sound.
    free: Vec<SlotIndex>,
    /// Reservations out: their slots, in chunk order.
    out: BTreeMap<ReqId, Vec<SlotIndex>>,
    /// Ids it reserved once; it never reserves one again (a vLLM request is allocated once).
    reserved: BTreeSet<ReqId>,
    /// The leading chunks it holds already of every request longer than this (a decode
    /// engine's local prefix hit): reserved with `handle_reserve_held`, they take no slot.
    held: u32,
}

impl App {
    pub(super) fn new(slots: u32, held: u32) -> Self {
        Self {
            free: (0..slots).map(SlotIndex).collect(),
            out: BTreeMap::new(),
            reserved: BTreeSet::new(),
            held,
        }
    }

    /// The chunks of a `total`-chunk request it holds already.
    fn held_of(&self, total: u32) -> u32 {
        if total > self.held {
            self.held
        } else {
            0
        }
    }
}

impl OpWorld {
    /// Begun requests the application has not reserved and has the slots for, oldest first.
    fn reservable(&self) -> Vec<(ReqId, u32)> {
        let Some(app) = &self.app else {
            return Vec::new();
        };
        let mut begun: Vec<(ReqId, u32)> = self
            .sides
            .iter()
            .flat_map(|s| s.requests.iter().map(|(id, total, _)| (id.clone(), *total)))
            .filter(|(id, total)| {
                let needed = total - app.held_of(*total);
                !app.reserved.contains(id) && needed as usize <= app.free.len()
            })
            .collect();
        begun.sort_by_key(|(id, _)| id.0[1..].parse::<u64>().unwrap_or(u64::MAX));
        begun
    }

    /// The explorer's events of the application: a reservation of each begun request it has
    /// the slots for and, with faults, a withdrawal of each reservation out.
    pub(super) fn placed_events(&self, events: &mut Vec<Event>) {
        let Some(app) = &self.app else { return };
        events.extend((0..self.reservable().len()).map(Event::Reserve));
        if self.faults {
            events.extend((0..app.out.len()).map(Event::Withdraw));
        }
    }

    /// Lends slots to the `pick`-th reservable request (modulo how many there are).
    pub(super) fn reserve(&mut self, pick: usize) {
        let candidates = self.reservable();
        if candidates.is_empty() {
            return;
        }
        let (id, total) = candidates[pick % candidates.len()].clone();
        let app = self.app.as_mut().expect("invariant: a placed world");
        let held = app.held_of(total);
        let at = app.free.len() - (total - held) as usize;
        let slots: Vec<SlotIndex> = app.free.drain(at..).rev().collect();
        self.receiver
            .handle_reserve_held(self.now, &id.0, held, slots.clone(), claim_secret(&id))
            .unwrap_or_else(|e| panic!("checker: reserving {} {slots:?} refused: {e}", id.0));
        app.reserved.insert(id.clone());
        app.out.insert(id, slots);
    }

    /// Takes the `pick`-th reservation out back (modulo how many there are). One already
    /// ending stays out until it is returned.
    pub(super) fn withdraw(&mut self, pick: usize) {
        let Some(app) = &self.app else { return };
        let Some(id) = app.out.keys().nth(pick % app.out.len().max(1)).cloned() else {
            return;
        };
        self.receiver
            .handle_withdraw(self.now, &id.0)
            .unwrap_or_else(|e| panic!("checker: withdrawing {} refused: {e}", id.0));
    }

    /// The ledger gave reservation `id`'s slots back.
    pub(super) fn on_returned(&mut self, id: &ReqId, slots: Vec<SlotIndex>, outcome: &Outcome) {
        let app = self
            .app
            .as_mut()
            .unwrap_or_else(|| panic!("checker: {} returned by a pool receiver", id.0));
        let reserved = app
            .out
            .remove(id)
            .unwrap_or_else(|| panic!("checker: {} returned ({outcome}) but not reserved", id.0));
        assert_eq!(
            reserved, slots,
            "checker: {} returned other slots than were reserved",
            id.0
        );
        app.free.extend(slots);
    }

    /// Healing: the application lends every begun request it has not reserved yet, as its
    /// slots come back.
    pub(super) fn reserve_all(&mut self) {
        while !self.reservable().is_empty() {
            self.reserve(0);
            self.pump();
        }
    }

    /// Every reservation came back and the application holds the whole buffer.
    pub(super) fn app_settled(&self) -> bool {
        self.app.as_ref().is_none_or(|app| {
            app.out.is_empty() && app.free.len() as u32 == self.receiver.capacity()
        })
    }

    /// The application's part of the canonical encoding: first of all, so that its stack
    /// names the slots it holds in stack order.
    pub(super) fn canon_app(&self, enc: &mut Canon) {
        let Some(app) = &self.app else { return };
        enc.len(app.free.len());
        app.free.iter().for_each(|&s| enc.slot(s));
        enc.len(app.out.len());
        for (id, slots) in &app.out {
            enc.str(&id.0);
            enc.len(slots.len());
            slots.iter().for_each(|&s| enc.slot(s));
        }
        enc.len(app.reserved.len());
        app.reserved.iter().for_each(|id| enc.str(&id.0));
    }
}

/// The claim secret of request `id`'s reservation, which its sender knows (the world's
/// application hands it over, as the vLLM router does).
pub(super) fn claim_secret(id: &crate::ids::ReqId) -> crate::claim::ClaimSecret {
    crate::claim::ClaimSecret::new(format!("claim-secret-of-{}", id.0))
        .expect("invariant: a printable secret of at least 16 bytes")
}
