//! Who may write where in an exposed buffer (`docs/spec/fabrics.md` §Access).
//!
//! A receiver's ledger decides which control peer holds each slot's current grant; the
//! fabric must make that decision stick for bytes that arrive on a *different* socket. Two
//! pieces do it:
//! - **Credentials** tie a fabric connection to a control peer. The receiver hands each kvx
//!   sender a `FabricCredential` in its replies (`AllocResponse::fabric_credential`): the
//!   peer's id and a keyed MAC of it under a random key of this buffer. The sender presents
//!   it when it attaches; a connection whose credential does not verify is refused, so no
//!   connection can act for a peer whose replies it never read.
//! - **The grant mirror**: the ledger's grants (`ReceiverLedger::poll_grant_change`), copied
//!   here before the reply that hands them out is sent. `admit` lets a write through only if
//!   its connection's peer holds the slot's current grant, its immediate names that slot and
//!   generation, it carries exactly the chunk's declared length (`SlotGrant::bytes`), and no
//!   other write of that grant came before it. The TCP
//!   and shared-memory fabrics call it before a byte touches the slot; RDMA, where the NIC
//!   writes first, calls it before announcing the write.
//!
//! The first write of a grant closes it: a grant admits one write. So at most one landing
//! notice per grant is ever announced, which bounds the notice channel by the buffer's size.

use std::fmt;
use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use kvx_proto::slots::{GrantChange, SlotGrant};
use kvx_proto::{PeerId, SlotIndex, WriteTag};
use siphasher::sip128::{Hasher128, SipHasher24};

/// What a sender presents to attach its fabric connection: the control peer it is, and the
/// receiver's MAC of that. Not a secret beyond the control channel it was sent on.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FabricCredential {
    /// The control peer the connection acts for.
    pub peer: PeerId,
    /// The receiver's MAC of `peer` under its buffer's key.
    pub tag: [u8; 16],
}

impl FabricCredential {
    /// Bytes on a fabric's wire.
    pub const LEN: usize = 24;

    /// The wire form: `peer` little-endian, then `tag`.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.peer.0.to_le_bytes());
        b[8..].copy_from_slice(&self.tag);
        b
    }

    /// Reads the wire form; any bytes make a credential (`FabricAccess::authenticate`
    /// decides whether it is worth anything).
    pub fn from_bytes(b: &[u8; Self::LEN]) -> Self {
        let mut peer = [0u8; 8];
        peer.copy_from_slice(&b[..8]);
        let mut tag = [0u8; 16];
        tag.copy_from_slice(&b[8..]);
        Self {
            peer: PeerId(u64::from_le_bytes(peer)),
            tag,
        }
    }

    /// The text form carried in `AllocResponse::fabric_credential`: 48 hex digits.
    pub fn to_text(&self) -> String {
        self.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses the text form; `None` for anything else.
    pub fn from_text(s: &str) -> Option<Self> {
        if s.len() != 2 * Self::LEN || !s.is_ascii() {
            return None;
        }
        let mut b = [0u8; Self::LEN];
        for (i, byte) in b.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Self::from_bytes(&b))
    }
}

impl fmt::Debug for FabricCredential {
    /// The tag is left out: logs are read by more people than the control channel.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FabricCredential({})", self.peer)
    }
}

/// Why `FabricAccess::admit` refused a write. Its text names what was wrong, never the
/// payload, so logging it cannot amplify an attacker's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteRefusal {
    /// The write carries no immediate, so it names no grant.
    NoImmediate {
        /// The slot written.
        slot: u32,
    },
    /// The immediate names another slot than the one written.
    SlotMismatch {
        /// The slot written.
        slot: u32,
        /// The slot the immediate names.
        named: u32,
    },
    /// No bytes: nothing would land.
    Empty {
        /// The slot written.
        slot: u32,
    },
    /// Outside the buffer.
    OutOfRange {
        /// The slot written.
        slot: u32,
    },
    /// The slot is not granted to anyone now.
    NotGranted {
        /// The peer the connection authenticated as.
        peer: PeerId,
        /// The slot written.
        slot: u32,
    },
    /// The slot is granted, to another peer.
    NotHolder {
        /// The peer the connection authenticated as.
        peer: PeerId,
        /// The slot written.
        slot: u32,
    },
    /// The immediate names an older (or a future) grant of the slot.
    StaleGrant {
        /// The peer the connection authenticated as.
        peer: PeerId,
        /// The slot written.
        slot: u32,
    },
    /// The grant was already written once.
    AlreadyWritten {
        /// The peer the connection authenticated as.
        peer: PeerId,
        /// The slot written.
        slot: u32,
    },
    /// The write's length is not the chunk's, as its batch declared it: a short write would
    /// leave the previous request's bytes in the rest of the slot, a long one is not the
    /// chunk, and two halves are two writes of one grant.
    WrongLength {
        /// The peer the connection authenticated as.
        peer: PeerId,
        /// The slot written.
        slot: u32,
        /// Bytes the write brings.
        len: u64,
        /// Bytes the chunk's batch declared.
        declared: u64,
    },
}

