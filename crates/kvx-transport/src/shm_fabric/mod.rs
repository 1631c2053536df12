//! `ShmFabric`: sender and receiver on one host; a write is one `memcpy`, done by the
//! receiver, from the sender's staging straight into the receiver's slot.
//!
//! A sender's staging is a file under the fabric's directory (`/dev/shm` by default, mode
//! 0600, removed when the staging is dropped). `connect` handshakes as over `TcpFabric` (its
//! own magic, the credential) and names that file after its hello; the receiver maps it
//! read-only, checking that it is a kvx file of the declared size in its own directory. For
//! each posted write the sender sends the 40-byte write header (id, remote slot, len,
//! immediate, checksum, staging slot) and nothing else; the receiver checks it against the
//! sender's grants, then copies the staging slot into its own buffer (which is private memory:
//! no other process maps it), computes the checksum over the copy while it is in the caches,
//! announces the landing and acks. The completion follows the ack, so it means the bytes are in
//! the receiver's memory and the receiver has heard of the write.
//!
//! Because the receiver does the copy, a write lands only where its sender holds the grant,
//! exactly as over TCP, and a fence stops the copies: the connection's task is what makes
//! them. Reset and broken connections flush as over TCP (`tcp_fabric::sender`). Layout and
//! notification format: `docs/spec/fabrics.md`.

mod map;

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvx_io::{
    Fabric, FabricAccess, FabricConn, FabricCredential, FabricError, FabricListener, LogLimiter,
    PostWrite, SlotMemory,
};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::tcp_fabric::check_bounds;
use crate::tcp_fabric::link::{self, Geometry, LinkConfig};
use crate::tcp_fabric::receiver::{self, Greeting, Landing, PullSource, Rules, Source};
use crate::tcp_fabric::sender::{Pending, SenderLink, Transmit};
use crate::tcp_fabric::wire::{Hello, WriteHeader, HEADER_LEN, SHM_MAGIC};
pub use map::ShmMemory;
use map::{StagingView, FILE_PREFIX};

/// Settings of a `ShmFabric`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmFabricConfig {
    /// Where exposed buffers' files are created; a tmpfs, so the buffer is memory.
    pub dir: PathBuf,
    /// The control channel's timeouts (`socket_buffer` matters little: it carries headers).
    pub link: LinkConfig,
}

impl Default for ShmFabricConfig {
    fn default() -> Self {
        ShmFabricConfig {
            dir: PathBuf::from("/dev/shm"),
            link: LinkConfig::default(),
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

    fn allocate_staging(
        &self,
        slots: u32,
        slot_bytes: usize,
    ) -> Result<Arc<ShmMemory>, FabricError> {
        Geometry::checked(slots, slot_bytes)?;
        // A file the receiver maps read-only: it copies each admitted write out of it.
        ShmMemory::create_shared(&self.config.dir, slots, slot_bytes)
            .map(Arc::new)
            .map_err(|e| alloc_error(&format!("staging in {}", self.config.dir.display()), e))
    }

    async fn expose(
        &self,
        endpoint: &str,
        slots: u32,
        slot_bytes: usize,
    ) -> Result<FabricListener<ShmMemory>, FabricError> {
        let geometry = Geometry::checked(slots, slot_bytes)?;
        // Private memory: only this process writes it, copying out of senders' staging.
        let memory = Arc::new(
            ShmMemory::anonymous(slots, slot_bytes).map_err(|e| alloc_error("shm buffer", e))?,
        );
        let listener = link::bind(endpoint, &self.config.link).await?;
        let local_endpoint = link::local_endpoint(&listener, endpoint)?;
        let (landed_tx, landed) = kvx_io::landing_channel(slots);
        let dir = self.config.dir.clone();
        let greeting = Greeting {
            magic: SHM_MAGIC,
            extra: Arc::from(&[][..]),
            config: self.config.link.clone(),
            accept: Arc::new(move |hello, named| open_staging(&dir, hello, named)),
        };
        let access = Arc::new(FabricAccess::with_random_key(slots)?);
        let rules = Rules {
            access: access.clone(),
            refusals_logged: Arc::new(LogLimiter::default()),
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
        })
    }

    async fn connect(
        &self,
        endpoint: &str,
        staging: Arc<ShmMemory>,
        credential: FabricCredential,
    ) -> Result<FabricConn, FabricError> {
        let ours = Geometry::checked(staging.slots(), staging.slot_bytes())?;
        let Some(path) = staging.path() else {
            return Err(FabricError::Io(
                "shm: the staging memory was not allocated by a ShmFabric".into(),
            ));
        };
        let named = path.as_os_str().as_bytes().to_vec();
        let mut stream = link::connect(endpoint, &self.config.link).await?;
        let peer = stream
            .peer_addr()
            .map_err(|e| FabricError::Io(e.to_string()))?;
        let welcomed = link::open_handshake(
            &mut stream,
            endpoint,
            SHM_MAGIC,
            ours,
            credential,
            &named,
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

/// The receiver's side of a sender's attach: maps the staging file the hello names, if it is
/// one a `ShmFabric` could have created — directly in our directory, with our prefix, a
/// regular file of the declared geometry. A sender cannot make the receiver read anything else.
fn open_staging(dir: &Path, hello: &Hello, named: &[u8]) -> Result<Source, String> {
    let path = staging_path(dir, named)?;
    let slot_bytes = usize::try_from(hello.staging_slot_bytes)
        .map_err(|_| "staging slots exceed the address space".to_owned())?;
    let view = StagingView::open(&path, hello.staging_slots, slot_bytes)
        .map_err(|e| format!("cannot map the staging {}: {e}", path.display()))?;
    Ok(Some(Box::new(view)))
}

fn staging_path(dir: &Path, named: &[u8]) -> Result<PathBuf, String> {
    let path = PathBuf::from(OsStr::from_bytes(named));
    let ours = path.parent() == Some(dir)
        && path
            .file_name()
            .is_some_and(|n| n.as_bytes().starts_with(FILE_PREFIX.as_bytes()));
    if ours {
        Ok(path)
    } else {
        Err(format!(
            "the sender's staging {} is not a kvx file in {}",
            path.display(),
            dir.display()
        ))
    }
}

impl PullSource for StagingView {
    fn geometry(&self) -> Geometry {
        Geometry {
            slots: self.slots(),
            slot_bytes: self.slot_bytes() as u64,
        }
    }

    fn copy_out(&self, slot: u32, dst: &mut [u8]) {
        StagingView::copy_out(self, slot, dst);
    }
}

/// Headers waiting for the socket, at most.
const OUTBOX_LEN: usize = HEADER_LEN * 64;

/// Sends each write's header: the receiver copies the bytes out of the staging itself.
#[derive(Debug)]
struct HeaderTransmit {
    staging_geometry: Geometry,
    remote_geometry: Geometry,
    outbox: [u8; OUTBOX_LEN],
    filled: usize,
    sent: usize,
}

impl Transmit for HeaderTransmit {
    fn check(&self, w: &PostWrite) -> Result<(), FabricError> {
        check_bounds(w, self.staging_geometry, self.remote_geometry)
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
