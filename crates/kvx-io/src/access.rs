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
//!
//! **No write outlives its grant.** A write's bytes may take a while to arrive (over TCP they
//! follow their header, piece by piece). Admission is not a licence for the rest of them:
//! every piece goes into the slot through `land`, which runs it under the slot's cell lock and
//! only while the grant that admitted the write is still the slot's current one. `apply`, which
//! revokes or replaces a grant, takes the same lock. So once the driver has mirrored a
//! revocation (cancel, timeout, quarantine expiry, peer loss) — which it does before it sends
//! the reply that grants the slot again — no byte of an earlier write can reach the slot: a
//! piece already being copied finishes first, every later one is refused (`Revoked`), and the
//! fabric reads the rest of that write past. Nothing has to wait for a hostile peer to finish
//! or stop its write before the slot is reused.

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
    /// The grant that admitted the write was revoked or replaced before this piece of its
    /// bytes arrived: they are read past, and the slot keeps its new holder's bytes.
    Revoked {
        /// The peer the connection authenticated as.
        peer: PeerId,
        /// The slot written.
        slot: u32,
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
            WriteRefusal::Revoked { peer, slot } => write!(
                f,
                "{peer} was still writing slot {slot} after its grant was revoked"
            ),
        }
    }
}

/// A write `FabricAccess::admit` let through: the grant it names, and which mirror of that
/// grant admitted it, so that `FabricAccess::land` can tell when the grant is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmittedWrite {
    /// The grant the write lands under (its immediate, as announced).
    pub tag: WriteTag,
    peer: PeerId,
    /// The slot's `Cell::epoch` at admission.
    epoch: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Cell {
    /// Counts every change mirrored into this slot: a write admitted under one epoch may land
    /// bytes only while the epoch is still the same.
    epoch: u64,
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
    /// Once it returns, no byte of a write admitted under the slot's previous grant can land
    /// (`land`).
    pub fn apply(&self, change: GrantChange) {
        if let Some(cell) = self.cells.get(change.slot.0 as usize) {
            let mut cell = lock(cell);
            *cell = Cell {
                epoch: cell.epoch.wrapping_add(1),
                grant: change.grant,
                written: false,
                standing: false,
            };
        }
    }

    /// Whether a write of `len` bytes into `slot` with immediate `imm`, arriving on a
    /// connection of `peer`, may land. An admitted write closes its grant; its bytes then go
    /// into the slot through `land`, which stops them once the grant is revoked. A refusal
    /// is counted (`refused`).
    pub fn admit(
        &self,
        peer: PeerId,
        slot: u32,
        len: u64,
        imm: Option<u32>,
    ) -> Result<AdmittedWrite, WriteRefusal> {
        let result = self.check(peer, slot, len, imm);
        if result.is_err() {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    /// Runs `f` — which puts (some of) an admitted write's bytes into its slot — under the
    /// slot's cell lock, if the grant that admitted the write is still the slot's current
    /// one; refuses (`Revoked`, counted) once it was revoked or replaced. A fabric that lands
    /// bytes itself (TCP, shared memory, in memory) puts every byte in through here, so a
    /// revocation mirrored by `apply` cannot be outrun by a write in flight.
    pub fn land<R>(&self, write: &AdmittedWrite, f: impl FnOnce() -> R) -> Result<R, WriteRefusal> {
        let slot = write.tag.slot.0;
        let cell = self
            .cells
            .get(slot as usize)
            .ok_or(WriteRefusal::OutOfRange { slot })?;
        let cell = lock(cell);
        if cell.epoch != write.epoch {
            drop(cell);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(WriteRefusal::Revoked {
                peer: write.peer,
                slot,
            });
        }
        Ok(f())
    }

    fn check(
        &self,
        peer: PeerId,
        slot: u32,
        len: u64,
        imm: Option<u32>,
    ) -> Result<AdmittedWrite, WriteRefusal> {
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
        let admitted = AdmittedWrite {
            tag,
            peer,
            epoch: cell.epoch,
        };
        if cell.standing {
            return Ok(admitted);
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
        Ok(admitted)
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
            let mut cell = lock(cell);
            *cell = Cell {
                epoch: cell.epoch.wrapping_add(1),
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

    #[test]
    fn no_byte_of_a_write_lands_once_its_grant_is_revoked() {
        let a = FabricAccess::new(1, [0; 16]);
        let (p, q) = (PeerId(1), PeerId(2));
        a.grant(0, p, 1);
        let w = a.admit(p, 0, 8, imm(0, 1)).expect("admitted");
        assert_eq!(a.land(&w, || 1), Ok(1), "a piece while the grant stands");
        assert_eq!(a.land(&w, || 2), Ok(2), "and the next");
        // Revoked (a cancel, a timeout, a quarantine's end), then granted to another peer.
        a.apply(GrantChange {
            slot: SlotIndex(0),
            grant: None,
        });
        assert_eq!(
            a.land(&w, || unreachable!("no piece after the revocation")),
            Err(WriteRefusal::Revoked { peer: p, slot: 0 })
        );
        a.grant(0, q, 2);
        let v = a.admit(q, 0, 8, imm(0, 2)).expect("the new holder's write");
        assert_eq!(a.land(&v, || 3), Ok(3));
        assert!(
            a.land(&w, || ()).is_err(),
            "nor after the slot was granted again"
        );
        // Granted back to the same peer under a new generation: the old write stays cut off.
        a.grant(0, p, 3);
        assert!(a.land(&w, || ()).is_err());
        assert_eq!(a.refused(), 3, "each cut-off piece is counted");
        // A standing grant (the fabric bench) lands every piece of every write.
        a.grant_standing(0, p);
        let s = a.admit(p, 0, 8, imm(0, 9)).expect("standing");
        for _ in 0..3 {
            assert!(a.land(&s, || ()).is_ok());
        }
    }
}
