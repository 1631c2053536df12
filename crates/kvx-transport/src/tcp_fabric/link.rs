//! Sockets and the handshake, shared by `TcpFabric` and `ShmFabric`'s control channel.
//!
//! Both fabrics open one TCP connection per sender: a `Hello` from the sender, a `Welcome`
//! (with the buffer's geometry) from the receiver, then write headers one way and acks the
//! other. Everything that can wait on the network here is bounded by a timeout.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use kvx_io::sockets::{self, bad_endpoint};
use kvx_io::{FabricAccess, FabricCredential, FabricError, SlotGeometry};
use kvx_proto::PeerId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::wire::{
    Hello, HelloKind, Welcome, WelcomeStatus, ACCEPTED_VERSIONS, HELLO_BASE_LEN, HELLO_LEN,
    VERSION, WELCOME_EXTRA_MAX, WELCOME_LEN,
};

/// Settings of the TCP connections a fabric makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkConfig {
    /// Bounds a sender's connect and handshake.
    pub connect_timeout: Duration,
    /// How long a receiver waits for an accepted connection's whole `Hello` (and the bytes
    /// that follow it) and takes to write its `Welcome`; a connection that says nothing, or
    /// trickles its hello, is closed then. Short, because a connection that has not greeted
    /// holds a place among `connections_max` (it is the first to go for a newcomer, but a
    /// place all the same). Also bounds a shm staging handoff. Default 3 s.
    pub hello_timeout: Duration,
    /// How long a flush waits for the receiver to confirm (over a fresh connection) that it
    /// stopped applying the old connection's writes before flushing anyway; also how long a
    /// receiver waits for a fenced connection to stop. See `docs/spec/fabrics.md` §Flush.
    pub fence_timeout: Duration,
    /// `SO_SNDBUF` / `SO_RCVBUF` in bytes; `None` leaves Linux's autotuning alone, which grows
    /// the buffers past what `net.core.rmem_max` allows a fixed size, and on loopback measured
    /// faster than a fixed 4 MiB (`docs/spec/fabrics.md` §Throughput).
    pub socket_buffer: Option<u32>,
    /// Sends payloads with `vmsplice` + `splice` instead of copying them into the socket
    /// (Linux; elsewhere ignored): one copy of every byte fewer (`tcp_fabric/splice.rs`), but
    /// page pinning and page-sized socket fragments instead. Off by default: on the 2-core VM
    /// it measured no faster in `kvx demo` and 25–30 % slower in `kvx bench` while another job
    /// held a core (`docs/spec/fabrics.md` §3); measure on the target host before enabling.
    pub zero_copy: bool,
    /// Connections one exposed buffer serves at once, handshaking ones included. Past it a
    /// newcomer is still taken (`kvx_io::ConnectionBudget`) and a connection that did not
    /// authenticate is closed for it: one that never completed a hello first (the oldest of
    /// those first), then one that greeted without a credential. When every place is
    /// authenticated, the newcomer greets beyond the cap (with at most a quarter of it
    /// others), and its own authentication closes the authenticated connection whose last
    /// write landed longest ago; so idle sockets never lock a sender out, and a sender that
    /// is writing is never closed for an idle newcomer. A sender holds one (plus one for
    /// a moment while it fences), so the default of 256 serves 255 senders per TP rank and
    /// bounds what a flood of sockets can hold (each connection buffers at most one header,
    /// 64 KiB of acks and, while it discards a refused payload, 64 KiB). Also bounds the shm
    /// handoff connections and the offers parked for their control connection.
    pub connections_max: usize,
    /// Connections from one source address at most (for the shm handoff, from one user);
    /// past it the quietest of that source's connections is closed for the newcomer, so that
    /// one address's flood evicts its own connections first. Default 64; above
    /// `connections_max` it is `connections_max`.
    pub connections_per_source_max: usize,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            connect_timeout: Duration::from_secs(5),
            hello_timeout: Duration::from_secs(3),
            fence_timeout: Duration::from_secs(5),
            socket_buffer: None,
            zero_copy: false,
            connections_max: 256,
            connections_per_source_max: 64,
        }
    }
}

/// Binds the receiving side (`sockets::bind`, with the configured buffer sizes).
pub(crate) async fn bind(endpoint: &str, config: &LinkConfig) -> Result<TcpListener, FabricError> {
    sockets::bind(endpoint, config.socket_buffer).await
}

pub(crate) use kvx_io::sockets::local_endpoint;

/// Options every fabric socket gets. NODELAY because acks and shm notices are small and
/// latency-bound; bulk payloads go out in large vectored writes, which Nagle would not help.
pub(crate) fn tune(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)
}

/// Connects a sender, bounded by `connect_timeout`.
pub(crate) async fn connect(endpoint: &str, config: &LinkConfig) -> Result<TcpStream, FabricError> {
    sockets::connect(endpoint, config.connect_timeout, config.socket_buffer).await
}

/// What a sender learns from a successful handshake.
#[derive(Debug)]
pub(crate) struct Welcomed {
    pub geometry: SlotGeometry,
    /// The receiver's id for this connection, to name it in a fence.
    pub conn: u64,
}

