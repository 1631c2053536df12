//! `ShmFabric`: sender and receiver on one host; a write is one `memcpy`, done by the
//! receiver, from the sender's staging straight into the receiver's slot.
//!
//! A sender's staging is a `memfd` sealed at its size (`map.rs`); it crosses to the receiver
//! as a descriptor, never as a name, so there is nothing in `/dev/shm` or any other file
//! system to guess, open or truncate. `connect` opens the control connection (TCP, as
//! `TcpFabric`'s: its own magic, the credential, the geometry), hands the descriptor over the
//! receiver's Unix handoff socket (`handoff.rs`: `SCM_RIGHTS`, the peer's uid checked both
//! ways), then names the ticket it got in its hello. The receiver maps the descriptor
//! read-only only if it is sealed against shrinking, growing and hole punching, backed
//! throughout, and exactly as large as the announced geometry, which is bounded
//! (`ShmFabricConfig::staging_bytes_max`): no access can fault, and a peer cannot make the
//! receiver reserve more address space than that.
//!
//! For each posted write the sender sends the 40-byte write header (id, remote slot, len,
//! immediate, checksum, staging slot) and nothing else; the receiver checks it against the
//! sender's grants, then copies the staging slot into its own buffer (which is private memory:
//! no other process maps it), computes the checksum over the copy while it is in the caches,
//! announces the landing and acks. The completion follows the ack, so it means the bytes are in
//! the receiver's memory and the receiver has heard of the write.
//!
//! Why a Unix socket beside the TCP control connection rather than instead of it: the
//! control protocol (handshake, write headers, acks, fences over fresh connections, flushes)
//! is `TcpFabric`'s, and its sender and receiver machinery is shared code built on TCP
//! streams; the descriptor is the only thing TCP cannot carry, so only it takes the Unix
//! socket, once per connection. The handoff checks what only a Unix socket can tell (the
//! peer's uid) and what the descriptor is; the control handshake keeps every check it makes
//! for `TcpFabric` and adds that the hello's geometry and credential are the offer's.
//!
//! Because the receiver does the copy, a write lands only where its sender holds the grant,
//! exactly as over TCP, and a fence stops the copies: the connection's task is what makes
//! them. Reset and broken connections flush as over TCP (`tcp_fabric::sender`). Layout and
//! notification format: `docs/spec/fabrics.md`.

mod handoff;
mod map;

use std::io;
use std::sync::Arc;

use kvx_io::{
    Fabric, FabricAccess, FabricConn, FabricCredential, FabricError, FabricListener, LogLimiter,
    PostWrite, SlotMemory,
};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::tcp_fabric::check_bounds;
use crate::tcp_fabric::link::{self, LinkConfig};
use crate::tcp_fabric::receiver::{self, Greeting, Landing, PullSource, Rules, Source};
use crate::tcp_fabric::sender::{Pending, SenderLink, Transmit};
use crate::tcp_fabric::wire::{Hello, WriteHeader, HEADER_LEN, SHM_MAGIC};
use handoff::{Tickets, Trust, TICKET_LEN};
use kvx_io::SlotGeometry;
pub use map::ShmMemory;
use map::StagingView;

/// Settings of a `ShmFabric`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmFabricConfig {
    /// The control channel's timeouts (`socket_buffer` matters little: it carries headers).
    /// `hello_timeout` also bounds a staging handoff (the receiver's side), `connections_max`
    /// the handoffs served at once and the offers parked for their control connection, and
    /// `connections_per_source_max` the handoffs from one user.
    pub link: LinkConfig,
    /// The largest sender staging a receiver maps, in bytes; a larger announced geometry is
    /// refused before anything is mapped. With `connections_max` it bounds the address space
    /// senders can make a receiver reserve: `2 × connections_max × staging_bytes_max` (parked
    /// offers plus attached connections; 32 TiB with the defaults, a quarter of x86-64's user
    /// address space).
    pub staging_bytes_max: u64,
    /// Users besides this process's own effective uid that may attach to its buffers (as a
    /// receiver) or receive its staging (as a sender); root is one only when listed.
    pub trusted_uids: Vec<u32>,
}

