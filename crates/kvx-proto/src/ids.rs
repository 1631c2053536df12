//! Newtype ids. Bare integers never cross an API boundary, so a slot index cannot be
//! passed where a staging slot or a peer is meant.

use std::fmt;

/// A peer as the local transport names it (a ZMQ routing identity mapped to a number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerId(pub u64);

/// Who stands behind a control peer, for fair shares (`docs/spec/protocol.md` §Principals):
/// the client's public key when the control channel authenticates it (CURVE), else the
/// address it connects from. Peers of one principal share one share, so extra identities buy
/// nothing. The transport makes it from those bytes with a keyed hash (an attacker cannot
/// aim at another principal's value); 63 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Principal(u64);

impl Principal {
    /// A principal from a transport's 64-bit keyed hash of what identifies it (the top bit
    /// is dropped: `share_key` uses it).
    pub fn new(hash: u64) -> Self {
        Self(hash & !(1 << 63))
    }

    /// The key admission counts the principal's share under. Peers a transport names are
    /// counters well below 2⁶³, and an unbound peer counts under its own id, so the top bit
    /// keeps the two apart.
    pub fn share_key(self) -> PeerId {
        PeerId(self.0 | 1 << 63)
    }
}

/// The proxy's request id, as it travels on the wire.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReqId(pub String);

/// A slot of a receiver's staging buffer (LMCache's page index, `remote_indexes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotIndex(pub u32);

/// A slot of a sender's staging pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StagingSlot(pub u32);

/// One posted one-sided write, unique per sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WriteId(pub u64);

/// A receiver's handle on one admission (one request's reservation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(pub u64);

/// Requests are keyed by (sender, req_id) on the receiver, so two senders that reuse an id
/// never merge (`docs/spec/protocol.md` §Identity).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReqKey {
    /// The control peer the request's messages came from.
    pub peer: PeerId,
    /// The id that peer gave the request.
    pub req_id: ReqId,
}

impl From<&str> for ReqId {
    fn from(s: &str) -> Self {
        ReqId(s.to_owned())
    }
}

impl fmt::Display for ReqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer{}", self.0)
    }
}

impl fmt::Display for ReqKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.peer, self.req_id)
    }
}

/// What a write's immediate value carries: the slot and the generation of its grant, so the
/// receiver learns which grant a landed write belongs to and can tell a late write apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WriteTag {
    /// The receiver slot written; below `SLOTS_MAX`, or `to_imm` corrupts the generation.
    pub slot: SlotIndex,
    /// The slot's grant count when it was handed out; only its low 12 bits travel.
    pub generation: u32,
}

impl WriteTag {
    /// Slots use the low 20 bits of the 32-bit immediate; generations wrap in the high 12.
    pub const SLOT_BITS: u32 = 20;
    /// Slots an immediate can name; `ReceiverConfig::buffer_slots` may not exceed it.
    pub const SLOTS_MAX: u32 = 1 << Self::SLOT_BITS;
    const GEN_MASK: u32 = (1 << (32 - Self::SLOT_BITS)) - 1;

    /// Packs into a verbs-style 32-bit immediate value.
    pub fn to_imm(self) -> u32 {
        ((self.generation & Self::GEN_MASK) << Self::SLOT_BITS) | self.slot.0
    }

    /// Unpacks an immediate; the generation comes back modulo 2^12.
    pub fn from_imm(imm: u32) -> Self {
        WriteTag {
            slot: SlotIndex(imm & (Self::SLOTS_MAX - 1)),
            generation: imm >> Self::SLOT_BITS,
        }
    }

    /// Compares generations the way they survive the immediate (modulo 2^12).
    pub fn same_grant(self, other: WriteTag) -> bool {
        self.slot == other.slot
            && (self.generation & Self::GEN_MASK) == (other.generation & Self::GEN_MASK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imm_round_trips_slot_and_wrapped_generation() {
        let tag = WriteTag {
            slot: SlotIndex(0xABCDE),
            generation: 0x1234_5678,
        };
        let back = WriteTag::from_imm(tag.to_imm());
        assert_eq!(back.slot, tag.slot);
        assert!(back.same_grant(tag));
        assert!(!back.same_grant(WriteTag {
            generation: tag.generation + 1,
            ..tag
        }));
    }
}
