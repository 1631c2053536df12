//! The staging handoff: how a sender's staging reaches a receiver as a descriptor.
//!
//! Beside its TCP control listener at `host:port`, an exposed shm buffer listens on the
//! abstract Unix socket `kvx-shm-fabric.<port>` (Linux's abstract namespace: no file to
//! create, guess or clean up; it goes with the socket). A sender, once its control connection
//! is up, connects there and sends one 48-byte offer carrying its staging `memfd` as
//! `SCM_RIGHTS`; the receiver answers with a 16-byte reply (and a reason when it refuses).
//! An accepted offer parks the checked mapping under a ticket; the sender names the ticket
//! (8 bytes after its `Hello`) on the control connection, whose handshake then claims it.
//!
//! Offer (sender → receiver), little-endian, with exactly one descriptor attached:
//! `magic "KVXD"`, `version u16 = 1`, `0u16`, `staging slots u32`, `0u32`,
//! `staging slot bytes u64`, `credential [u8; 24]` (`FabricCredential::to_bytes`).
//!
//! Reply: `magic "KVXD"`, `status u16` (`HandoffStatus`), `reason length u16` (≤ 512),
//! `ticket u64` (zero unless accepted), then the reason, UTF-8.
//!
//! Descriptors, receiver side, before anything is judged: the connecting process's user is
//! known at accept (`SO_PEERCRED`), where the connection budget caps connections per user
//! and in all; an untrusted user's descriptors never enter this process (its offer is read
//! with no room for them, so the kernel closes them), and of a trusted user's only the
//! first is kept while it is the only one: a second refuses the offer, every descriptor
//! taken is closed as it comes, and later reads leave no room. A peer that trickles its
//! offer with descriptors attached to every byte so costs the receiver a socket.
//!
//! Checks, receiver side, once the whole offer is read, each refused with a reason the
//! sender reads: the connecting process runs as an allowed user (`SO_PEERCRED`, below); the
//! offer's credential was issued by this buffer; exactly one descriptor came with it; that
//! descriptor passes `StagingView::sealed` (at most `staging_bytes_max`, a tmpfs memfd
//! sealed against shrinking, growing, hole punching and resealing, exactly as large as the
//! offer's geometry, without holes). The control
//! handshake then checks the version, the credential and the slot size as for every fabric,
//! and that the hello's geometry and peer are the offer's.
//!
//! Trust (same host): a receiver admits connections from processes of its own effective uid
//! and of the uids in `ShmFabricConfig::trusted_uids`, nobody else (root included: it is
//! admitted only when listed). A sender passes its staging only to a socket whose owner is
//! one of those users too, so a process that took the socket's name first receives nothing.
//! Only trusted users reach the descriptor checks at all; the fabric credential still decides
//! which of their processes may write into the buffer.

use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvx_io::sockets::bad_endpoint;
use kvx_io::{
    ConnectionBudget, Evicted, FabricAccess, FabricCredential, FabricError, Held, LandedWrite,
    LogLimiter,
};
use kvx_proto::PeerId;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::map::StagingView;
use kvx_io::SlotGeometry;

pub(crate) const MAGIC: [u8; 4] = *b"KVXD";
pub(crate) const VERSION: u16 = 1;
pub(crate) const OFFER_LEN: usize = 48;
pub(crate) const REPLY_LEN: usize = 16;
/// The longest reason a reply carries (longer ones are cut at a character boundary).
pub(crate) const REASON_MAX: usize = 512;
/// What a ticket takes after the control connection's `Hello`.
pub(crate) const TICKET_LEN: usize = 8;
/// Descriptors a receiver reads per offer: one is expected, more are received only to be
/// closed and refused.
const FDS_MAX: usize = 4;
/// How long a receiver retries binding a name an exposed buffer just dropped still holds.
const REBIND_GRACE: Duration = Duration::from_millis(500);

/// The abstract socket name of the handoff for the control listener on `port`.
pub(crate) fn socket_name(port: u16) -> String {
    format!("kvx-shm-fabric.{port}")
}

