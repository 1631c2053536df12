//! The side channel's frames (`docs/operations.md` §Side channel): the out-of-band exchange of
//! queue pair numbers, GIDs and the remote key that sets up a reliable connection, then the
//! fence. All integers little-endian, every frame fixed-size, reserved bytes zero.
//!
//! - `Hello` (sender → receiver, 96 bytes): magic `KVXR`, version, the sender's staging shape,
//!   its queue pair's address, and (from version 2, bytes 64..88) the fabric credential that
//!   ties the queue pair to a control peer (`kvx_io::access`).
//! - `Welcome` (receiver → sender, 64 bytes): a status, the exposed buffer's shape, the
//!   receiver's queue pair address, and the buffer's address and remote key.
//! - `Control` (8 bytes, either way, after the welcome): `Fence` asks the receiver to move its
//!   queue pair to the error state; `Fenced` says it did (nothing of this connection lands any
//!   more).
//! - `WriteFrame` (sender → receiver, 16 bytes, from version 3): sent ahead of every write with
//!   immediate, in posting order: the immediate, the length and, when the sender computed it,
//!   the chunk's checksum (`kvx_io::chunk_checksum`). The receiver pairs it with the write's
//!   receive completion (`pairing`) and checks the landed bytes against it.
//!
//! `Inbound` splits what a receiver reads after its welcome into these frames.

use kvx_io::{FabricCredential, FabricError, SlotGeometry};

pub(crate) const MAGIC: [u8; 4] = *b"KVXR";
/// Version 2 added the credential to the hello and the `Unauthorized` refusal; version 3 the
/// `WriteFrame` ahead of every write with immediate (a receiver of version 3 waits for it, so
/// both ends must speak it: a hello of another version is refused).
pub(crate) const VERSION: u16 = 3;
/// The hello's version-independent part, which a receiver reads first to answer any sender.
pub(crate) const HELLO_BASE_LEN: usize = 64;
pub(crate) const HELLO_LEN: usize = 96;
pub(crate) const WELCOME_LEN: usize = 64;
pub(crate) const CONTROL_LEN: usize = 8;
pub(crate) const WRITE_FRAME_LEN: usize = 16;

/// The largest slot a write may fill: a verbs message length is 32 bits, and kvx chunks are at
/// most 1 GiB.
pub const SLOT_BYTES_MAX: u64 = 1 << 30;

/// A buffer's shape as RDMA takes it, from loose numbers (a lent region's, a peer's): kvx-io's
/// one check (`SlotGeometry::new`), then RDMA's own bound (`within_one_write`).
pub fn checked_geometry(slots: u32, slot_bytes: usize) -> Result<SlotGeometry, FabricError> {
    within_one_write(SlotGeometry::new(slots, slot_bytes)?)
}

/// RDMA's one limit beyond `SlotGeometry::new`'s: slots no larger than one RDMA write may be
/// (`SLOT_BYTES_MAX`).
pub fn within_one_write(geometry: SlotGeometry) -> Result<SlotGeometry, FabricError> {
    if geometry.slot_bytes > SLOT_BYTES_MAX {
        let SlotGeometry { slots, slot_bytes } = geometry;
        return Err(FabricError::Allocation(format!(
            "{slots} slots of {slot_bytes} bytes: an RDMA slot holds at most {SLOT_BYTES_MAX} bytes"
        )));
    }
    Ok(geometry)
}

/// The kind of a GID, which sets the packets' format on the wire (InfiniBand, RoCE v1 over
/// Ethernet, RoCE v2 over UDP/IP): the two ends of a connection must use the same, or no
/// packet of one is understood by the other and writes end in "retry counter exceeded".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GidKind {
    /// Not said (a peer that does not send it): not checked.
    #[default]
    Unsaid,
    InfiniBand,
    RoceV1,
    RoceV2,
}

impl GidKind {
    fn code(self) -> u8 {
        match self {
            GidKind::Unsaid => 0,
            GidKind::InfiniBand => 1,
            GidKind::RoceV1 => 2,
            GidKind::RoceV2 => 3,
        }
    }

