//! A raw peer of the TCP fabric (`docs/spec/fabrics.md` §2), written from the spec: hellos of
//! either version, write headers, and the receiver's welcomes and acks.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvx_io::FabricCredential;
use kvx_proto::{SlotIndex, WriteTag};

pub const MAGIC: &[u8; 4] = b"KVXT";
const WAIT: Duration = Duration::from_secs(5);

/// An attaching hello of the current version (3) with `credential`.
pub fn hello(slots: u32, slot_bytes: u64, credential: &FabricCredential) -> Vec<u8> {
    let mut b = hello_v1(slots, slot_bytes);
    b[4..6].copy_from_slice(&3u16.to_le_bytes());
    b.extend_from_slice(&credential.to_bytes());
    b.extend_from_slice(&[0u8; 8]);
    b
}

/// A version-1 hello (32 bytes, no credential): what kvx spoke before credentials.
pub fn hello_v1(slots: u32, slot_bytes: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&0u16.to_le_bytes());
    b.extend_from_slice(&slots.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&slot_bytes.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b
}

/// A write header (40 bytes, from staging slot 0); `checksum` sets flag bit 1.
pub fn header(id: u64, slot: u32, len: u64, imm: Option<u32>, checksum: Option<u32>) -> Vec<u8> {
    let flags = u32::from(imm.is_some()) | (u32::from(checksum.is_some()) << 1);
    let mut b = Vec::new();
    b.extend_from_slice(&id.to_le_bytes());
    b.extend_from_slice(&slot.to_le_bytes());
    b.extend_from_slice(&flags.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b.extend_from_slice(&imm.unwrap_or(0).to_le_bytes());
    b.extend_from_slice(&checksum.unwrap_or(0).to_le_bytes());
    b.extend_from_slice(&[0u8; 8]); // staging slot 0, reserved
    b
}

/// The immediate naming grant `generation` of `slot`.
pub fn imm(slot: u32, generation: u32) -> u32 {
    WriteTag {
        slot: SlotIndex(slot),
        generation,
    }
    .to_imm()
}

/// A connection to a receiver's fabric port.
#[derive(Debug)]
pub struct FabricPeer {
    pub stream: TcpStream,
}

/// The receiver's answer to a hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcome {
    pub status: u16,
    pub slots: u32,
    pub slot_bytes: u64,
    pub extra_len: u32,
}

impl FabricPeer {
    pub fn connect(addr: SocketAddr) -> io::Result<FabricPeer> {
        let stream = TcpStream::connect_timeout(&addr, WAIT)?;
        stream.set_read_timeout(Some(WAIT))?;
        stream.set_write_timeout(Some(WAIT))?;
        stream.set_nodelay(true)?;
        Ok(FabricPeer { stream })
    }

    pub fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Reads a welcome (and skips its extra bytes).
    pub fn welcome(&mut self) -> io::Result<Welcome> {
        let mut b = [0u8; 32];
        self.stream.read_exact(&mut b)?;
        let w = Welcome {
            status: u16::from_le_bytes([b[6], b[7]]),
            slots: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            extra_len: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
            slot_bytes: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
        };
        let mut extra = vec![0u8; w.extra_len.min(4096) as usize];
        self.stream.read_exact(&mut extra)?;
        Ok(w)
    }

    /// Reads one ack: (write id, status).
    pub fn ack(&mut self) -> io::Result<(u64, u32)> {
        let mut b = [0u8; 16];
        self.stream.read_exact(&mut b)?;
        Ok((
            u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
        ))
    }

    /// Whether the receiver closes the connection within `WAIT`.
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        for _ in 0..1_000 {
            match self.stream.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) => return e.kind() != io::ErrorKind::WouldBlock,
            }
        }
        false
    }
}
