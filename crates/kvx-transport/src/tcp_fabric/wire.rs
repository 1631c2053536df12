//! The byte layout of the fabric connections (`docs/spec/fabrics.md` §Wire format).
//!
//! Both fabrics speak it: `TcpFabric` streams each write's payload right behind its header,
//! `ShmFabric` sends the header alone (the receiver copies the payload out of the sender's
//! shared staging). Every
//! integer is little-endian; every frame has a fixed size, so a reader never allocates and
//! never trusts a length it has not bounded.

use kvx_io::{FabricCredential, PostWrite};

/// The protocol version both sides must speak. Version 2 added the credential to the hello,
/// the checksum to the write header and the refusal statuses; version 3, runs (`FLAG_RUN`).
pub(crate) const VERSION: u16 = 3;
/// The versions a receiver serves: version 2 differs from 3 only in having no runs, which a
/// version-2 sender never sends, so receivers can be upgraded before their senders. (A
/// version-2 receiver refuses a version-3 sender: it would drop the connection at its first
/// run.)
pub(crate) const ACCEPTED_VERSIONS: [u16; 2] = [2, VERSION];
/// First bytes of a `TcpFabric` connection.
pub(crate) const TCP_MAGIC: [u8; 4] = *b"KVXT";
/// First bytes of a `ShmFabric` control connection (so a TCP sender cannot talk to it).
pub(crate) const SHM_MAGIC: [u8; 4] = *b"KVXS";

/// A hello's fixed first part, the same in every version (so a receiver can read the
/// version of any sender and answer it), then the version-2 rest.
pub(crate) const HELLO_BASE_LEN: usize = 32;
pub(crate) const HELLO_LEN: usize = 64;
pub(crate) const WELCOME_LEN: usize = 32;
pub(crate) const HEADER_LEN: usize = 40;
pub(crate) const ACK_LEN: usize = 16;
/// The most trailing bytes a `Hello` or `Welcome` may announce.
pub(crate) const WELCOME_EXTRA_MAX: u32 = 4096;

/// Header flag: the write carries an immediate value.
pub(crate) const FLAG_IMM: u32 = 1;
/// Header flag: the write carries its chunk's checksum (`kvx_io::chunk_checksum`) at offset 28.
pub(crate) const FLAG_CHECKSUM: u32 = 2;
/// Header flag: the next header is the next piece of the same write, a run
/// (`kvx_io::WriteRun`); the payloads of all the run's pieces follow its last header, in
/// piece order (`TcpFabric` only: shared-memory writes carry no payload and no runs).
pub(crate) const FLAG_RUN: u32 = 4;
/// Every flag this version knows; a header with another bit set ends the connection.
pub(crate) const FLAGS_KNOWN: u32 = FLAG_IMM | FLAG_CHECKSUM | FLAG_RUN;

/// Why a receiver refused a connection (`Welcome::status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WelcomeStatus {
    Ok,
    /// The sender speaks another protocol version.
    Version,
    /// The sender's staging slots are not as large as the receiver's slots.
    Geometry,
    /// `ShmFabric`: the hello's ticket names no staging this peer handed over with the
    /// hello's geometry (the descriptor's own checks answer over the handoff socket).
    Staging,
    /// A fence: the named connection did not stop within the receiver's fence timeout.
    FenceTimeout,
    /// The hello's credential was not issued by this buffer, or a fence names a connection
    /// of another peer.
    Unauthorized,
    /// A status this version does not know.
    Unknown(u16),
}

impl WelcomeStatus {
    fn code(self) -> u16 {
        match self {
            WelcomeStatus::Ok => 0,
            WelcomeStatus::Version => 1,
            WelcomeStatus::Geometry => 2,
            WelcomeStatus::FenceTimeout => 3,
            WelcomeStatus::Unauthorized => 4,
            WelcomeStatus::Staging => 5,
            WelcomeStatus::Unknown(c) => c,
        }
    }

    fn from_code(c: u16) -> Self {
        match c {
            0 => WelcomeStatus::Ok,
            1 => WelcomeStatus::Version,
            2 => WelcomeStatus::Geometry,
            3 => WelcomeStatus::FenceTimeout,
            4 => WelcomeStatus::Unauthorized,
            5 => WelcomeStatus::Staging,
            c => WelcomeStatus::Unknown(c),
        }
    }
}

/// What a connection is for (`Hello::kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HelloKind {
    /// A sender attaching its staging: writes follow.
    Attach,
    /// A sender asking the receiver to stop applying one of its earlier connections
    /// (`Hello::conn`) and to say when it has.
    Fence,
    /// A kind this version does not know.
    Unknown(u16),
}

impl HelloKind {
    fn code(self) -> u16 {
        match self {
            HelloKind::Attach => 0,
            HelloKind::Fence => 1,
            HelloKind::Unknown(c) => c,
        }
    }

    fn from_code(c: u16) -> Self {
        match c {
            0 => HelloKind::Attach,
            1 => HelloKind::Fence,
            c => HelloKind::Unknown(c),
        }
    }
}