    fn from_code(c: u8) -> Self {
        match c {
            1 => GidKind::InfiniBand,
            2 => GidKind::RoceV1,
            3 => GidKind::RoceV2,
            _ => GidKind::Unsaid,
        }
    }

    /// Whether two sides that said their kinds said different ones.
    pub fn clashes_with(self, other: GidKind) -> bool {
        self != GidKind::Unsaid && other != GidKind::Unsaid && self != other
    }
}

impl std::fmt::Display for GidKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GidKind::Unsaid => "unknown",
            GidKind::InfiniBand => "InfiniBand",
            GidKind::RoceV1 => "RoCE v1",
            GidKind::RoceV2 => "RoCE v2",
        })
    }
}

/// Where a queue pair can be reached: what `ibv_modify_qp` to RTR needs about the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAddr {
    pub qpn: u32,
    /// Packet sequence number the peer starts at (24 bits).
    pub psn: u32,
    /// InfiniBand local id (0 on RoCE).
    pub lid: u16,
    /// The MTU this side offers (its port's active MTU under its own cap, `offered_mtu`), as
    /// the verbs code (1 = 256 … 5 = 4096); the connection runs at the smaller offer.
    pub mtu: u8,
    pub gid: [u8; 16],
    /// The kind of `gid`.
    pub gid_kind: GidKind,
}

impl QpAddr {
    fn put(&self, b: &mut [u8]) {
        b[12..16].copy_from_slice(&self.qpn.to_le_bytes());
        b[24..28].copy_from_slice(&self.psn.to_le_bytes());
        b[28..30].copy_from_slice(&self.lid.to_le_bytes());
        b[30] = self.mtu;
        b[31] = self.gid_kind.code();
        b[32..48].copy_from_slice(&self.gid);
    }

