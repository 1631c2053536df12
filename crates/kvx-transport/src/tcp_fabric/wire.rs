//! The byte layout of the fabric connections (`docs/spec/fabrics.md` §Wire format).
//!
//! Both fabrics speak it: `TcpFabric` streams each write's payload right behind its header,
//! `ShmFabric` sends the header alone (the payload is already in the shared mapping). Every
//! integer is little-endian; every frame has a fixed size, so a reader never allocates and
//! never trusts a length it has not bounded.

use kvx_io::PostWrite;

/// The protocol version both sides must speak.
pub(crate) const VERSION: u16 = 1;
/// First bytes of a `TcpFabric` connection.
pub(crate) const TCP_MAGIC: [u8; 4] = *b"KVXT";
/// First bytes of a `ShmFabric` control connection (so a TCP sender cannot talk to it).
pub(crate) const SHM_MAGIC: [u8; 4] = *b"KVXS";

pub(crate) const HELLO_LEN: usize = 32;
pub(crate) const WELCOME_LEN: usize = 32;
pub(crate) const HEADER_LEN: usize = 32;
pub(crate) const ACK_LEN: usize = 16;
/// The most trailing bytes a `Welcome` may announce (the shm file's path).
pub(crate) const WELCOME_EXTRA_MAX: u32 = 4096;

/// Header flag: the write carries an immediate value.
pub(crate) const FLAG_IMM: u32 = 1;

/// Why a receiver refused a connection (`Welcome::status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WelcomeStatus {
    Ok,
    /// The sender speaks another protocol version.
    Version,
    /// The sender's staging slots are larger than the receiver's slots.
    Geometry,
    /// A fence: the named connection did not stop within the receiver's fence timeout.
    FenceTimeout,
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
            WelcomeStatus::Unknown(c) => c,
        }
    }

    fn from_code(c: u16) -> Self {
        match c {
            0 => WelcomeStatus::Ok,
            1 => WelcomeStatus::Version,
            2 => WelcomeStatus::Geometry,
            3 => WelcomeStatus::FenceTimeout,
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
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&self.magic);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.kind.code().to_le_bytes());
        b[8..12].copy_from_slice(&self.staging_slots.to_le_bytes());
        // 12..16 reserved, zero.
        b[16..24].copy_from_slice(&self.staging_slot_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.conn.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HELLO_LEN]) -> Self {
        Hello {
            magic: [b[0], b[1], b[2], b[3]],
            version: u16::from_le_bytes([b[4], b[5]]),
            kind: HelloKind::from_code(u16::from_le_bytes([b[6], b[7]])),
            staging_slots: u32_at(b, 8),
            staging_slot_bytes: u64_at(b, 16),
            conn: u64_at(b, 24),
        }
    }
}

/// Receiver → sender, the answer to `Hello`: the buffer's geometry and the connection's id,
/// then `extra_len` bytes (the shm file's path; none over TCP). The answer to a fence names
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
}

impl WriteHeader {
    pub(crate) fn of(w: &PostWrite) -> Self {
        WriteHeader {
            id: w.id.0,
            remote: w.remote.0,
            flags: if w.imm.is_some() { FLAG_IMM } else { 0 },
            len: w.len as u64,
            imm: w.imm.unwrap_or(0),
        }
    }

    pub(crate) fn imm(&self) -> Option<u32> {
        (self.flags & FLAG_IMM != 0).then_some(self.imm)
    }

    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..12].copy_from_slice(&self.remote.to_le_bytes());
        b[12..16].copy_from_slice(&self.flags.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..28].copy_from_slice(&self.imm.to_le_bytes());
        // 28..32 reserved, zero.
        b
    }

    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Self {
        WriteHeader {
            id: u64_at(b, 0),
            remote: u32_at(b, 8),
            flags: u32_at(b, 12),
            len: u64_at(b, 16),
            imm: u32_at(b, 24),
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
            flags: FLAG_IMM,
            len: 65536,
            imm: 0xdead_beef,
        };
        assert_eq!(WriteHeader::decode(&hd.encode()), hd);
        assert_eq!(hd.imm(), Some(0xdead_beef));
        for status in [AckStatus::Ok, AckStatus::OutOfBounds, AckStatus::Unknown(9)] {
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
            flags: FLAG_IMM,
            len: 0x100,
            imm: 0xAABB_CCDD,
        };
        let b = hd.encode();
        assert_eq!(&b[0..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[8..12], &[3, 0, 0, 0]);
        assert_eq!(&b[12..16], &[1, 0, 0, 0]);
        assert_eq!(&b[16..24], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[24..28], &[0xDD, 0xCC, 0xBB, 0xAA]);
        assert_eq!(&b[28..32], &[0, 0, 0, 0]);
    }
}
