//! The receiver's buffer slots: who owns each, which grant (generation) it is on, and
//! whether a write into it may still land (`docs/spec/protocol.md` §Slots).
//!
//! A slot is never handed out again while a write into it may still land: a rolled-back
//! slot whose write has not been seen goes to quarantine until its write lands (the write
//! tag names the grant) or `write_quarantine` passes.
//!
//! Freed slots are reused newest-first (a stack): the slot a decoder has just read is still in
//! the CPU's caches, so the next write into it (a TCP or shared-memory fabric copies with the
//! CPU) costs less. `kvx demo` over TCP with 4 staging chunks: 4.39–4.62 GB/s against
//! 4.22–4.38 oldest-first, and 6 % less CPU per GB (docs/PERFORMANCE.md). Safety never rested
//! on the order: a slot a write may still reach is in quarantine, not free.

use std::collections::VecDeque;

use crate::ids::{PeerId, SlotIndex, Ticket, WriteTag};
use crate::time::Instant;

/// Who may write into a slot now: the peer its current grant went to, under that grant's
/// generation. The fabric mirrors these (`poll_grant_change`) and refuses every other write
/// before it touches the slot (`docs/spec/protocol.md` §Slots, grant-bound writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotGrant {
    /// The control peer the grant went to; only its fabric connections may write the slot.
    pub peer: PeerId,
    /// The grant's generation, as its write's immediate must carry it.
    pub generation: u32,
    /// The chunk's length as its batch declared it: the one write of the grant must bring
    /// exactly this many bytes. `None`: any length (a legacy sender's request, which declares
    /// none).
    pub bytes: Option<u64>,
}

/// A slot's grant changed: `Some` when it is handed out, `None` once it is free again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantChange {
    /// The slot whose grant changed.
    pub slot: SlotIndex,
    /// Its grant from now on.
    pub grant: Option<SlotGrant>,
}

/// Where a slot is in its cycle: `Free` → `Granted` → `Landed` → `Free`. A rolled-back
/// request's `Granted` slot goes to `Quarantined` (then `Free`), or straight to `Free` when
/// its sender said it is drained. In a table the application owns (`SlotTable::for_caller`)
/// `Caller` takes `Free`'s place: `Caller` → `Granted` (`grant_at`) → `Landed` → `Caller`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// No grant; `grant` may hand it out.
    Free,
    /// Handed to `owner`'s sender; its write has not been seen.
    Granted {
        /// The request's admission ticket.
        owner: Ticket,
    },
    /// `owner`'s write has landed.
    Landed {
        /// The request's admission ticket.
        owner: Ticket,
    },
    /// Owner rolled back while a write may still land; unusable until `until`.
    Quarantined {
        /// When it is freed if no late write clears it first.
        until: Instant,
    },
    /// The application's (`Placement::Caller`): no grant; only `grant_at` hands it out, for
    /// a request the application reserved it for.
    Caller,
}

/// What a landed-write notice meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landing {
    /// The write of a current grant landed.
    Current {
        /// The request's admission ticket.
        owner: Ticket,
    },
    /// A late write of a rolled-back grant landed in quarantine; the slot is free now.
    QuarantineCleared,
    /// A notice for a grant that is not current (duplicate, or a slot already reused):
    /// counted, ignored.
    Stale,
    /// The grant is current but the write came from another peer's connection: never
    /// announced, never clears a quarantine.
    Forged,
}