/// Sender → receiver, the first frame: what the connection is for, and what the sender's
/// staging looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub magic: [u8; 4],
    pub version: u16,
    pub kind: HelloKind,
    pub staging_slots: u32,
    pub staging_slot_bytes: u64,
    /// `Fence`: the connection to stop (its `Welcome::conn`); `Attach`: zero.
    pub conn: u64,
    /// Whose connection this is (the control peer the receiver issued it to).
    pub credential: FabricCredential,
    /// Bytes that follow the hello (`ShmFabric`: the 8-byte ticket of the sender's staging
    /// handoff; at most `WELCOME_EXTRA_MAX`).
    pub extra_len: u32,
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[32..56].copy_from_slice(&self.credential.to_bytes());
        // 56..64 reserved, zero.
        b[0..4].copy_from_slice(&self.magic);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.kind.code().to_le_bytes());
        b[8..12].copy_from_slice(&self.staging_slots.to_le_bytes());
        b[12..16].copy_from_slice(&self.extra_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.staging_slot_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.conn.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HELLO_LEN]) -> Self {
        let mut credential = [0u8; FabricCredential::LEN];
        credential.copy_from_slice(&b[32..56]);
        Hello {
            credential: FabricCredential::from_bytes(&credential),
            ..Self::decode_base(b)
        }
    }

    /// The version-independent first `HELLO_BASE_LEN` bytes (no credential).
    pub(crate) fn decode_base(b: &[u8]) -> Self {
        Hello {
            magic: [b[0], b[1], b[2], b[3]],
            version: u16::from_le_bytes([b[4], b[5]]),
            kind: HelloKind::from_code(u16::from_le_bytes([b[6], b[7]])),
            staging_slots: u32_at(b, 8),
            staging_slot_bytes: u64_at(b, 16),
            conn: u64_at(b, 24),
            credential: FabricCredential {
                peer: kvx_proto::PeerId(0),
                tag: [0; 16],
            },
            extra_len: u32_at(b, 12),
        }
    }
}

/// Receiver → sender, the answer to `Hello`: the buffer's geometry and the connection's id,
/// then `extra_len` bytes (none in this version). The answer to a fence names
/// the fenced connection and carries no geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Welcome {
    pub magic: [u8; 4],
    pub version: u16,
    pub status: WelcomeStatus,
    pub slots: u32,
    pub extra_len: u32,
    pub slot_bytes: u64,
    pub conn: u64,
}

impl Welcome {
    pub(crate) fn encode(&self) -> [u8; WELCOME_LEN] {
        let mut b = [0u8; WELCOME_LEN];
        b[0..4].copy_from_slice(&self.magic);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.status.code().to_le_bytes());
        b[8..12].copy_from_slice(&self.slots.to_le_bytes());
        b[12..16].copy_from_slice(&self.extra_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.slot_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.conn.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; WELCOME_LEN]) -> Self {
        Welcome {
            magic: [b[0], b[1], b[2], b[3]],
            version: u16::from_le_bytes([b[4], b[5]]),
            status: WelcomeStatus::from_code(u16::from_le_bytes([b[6], b[7]])),
            slots: u32_at(b, 8),
            extra_len: u32_at(b, 12),
            slot_bytes: u64_at(b, 16),
            conn: u64_at(b, 24),
        }
    }
}

/// Sender → receiver, one per posted write; over TCP, `len` payload bytes follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WriteHeader {
    pub id: u64,
    pub remote: u32,
    pub flags: u32,
    pub len: u64,
    pub imm: u32,
    pub checksum: u32,
    /// The staging slot the bytes come from (`ShmFabric`, where the receiver copies them
    /// out of the sender's staging; ignored over TCP, where they follow the header).
    pub local: u32,
    /// A run's first header: the run's pieces (2 ..= `WriteRun::MAX_PIECES`), so the
    /// receiver reads the other headers at once; 0 in every other header.
    pub run: u32,
}

impl WriteHeader {
    pub(crate) fn of(w: &PostWrite) -> Self {
        let flags = if w.imm.is_some() { FLAG_IMM } else { 0 }
            | if w.checksum.is_some() {
                FLAG_CHECKSUM
            } else {
                0
            };
        WriteHeader {
            id: w.id.0,
            remote: w.remote.0,
            flags,
            len: w.len as u64,
            imm: w.imm.unwrap_or(0),
            checksum: w.checksum.unwrap_or(0),
            local: w.local.0,
            run: 0,
        }
    }

    pub(crate) fn imm(&self) -> Option<u32> {
        (self.flags & FLAG_IMM != 0).then_some(self.imm)
    }