fn socket_addr(port: u16) -> io::Result<std::os::unix::net::SocketAddr> {
    std::os::unix::net::SocketAddr::from_abstract_name(socket_name(port).as_bytes())
}

/// A reply's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HandoffStatus {
    Ok,
    /// The descriptor (or the offer) is not a staging this receiver maps; the reason says why.
    Staging,
    /// The user or the credential may not attach.
    Unauthorized,
    /// Another offer version or magic.
    Version,
    /// As many offers are waiting for their control connection as the receiver parks.
    Busy,
}

impl HandoffStatus {
    fn code(self) -> u16 {
        match self {
            HandoffStatus::Ok => 0,
            HandoffStatus::Staging => 1,
            HandoffStatus::Unauthorized => 2,
            HandoffStatus::Version => 3,
            HandoffStatus::Busy => 4,
        }
    }

    fn from_code(c: u16) -> Option<Self> {
        Some(match c {
            0 => HandoffStatus::Ok,
            1 => HandoffStatus::Staging,
            2 => HandoffStatus::Unauthorized,
            3 => HandoffStatus::Version,
            4 => HandoffStatus::Busy,
            _ => return None,
        })
    }
}

/// Which users may meet over a handoff socket: this process's effective uid and `extra`.
#[derive(Debug, Clone)]
pub(crate) struct Trust {
    own: u32,
    extra: Arc<[u32]>,
}

impl Trust {
    pub(crate) fn new(extra: &[u32]) -> Self {
        Trust {
            own: rustix::process::geteuid().as_raw(),
            extra: Arc::from(extra),
        }
    }

    fn admits(&self, uid: u32) -> bool {
        uid == self.own || self.extra.contains(&uid)
    }
}

/// An offer, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Offer {
    pub version: u16,
    pub geometry: SlotGeometry,
    pub credential: FabricCredential,
}

impl Offer {
    pub(crate) fn encode(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[8..12].copy_from_slice(&self.geometry.slots.to_le_bytes());
        b[16..24].copy_from_slice(&self.geometry.slot_bytes.to_le_bytes());
        b[24..48].copy_from_slice(&self.credential.to_bytes());
        b
    }

    /// None when the magic is not ours.
    fn decode(b: &[u8; OFFER_LEN]) -> Option<Self> {
        if b[0..4] != MAGIC {
            return None;
        }
        let u32_at = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let mut sb = [0u8; 8];
        sb.copy_from_slice(&b[16..24]);
        let mut cred = [0u8; FabricCredential::LEN];
        cred.copy_from_slice(&b[24..48]);
        Some(Offer {
            version: u16::from_le_bytes([b[4], b[5]]),
            geometry: SlotGeometry {
                slots: u32_at(8),
                slot_bytes: u64::from_le_bytes(sb),
            },
            credential: FabricCredential::from_bytes(&cred),
        })
    }
}

fn encode_reply(status: HandoffStatus, ticket: u64, reason: &str) -> Vec<u8> {
    let mut cut = reason.len().min(REASON_MAX);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    let reason = &reason.as_bytes()[..cut];
    let mut b = Vec::with_capacity(REPLY_LEN + reason.len());
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&status.code().to_le_bytes());
    b.extend_from_slice(&(reason.len() as u16).to_le_bytes());
    b.extend_from_slice(&ticket.to_le_bytes());
    b.extend_from_slice(reason);
    b
}

/// A checked, mapped staging waiting for its sender's control connection.
#[derive(Debug)]
struct Parked {
    peer: PeerId,
    view: StagingView,
    since: Instant,
}