impl fmt::Display for WriteRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WriteRefusal::NoImmediate { slot } => {
                write!(f, "a write into slot {slot} names no grant (no immediate)")
            }
            WriteRefusal::SlotMismatch { slot, named } => {
                write!(f, "a write into slot {slot} names slot {named}")
            }
            WriteRefusal::Empty { slot } => write!(f, "a write into slot {slot} has no bytes"),
            WriteRefusal::OutOfRange { slot } => write!(f, "slot {slot} is outside the buffer"),
            WriteRefusal::NotGranted { peer, slot } => {
                write!(f, "{peer} wrote slot {slot}, which is granted to nobody")
            }
            WriteRefusal::NotHolder { peer, slot } => {
                write!(
                    f,
                    "{peer} wrote slot {slot}, which is granted to another peer"
                )
            }
            WriteRefusal::StaleGrant { peer, slot } => {
                write!(
                    f,
                    "{peer} wrote slot {slot} under a grant that is not current"
                )
            }
            WriteRefusal::AlreadyWritten { peer, slot } => {
                write!(f, "{peer} wrote slot {slot} twice under one grant")
            }
            WriteRefusal::WrongLength {
                peer,
                slot,
                len,
                declared,
            } => write!(
                f,
                "{peer} wrote {len} bytes into slot {slot}, whose chunk is {declared} bytes"
            ),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Cell {
    grant: Option<SlotGrant>,
    /// A write of this grant was admitted.
    written: bool,
    /// `grant_standing`: every write of the grant's peer is admitted.
    standing: bool,
}

/// The exposed buffer's access rules, shared by the receiver's driver (which mirrors the
/// ledger's grants into it) and the fabric's connection tasks (which check every write).
pub struct FabricAccess {
    key: (u64, u64),
    cells: Vec<Mutex<Cell>>,
    refused: AtomicU64,
}

impl fmt::Debug for FabricAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FabricAccess")
            .field("slots", &self.cells.len())
            .field("refused", &self.refused())
            .finish_non_exhaustive()
    }
}

impl FabricAccess {
    /// A buffer of `slots` slots, nothing granted, credentials keyed by `key` (every fabric
    /// but the simulation's takes it from the OS: `with_random_key`).
    pub fn new(slots: u32, key: [u8; 16]) -> Self {
        let mut k0 = [0u8; 8];
        let mut k1 = [0u8; 8];
        k0.copy_from_slice(&key[..8]);
        k1.copy_from_slice(&key[8..]);
        Self {
            key: (u64::from_le_bytes(k0), u64::from_le_bytes(k1)),
            cells: (0..slots).map(|_| Mutex::new(Cell::default())).collect(),
            refused: AtomicU64::new(0),
        }
    }

    /// As `new`, with 128 random bits from the operating system.
    pub fn with_random_key(slots: u32) -> Result<Self, crate::FabricError> {
        let mut key = [0u8; 16];
        getrandom::fill(&mut key).map_err(|e| {
            crate::FabricError::Allocation(format!("no randomness for the buffer's key: {e}"))
        })?;
        Ok(Self::new(slots, key))
    }

    /// Slots in the buffer.
    pub fn slots(&self) -> u32 {
        self.cells.len() as u32
    }