/// The receiver's buffer slots: each slot's state, the generation of its latest grant, the
/// peer that grant went to, and the quarantine queue.
///
/// Contract: the caller (`ReceiverLedger`) calls `grant` once per chunk of an admitted
/// request's batch (admission leaves a free slot for every reserved chunk; `None` means it
/// did not); `land` for every write the fabric reports, whatever its tag and peer claim
/// (stale, forged or out-of-range notices change nothing); `release` for a slot whose write
/// can no longer land (it landed, or the sender said it is drained); `quarantine` for each
/// slot of a request rolled back without that assurance (one already landed is freed),
/// always with `until = now + write_quarantine`, so the queue stays in deadline order; and
/// `poll_quarantine_expired(now)` until `None` whenever `now` reaches `next_deadline`.
/// `release` and `quarantine` take only a slot that is `Granted` or `Landed`, once per
/// grant (they panic otherwise). It emits every grant and every return to `Free`, in order,
/// through `poll_grant_change`, and each slot its quarantine freed, with the peer that held
/// it, through `poll_quarantine_expired`; the caller gives that peer's pinned slot back to
/// admission (`Admission::unpin`), as it does for a `Landing::QuarantineCleared`. The
/// driver applies the grant changes to the fabric's mirror before it sends the replies that
/// hand the grants out.
#[derive(Debug, Clone)]
pub struct SlotTable {
    state: Vec<SlotState>,
    generation: Vec<u32>,
    /// The peer of each slot's current grant, from `grant` until the slot is free again
    /// (through `Landed` and `Quarantined`: a late write of that grant may still land).
    holder: Vec<Option<PeerId>>,
    /// Grant changes not yet taken by `poll_grant_change`, in order.
    changes: VecDeque<GrantChange>,
    /// A stack: `grant` takes the slot freed last.
    free: Vec<SlotIndex>,
    /// (until, slot, generation) in `until` order, since `until` is now + a fixed duration.
    quarantine: VecDeque<(Instant, SlotIndex, u32)>,
    granted: u32,
    landed: u32,
    quarantined: u32,
    /// Slots in state `Caller`; always 0 in a pool table.
    caller: u32,
    /// The application owns the slots (`Placement::Caller`): a slot whose grant ends goes
    /// back to `Caller`, never to the free stack.
    caller_owned: bool,
}

impl SlotTable {
    /// `slots` free slots, all at generation 0; slot 0 is granted first.
    pub fn new(slots: u32) -> Self {
        Self {
            state: vec![SlotState::Free; slots as usize],
            generation: vec![0; slots as usize],
            holder: vec![None; slots as usize],
            changes: VecDeque::new(),
            // Reversed, so that a fresh table grants slot 0 first.
            free: (0..slots).rev().map(SlotIndex).collect(),
            quarantine: VecDeque::new(),
            granted: 0,
            landed: 0,
            quarantined: 0,
            caller: 0,
            caller_owned: false,
        }
    }

    /// `slots` slots the application owns (`Placement::Caller`), all in state `Caller` at
    /// generation 0: `grant` never hands one out, `grant_at` does.
    pub fn for_caller(slots: u32) -> Self {
        let mut table = Self::new(slots);
        table.state.fill(SlotState::Caller);
        table.free.clear();
        table.caller = slots;
        table.caller_owned = true;
        table
    }

    /// Slots in state `Caller`: the application's, no grant on them.
    pub fn caller_count(&self) -> u32 {
        self.caller
    }

    /// Slots in the buffer.
    pub fn capacity(&self) -> u32 {
        self.state.len() as u32
    }

    /// Slots `grant` may hand out.
    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    /// Slots out of use until a late write lands or their quarantine ends.
    pub fn quarantined_count(&self) -> u32 {
        self.quarantined
    }

    /// Granted or landed: slots that belong to a live request.
    pub fn held_count(&self) -> u32 {
        self.granted + self.landed
    }

    /// The state of `slot`. Panics if `slot` is not below `capacity`.
    pub fn state(&self, slot: SlotIndex) -> SlotState {
        self.state[slot.0 as usize]
    }

    /// `slot` with its current generation (that of its latest grant). Panics if `slot` is not
    /// below `capacity`.
    pub fn tag(&self, slot: SlotIndex) -> WriteTag {
        WriteTag {
            slot,
            generation: self.generation[slot.0 as usize],
        }
    }

    /// Hands a free slot to `owner` (a request of `peer`) under a new generation, for a
    /// chunk of `bytes` bytes (`SlotGrant::bytes`). None when no slot is free, which
    /// admission rules out for admitted requests (asserted by the ledger).
    pub fn grant(&mut self, owner: Ticket, peer: PeerId, bytes: Option<u64>) -> Option<WriteTag> {
        let slot = self.free.pop()?;
        let i = slot.0 as usize;
        debug_assert_eq!(self.state[i], SlotState::Free);
        self.generation[i] = self.generation[i].wrapping_add(1);
        self.state[i] = SlotState::Granted { owner };
        self.holder[i] = Some(peer);
        self.granted += 1;
        let generation = self.generation[i];
        self.changes.push_back(GrantChange {
            slot,
            grant: Some(SlotGrant {
                peer,
                generation,
                bytes,
            }),
        });
        Some(WriteTag { slot, generation })
    }