/// The offers one exposed buffer accepted and its control handshakes have not claimed yet.
/// At most `max` at once, each for at most `ttl`, so what they map is bounded by
/// `max × staging_bytes_max`.
#[derive(Debug)]
pub(crate) struct Tickets {
    parked: Mutex<HashMap<u64, Parked>>,
    next: Mutex<u64>,
    max: usize,
    ttl: Duration,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl Tickets {
    pub(crate) fn new(max: usize, ttl: Duration) -> Self {
        Tickets {
            parked: Mutex::default(),
            next: Mutex::new(1),
            max,
            ttl,
        }
    }

    fn park(&self, peer: PeerId, view: StagingView) -> Result<u64, (HandoffStatus, String)> {
        let mut parked = lock(&self.parked);
        let ttl = self.ttl;
        parked.retain(|_, p| p.since.elapsed() <= ttl);
        if parked.len() >= self.max {
            return Err((
                HandoffStatus::Busy,
                format!(
                    "{} offers already wait for their control connection",
                    parked.len()
                ),
            ));
        }
        let ticket = {
            let mut next = lock(&self.next);
            let t = *next;
            *next = next.wrapping_add(1).max(1);
            t
        };
        parked.insert(
            ticket,
            Parked {
                peer,
                view,
                since: Instant::now(),
            },
        );
        Ok(ticket)
    }

    /// The staging parked under `ticket`, if `peer` offered it with `geometry` and it has not
    /// expired; a ticket is claimed once, whatever the outcome.
    pub(crate) fn claim(
        &self,
        ticket: u64,
        peer: PeerId,
        geometry: SlotGeometry,
    ) -> Result<StagingView, String> {
        let p = lock(&self.parked)
            .remove(&ticket)
            .ok_or_else(|| format!("no staging offered under ticket {ticket}"))?;
        if p.since.elapsed() > self.ttl {
            return Err(format!("the staging under ticket {ticket} expired"));
        }
        if p.peer != peer {
            return Err(format!("ticket {ticket} was issued to another peer"));
        }
        let offered = SlotGeometry {
            slots: p.view.slots(),
            slot_bytes: p.view.slot_bytes() as u64,
        };
        if offered != geometry {
            return Err(format!(
                "the hello's staging {geometry:?} is not the offered {offered:?}"
            ));
        }
        Ok(p.view)
    }
}

/// What the receiver's handoff checks against.
#[derive(Debug, Clone)]
pub(crate) struct Rules {
    pub access: Arc<FabricAccess>,
    pub trust: Trust,
    pub staging_bytes_max: u64,
    pub tickets: Arc<Tickets>,
    /// Bounds each handoff connection, start to reply.
    pub timeout: Duration,
    /// Handoff connections served at once, and from one user; past either the quietest is
    /// closed for a newcomer (`kvx_io::ConnectionBudget`, by uid).
    pub connections_max: usize,
    pub connections_per_user_max: usize,
    pub refusals_logged: Arc<LogLimiter>,
}

/// Binds the handoff socket for the control listener on `port`, waiting up to
/// `REBIND_GRACE` for a buffer just dropped at the same port to let the name go.
pub(crate) async fn bind(port: u16, endpoint: &str) -> Result<UnixListener, FabricError> {
    let addr = socket_addr(port).map_err(|e| bad_endpoint(endpoint, e))?;
    let deadline = Instant::now() + REBIND_GRACE;
    loop {
        match std::os::unix::net::UnixListener::bind_addr(&addr) {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => {
                return Err(bad_endpoint(
                    endpoint,
                    format!("the shm handoff socket @{}: {e}", socket_name(port)),
                ))
            }
            Ok(l) => {
                return l
                    .set_nonblocking(true)
                    .and_then(|()| UnixListener::from_std(l))
                    .map_err(|e| bad_endpoint(endpoint, e))
            }
        }
    }
}

/// Serves offers until the buffer's owner drops its `landed` receiver (as the control accept
/// loop does).
pub(crate) async fn serve(listener: UnixListener, landed: mpsc::Sender<LandedWrite>, rules: Rules) {
    // By user: a Unix socket has no source address, and `SO_PEERCRED` is known at accept.
    let budget: ConnectionBudget<u32> =
        ConnectionBudget::new(rules.connections_max, rules.connections_per_user_max);
    loop {
        let accepted = tokio::select! {
            biased;
            () = landed.closed() => break,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, _)) => {
                let uid = stream.peer_cred().map_or(u32::MAX, |c| c.uid());
                let (held, Evicted(evicted)) = budget.open(uid);
                if evicted > 0 {
                    if let Some(left_out) = rules.refusals_logged.allow() {
                        warn!(
                            uid,
                            evicted,
                            left_out,
                            "shm handoff closed for a newcomer: connections_max reached"
                        );
                    }
                }
                let rules = rules.clone();
                tokio::spawn(async move {
                    let served = held
                        .run(tokio::time::timeout(
                            rules.timeout,
                            answer(stream, &rules, &held),
                        ))
                        .await;
                    let why = match served {
                        Some(Ok(Ok(()))) => return,
                        Some(Ok(Err(why))) => why,
                        Some(Err(_)) => format!("no offer within {:?}", rules.timeout),
                        None => "closed for a newcomer".to_owned(),
                    };
                    if let Some(left_out) = rules.refusals_logged.allow() {
                        warn!(%why, left_out, "shm staging refused");
                    }
                });
            }
            Err(e) => {
                warn!(error = %e, "shm handoff accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    debug!("shm buffer dropped; no more staging accepted");
}

/// One handoff connection: judge the offer, reply. `Err` is a refusal (already answered
/// when the peer could still read it), for the log.
async fn answer(mut stream: UnixStream, rules: &Rules, held: &Held<u32>) -> Result<(), String> {
    let (status, ticket, reason) = match judge(&stream, rules, held).await {
        Ok(ticket) => (HandoffStatus::Ok, ticket, String::new()),
        Err((status, reason)) => (status, 0, reason),
    };
    let reply = encode_reply(status, ticket, &reason);
    stream
        .write_all(&reply)
        .await
        .map_err(|e| format!("reply: {e}"))?;
    if status == HandoffStatus::Ok {
        debug!(ticket, "shm staging accepted");
        Ok(())
    } else {
        Err(reason)
    }
}

async fn judge(
    stream: &UnixStream,
    rules: &Rules,
    held: &Held<u32>,
) -> Result<u64, (HandoffStatus, String)> {
    // The peer's user is known at accept (`SO_PEERCRED`): an untrusted one's descriptors are
    // never taken into this process (the kernel closes them), a trusted one's beyond the
    // first are closed as they come. The offer is read before anything is judged, an
    // untrusted peer's too: a reply sent before the offer was read could close the socket
    // under the sender's `sendmsg`, which would then fail without the reason.
    let cred = stream
        .peer_cred()
        .map_err(|e| (HandoffStatus::Unauthorized, format!("SO_PEERCRED: {e}")))?;
    let trusted = rules.trust.admits(cred.uid());
    let (bytes, fds, truncated) = recv_offer(stream, trusted)
        .await
        .map_err(|e| (HandoffStatus::Staging, format!("reading the offer: {e}")))?;
    held.heard();
    if !trusted {
        return Err((
            HandoffStatus::Unauthorized,
            format!(
                "uid {} may not attach to a buffer of uid {}",
                cred.uid(),
                rules.trust.own
            ),
        ));
    }
    let Some(offer) = Offer::decode(&bytes) else {
        return Err((HandoffStatus::Version, "not a kvx staging offer".into()));
    };
    if offer.version != VERSION {
        return Err((
            HandoffStatus::Version,
            format!(
                "offer version {}, this receiver speaks {VERSION}",
                offer.version
            ),
        ));
    }
    let peer = rules
        .access
        .authenticate(&offer.credential)
        .ok_or_else(|| {
            (
                HandoffStatus::Unauthorized,
                "the credential was not issued by this receiver".to_owned(),
            )
        })?;
    let _ = held.authenticated();
    let Descriptors { first, seen } = fds;
    let (Some(fd), 1, false) = (first, seen, truncated) else {
        return Err((
            HandoffStatus::Staging,
            format!("the offer carries {seen} descriptors (truncated: {truncated}), not one"),
        ));
    };
    let view = StagingView::sealed(
        fd,
        offer.geometry.slots,
        offer.geometry.slot_bytes,
        rules.staging_bytes_max,
    )
    .map_err(|why| (HandoffStatus::Staging, why))?;
    rules.tickets.park(peer, view)
}

/// The descriptors that came with an offer: the first, kept only while it is the only one
/// (closed on drop unless used), and how many were seen.
#[derive(Debug, Default)]
struct Descriptors {
    first: Option<OwnedFd>,
    seen: usize,
}

/// Reads an offer's bytes and the descriptors that came with them. With `take_fds` false
/// (an untrusted peer) no descriptor enters this process: the kernel closes what a read
/// without room for them leaves. Otherwise the first is kept; once a second comes, every
/// one taken is closed at once and later reads leave no room, so one connection holds at
/// most `FDS_MAX` descriptors, briefly, whatever it sends. Bounded: each pass reads at
/// least one byte of the 48 or ends.
async fn recv_offer(
    stream: &UnixStream,
    take_fds: bool,
) -> io::Result<([u8; OFFER_LEN], Descriptors, bool)> {
    let mut b = [0u8; OFFER_LEN];
    let mut fds = Descriptors::default();
    let mut truncated = false;
    let mut got = 0;
    while got < OFFER_LEN {
        let room = take_fds && fds.seen <= 1;
        let n = stream
            .async_io(Interest::READABLE, || {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_MAX))];
                let space = if room {
                    &mut space[..]
                } else {
                    &mut space[..0]
                };
                let mut control = RecvAncillaryBuffer::new(space);
                let msg = rustix::net::recvmsg(
                    stream,
                    &mut [IoSliceMut::new(&mut b[got..])],
                    &mut control,
                    RecvFlags::CMSG_CLOEXEC,
                )?;
                for m in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(received) = m {
                        for fd in received {
                            fds.seen += 1;
                            if fds.seen == 1 {
                                fds.first = Some(fd);
                            }
                            // Past the first, each is dropped (closed) here.
                        }
                    }
                }
                if fds.seen > 1 {
                    fds.first = None;
                }
                // With no room, descriptors the peer sent show only as a cut control message.
                truncated |= msg.flags.contains(ReturnFlags::CTRUNC);
                Ok(msg.bytes)
            })
            .await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok((b, fds, truncated))
}