    /// The credential the receiver gives `peer` (deterministic: the same for every reply).
    pub fn credential_for(&self, peer: PeerId) -> FabricCredential {
        FabricCredential {
            peer,
            tag: self.mac(peer),
        }
    }

    /// The peer a presented credential stands for, if it was issued by this buffer.
    pub fn authenticate(&self, credential: &FabricCredential) -> Option<PeerId> {
        let expected = self.mac(credential.peer);
        // Compared without an early exit, so the time taken says nothing of how many leading
        // bytes were right (a network peer could otherwise guess a tag byte by byte).
        let diff = expected
            .iter()
            .zip(credential.tag.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        (diff == 0).then_some(credential.peer)
    }

    fn mac(&self, peer: PeerId) -> [u8; 16] {
        let mut h = SipHasher24::new_with_keys(self.key.0, self.key.1);
        h.write(b"kvx fabric credential v1");
        h.write(&peer.0.to_le_bytes());
        h.finish128().as_bytes()
    }

    /// Mirrors one change of the ledger's grants.
    pub fn apply(&self, change: GrantChange) {
        if let Some(cell) = self.cells.get(change.slot.0 as usize) {
            *lock(cell) = Cell {
                grant: change.grant,
                written: false,
                standing: false,
            };
        }
    }

    /// Whether a write of `len` bytes into `slot` with immediate `imm`, arriving on a
    /// connection of `peer`, may land. An admitted write closes its grant. A refusal is
    /// counted (`refused`).
    pub fn admit(
        &self,
        peer: PeerId,
        slot: u32,
        len: u64,
        imm: Option<u32>,
    ) -> Result<WriteTag, WriteRefusal> {
        let result = self.check(peer, slot, len, imm);
        if result.is_err() {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    fn check(
        &self,
        peer: PeerId,
        slot: u32,
        len: u64,
        imm: Option<u32>,
    ) -> Result<WriteTag, WriteRefusal> {
        let Some(imm) = imm else {
            return Err(WriteRefusal::NoImmediate { slot });
        };
        let tag = WriteTag::from_imm(imm);
        if tag.slot.0 != slot {
            return Err(WriteRefusal::SlotMismatch {
                slot,
                named: tag.slot.0,
            });
        }
        if len == 0 {
            return Err(WriteRefusal::Empty { slot });
        }
        let Some(cell) = self.cells.get(slot as usize) else {
            return Err(WriteRefusal::OutOfRange { slot });
        };
        let mut cell = lock(cell);
        let Some(grant) = cell.grant else {
            return Err(WriteRefusal::NotGranted { peer, slot });
        };
        if grant.peer != peer {
            return Err(WriteRefusal::NotHolder { peer, slot });
        }
        if cell.standing {
            return Ok(tag);
        }
        let current = WriteTag {
            slot: SlotIndex(slot),
            generation: grant.generation,
        };
        if !current.same_grant(tag) {
            return Err(WriteRefusal::StaleGrant { peer, slot });
        }
        if cell.written {
            return Err(WriteRefusal::AlreadyWritten { peer, slot });
        }
        if let Some(declared) = grant.bytes.filter(|&d| d != len) {
            return Err(WriteRefusal::WrongLength {
                peer,
                slot,
                len,
                declared,
            });
        }
        cell.written = true;
        Ok(tag)
    }

    /// Writes refused since the buffer was exposed.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Grants `slot` to `peer` under `generation` for a write of any length (tests, benches
    /// and tools that drive a fabric without a receiver ledger; a ledger's grants name the
    /// chunk's length).
    pub fn grant(&self, slot: u32, peer: PeerId, generation: u32) {
        self.apply(GrantChange {
            slot: SlotIndex(slot),
            grant: Some(SlotGrant {
                peer,
                generation,
                bytes: None,
            }),
        });
    }

    /// Lets `peer` write `slot` as often as it likes, under any generation: for a fabric
    /// benchmark (`kvx bench`), which streams writes with no ledger to re-grant each one. A
    /// receiver never uses it; the one-write rule, and so the bound on landing notices, do
    /// not hold for such a slot.
    pub fn grant_standing(&self, slot: u32, peer: PeerId) {
        if let Some(cell) = self.cells.get(slot as usize) {
            *lock(cell) = Cell {
                grant: Some(SlotGrant {
                    peer,
                    generation: 0,
                    bytes: None,
                }),
                written: false,
                standing: true,
            };
        }
    }
}

fn lock(m: &Mutex<Cell>) -> MutexGuard<'_, Cell> {
    m.lock().unwrap_or_else(|poison| poison.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn imm(slot: u32, generation: u32) -> Option<u32> {
        Some(
            WriteTag {
                slot: SlotIndex(slot),
                generation,
            }
            .to_imm(),
        )
    }

    #[test]
    fn credentials_verify_only_with_the_issuing_key() {
        let a = FabricAccess::new(1, [1; 16]);
        let b = FabricAccess::new(1, [2; 16]);
        let c = a.credential_for(PeerId(7));
        assert_eq!(a.authenticate(&c), Some(PeerId(7)));
        assert_eq!(b.authenticate(&c), None, "another buffer's key");
        let forged = FabricCredential {
            peer: PeerId(8),
            tag: c.tag,
        };
        assert_eq!(a.authenticate(&forged), None, "another peer's id");
        let mut flipped = c;
        flipped.tag[15] ^= 1;
        assert_eq!(a.authenticate(&flipped), None);
        assert_eq!(FabricCredential::from_text(&c.to_text()), Some(c));
        assert_eq!(FabricCredential::from_text("zz"), None);
        assert_eq!(
            format!("{c:?}"),
            "FabricCredential(peer7)",
            "no tag in logs"
        );
    }

    #[test]
    fn only_the_holder_of_the_current_grant_writes_and_only_once() {
        let a = FabricAccess::new(2, [0; 16]);
        let (p, q) = (PeerId(1), PeerId(2));
        assert_eq!(
            a.admit(p, 0, 8, imm(0, 1)),
            Err(WriteRefusal::NotGranted { peer: p, slot: 0 })
        );
        a.grant(0, p, 1);
        assert_eq!(
            a.admit(q, 0, 8, imm(0, 1)),
            Err(WriteRefusal::NotHolder { peer: q, slot: 0 })
        );
        assert_eq!(
            a.admit(p, 0, 8, imm(0, 2)),
            Err(WriteRefusal::StaleGrant { peer: p, slot: 0 })
        );
        assert_eq!(
            a.admit(p, 0, 8, imm(1, 1)),
            Err(WriteRefusal::SlotMismatch { slot: 0, named: 1 })
        );
        assert_eq!(
            a.admit(p, 0, 0, imm(0, 1)),
            Err(WriteRefusal::Empty { slot: 0 })
        );
        assert_eq!(
            a.admit(p, 0, 8, None),
            Err(WriteRefusal::NoImmediate { slot: 0 })
        );
        assert!(a.admit(p, 0, 8, imm(0, 1)).is_ok());
        assert_eq!(
            a.admit(p, 0, 8, imm(0, 1)),
            Err(WriteRefusal::AlreadyWritten { peer: p, slot: 0 })
        );
        assert_eq!(a.refused(), 7);
        // A new grant opens the slot again, to its new holder only.
        a.grant(0, q, 2);
        assert!(a.admit(p, 0, 8, imm(0, 2)).is_err());
        assert!(a.admit(q, 0, 8, imm(0, 2)).is_ok());
    }

    #[test]
    fn a_grant_with_a_declared_length_admits_that_length_only() {
        let a = FabricAccess::new(1, [0; 16]);
        let p = PeerId(1);
        a.apply(GrantChange {
            slot: SlotIndex(0),
            grant: Some(SlotGrant {
                peer: p,
                generation: 1,
                bytes: Some(64),
            }),
        });
        for len in [1, 32, 63, 65, 128] {
            assert_eq!(
                a.admit(p, 0, len, imm(0, 1)),
                Err(WriteRefusal::WrongLength {
                    peer: p,
                    slot: 0,
                    len,
                    declared: 64
                })
            );
        }
        // A refused write does not close the grant; the whole chunk still lands, once.
        assert!(a.admit(p, 0, 64, imm(0, 1)).is_ok());
        assert_eq!(
            a.admit(p, 0, 32, imm(0, 1)),
            Err(WriteRefusal::AlreadyWritten { peer: p, slot: 0 })
        );
        assert_eq!(a.refused(), 6);
    }
}