    pub(crate) fn checksum(&self) -> Option<u32> {
        (self.flags & FLAG_CHECKSUM != 0).then_some(self.checksum)
    }

    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..12].copy_from_slice(&self.remote.to_le_bytes());
        b[12..16].copy_from_slice(&self.flags.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..28].copy_from_slice(&self.imm.to_le_bytes());
        b[28..32].copy_from_slice(&self.checksum.to_le_bytes());
        b[32..36].copy_from_slice(&self.local.to_le_bytes());
        b[36..40].copy_from_slice(&self.run.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Self {
        WriteHeader {
            id: u64_at(b, 0),
            remote: u32_at(b, 8),
            flags: u32_at(b, 12),
            len: u64_at(b, 16),
            imm: u32_at(b, 24),
            checksum: u32_at(b, 28),
            local: u32_at(b, 32),
            run: u32_at(b, 36),
        }
    }
}

/// Receiver → sender, one per write, in the order the writes arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ack {
    pub id: u64,
    pub status: AckStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AckStatus {
    /// The bytes are in the receiver's memory (and its `Landed` notice, if any, is out).
    Ok,
    /// The write fell outside the registered memory; nothing was written.
    OutOfBounds,
    /// The connection's peer holds no current grant for the write (or it names none, or
    /// has no bytes, or its grant was written already); nothing was written.
    Refused,
    /// The bytes landed but do not match the write's checksum; the receiver fails the
    /// request (its notice says so).
    Corrupt,
    /// A status this version does not know.
    Unknown(u32),
}

impl Ack {
    pub(crate) fn encode(&self) -> [u8; ACK_LEN] {
        let mut b = [0u8; ACK_LEN];
        b[0..8].copy_from_slice(&self.id.to_le_bytes());
        let status = match self.status {
            AckStatus::Ok => 0,
            AckStatus::OutOfBounds => 1,
            AckStatus::Refused => 2,
            AckStatus::Corrupt => 3,
            AckStatus::Unknown(c) => c,
        };
        b[8..12].copy_from_slice(&status.to_le_bytes());
        // 12..16 reserved, zero.
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Self {
        debug_assert!(b.len() >= ACK_LEN, "invariant: callers pass whole acks");
        let status = match u32_at(b, 8) {
            0 => AckStatus::Ok,
            1 => AckStatus::OutOfBounds,
            2 => AckStatus::Refused,
            3 => AckStatus::Corrupt,
            c => AckStatus::Unknown(c),
        };
        Ack {
            id: u64_at(b, 0),
            status,
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut v = [0u8; 4];
    v.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(v)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let h = Hello {
            magic: TCP_MAGIC,
            version: VERSION,
            kind: HelloKind::Fence,
            staging_slots: 7,
            staging_slot_bytes: 1 << 20,
            conn: 42,
            credential: FabricCredential {
                peer: kvx_proto::PeerId(77),
                tag: [9; 16],
            },
            extra_len: 12,
        };
        assert_eq!(Hello::decode(&h.encode()), h);
        let w = Welcome {
            magic: SHM_MAGIC,
            version: VERSION,
            status: WelcomeStatus::Geometry,
            slots: 9,
            extra_len: 31,
            slot_bytes: 4096,
            conn: 9,
        };
        assert_eq!(Welcome::decode(&w.encode()), w);
        let hd = WriteHeader {
            id: u64::MAX - 3,
            remote: 12,
            flags: FLAG_IMM | FLAG_CHECKSUM,
            len: 65536,
            imm: 0xdead_beef,
            checksum: 0x1234_5678,
            local: 3,
            run: 4,
        };
        assert_eq!(WriteHeader::decode(&hd.encode()), hd);
        assert_eq!(hd.imm(), Some(0xdead_beef));
        assert_eq!(hd.checksum(), Some(0x1234_5678));
        for status in [
            AckStatus::Ok,
            AckStatus::OutOfBounds,
            AckStatus::Refused,
            AckStatus::Corrupt,
            AckStatus::Unknown(9),
        ] {
            let a = Ack { id: 5, status };
            assert_eq!(Ack::decode(&a.encode()), a);
        }
    }

    #[test]
    fn header_layout_is_the_documented_one() {
        // docs/spec/fabrics.md gives these bytes; a change here is a wire break.
        let hd = WriteHeader {
            id: 0x0102_0304_0506_0708,
            remote: 3,
            flags: FLAG_IMM | FLAG_CHECKSUM,
            len: 0x100,
            imm: 0xAABB_CCDD,
            checksum: 0x1122_3344,
            local: 0x0506_0708,
            run: 0x0A0B_0C0D,
        };
        let b = hd.encode();
        assert_eq!(&b[0..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[8..12], &[3, 0, 0, 0]);
        assert_eq!(&b[12..16], &[3, 0, 0, 0]);
        assert_eq!(&b[16..24], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[24..28], &[0xDD, 0xCC, 0xBB, 0xAA]);
        assert_eq!(&b[28..32], &[0x44, 0x33, 0x22, 0x11]);
        assert_eq!(&b[32..36], &[8, 7, 6, 5]);
        assert_eq!(&b[36..40], &[0x0D, 0x0C, 0x0B, 0x0A]);
        assert_eq!(
            (FLAG_IMM, FLAG_CHECKSUM, FLAG_RUN),
            (1, 2, 4),
            "flag bits 0-2: immediate, checksum, run"
        );
    }
}
