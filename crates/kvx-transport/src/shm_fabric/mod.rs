//! `ShmFabric`: sender and receiver on one host; a write is one `memcpy` from the staging
//! slot straight into the receiver's slot through a shared mapping.
//!
//! `expose` creates a file under the fabric's directory (`/dev/shm` by default) holding the
//! whole buffer, maps it, and listens on the endpoint (loopback TCP) for senders: the control
//! channel. A sender connects, handshakes as over `TcpFabric` (its own magic), learns the file
//! name and geometry from the `Welcome`, and maps the same file. For each posted write its
//! task copies the payload into the mapped slot, then sends the 32-byte write header (id,
//! remote slot, len, immediate, checksum) as the notification; the receiver checks it against
//! the sender's grants, computes the checksum over the mapped slot, announces the landing
//! and acks. The completion follows the ack, so it means the bytes are in the receiver's
//! memory and the receiver has heard of the write. Only an authenticated sender learns the
//! file's name (the welcome carries it only after the credential verified).
//!
//! Reset and broken connections flush exactly as over TCP (`tcp_fabric::sender`): the sender
//! stops copying at once, fences the receiver, then flushes. The file is removed when the
//! exposing side's memory is dropped; senders' mappings stay valid until they let go.
//! Layout and notification format: `docs/spec/fabrics.md`.

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
use crate::tcp_fabric::receiver::{self, Greeting, Landing, Rules};
use crate::tcp_fabric::sender::{Pending, SenderLink, Transmit};
use crate::tcp_fabric::wire::{WriteHeader, HEADER_LEN, SHM_MAGIC};
pub use map::ShmMemory;
use map::{SharedSlots, FILE_PREFIX};

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
        ShmMemory::anonymous(slots, slot_bytes)
            .map(Arc::new)
            .map_err(|e| alloc_error("staging mapping", e))
    }

    async fn expose(
        &self,
        endpoint: &str,
        slots: u32,
        slot_bytes: usize,
    ) -> Result<FabricListener<ShmMemory>, FabricError> {
        let geometry = Geometry::checked(slots, slot_bytes)?;
        // Creating and filling the file writes the whole buffer: keep it off the IO threads.
        let dir = self.config.dir.clone();
        let created =
            tokio::task::spawn_blocking(move || ShmMemory::create_shared(&dir, slots, slot_bytes))
                .await
                .map_err(|e| alloc_error("shm buffer", e))?;
        let memory = Arc::new(created.map_err(|e| {
            alloc_error(&format!("shm buffer in {}", self.config.dir.display()), e)
        })?);
        let path = memory
            .path()
            .expect("invariant: an exposed ShmMemory has a file")
            .as_os_str()
            .as_bytes()
            .to_vec();
        // On error `memory` drops here and takes its file with it.
        let listener = link::bind(endpoint, &self.config.link).await?;
        let local_endpoint = link::local_endpoint(&listener, endpoint)?;
        let (landed_tx, landed) = kvx_io::landing_channel(slots);
        let greeting = Greeting {
            magic: SHM_MAGIC,
            extra: Arc::from(path),
            config: self.config.link.clone(),
        };
        let access = Arc::new(FabricAccess::with_random_key(slots)?);
        let rules = Rules {
            access: access.clone(),
            refusals_logged: Arc::new(LogLimiter::default()),
        };
        // The control tasks hold `memory` only weakly: dropping the listener removes the file.
        let weak: std::sync::Weak<dyn SlotMemory> = Arc::downgrade(&memory) as _;
        tokio::spawn(receiver::accept_loop(
            listener,
            Landing::Shared(weak, geometry),
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
            &self.config.link,
        )
        .await?;
        let refuse = |why: String| FabricError::Endpoint {
            endpoint: endpoint.to_owned(),
            why,
        };
        let path = buffer_path(&self.config.dir, &welcomed.extra).map_err(&refuse)?;
        if staging.path() == Some(path.as_path()) {
            return Err(refuse("staging is the receiver's own buffer".into()));
        }
        let remote_geometry = welcomed.geometry;
        let slot_bytes = usize::try_from(remote_geometry.slot_bytes)
            .map_err(|_| refuse("remote slots exceed the address space".into()))?;
        let remote = SharedSlots::open(&path, remote_geometry.slots, slot_bytes).map_err(|e| {
            refuse(format!(
                "cannot map {} (is the receiver on this host?): {e}",
                path.display()
            ))
        })?;
        let (ops_tx, ops) = mpsc::unbounded_channel();
        let (done, done_rx) = mpsc::unbounded_channel();
        let link = SenderLink {
            stream,
            transmit: SharedTransmit {
                staging,
                staging_geometry: ours,
                remote,
                remote_geometry,
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

/// The file a receiver named, if it is one this fabric could have created: directly in our
/// directory, with our prefix. A receiver cannot make a sender write anywhere else.
fn buffer_path(dir: &Path, named: &[u8]) -> Result<PathBuf, String> {
    let path = PathBuf::from(OsStr::from_bytes(named));
    let ours = path.parent() == Some(dir)
        && path
            .file_name()
            .is_some_and(|n| n.as_bytes().starts_with(FILE_PREFIX.as_bytes()));
    if ours {
        Ok(path)
    } else {
        Err(format!(
            "the receiver's buffer {} is not a kvx file in {}",
            path.display(),
            dir.display()
        ))
    }
}

/// Headers waiting for the socket, at most.
const OUTBOX_LEN: usize = HEADER_LEN * 64;
/// Payload bytes one `transmit` call copies before the task looks at acks and resets.
const COPY_BUDGET: usize = 8 << 20;

/// Copies each write into the receiver's mapping, then queues its header as the notice.
#[derive(Debug)]
struct SharedTransmit {
    staging: Arc<ShmMemory>,
    staging_geometry: Geometry,
    remote: SharedSlots,
    remote_geometry: Geometry,
    outbox: [u8; OUTBOX_LEN],
    filled: usize,
    sent: usize,
}

impl Transmit for SharedTransmit {
    fn check(&self, w: &PostWrite) -> Result<(), FabricError> {
        check_bounds(w, self.staging_geometry, self.remote_geometry)
    }

    fn backlog(&self) -> bool {
        self.sent < self.filled
    }

    fn transmit(&mut self, stream: &TcpStream, pending: &mut Pending) -> io::Result<()> {
        let mut budget = COPY_BUDGET;
        loop {
            // Notices of writes already copied go first, in order.
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
            while budget > 0 && self.filled + HEADER_LEN <= OUTBOX_LEN {
                let Some(w) = pending.next_unsent() else {
                    break;
                };
                let remote = &self.remote;
                self.staging.with_slot(w.local.0, |src| {
                    remote.copy_into(w.remote.0, &src[..w.len]);
                });
                let header = WriteHeader::of(&w).encode();
                self.outbox[self.filled..self.filled + HEADER_LEN].copy_from_slice(&header);
                self.filled += HEADER_LEN;
                pending.mark_sent();
                budget = budget.saturating_sub(w.len.max(HEADER_LEN));
            }
            if self.filled == 0 {
                return Ok(());
            }
        }
    }
}