/// The sender's half of the handshake, bounded by `connect_timeout`. `extra` follows the hello
/// (`ShmFabric`: the ticket of the staging descriptor it handed over).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn open_handshake(
    stream: &mut TcpStream,
    endpoint: &str,
    magic: [u8; 4],
    staging: SlotGeometry,
    credential: FabricCredential,
    extra: &[u8],
    config: &LinkConfig,
) -> Result<Welcomed, FabricError> {
    let exchange = async {
        let hello = Hello {
            magic,
            version: VERSION,
            kind: HelloKind::Attach,
            staging_slots: staging.slots,
            staging_slot_bytes: staging.slot_bytes,
            conn: 0,
            credential,
            extra_len: extra.len() as u32,
        };
        let mut out = hello.encode().to_vec();
        out.extend_from_slice(extra);
        stream.write_all(&out).await?;
        let mut b = [0u8; WELCOME_LEN];
        stream.read_exact(&mut b).await?;
        let welcome = Welcome::decode(&b);
        let mut extra = Vec::new();
        if welcome.magic == magic
            && welcome.status == WelcomeStatus::Ok
            && welcome.extra_len <= WELCOME_EXTRA_MAX
        {
            extra.resize(welcome.extra_len as usize, 0);
            stream.read_exact(&mut extra).await?;
        }
        Ok::<_, io::Error>((welcome, extra))
    };
    let (welcome, extra) = match tokio::time::timeout(config.connect_timeout, exchange).await {
        Ok(Ok(v)) => v,
        // A receiver that hangs up on our Hello is not one of ours (or refused the magic);
        // hanging up before reading all of it resets the connection instead.
        Ok(Err(e))
            if matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
            ) =>
        {
            return Err(bad_endpoint(
                endpoint,
                "the peer closed during the handshake",
            ))
        }
        Ok(Err(e)) => return Err(FabricError::Io(format!("handshake with {endpoint}: {e}"))),
        Err(_) => {
            return Err(bad_endpoint(
                endpoint,
                format!("no handshake within {:?}", config.connect_timeout),
            ))
        }
    };
    if welcome.magic != magic {
        return Err(bad_endpoint(endpoint, "not a kvx buffer of this fabric"));
    }
    let geometry = SlotGeometry {
        slots: welcome.slots,
        slot_bytes: welcome.slot_bytes,
    };
    let incompatible = |why: String| FabricError::Incompatible {
        endpoint: endpoint.to_owned(),
        why,
    };
    match welcome.status {
        WelcomeStatus::Ok => {}
        WelcomeStatus::Version => {
            return Err(incompatible(format!(
                "the receiver speaks fabric version {}, we speak {VERSION}",
                welcome.version
            )))
        }
        WelcomeStatus::Geometry => {
            return Err(incompatible(kvx_io::fabric::slot_size_mismatch(
                staging.slot_bytes as usize,
                geometry.slot_bytes as usize,
            )))
        }
        WelcomeStatus::Unauthorized => {
            return Err(FabricError::Unauthorized(
                endpoint.to_owned(),
                "not issued by this receiver (it may have restarted)".into(),
            ))
        }
        WelcomeStatus::Staging => {
            return Err(incompatible(
                "the receiver has no staging handed over under this connection's ticket".into(),
            ))
        }
        WelcomeStatus::FenceTimeout | WelcomeStatus::Unknown(_) => {
            return Err(bad_endpoint(
                endpoint,
                format!("refused ({:?})", welcome.status),
            ))
        }
    }
    if welcome.extra_len > WELCOME_EXTRA_MAX || geometry.slots == 0 || geometry.slot_bytes == 0 {
        return Err(bad_endpoint(endpoint, "malformed welcome"));
    }
    // Trailing bytes of the welcome carry nothing this version reads.
    drop(extra);
    Ok(Welcomed {
        geometry,
        conn: welcome.conn,
    })
}

/// What a receiver learnt from a `Hello`.
#[derive(Debug)]
pub(crate) enum Greeted<S> {
    /// A sender of `PeerId` attached (and was welcomed), with what `accept` made of its
    /// hello: writes follow.
    Attached(PeerId, S),
    /// `PeerId` asks to fence its connection `conn`; answer with `answer_fence`.
    Fence(u64, PeerId),
}

/// What a receiver's fabric makes of an attaching sender's hello and the bytes that follow
/// it, before welcoming it (`ShmFabric` claims the staging handed over under the ticket that
/// follows); `Err` refuses it with
/// `WelcomeStatus::Staging`.
pub(crate) type Accept<S> = dyn Fn(&Hello, &[u8]) -> Result<S, String> + Send + Sync;

