//! What a landed write must prove before it counts (`docs/spec/protocol.md` §Receiver,
//! landings): that its immediate names the slot it was written into, that the connection it
//! came through belongs to the peer holding that slot's current grant, that it brought
//! exactly the bytes its batch declared for the chunk (`AllocRequest::chunk_bytes`), and that
//! they match the checksum its sender computed. A write that fails the first two is
//! *refused* (counted, never announced, the slot unchanged); one that fails the last two is
//! *corrupt* and fails its request, so the decoder never reads it.

use std::fmt;

use super::{Failure, ReceiverLedger};
use crate::ids::{PeerId, SlotIndex, WriteTag};
use crate::slots::Landing;
use crate::time::Instant;

/// What the fabric found when a write's bytes were in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChecksumCheck {
    /// The write carried no checksum (a sender with checksums off, or, over RDMA, a write
    /// whose frame did not come in time).
    Absent,
    /// The landed bytes match the checksum the sender computed.
    Match,
    /// They do not: the bytes changed between the sender's staging and this buffer.
    Mismatch {
        /// The checksum the write carried.
        carried: u32,
        /// The checksum of the bytes that landed.
        computed: u32,
    },
}

/// One write the fabric applied: who wrote (the control peer its connection authenticated
/// as), where, with which immediate, how many bytes, and how its checksum compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LandedWrite {
    /// The control peer the writing connection authenticated as (never what the write
    /// claims).
    pub peer: PeerId,
    /// The slot the bytes went into.
    pub slot: SlotIndex,
    /// The write's immediate, decoded (`WriteTag::from_imm`).
    pub tag: WriteTag,
    /// Bytes written, as the fabric counted them landing; anything but the chunk's declared
    /// length (0 included) fails the grant holder's request.
    pub bytes: u64,
    /// How the carried checksum compared with the landed bytes.
    pub checksum: ChecksumCheck,
}

/// What the ledger made of a landed write (drivers count and log refusals).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LandingVerdict {
    /// A chunk of a live request landed whole.
    Accepted,
    /// A late write of a rolled-back grant: its quarantined slot is free again.
    QuarantineCleared,
    /// A duplicate, or a write for a grant that is no longer current: ignored.
    Stale,
    /// Not this peer's grant, or not the slot the immediate names: ignored, never announced.
    Refused(String),
    /// The grant holder's write arrived empty, not of its chunk's length, or corrupt: its
    /// request failed.
    Corrupt(String),
}

impl fmt::Display for ChecksumCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChecksumCheck::Absent => f.write_str("no checksum"),
            ChecksumCheck::Match => f.write_str("checksum matches"),
            ChecksumCheck::Mismatch { carried, computed } => write!(
                f,
                "checksum mismatch (the sender computed {carried:08x}, the landed bytes give {computed:08x})"
            ),
        }
    }
}

impl ReceiverLedger {
    /// A write landed in the exposed buffer (`w.tag` is its immediate).
    pub fn handle_chunk_landed(&mut self, now: Instant, w: LandedWrite) -> LandingVerdict {
        if w.tag.slot != w.slot {
            self.stats.refused_landings += 1;
            return LandingVerdict::Refused(format!(
                "the immediate names slot {} but {} wrote slot {}",
                w.tag.slot.0, w.peer, w.slot.0
            ));
        }
        match self.slots.land(w.tag, w.peer) {
            Landing::Current { owner } => {
                let key = self
                    .tickets
                    .get(&owner)
                    .cloned()
                    .expect("invariant: a granted slot's owner is tracked");
                if let Some(why) = self.integrity_problem(&key, &w) {
                    self.stats.corrupt_chunks += 1;
                    // The write arrived, so nothing more can land in that slot: the failure
                    // frees it; the request's other granted slots go to quarantine.
                    self.fail(now, &key, Failure::Integrity(why.clone()), false);
                    return LandingVerdict::Corrupt(why);
                }
                let req = self
                    .requests
                    .get_mut(&key)
                    .expect("invariant: ticket maps to a request");
                req.landed += 1;
                let (ticket, notices) = (req.ticket, req.notices);
                self.touch(&key, now);
                self.stall_progress(ticket, notices, now);
                self.maybe_ready(now, &key);
                LandingVerdict::Accepted
            }
            Landing::QuarantineCleared => {
                match self.cfg.placement {
                    // A slot came back: the head of the admission queue may fit now.
                    crate::config::Placement::Pool => {
                        self.admission.unpin(self.principals.share_key(w.peer), 1);
                        self.drain_admitted(now);
                    }
                    // Its reservation may go back to the application now.
                    crate::config::Placement::Caller => self.placed_slot_back(w.slot),
                }
                LandingVerdict::QuarantineCleared
            }
            Landing::Stale => {
                self.stats.stale_landings += 1;
                LandingVerdict::Stale
            }
            Landing::Forged => {
                self.stats.refused_landings += 1;
                LandingVerdict::Refused(format!(
                    "{} wrote slot {} under a grant it does not hold",
                    w.peer, w.slot.0
                ))
            }
        }
    }

    /// Why the grant holder's own write cannot be handed to the decoder, if it cannot.
    fn integrity_problem(&self, key: &crate::ids::ReqKey, w: &LandedWrite) -> Option<String> {
        let req = &self.requests[key];
        let index = req.slots.iter().position(|t| t.slot == w.slot);
        let chunk = index.map_or_else(|| "?".to_owned(), |i| i.to_string());
        let what = format!("chunk {chunk} of request {key} (slot {})", w.slot.0);
        if w.bytes == 0 {
            return Some(format!("{what} landed with no bytes"));
        }
        let declared = index.and_then(|i| req.bytes[i]);
        if let Some(declared) = declared {
            if w.bytes != declared {
                // A short write leaves the rest of the slot as the previous request left it;
                // a long one is not the chunk its batch described. Either way the decoder
                // would read bytes the sender never sent as this chunk.
                return Some(format!(
                    "{what} landed {} bytes but its batch declared {declared}: a chunk \
                     counts only whole",
                    w.bytes
                ));
            }
        }
        match w.checksum {
            ChecksumCheck::Mismatch { .. } => Some(format!("{what}: {}", w.checksum)),
            ChecksumCheck::Absent if self.cfg.require_checksums && req.notices => Some(format!(
                "{what} carried no checksum and this receiver requires them \
                 (turn checksums on at the sender, or set require_checksums = false here)"
            )),
            _ => None,
        }
    }
}