/// The sender's half: hands `memfd` (the staging of `geometry`) to the receiver whose control
/// listener is on `port` of this host, and returns the ticket to name in the hello. Bounded
/// by `timeout`.
pub(crate) async fn offer(
    port: u16,
    endpoint: &str,
    memfd: BorrowedFd<'_>,
    geometry: SlotGeometry,
    credential: FabricCredential,
    trust: &Trust,
    timeout: Duration,
) -> Result<u64, FabricError> {
    let exchange = async {
        let addr = socket_addr(port).map_err(|e| bad_endpoint(endpoint, e))?;
        // A Unix connect completes at once or fails: it never waits on a network.
        let std_stream = std::os::unix::net::UnixStream::connect_addr(&addr).map_err(|e| {
            bad_endpoint(
                endpoint,
                format!(
                    "no shm handoff socket @{} ({e}): is the receiver an shm buffer on this \
                     host, in this network namespace?",
                    socket_name(port)
                ),
            )
        })?;
        let io_err = |what: &str, e: io::Error| FabricError::Io(format!("{what}: {e}"));
        std_stream
            .set_nonblocking(true)
            .map_err(|e| io_err("handoff socket", e))?;
        let mut stream =
            UnixStream::from_std(std_stream).map_err(|e| io_err("handoff socket", e))?;
        let owner = stream
            .peer_cred()
            .map_err(|e| io_err("SO_PEERCRED", e))?
            .uid();
        if !trust.admits(owner) {
            return Err(bad_endpoint(
                endpoint,
                format!(
                    "the shm handoff socket belongs to uid {owner}, not a user this sender \
                     trusts with its staging"
                ),
            ));
        }
        let bytes = Offer {
            version: VERSION,
            geometry,
            credential,
        }
        .encode();
        let sent = match send_with_fd(&stream, &bytes, memfd).await {
            Ok(n) => stream.write_all(&bytes[n..]).await,
            Err(e) => Err(e),
        };
        // A receiver that refused and closed early may have left its reply: it says more
        // than the failed send.
        let mut reply = [0u8; REPLY_LEN];
        if let Err(e) = stream.read_exact(&mut reply).await {
            return Err(match sent {
                Err(send) => io_err("offer", send),
                Ok(()) => io_err("handoff reply", e),
            });
        }
        if reply[0..4] != MAGIC {
            return Err(bad_endpoint(endpoint, "not a kvx shm handoff socket"));
        }
        let status = HandoffStatus::from_code(u16::from_le_bytes([reply[4], reply[5]]));
        let reason_len = usize::from(u16::from_le_bytes([reply[6], reply[7]]));
        let mut ticket = [0u8; 8];
        ticket.copy_from_slice(&reply[8..16]);
        let mut reason = vec![0u8; reason_len.min(REASON_MAX)];
        stream
            .read_exact(&mut reason)
            .await
            .map_err(|e| io_err("handoff reason", e))?;
        let reason = String::from_utf8_lossy(&reason).into_owned();
        match status {
            Some(HandoffStatus::Ok) => Ok(u64::from_le_bytes(ticket)),
            Some(HandoffStatus::Unauthorized) => {
                Err(FabricError::Unauthorized(endpoint.to_owned(), reason))
            }
            Some(HandoffStatus::Staging) => Err(FabricError::Incompatible {
                endpoint: endpoint.to_owned(),
                why: format!("the receiver refused this sender's staging: {reason}"),
            }),
            other => Err(bad_endpoint(
                endpoint,
                format!("the staging offer was refused ({other:?}): {reason}"),
            )),
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(bad_endpoint(
            endpoint,
            format!("no answer to the staging offer within {timeout:?}"),
        )),
    }
}

/// Sends `bytes` (or a first part of them) with `fd` attached; returns how many went.
async fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    let sent = stream
        .async_io(Interest::WRITABLE, || {
            let fds = [fd];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                return Err(io::Error::other("no room for the descriptor"));
            }
            Ok(rustix::net::sendmsg(
                stream,
                &[IoSlice::new(bytes)],
                &mut control,
                SendFlags::NOSIGNAL,
            )?)
        })
        .await?;
    if sent == 0 {
        return Err(io::ErrorKind::WriteZero.into());
    }
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Root is trusted only when listed, like any other user.
    #[test]
    fn trust_is_the_own_uid_and_the_listed_ones() {
        let trust = Trust {
            own: 1000,
            extra: Arc::from(&[1001][..]),
        };
        assert!(trust.admits(1000) && trust.admits(1001));
        assert!(!trust.admits(0) && !trust.admits(1002));
        let root = Trust {
            own: 1000,
            extra: Arc::from(&[0][..]),
        };
        assert!(root.admits(0));
    }

    #[test]
    fn offers_round_trip_and_replies_cut_long_reasons() {
        let offer = Offer {
            version: VERSION,
            geometry: SlotGeometry {
                slots: 3,
                slot_bytes: 1 << 20,
            },
            credential: FabricAccess::new(1, [7; 16]).credential_for(PeerId(4)),
        };
        assert_eq!(Offer::decode(&offer.encode()), Some(offer));
        let mut other = offer.encode();
        other[0] = b'X';
        assert_eq!(Offer::decode(&other), None);
        let reply = encode_reply(HandoffStatus::Staging, 0, &"é".repeat(400));
        let len = usize::from(u16::from_le_bytes([reply[6], reply[7]]));
        assert_eq!(len, REASON_MAX);
        assert_eq!(reply.len(), REPLY_LEN + len);
        assert_eq!(HandoffStatus::from_code(1), Some(HandoffStatus::Staging));
    }
}
