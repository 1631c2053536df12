//! `RdmaConfig`: which device, port and GID, the path MTU, the side channel's timeouts and the
//! queue pairs' retry settings (`docs/operations.md` §Settings).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// A path MTU (the RDMA payload per packet, without headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PathMtu {
    Mtu256,
    Mtu512,
    Mtu1024,
    Mtu2048,
    Mtu4096,
}

impl PathMtu {
    /// The verbs code (`IBV_MTU_256` = 1 … `IBV_MTU_4096` = 5).
    pub fn code(self) -> u8 {
        match self {
            PathMtu::Mtu256 => 1,
            PathMtu::Mtu512 => 2,
            PathMtu::Mtu1024 => 3,
            PathMtu::Mtu2048 => 4,
            PathMtu::Mtu4096 => 5,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => PathMtu::Mtu256,
            2 => PathMtu::Mtu512,
            3 => PathMtu::Mtu1024,
            4 => PathMtu::Mtu2048,
            5 => PathMtu::Mtu4096,
            _ => return None,
        })
    }

    pub fn bytes(self) -> u32 {
        128 << self.code()
    }
}

impl fmt::Display for PathMtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

impl FromStr for PathMtu {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bytes: u32 = s.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
        (1..=5)
            .filter_map(PathMtu::from_code)
            .find(|m| m.bytes() == bytes)
            .ok_or_else(|| format!("an RDMA MTU is 256, 512, 1024, 2048 or 4096, not {bytes}"))
    }
}

/// The MTU a side offers its peer in the handshake: its port's active MTU, capped by its own
/// configuration (an active MTU that is not a verbs code is offered as it is, and refused by
/// `path_mtu`).
pub(crate) fn offered_mtu(active: u8, cap: Option<PathMtu>) -> u8 {
    match (PathMtu::from_code(active), cap) {
        (Some(m), Some(c)) => m.min(c).code(),
        _ => active,
    }
}

/// The path MTU of a connection: the smaller of the two offers (`offered_mtu`). Both sides
/// compute it from the same two numbers, so they agree — which they must: a responder
/// rejects every packet of a multi-packet write whose length does not match its own path
/// MTU (IBA C9-92), so a cap applied by one side only would fail every chunk larger than a
/// packet. None when an offer is not a verbs MTU (a peer that sent garbage).
pub(crate) fn path_mtu(ours: u8, theirs: u8) -> Option<u8> {
    Some(
        PathMtu::from_code(ours)?
            .min(PathMtu::from_code(theirs)?)
            .code(),
    )
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Device name (`ibv_devices`, e.g. `mlx5_0`); None: the first device.
    pub device: Option<String>,
    /// Physical port, from 1.
    pub port: u8,
    /// GID index (`show_gids`); None: on Ethernet (RoCE) the first RoCE v2 GID holding an
    /// IPv4 address, else the first RoCE v2 GID, else 0; on InfiniBand 0.
    pub gid_index: Option<u32>,
    /// Caps the path MTU: this side offers at most this much, and a connection runs at the
    /// smaller of both sides' offers; None: the port's active MTU.
    pub mtu: Option<PathMtu>,
    /// Service level (InfiniBand) / priority of the address vector: 0–15 (a larger value is
    /// taken as 15).
    pub service_level: u8,
    /// Traffic class of the GRH (RoCE: DSCP << 2, for PFC/ECN classes).
    pub traffic_class: u8,
    /// Bounds the side channel's connect and each handshake step of a sender, the sending of
    /// its write frames, and a receiver's wait for a write's frame once the write landed
    /// (beyond, the write is announced without its checksum: `pairing`).
    pub connect_timeout: Duration,
    /// How long a receiver waits for an accepted side-channel connection's whole hello; a
    /// connection that says nothing, or trickles its hello, is closed then. Short, because a
    /// connection that has not greeted holds a place among `connections_max`. Default 3 s.
    pub hello_timeout: Duration,
    /// Side-channel connections one exposed buffer serves at once, handshaking ones included;
    /// past it a newcomer is still taken and the quietest connection is closed for it (never
    /// greeted first, then one that greeted without a valid credential, then the
    /// authenticated sender whose last write was announced longest ago), as over TCP
    /// (`kvx_io::ConnectionBudget`, docs/spec/fabrics.md §6). Default 256.
    pub connections_max: usize,
    /// Side-channel connections from one source address at most; past it the quietest of
    /// that address's connections is closed for the newcomer. Default 64.
    pub connections_per_source_max: usize,
    /// Bounds a sender's fence (and its wait for flush completions after it).
    pub fence_timeout: Duration,
    /// Local ACK timeout, 4.096 µs × 2^`ack_timeout` (14 ≈ 67 ms): 0–31 (a larger value is
    /// taken as 31; 0 waits without limit).
    pub ack_timeout: u8,
    /// Transport retries before a write fails (at most 7).
    pub retry_count: u8,
    /// Retries when the receiver has no receive posted (7: without limit).
    pub rnr_retry: u8,
    /// Receives a receiver posts beyond the sender's staging slots.
    pub recv_slack: u32,
    /// Completion queue entries of the device (capped by the device's maximum); every queue
    /// pair's send and receive depth counts against it.
    pub cq_depth: u32,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            device: None,
            port: 1,
            gid_index: None,
            mtu: None,
            service_level: 0,
            traffic_class: 0,
            connect_timeout: Duration::from_secs(5),
            hello_timeout: Duration::from_secs(3),
            connections_max: 256,
            connections_per_source_max: 64,
            fence_timeout: Duration::from_secs(5),
            ack_timeout: 14,
            retry_count: 7,
            rnr_retry: 7,
            recv_slack: 16,
            cq_depth: 65_536,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_parses_and_codes() {
        assert_eq!("4096".parse::<PathMtu>(), Ok(PathMtu::Mtu4096));
        assert_eq!(PathMtu::Mtu1024.bytes(), 1024);
        assert_eq!(PathMtu::Mtu256.code(), 1);
        assert!("1500".parse::<PathMtu>().is_err());
        assert_eq!(PathMtu::from_code(6), None);
    }

    #[test]
    fn path_mtu_is_the_smallest_offer_and_both_sides_agree() {
        assert_eq!(offered_mtu(5, None), 5);
        assert_eq!(offered_mtu(5, Some(PathMtu::Mtu2048)), 4);
        assert_eq!(offered_mtu(2, Some(PathMtu::Mtu4096)), 2);
        assert_eq!(offered_mtu(0, Some(PathMtu::Mtu1024)), 0);
        assert_eq!(path_mtu(5, 3), Some(3));
        assert_eq!(path_mtu(0, 5), None);
        // A cap on one side only: each side's view of the path is the same.
        let (a, b) = (offered_mtu(5, None), offered_mtu(5, Some(PathMtu::Mtu1024)));
        assert_eq!(path_mtu(a, b), path_mtu(b, a));
        assert_eq!(path_mtu(a, b), Some(3));
    }
}