impl Default for ShmFabricConfig {
    fn default() -> Self {
        ShmFabricConfig {
            link: LinkConfig::default(),
            staging_bytes_max: 64 << 30,
            trusted_uids: Vec::new(),
        }
    }
}

/// One-sided writes through shared memory on one host. Clones share the configuration only.
#[derive(Debug, Clone, Default)]
pub struct ShmFabric {
    config: ShmFabricConfig,
}

impl ShmFabric {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_config(config: ShmFabricConfig) -> Self {
        ShmFabric { config }
    }
}

fn alloc_error(what: &str, e: impl std::fmt::Display) -> FabricError {
    FabricError::Allocation(format!("{what}: {e}"))
}

impl Fabric for ShmFabric {
    type Memory = ShmMemory;

    fn allocate_staging(&self, geometry: SlotGeometry) -> Result<Arc<ShmMemory>, FabricError> {
        // A sealed memfd the receiver maps read-only: it copies each admitted write out of it.
        ShmMemory::sealed_staging(geometry)
            .map(Arc::new)
            .map_err(|e| alloc_error("sealed memfd staging", e))
    }

    async fn expose(
        &self,
        endpoint: &str,
        geometry: SlotGeometry,
    ) -> Result<FabricListener<ShmMemory>, FabricError> {
        // Private memory: only this process writes it, copying out of senders' staging.
        let memory =
            Arc::new(ShmMemory::anonymous(geometry).map_err(|e| alloc_error("shm buffer", e))?);
        let listener = link::bind(endpoint, &self.config.link).await?;
        let local_endpoint = link::local_endpoint(&listener, endpoint)?;
        let port = listener
            .local_addr()
            .map_err(|e| FabricError::Io(e.to_string()))?
            .port();
        let handoff_listener = handoff::bind(port, endpoint).await?;
        let (landed_tx, landed) = kvx_io::landing_channel(geometry.slots);
        let access = Arc::new(FabricAccess::with_random_key(geometry.slots)?);
        let refusals_logged = Arc::new(LogLimiter::default());
        let link_config = &self.config.link;
        let tickets = Arc::new(Tickets::new(
            link_config.connections_max,
            link_config.connect_timeout,
        ));
        tokio::spawn(handoff::serve(
            handoff_listener,
            landed_tx.clone(),
            handoff::Rules {
                access: access.clone(),
                trust: Trust::new(&self.config.trusted_uids),
                staging_bytes_max: self.config.staging_bytes_max,
                tickets: tickets.clone(),
                timeout: link_config.hello_timeout,
                connections_max: link_config.connections_max,
                connections_per_user_max: link_config.connections_per_source_max,
                refusals_logged: refusals_logged.clone(),
            },
        ));
        let claim_access = access.clone();
        let greeting = Greeting {
            magic: SHM_MAGIC,
            extra: Arc::from(&[][..]),
            config: link_config.clone(),
            accept: Arc::new(move |hello, ticket| {
                claim_staging(&tickets, &claim_access, hello, ticket)
            }),
        };
        let rules = Rules {
            access: access.clone(),
            refusals_logged,
        };
        // The connection tasks hold `memory` only weakly: it goes with the listener.
        let weak: std::sync::Weak<dyn SlotMemory> = Arc::downgrade(&memory) as _;
        tokio::spawn(receiver::accept_loop(
            listener,
            Landing::Pulled(weak, geometry),
            landed_tx,
            greeting,
            rules,
        ));
        tracing::debug!(%local_endpoint, ?memory, "shm fabric buffer exposed");
        Ok(FabricListener {
            local_endpoint,
            memory,
            landed,
            access,
            // Every byte goes in through `FabricAccess::land` (the TCP fabric's receiver).
            revocation_stops_writes: true,
        })
    }

