//! The checker's model of one receiver, built from the outside: its requests and their
//! reservations, each slot's latest grant, the requests awaiting a reply, the ended ones.

use std::collections::BTreeMap;
use std::time::Duration;

use kvx_proto::PeerId;

pub(super) type Key = (PeerId, String);

#[derive(Debug, Default)]
pub(super) struct Req {
    pub(super) admitted: bool,
    pub(super) reserved: u32,
    pub(super) granted: u32,
    pub(super) drained_cancel: bool,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct End {
    pub(super) consumed: bool,
    pub(super) at: Duration,
    pub(super) drained: bool,
}

#[derive(Debug)]
pub(super) struct Owner {
    pub(super) key: Key,
    pub(super) generation: u32,
    pub(super) landed: bool,
}

#[derive(Debug)]
pub(super) enum Pending {
    Alloc { req: String, total: u32, last: bool },
    Cancel { req: String },
}

#[derive(Debug)]
pub(super) struct Model {
    pub(super) capacity: u32,
    pub(super) quarantine: Duration,
    pub(super) peers: BTreeMap<PeerId, String>,
    pub(super) requests: BTreeMap<Key, Req>,
    pub(super) ended: BTreeMap<Key, End>,
    pub(super) slots: Vec<Option<Owner>>,
    pub(super) pending: BTreeMap<(PeerId, u64), Pending>,
}

impl Model {
    /// The slot may still receive a late write of a failed request: it counts as pinned.
    pub(super) fn quarantined(&self, owner: &Owner, now: Duration) -> bool {
        match self.ended.get(&owner.key) {
            Some(end) => {
                !end.consumed && !end.drained && !owner.landed && now < end.at + self.quarantine
            }
            None => false,
        }
    }

    pub(super) fn pinned(&self, now: Duration) -> u32 {
        self.slots
            .iter()
            .flatten()
            .filter(|o| self.quarantined(o, now))
            .count() as u32
    }

    pub(super) fn reserved(&self) -> u32 {
        self.requests
            .values()
            .filter(|r| r.admitted)
            .map(|r| r.reserved)
            .sum()
    }
}