    fn get(b: &[u8]) -> Self {
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[32..48]);
        QpAddr {
            qpn: u32_at(b, 12),
            psn: u32_at(b, 24),
            lid: u16::from_le_bytes([b[28], b[29]]),
            mtu: b[30],
            gid,
            gid_kind: GidKind::from_code(b[31]),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub version: u16,
    pub staging: SlotGeometry,
    pub qp: QpAddr,
    pub credential: FabricCredential,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WelcomeStatus {
    Ok,
    VersionMismatch,
    /// The sender's staging slots are not as large as the receiver's.
    StagingMismatch,
    /// The receiver could not create or connect a queue pair.
    NoResources,
    /// The hello's credential was not issued by this buffer.
    Unauthorized,
    /// The sender's GID is of another kind than the receiver's (the welcome's `qp.gid_kind`
    /// says the receiver's).
    GidMismatch,
    /// The receiver's device failed (a completion queue or device error, or the device was
    /// removed): it takes no new senders.
    DeviceUnusable,
    Unknown(u16),
}

impl WelcomeStatus {
    fn code(self) -> u16 {
        match self {
            WelcomeStatus::Ok => 0,
            WelcomeStatus::VersionMismatch => 1,
            WelcomeStatus::StagingMismatch => 2,
            WelcomeStatus::NoResources => 3,
            WelcomeStatus::Unauthorized => 4,
            WelcomeStatus::GidMismatch => 5,
            WelcomeStatus::DeviceUnusable => 6,
            WelcomeStatus::Unknown(c) => c,
        }
    }

    fn from_code(c: u16) -> Self {
        match c {
            0 => WelcomeStatus::Ok,
            1 => WelcomeStatus::VersionMismatch,
            2 => WelcomeStatus::StagingMismatch,
            3 => WelcomeStatus::NoResources,
            4 => WelcomeStatus::Unauthorized,
            5 => WelcomeStatus::GidMismatch,
            6 => WelcomeStatus::DeviceUnusable,
            c => WelcomeStatus::Unknown(c),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Welcome {
    pub status: WelcomeStatus,
    pub buffer: SlotGeometry,
    pub qp: QpAddr,
    /// The exposed buffer's virtual address and remote key.
    pub addr: u64,
    pub rkey: u32,
}

impl Welcome {
    /// A refusal: nothing but the status means anything.
    pub fn refusal(status: WelcomeStatus) -> Self {
        Welcome {
            status,
            buffer: SlotGeometry {
                slots: 0,
                slot_bytes: 0,
            },
            qp: QpAddr::default(),
            addr: 0,
            rkey: 0,
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn head(b: &mut [u8], version: u16, word: u16) {
    b[0..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&version.to_le_bytes());
    b[6..8].copy_from_slice(&word.to_le_bytes());
}

/// Why a frame was not understood: the peer speaks something else; hang up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadMagic;

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        head(&mut b, self.version, 0);
        b[8..12].copy_from_slice(&self.staging.slots.to_le_bytes());
        b[16..24].copy_from_slice(&self.staging.slot_bytes.to_le_bytes());
        self.qp.put(&mut b);
        b[64..88].copy_from_slice(&self.credential.to_bytes());
        b
    }

    /// The version-independent first `HELLO_BASE_LEN` bytes (the credential left zero).
    pub fn decode_base(b: &[u8]) -> Result<Self, BadMagic> {
        if b.len() < HELLO_BASE_LEN || b[0..4] != MAGIC {
            return Err(BadMagic);
        }
        Ok(Hello {
            version: u16::from_le_bytes([b[4], b[5]]),
            staging: SlotGeometry {
                slots: u32_at(b, 8),
                slot_bytes: u64_at(b, 16),
            },
            qp: QpAddr::get(b),
            credential: FabricCredential {
                peer: kvx_proto::PeerId(0),
                tag: [0; 16],
            },
        })
    }

    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, BadMagic> {
        let mut credential = [0u8; FabricCredential::LEN];
        credential.copy_from_slice(&b[64..88]);
        Ok(Hello {
            credential: FabricCredential::from_bytes(&credential),
            ..Self::decode_base(b)?
        })
    }
}

impl Welcome {
    pub fn encode(&self) -> [u8; WELCOME_LEN] {
        let mut b = [0u8; WELCOME_LEN];
        head(&mut b, VERSION, self.status.code());
        b[8..12].copy_from_slice(&self.buffer.slots.to_le_bytes());
        b[16..24].copy_from_slice(&self.buffer.slot_bytes.to_le_bytes());
        self.qp.put(&mut b);
        b[48..56].copy_from_slice(&self.addr.to_le_bytes());
        b[56..60].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; WELCOME_LEN]) -> Result<Self, BadMagic> {
        if b[0..4] != MAGIC {
            return Err(BadMagic);
        }
        Ok(Welcome {
            status: WelcomeStatus::from_code(u16::from_le_bytes([b[6], b[7]])),
            buffer: SlotGeometry {
                slots: u32_at(b, 8),
                slot_bytes: u64_at(b, 16),
            },
            qp: QpAddr::get(b),
            addr: u64_at(b, 48),
            rkey: u32_at(b, 56),
        })
    }
}

/// After the welcome: the fence and its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Control {
    /// Sender → receiver: move your queue pair to the error state.
    Fence,
    /// Receiver → sender: done; nothing of this connection lands any more.
    Fenced,
    Unknown(u32),
}

impl Control {
    pub fn encode(self) -> [u8; CONTROL_LEN] {
        let kind: u32 = match self {
            Control::Fence => 1,
            Control::Fenced => 2,
            Control::Unknown(k) => k,
        };
        let mut b = [0u8; CONTROL_LEN];
        b[0..4].copy_from_slice(&kind.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; CONTROL_LEN]) -> Self {
        match u32_at(b, 0) {
            1 => Control::Fence,
            2 => Control::Fenced,
            k => Control::Unknown(k),
        }
    }
}

/// `WriteFrame` kinds (the control kinds' space): with a checksum, and without one.
const WRITE_SUMMED: u32 = 3;
const WRITE_UNSUMMED: u32 = 4;

/// Sender → receiver, ahead of each write with immediate: which write (its immediate), how
/// long, and the checksum of its bytes when the sender computed one. Layout: kind (3: with a
/// checksum, 4: without) at 0..4, the immediate at 4..8, the length at 8..12, the checksum
/// (zero without one) at 12..16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WriteFrame {
    pub imm: u32,
    pub len: u32,
    pub checksum: Option<u32>,
}

impl WriteFrame {
    pub fn encode(&self) -> [u8; WRITE_FRAME_LEN] {
        let mut b = [0u8; WRITE_FRAME_LEN];
        let kind = if self.checksum.is_some() {
            WRITE_SUMMED
        } else {
            WRITE_UNSUMMED
        };
        b[0..4].copy_from_slice(&kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.imm.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.checksum.unwrap_or(0).to_le_bytes());
        b
    }
}

/// A frame a receiver read after its welcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InboundFrame {
    Write(WriteFrame),
    Control(Control),
}

/// The receiver's side-channel bytes, cut into frames as they arrive: a frame's kind (its
/// first 4 bytes) says its length, 16 bytes for a `WriteFrame`, 8 for a `Control`. Reading
/// into `space` and taking frames with `next` never loses a byte, whatever the socket's
/// reads cut.
#[derive(Debug)]
pub(crate) struct Inbound {
    buf: Box<[u8; Inbound::CAPACITY]>,
    start: usize,
    end: usize,
}

impl Inbound {
    /// Room for 256 write frames per read: one read takes a burst's frames at once.
    const CAPACITY: usize = 256 * WRITE_FRAME_LEN;

    pub fn new() -> Self {
        Inbound {
            buf: Box::new([0; Inbound::CAPACITY]),
            start: 0,
            end: 0,
        }
    }

    /// Where the next read goes (never empty: a partial frame is moved to the front first).
    pub fn space(&mut self) -> &mut [u8] {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.buf[self.end..]
    }

    /// `n` bytes were read into `space`.
    pub fn filled(&mut self, n: usize) {
        self.end = (self.end + n).min(Inbound::CAPACITY);
    }

    /// The next whole frame, if one has arrived; a control frame only with `controls` (else it
    /// stays, and so does everything behind it).
    pub fn next_frame(&mut self, controls: bool) -> Option<InboundFrame> {
        let b = &self.buf[self.start..self.end];
        if b.len() < CONTROL_LEN {
            return None;
        }
        let kind = u32_at(b, 0);
        if kind == WRITE_SUMMED || kind == WRITE_UNSUMMED {
            if b.len() < WRITE_FRAME_LEN {
                return None;
            }
            let frame = WriteFrame {
                imm: u32_at(b, 4),
                len: u32_at(b, 8),
                checksum: (kind == WRITE_SUMMED).then(|| u32_at(b, 12)),
            };
            self.start += WRITE_FRAME_LEN;
            return Some(InboundFrame::Write(frame));
        }
        if !controls {
            return None;
        }
        let mut c = [0u8; CONTROL_LEN];
        c.copy_from_slice(&b[..CONTROL_LEN]);
        self.start += CONTROL_LEN;
        Some(InboundFrame::Control(Control::decode(&c)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_proto::WriteTag;

    fn addr() -> QpAddr {
        QpAddr {
            qpn: 0x00AB_CDEF,
            psn: 0x12_3456,
            lid: 7,
            mtu: 5,
            gid: [0xFE; 16],
            gid_kind: GidKind::RoceV2,
        }
    }

    #[test]
    fn hello_round_trips_and_has_the_documented_layout() {
        let h = Hello {
            version: VERSION,
            staging: SlotGeometry {
                slots: 16,
                slot_bytes: 1 << 20,
            },
            qp: addr(),
            credential: FabricCredential {
                peer: kvx_proto::PeerId(5),
                tag: [3; 16],
            },
        };
        let b = h.encode();
        assert_eq!(&b[0..4], b"KVXR");
        assert_eq!(&b[4..6], &3u16.to_le_bytes());
        assert_eq!(&b[8..12], &16u32.to_le_bytes());
        assert_eq!(&b[12..16], &0x00AB_CDEFu32.to_le_bytes());
        assert_eq!(&b[16..24], &(1u64 << 20).to_le_bytes());
        assert_eq!(&b[24..28], &0x12_3456u32.to_le_bytes());
        assert_eq!(b[30], 5);
        assert_eq!(b[31], 3, "the GID's kind: RoCE v2");
        assert!(b[48..64].iter().all(|&x| x == 0), "reserved bytes are zero");
        assert_eq!(&b[64..72], &5u64.to_le_bytes());
        assert!(b[88..].iter().all(|&x| x == 0), "reserved bytes are zero");
        assert_eq!(Hello::decode(&b), Ok(h));
    }

    #[test]
    fn welcome_round_trips_with_address_and_key() {
        let w = Welcome {
            status: WelcomeStatus::Ok,
            buffer: SlotGeometry {
                slots: 64,
                slot_bytes: 4096,
            },
            qp: addr(),
            addr: 0x7F00_DEAD_0000,
            rkey: 0xCAFE,
        };
        let b = w.encode();
        assert_eq!(&b[48..56], &0x7F00_DEAD_0000u64.to_le_bytes());
        assert_eq!(Welcome::decode(&b), Ok(w));
        let refused = Welcome::refusal(WelcomeStatus::StagingMismatch).encode();
        assert_eq!(
            Welcome::decode(&refused).map(|w| w.status),
            Ok(WelcomeStatus::StagingMismatch)
        );
        let mut odd = refused;
        odd[6] = 9;
        assert_eq!(
            Welcome::decode(&odd).map(|w| w.status),
            Ok(WelcomeStatus::Unknown(9))
        );
    }

    #[test]
    fn other_magic_is_refused() {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(b"KVXT");
        assert_eq!(Hello::decode(&b), Err(BadMagic));
        let mut w = [0u8; WELCOME_LEN];
        w[0..4].copy_from_slice(b"KVXT");
        assert_eq!(Welcome::decode(&w), Err(BadMagic));
    }

    #[test]
    fn control_frames_round_trip() {
        for c in [Control::Fence, Control::Fenced, Control::Unknown(77)] {
            assert_eq!(Control::decode(&c.encode()), c);
        }
    }

    #[test]
    fn write_frames_and_controls_are_cut_however_the_reads_come() {
        let frames = [
            InboundFrame::Write(WriteFrame {
                imm: 0xABCD_0001,
                len: 4096,
                checksum: Some(0xDEAD_BEEF),
            }),
            InboundFrame::Write(WriteFrame {
                imm: 7,
                len: 1,
                checksum: None,
            }),
            InboundFrame::Control(Control::Fence),
        ];
        let summed = WriteFrame {
            imm: 0xABCD_0001,
            len: 4096,
            checksum: Some(0xDEAD_BEEF),
        }
        .encode();
        assert_eq!(&summed[0..4], &3u32.to_le_bytes());
        assert_eq!(&summed[4..8], &0xABCD_0001u32.to_le_bytes());
        assert_eq!(&summed[8..12], &4096u32.to_le_bytes());
        assert_eq!(&summed[12..16], &0xDEAD_BEEFu32.to_le_bytes());
        let mut bytes = Vec::new();
        for f in frames {
            match f {
                InboundFrame::Write(w) => bytes.extend_from_slice(&w.encode()),
                InboundFrame::Control(c) => bytes.extend_from_slice(&c.encode()),
            }
        }
        for cut in 1..=bytes.len() {
            let mut inbound = Inbound::new();
            let mut got = Vec::new();
            for piece in bytes.chunks(cut) {
                inbound.space()[..piece.len()].copy_from_slice(piece);
                inbound.filled(piece.len());
                // Write frames alone first, as a receiver takes them with completions: a
                // control frame stops them.
                while let Some(f) = inbound.next_frame(false) {
                    assert!(matches!(f, InboundFrame::Write(_)));
                    got.push(f);
                }
                while let Some(f) = inbound.next_frame(true) {
                    got.push(f);
                }
            }
            assert_eq!(got, frames, "reads of {cut} bytes");
        }
    }

    #[test]
    fn geometry_bounds() {
        assert!(checked_geometry(0, 8).is_err());
        assert!(checked_geometry(8, 0).is_err());
        assert!(checked_geometry(WriteTag::SLOTS_MAX + 1, 8).is_err());
        assert!(checked_geometry(1, (SLOT_BYTES_MAX + 1) as usize).is_err());
        let g = checked_geometry(4, 100).expect("fine");
        assert!(g.holds(3, 100));
        assert!(!g.holds(4, 1));
        assert!(!g.holds(0, 101));
        assert_eq!(g.offset(3), 300);
        assert_eq!(g.total_bytes(), 400);
    }
}