    async fn connect(
        &self,
        endpoint: &str,
        staging: Arc<ShmMemory>,
        credential: FabricCredential,
    ) -> Result<FabricConn, FabricError> {
        // Checked when `allocate_staging` made it (a shm staging is never lent).
        let ours = staging.geometry();
        let Some(memfd) = staging.memfd() else {
            return Err(FabricError::Io(
                "shm: the staging memory was not allocated by a ShmFabric".into(),
            ));
        };
        let mut stream = link::connect(endpoint, &self.config.link).await?;
        let peer = stream
            .peer_addr()
            .map_err(|e| FabricError::Io(e.to_string()))?;
        // The handoff socket is named after the port the control connection reached, so
        // `localhost:p` and `127.0.0.1:p` find the same one.
        let ticket = handoff::offer(
            peer.port(),
            endpoint,
            memfd,
            ours,
            credential,
            &Trust::new(&self.config.trusted_uids),
            self.config.link.connect_timeout,
        )
        .await?;
        let welcomed = link::open_handshake(
            &mut stream,
            endpoint,
            SHM_MAGIC,
            ours,
            credential,
            &ticket.to_le_bytes(),
            &self.config.link,
        )
        .await?;
        let (ops_tx, ops) = mpsc::unbounded_channel();
        let (done, done_rx) = mpsc::unbounded_channel();
        let link = SenderLink {
            stream,
            transmit: HeaderTransmit {
                staging_geometry: ours,
                remote_geometry: welcomed.geometry,
                outbox: [0; OUTBOX_LEN],
                filled: 0,
                sent: 0,
            },
            ops,
            done,
            fence_timeout: self.config.link.fence_timeout,
            peer,
            conn: welcomed.conn,
            magic: SHM_MAGIC,
            credential,
        };
        tokio::spawn(link.run());
        Ok(FabricConn::new(ops_tx, done_rx))
    }
}

/// The receiver's side of a sender's attach: the staging its handoff parked under the
/// ticket the hello names, offered by the same peer with the hello's geometry. A sender
/// cannot make the receiver read anything it did not hand over as a sealed descriptor.
fn claim_staging(
    tickets: &Tickets,
    access: &FabricAccess,
    hello: &Hello,
    ticket: &[u8],
) -> Result<Source, String> {
    let ticket: [u8; TICKET_LEN] = ticket
        .try_into()
        .map_err(|_| format!("the hello carries {} bytes, not a ticket", ticket.len()))?;
    let peer = access
        .authenticate(&hello.credential)
        .ok_or("the credential was not issued by this receiver")?;
    let geometry = SlotGeometry {
        slots: hello.staging_slots,
        slot_bytes: hello.staging_slot_bytes,
    };
    let view = tickets.claim(u64::from_le_bytes(ticket), peer, geometry)?;
    Ok(Some(Box::new(view)))
}

impl PullSource for StagingView {
    fn geometry(&self) -> SlotGeometry {
        SlotGeometry {
            slots: self.slots(),
            slot_bytes: self.slot_bytes() as u64,
        }
    }

    fn copy_out(&self, slot: u32, dst: &mut [u8], checksum: bool) -> Option<u32> {
        StagingView::copy_out(self, slot, dst, checksum)
    }
}

/// Headers waiting for the socket, at most.
const OUTBOX_LEN: usize = HEADER_LEN * 64;

/// Sends each write's header: the receiver copies the bytes out of the staging itself.
#[derive(Debug)]
struct HeaderTransmit {
    staging_geometry: SlotGeometry,
    remote_geometry: SlotGeometry,
    outbox: [u8; OUTBOX_LEN],
    filled: usize,
    sent: usize,
}

impl Transmit for HeaderTransmit {
    fn check(&self, w: &PostWrite) -> Result<(), FabricError> {
        check_bounds(w, self.staging_geometry, self.remote_geometry)
    }

    fn staging_slot_bytes(&self) -> usize {
        self.staging_geometry.slot_bytes as usize
    }

    fn backlog(&self) -> bool {
        self.sent < self.filled
    }

    fn transmit(&mut self, stream: &TcpStream, pending: &mut Pending) -> io::Result<()> {
        loop {
            // Headers already queued go first, in order.
            while self.sent < self.filled {
                match stream.try_write(&self.outbox[self.sent..self.filled]) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(n) => self.sent += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
            self.filled = 0;
            self.sent = 0;
            while self.filled + HEADER_LEN <= OUTBOX_LEN {
                let Some(w) = pending.next_unsent() else {
                    break;
                };
                let header = WriteHeader::of(&w).encode();
                self.outbox[self.filled..self.filled + HEADER_LEN].copy_from_slice(&header);
                self.filled += HEADER_LEN;
                pending.mark_sent();
            }
            if self.filled == 0 {
                return Ok(());
            }
        }
    }
}