    /// Hands `slot`, the application's (state `Caller`), to `owner` (a request of `peer`)
    /// under a new generation: the slot the application reserved for that chunk. Panics
    /// unless `slot` is in state `Caller`: the ledger checks every reserved slot when it is
    /// reserved and lends it to one request at a time.
    pub fn grant_at(
        &mut self,
        slot: SlotIndex,
        owner: Ticket,
        peer: PeerId,
        bytes: Option<u64>,
    ) -> WriteTag {
        let i = slot.0 as usize;
        assert_eq!(
            self.state.get(i),
            Some(&SlotState::Caller),
            "invariant: grant_at of slot {} the application did not reserve",
            slot.0
        );
        self.caller -= 1;
        self.state[i] = SlotState::Free;
        self.free.push(slot);
        self.grant(owner, peer, bytes)
            .expect("invariant: the slot was just put on the free stack")
    }

    /// The next change to the slots' grants, for the fabric's mirror (`FabricAccess`). A
    /// driver applies every change before it sends the replies the ledger queued with them,
    /// so a write never arrives before its grant is known to the fabric.
    pub fn poll_grant_change(&mut self) -> Option<GrantChange> {
        self.changes.pop_front()
    }

    /// The peer whose grant `slot` is under, if any.
    pub fn holder(&self, slot: SlotIndex) -> Option<PeerId> {
        self.holder.get(slot.0 as usize).copied().flatten()
    }

    /// Whether `peer` holds any slot (granted to one of its requests, or quarantined after
    /// its rollback). Linear in the slots.
    pub fn holds_any(&self, peer: PeerId) -> bool {
        self.holder.contains(&Some(peer))
    }

    /// A write notice arrived for `tag` from a connection of `peer`.
    pub fn land(&mut self, tag: WriteTag, peer: PeerId) -> Landing {
        let Some(&state) = self.state.get(tag.slot.0 as usize) else {
            return Landing::Stale;
        };
        if !self.tag(tag.slot).same_grant(tag) {
            return Landing::Stale;
        }
        let unheld = matches!(state, SlotState::Free | SlotState::Caller);
        if !unheld && self.holder(tag.slot) != Some(peer) {
            return Landing::Forged;
        }
        match state {
            SlotState::Granted { owner } => {
                self.state[tag.slot.0 as usize] = SlotState::Landed { owner };
                self.granted -= 1;
                self.landed += 1;
                Landing::Current { owner }
            }
            SlotState::Quarantined { .. } => {
                self.set_free(tag.slot);
                self.quarantined -= 1;
                Landing::QuarantineCleared
            }
            SlotState::Free | SlotState::Caller | SlotState::Landed { .. } => Landing::Stale,
        }
    }

    /// Frees a slot whose write cannot land any more (it landed, or the sender is drained).
    pub fn release(&mut self, slot: SlotIndex) {
        match self.state(slot) {
            SlotState::Granted { .. } => self.granted -= 1,
            SlotState::Landed { .. } => self.landed -= 1,
            other => panic!("invariant: release of slot {} in state {other:?}", slot.0),
        }
        self.set_free(slot);
    }

    /// Takes a granted slot out of use until its write lands or `until` passes. Returns
    /// false (and frees the slot) when its write already landed.
    pub fn quarantine(&mut self, slot: SlotIndex, until: Instant) -> bool {
        match self.state(slot) {
            SlotState::Landed { .. } => {
                self.release(slot);
                false
            }
            SlotState::Granted { .. } => {
                self.granted -= 1;
                self.quarantined += 1;
                self.state[slot.0 as usize] = SlotState::Quarantined { until };
                let generation = self.generation[slot.0 as usize];
                self.quarantine.push_back((until, slot, generation));
                true
            }
            other => panic!(
                "invariant: quarantine of slot {} in state {other:?}",
                slot.0
            ),
        }
    }

    /// Frees the next quarantined slot whose time is up, and says whose grant it was under.
    /// Entries whose slot was already cleared by a late landing are skipped.
    pub fn poll_quarantine_expired(&mut self, now: Instant) -> Option<(SlotIndex, PeerId)> {
        while let Some(&(until, slot, generation)) = self.quarantine.front() {
            let live = self.generation[slot.0 as usize] == generation
                && matches!(self.state(slot), SlotState::Quarantined { .. });
            if live && until > now {
                return None;
            }
            self.quarantine.pop_front();
            if live {
                let holder = self
                    .holder(slot)
                    .expect("invariant: a quarantined slot has a holder");
                self.set_free(slot);
                self.quarantined -= 1;
                return Some((slot, holder));
            }
        }
        None
    }