/// The receiver's half of the handshake, bounded by `hello_timeout`. Refuses a sender of
/// another fabric, another version, a credential this buffer did not issue, or staging slots
/// of another size than ours (a smaller chunk would leave each slot's tail stale, a larger
/// one could not land); `extra` follows only an accepting `Welcome`,
/// which names the connection `conn`. A fence request is returned unanswered.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn accept_handshake<S>(
    stream: &mut TcpStream,
    magic: [u8; 4],
    ours: SlotGeometry,
    extra: &[u8],
    conn: u64,
    access: &FabricAccess,
    accept: &Accept<S>,
    config: &LinkConfig,
) -> Result<Greeted<S>, String> {
    let exchange = async {
        let mut b = [0u8; HELLO_LEN];
        stream
            .read_exact(&mut b[..HELLO_BASE_LEN])
            .await
            .map_err(|e| e.to_string())?;
        let base = Hello::decode_base(&b);
        if base.magic != magic {
            // Not one of ours: hang up without answering.
            return Err(format!("unknown magic {:?}", base.magic));
        }
        let mut peer = None;
        let mut accepted_as = None;
        let status = if !ACCEPTED_VERSIONS.contains(&base.version) {
            // Answered from the version-independent part: an older sender reads why.
            WelcomeStatus::Version
        } else {
            stream
                .read_exact(&mut b[HELLO_BASE_LEN..])
                .await
                .map_err(|e| e.to_string())?;
            let hello = Hello::decode(&b);
            if hello.extra_len > WELCOME_EXTRA_MAX {
                return Err(format!("a hello announcing {} more bytes", hello.extra_len));
            }
            let mut more = vec![0u8; hello.extra_len as usize];
            stream
                .read_exact(&mut more)
                .await
                .map_err(|e| e.to_string())?;
            peer = access.authenticate(&hello.credential);
            match (hello.kind, peer) {
                (HelloKind::Unknown(k), _) => return Err(format!("unknown hello kind {k}")),
                (_, None) => WelcomeStatus::Unauthorized,
                (HelloKind::Fence, Some(p)) => return Ok(Greeted::Fence(hello.conn, p)),
                (HelloKind::Attach, _) if hello.staging_slot_bytes != ours.slot_bytes => {
                    WelcomeStatus::Geometry
                }
                (HelloKind::Attach, _) => match accept(&hello, &more) {
                    Ok(s) => {
                        accepted_as = Some(s);
                        WelcomeStatus::Ok
                    }
                    Err(why) => {
                        tracing::debug!(%why, "fabric sender's staging refused");
                        WelcomeStatus::Staging
                    }
                },
            }
        };
        let accepted = status == WelcomeStatus::Ok;
        let welcome = Welcome {
            magic,
            version: VERSION,
            status,
            slots: ours.slots,
            extra_len: if accepted { extra.len() as u32 } else { 0 },
            slot_bytes: ours.slot_bytes,
            conn,
        };
        stream
            .write_all(&welcome.encode())
            .await
            .map_err(|e| e.to_string())?;
        let (Some(peer), Some(s)) = (peer.filter(|_| accepted), accepted_as) else {
            return Err(format!("refused: {status:?} (version {})", base.version));
        };
        stream.write_all(extra).await.map_err(|e| e.to_string())?;
        Ok(Greeted::Attached(peer, s))
    };
    match tokio::time::timeout(config.hello_timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(format!("no hello within {:?}", config.hello_timeout)),
    }
}

/// The receiver's answer to a fence request: `status` says whether the connection `conn`
/// applies nothing any more (`Ok`), did not stop in time, or is not the asker's to fence.
pub(crate) async fn answer_fence(
    stream: &mut TcpStream,
    magic: [u8; 4],
    conn: u64,
    status: WelcomeStatus,
) -> io::Result<()> {
    let welcome = Welcome {
        magic,
        version: VERSION,
        status,
        slots: 0,
        extra_len: 0,
        slot_bytes: 0,
        conn,
    };
    stream.write_all(&welcome.encode()).await
}

/// The sender's fence: over a fresh connection to `addr`, asks the receiver to stop applying
/// connection `conn` and waits for it to confirm, within `limit`. Ok means nothing from that
/// connection can land any more; so does a refused connection (no listener, no receiver).
pub(crate) async fn fence_remote(
    addr: SocketAddr,
    magic: [u8; 4],
    conn: u64,
    credential: FabricCredential,
    limit: Duration,
) -> Result<(), String> {
    let exchange = async {
        let mut stream = match TcpStream::connect(addr).await {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Ok(()),
            Err(e) => return Err(format!("connect: {e}")),
        };
        let hello = Hello {
            magic,
            version: VERSION,
            kind: HelloKind::Fence,
            staging_slots: 0,
            staging_slot_bytes: 0,
            conn,
            credential,
            extra_len: 0,
        };
        stream
            .write_all(&hello.encode())
            .await
            .map_err(|e| format!("send: {e}"))?;
        let mut b = [0u8; WELCOME_LEN];
        stream
            .read_exact(&mut b)
            .await
            .map_err(|e| format!("answer: {e}"))?;
        let welcome = Welcome::decode(&b);
        if welcome.magic != magic || welcome.conn != conn {
            return Err(format!("unexpected answer {welcome:?}"));
        }
        match welcome.status {
            WelcomeStatus::Ok => Ok(()),
            other => Err(format!("the receiver answered {other:?}")),
        }
    };
    match tokio::time::timeout(limit, exchange).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {limit:?}")),
    }
}