    /// When `poll_quarantine_expired` may next have a slot to free. It may come early (the
    /// head entry's slot was already cleared by a late write): the poll then skips it.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.quarantine.front().map(|q| q.0)
    }

    fn set_free(&mut self, slot: SlotIndex) {
        self.holder[slot.0 as usize] = None;
        self.changes.push_back(GrantChange { slot, grant: None });
        if self.caller_owned {
            self.state[slot.0 as usize] = SlotState::Caller;
            self.caller += 1;
        } else {
            self.state[slot.0 as usize] = SlotState::Free;
            self.free.push(slot);
        }
    }

    /// The explorer's canonical encoding (feature `testing`), first part: each slot's current
    /// generation for the encoder, and the free stack in order (`grant` takes its top).
    #[cfg(feature = "testing")]
    pub(crate) fn canon_free(&self, enc: &mut crate::canon::Canon) {
        let free = |(s, g): (&SlotState, &u32)| (*s != SlotState::Free).then_some(*g);
        enc.set_generations(self.state.iter().zip(&self.generation).map(free));
        enc.len(self.free.len());
        self.free.iter().for_each(|&s| enc.slot(s));
    }

    /// Second part, once the ledger has named the slots its requests hold: the quarantine
    /// queue (entries already cleared included: they still set `next_deadline`), then each
    /// slot's state in the order of its name. The counters follow from the states.
    #[cfg(feature = "testing")]
    pub(crate) fn canon_rest(&self, enc: &mut crate::canon::Canon) {
        enc.len(self.quarantine.len());
        for &(until, slot, generation) in &self.quarantine {
            enc.time(until);
            enc.slot(slot);
            enc.generation(slot, generation);
        }
        for slot in enc.named_slots(self.capacity()) {
            match self.state(slot) {
                SlotState::Free => enc.len(0),
                SlotState::Granted { owner } => {
                    enc.len(1);
                    enc.ticket(owner);
                }
                SlotState::Landed { owner } => {
                    enc.len(2);
                    enc.ticket(owner);
                }
                SlotState::Quarantined { until } => {
                    enc.len(3);
                    enc.time(until);
                    // Whose late write may still clear it.
                    enc.u(self.holder(slot).map_or(0, |p| p.0));
                }
                SlotState::Caller => enc.len(4),
            }
        }
    }

    /// Panics if the counters, the free stack or the holders disagree with the states.
    pub fn check_invariants(&self) {
        let (mut free, mut granted, mut landed, mut quarantined, mut caller) = (0, 0, 0, 0, 0u32);
        for s in &self.state {
            match s {
                SlotState::Free => free += 1,
                SlotState::Granted { .. } => granted += 1,
                SlotState::Landed { .. } => landed += 1,
                SlotState::Quarantined { .. } => quarantined += 1,
                SlotState::Caller => caller += 1,
            }
        }
        assert!(
            self.caller_owned || caller == 0,
            "invariant: only an application's table has Caller slots"
        );
        assert!(
            !self.caller_owned || free == 0,
            "invariant: an application's table has no free slots"
        );
        assert_eq!(
            free as usize,
            self.free.len(),
            "invariant: free list matches free slots"
        );
        assert_eq!(
            (granted, landed, quarantined, caller),
            (self.granted, self.landed, self.quarantined, self.caller),
            "invariant: slot counters"
        );
        assert_eq!(
            free + granted + landed + quarantined + caller,
            self.capacity(),
            "invariant: every slot has one state"
        );
        for (i, s) in self.state.iter().enumerate() {
            assert_eq!(
                matches!(s, SlotState::Free | SlotState::Caller),
                self.holder[i].is_none(),
                "invariant: slot {i} has a holder iff it is not free"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The checker catches what it is there for: a counter or the free stack out of step
    /// with the slots' states.
    #[test]
    fn check_invariants_catches_counters_out_of_step() {
        let mut t = SlotTable::new(2);
        t.grant(Ticket(1), PeerId(1), None).expect("free slot");
        t.check_invariants();
        for (what, corrupt) in [
            ("slot counters", |t: &mut SlotTable| t.granted += 1),
            ("free list", |t: &mut SlotTable| {
                t.free.pop();
            }),
        ] as [(&str, fn(&mut SlotTable)); 2]
        {
            let mut bad = t.clone();
            corrupt(&mut bad);
            let caught = crate::testing::panic_message(|| bad.check_invariants());
            assert!(caught.is_some(), "{what} out of step is caught");
        }
    }

    #[test]
    fn a_late_write_clears_quarantine_and_a_stale_one_is_ignored() {
        let mut t = SlotTable::new(2);
        let a = t.grant(Ticket(1), PeerId(1), None).expect("free slot");
        assert!(t.quarantine(a.slot, Instant::ZERO + Duration::from_secs(5)));
        assert_eq!(t.free_count(), 1);
        assert_eq!(t.land(a, PeerId(1)), Landing::QuarantineCleared);
        assert_eq!(t.land(a, PeerId(1)), Landing::Stale);
        t.check_invariants();
    }

    #[test]
    fn quarantine_expires_in_order() {
        let mut t = SlotTable::new(2);
        let a = t.grant(Ticket(1), PeerId(1), None).expect("free slot");
        let b = t.grant(Ticket(1), PeerId(1), None).expect("free slot");
        t.quarantine(a.slot, Instant::ZERO + Duration::from_secs(1));
        t.quarantine(b.slot, Instant::ZERO + Duration::from_secs(2));
        assert_eq!(
            t.poll_quarantine_expired(Instant::ZERO + Duration::from_secs(1)),
            Some((a.slot, PeerId(1)))
        );
        assert_eq!(
            t.poll_quarantine_expired(Instant::ZERO + Duration::from_secs(1)),
            None
        );
        assert_eq!(
            t.grant(Ticket(2), PeerId(2), None).map(|g| g.slot),
            Some(a.slot)
        );
        t.check_invariants();
    }

    /// A slot cleared by its late write and quarantined again under a new grant keeps the
    /// new quarantine's time: the old entry, due first, frees nothing (freeing the slot then
    /// would let the second grant's stale write land in its next owner's data).
    #[test]
    fn a_requarantined_slot_waits_for_its_new_quarantine() {
        let at = |s| Instant::ZERO + Duration::from_secs(s);
        let mut t = SlotTable::new(1);
        let a = t.grant(Ticket(1), PeerId(1), None).expect("free slot");
        assert!(t.quarantine(a.slot, at(5)));
        assert_eq!(t.land(a, PeerId(1)), Landing::QuarantineCleared);
        let b = t
            .grant(Ticket(2), PeerId(1), None)
            .expect("the cleared slot");
        assert!(t.quarantine(b.slot, at(10)));
        assert_eq!(t.next_deadline(), Some(at(5)), "the old entry, due first");
        assert_eq!(
            t.poll_quarantine_expired(at(6)),
            None,
            "the old entry frees nothing"
        );
        assert_eq!(t.quarantined_count(), 1);
        assert_eq!(t.poll_quarantine_expired(at(10)), Some((b.slot, PeerId(1))));
        t.check_invariants();
    }

    #[test]
    fn regranting_bumps_the_generation() {
        let mut t = SlotTable::new(1);
        let a = t.grant(Ticket(1), PeerId(1), None).expect("free slot");
        t.release(a.slot);
        let b = t.grant(Ticket(2), PeerId(2), None).expect("free slot");
        assert_eq!(a.slot, b.slot);
        assert_ne!(a.generation, b.generation);
        assert_eq!(t.land(a, PeerId(1)), Landing::Stale);
    }

    #[test]
    fn a_write_from_another_peer_is_forged_and_changes_nothing() {
        let mut t = SlotTable::new(2);
        let a = t.grant(Ticket(1), PeerId(1), None).expect("free slot");
        assert_eq!(t.land(a, PeerId(2)), Landing::Forged);
        assert_eq!(t.state(a.slot), SlotState::Granted { owner: Ticket(1) });
        // Nor may it clear the quarantine of a rolled-back grant.
        assert!(t.quarantine(a.slot, Instant::ZERO + Duration::from_secs(5)));
        assert_eq!(t.land(a, PeerId(2)), Landing::Forged);
        assert_eq!(t.quarantined_count(), 1);
        assert_eq!(t.land(a, PeerId(1)), Landing::QuarantineCleared);
        t.check_invariants();
    }

    #[test]
    fn grant_changes_mirror_grants_and_frees_in_order() {
        let mut t = SlotTable::new(1);
        let a = t.grant(Ticket(1), PeerId(7), Some(64)).expect("free slot");
        t.release(a.slot);
        let changes: Vec<_> = std::iter::from_fn(|| t.poll_grant_change()).collect();
        assert_eq!(
            changes,
            vec![
                GrantChange {
                    slot: a.slot,
                    grant: Some(SlotGrant {
                        peer: PeerId(7),
                        generation: a.generation,
                        bytes: Some(64)
                    })
                },
                GrantChange {
                    slot: a.slot,
                    grant: None
                },
            ]
        );
    }
}
