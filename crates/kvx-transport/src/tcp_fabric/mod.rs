//! `TcpFabric`: one-sided writes carried over TCP, for clusters without RDMA.
//!
//! The receiver binds a listener at the exposed endpoint; its buffer is a `LocalMemory` (kvx's own allocation, or a region the caller lends).
//! Each sender opens one connection, handshakes (magic, version, geometry), then streams a
//! 40-byte header and the payload for every posted write, straight from its staging slot
//! (a vectored write, no copy); a run of consecutive slots (`kvx_io::WriteRun`) goes as one
//! write, its headers then its payload. The receiver validates each header, reads the
//! payload straight into the slot, sends its `Landed` notice if the write carries an
//! immediate, and acks; the sender turns acks into completions in posting order. Writes are
//! pipelined: nothing waits for an ack before the next write goes out.
//!
//! A completion therefore means the bytes are in the receiver's memory. A reset or a broken
//! connection flushes every outstanding write with `FabricError::Flushed`, after the receiver
//! has confirmed it stopped applying this sender's writes (bounded; see
//! `docs/spec/fabrics.md` §Flush, which also gives the wire format and measured throughput).
//!
//! Submodules `link`, `sender`, `receiver` (with `receiver_conn`, one connection's task) and
//! `wire` are shared with `ShmFabric`, whose
//! control channel is this protocol without payloads.

pub(crate) mod link;
pub(crate) mod receiver;
mod receiver_conn;
pub(crate) mod sender;
#[cfg(target_os = "linux")]
mod splice;
pub(crate) mod wire;

use std::io::{self, IoSlice};
use std::sync::Arc;

use kvx_io::{
    ExternalRegion, Fabric, FabricAccess, FabricConn, FabricCredential, FabricError,
    FabricListener, LocalMemory, LogLimiter, PostWrite, SlotMemory,
};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use kvx_io::SlotGeometry;
pub use link::LinkConfig as TcpFabricConfig;
use receiver::{Greeting, Landing, Rules};
use sender::{Pending, SenderLink, Transmit};
use wire::{WriteHeader, FLAG_RUN, TCP_MAGIC};

/// One-sided writes over TCP. Clones share the configuration only; every exposed buffer and
/// every connection is independent.
#[derive(Debug, Clone, Default)]
pub struct TcpFabric {
    config: TcpFabricConfig,
}

impl TcpFabric {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_config(config: TcpFabricConfig) -> Self {
        TcpFabric { config }
    }

    /// Accepts writes into `memory` at `endpoint`.
    async fn expose_memory(
        &self,
        endpoint: &str,
        memory: Arc<LocalMemory>,
    ) -> Result<FabricListener<LocalMemory>, FabricError> {
        let (slots, slot_bytes) = (memory.slots(), memory.slot_bytes());
        let listener = link::bind(endpoint, &self.config).await?;
        let local_endpoint = link::local_endpoint(&listener, endpoint)?;
        let (landed_tx, landed) = kvx_io::landing_channel(slots);
        let greeting = Greeting {
            magic: TCP_MAGIC,
            extra: Arc::from(&[][..]),
            config: self.config.clone(),
            // Payloads follow their headers: nothing to pull from.
            accept: Arc::new(|_, _| Ok(None)),
        };
        let access = Arc::new(FabricAccess::with_random_key(slots)?);
        let rules = Rules {
            access: access.clone(),
            refusals_logged: Arc::new(LogLimiter::default()),
        };
        tokio::spawn(receiver::accept_loop(
            listener,
            Landing::Inline(memory.clone()),
            landed_tx,
            greeting,
            rules,
        ));
        tracing::debug!(%local_endpoint, slots, slot_bytes, "tcp fabric buffer exposed");
        Ok(FabricListener {
            local_endpoint,
            memory,
            landed,
            access,
            // Every byte goes in through `FabricAccess::land`.
            revocation_stops_writes: true,
        })
    }
}

impl Fabric for TcpFabric {
    type Memory = LocalMemory;

    fn allocate_staging(&self, geometry: SlotGeometry) -> Result<Arc<LocalMemory>, FabricError> {
        Ok(Arc::new(LocalMemory::allocate(geometry)?))
    }

    fn staging_in(&self, region: ExternalRegion) -> Result<Arc<LocalMemory>, FabricError> {
        SlotGeometry::new(region.slots(), region.slot_bytes())?;
        Ok(Arc::new(LocalMemory::external(region)))
    }

    async fn expose(
        &self,
        endpoint: &str,
        geometry: SlotGeometry,
    ) -> Result<FabricListener<LocalMemory>, FabricError> {
        let memory = LocalMemory::allocate(geometry)?;
        self.expose_memory(endpoint, Arc::new(memory)).await
    }

    async fn expose_in(
        &self,
        endpoint: &str,
        region: ExternalRegion,
    ) -> Result<FabricListener<LocalMemory>, FabricError> {
        SlotGeometry::new(region.slots(), region.slot_bytes())?;
        self.expose_memory(endpoint, Arc::new(LocalMemory::external(region)))
            .await
    }

    async fn connect(
        &self,
        endpoint: &str,
        staging: Arc<LocalMemory>,
        credential: FabricCredential,
    ) -> Result<FabricConn, FabricError> {
        // Checked when it was allocated (`SlotGeometry::new`) or lent (`staging_in`).
        let ours = staging.geometry();
        let mut stream = link::connect(endpoint, &self.config).await?;
        let peer = stream
            .peer_addr()
            .map_err(|e| FabricError::Io(e.to_string()))?;
        let welcomed = link::open_handshake(
            &mut stream,
            endpoint,
            TCP_MAGIC,
            ours,
            credential,
            &[],
            &self.config,
        )
        .await?;
        let (ops_tx, ops) = mpsc::unbounded_channel();
        let (done, done_rx) = mpsc::unbounded_channel();
        let link = SenderLink {
            stream,
            transmit: InlineTransmit::new(staging, welcomed.geometry, self.config.zero_copy),
            ops,
            done,
            fence_timeout: self.config.fence_timeout,
            peer,
            conn: welcomed.conn,
            magic: TCP_MAGIC,
            credential,
        };
        tokio::spawn(link.run());
        Ok(FabricConn::carrying_runs(ops_tx, done_rx))
    }
}

/// Bytes one `transmit` call may put on the wire before the task looks at acks and resets.
const TRANSMIT_BUDGET: usize = 8 << 20;

/// Streams each write as its header(s) + payload, the payload straight from the staging
/// slots.
#[derive(Debug)]
struct InlineTransmit {
    staging: Arc<LocalMemory>,
    remote: SlotGeometry,
    /// The write on its way.
    frame: Frame,
    /// Bytes of the current write (headers + payload) already on the wire (or in `pipe`).
    progress: usize,
    /// Zero-copy sends through a pipe (`splice`), where the platform has them.
    #[cfg(target_os = "linux")]
    pipe: Option<splice::SplicePipe>,
}

impl InlineTransmit {
    fn new(staging: Arc<LocalMemory>, remote: SlotGeometry, zero_copy: bool) -> Self {
        Self {
            staging,
            remote,
            frame: Frame::default(),
            progress: 0,
            #[cfg(target_os = "linux")]
            pipe: zero_copy
                .then(|| {
                    splice::SplicePipe::new()
                        .inspect_err(
                            |e| tracing::warn!(error = %e, "no pipe for zero-copy sends; copying"),
                        )
                        .ok()
                })
                .flatten(),
        }
    }

    /// `transmit` through the pipe: fill it from the current write (headers copied, payload
    /// mapped piece by piece), empty it into the socket, until the socket is full or the
    /// budget spent. A write counts as on the wire from its first byte (`Frame::start`);
    /// `backlog` keeps the task interested in writability until it is all in the pipe and
    /// the pipe is empty.
    #[cfg(target_os = "linux")]
    fn transmit_spliced(&mut self, stream: &TcpStream, pending: &mut Pending) -> io::Result<()> {
        let Some(pipe) = self.pipe.as_mut() else {
            return Ok(());
        };
        let mut budget = TRANSMIT_BUDGET;
        loop {
            while pipe.queued() > 0 {
                match pipe.drain_into(stream) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(n) => budget = budget.saturating_sub(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
            if budget == 0 {
                return Ok(());
            }
            if !self.frame.in_progress() && !self.frame.start(pending) {
                return Ok(());
            }
            let (progress, headers) = (self.progress, self.frame.headers.len());
            let fed = if progress < headers {
                pipe.copy_in(&self.frame.headers[progress..])
            } else if progress < self.frame.len() {
                // The slot lock is held only for the call; the kernel's page references
                // outlive it, which the staging discipline allows (see `splice`).
                let (w, at) = self.frame.piece_at(progress - headers, &self.staging);
                self.staging
                    .with_slot(w.local.0, |slot| pipe.map_in(&slot[at..w.len]))
            } else {
                Ok(0)
            };
            match fed {
                Ok(n) => self.progress += n,
                // The pipe is full: the next round empties it into the socket first.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
            if self.progress == self.frame.len() {
                self.progress = 0;
                self.frame.finish();
            }
        }
    }

    /// One non-blocking send of the current write from `progress` on: the rest of its
    /// headers and of its payload, the payload one span where its staging slots are
    /// contiguous in memory (a run within one part), else the rest of the current piece.
    fn send_frame(&self, stream: &TcpStream) -> io::Result<usize> {
        let frame = &self.frame;
        let headers = &frame.headers[self.progress.min(frame.headers.len())..];
        let at = self.progress.saturating_sub(frame.headers.len());
        let send = |payload: &[u8]| {
            if headers.is_empty() {
                stream.try_write(payload)
            } else {
                stream.try_write_vectored(&[IoSlice::new(headers), IoSlice::new(payload)])
            }
        };
        // The slot locks are held only for the non-blocking syscall, never across an await.
        let first = frame.writes[0].local.0;
        let whole = self
            .staging
            .with_run(first, frame.writes.len() as u32, |span| {
                send(&span[at..frame.payload])
            });
        if let Some(sent) = whole {
            return sent;
        }
        let (w, at) = frame.piece_at(at, &self.staging);
        self.staging
            .with_slot(w.local.0, |slot| send(&slot[at..w.len]))
    }
}

/// The write a connection is transmitting: its pieces (1, or a run's), their headers
/// encoded once, and its payload's length.
#[derive(Debug, Default)]
struct Frame {
    writes: Vec<PostWrite>,
    headers: Vec<u8>,
    payload: usize,
}

impl Frame {
    /// Takes the next write of `pending`; false when there is none. A run's headers all go
    /// first, each but the last flagged `FLAG_RUN`; its payloads follow in piece order.
    /// Its pieces count as on the wire from now: the receiver acks each as it lands, which
    /// for a run's first pieces is before its last bytes are sent.
    fn start(&mut self, pending: &mut Pending) -> bool {
        let Some(pieces) = pending.next_frame() else {
            return false;
        };
        self.writes.clear();
        self.writes.extend((0..pieces).map(|i| pending.piece(i)));
        pending.mark_frame_sent(pieces);
        self.headers.clear();
        self.payload = 0;
        for (i, w) in self.writes.iter().enumerate() {
            let mut header = WriteHeader::of(w);
            if i + 1 < pieces {
                header.flags |= FLAG_RUN;
            }
            if i == 0 && pieces > 1 {
                header.run = pieces as u32;
            }
            self.headers.extend_from_slice(&header.encode());
            self.payload += w.len;
        }
        true
    }

    /// The write is all on the wire (or in the pipe).
    fn finish(&mut self) {
        self.writes.clear();
    }

    /// Whether a write is partly on the wire.
    fn in_progress(&self) -> bool {
        !self.writes.is_empty()
    }

    /// Headers and payload.
    fn len(&self) -> usize {
        self.headers.len() + self.payload
    }

    /// The piece holding payload byte `at`, and where in its slot that byte is (every piece
    /// but the last fills its slot: `WriteRun`).
    fn piece_at(&self, at: usize, staging: &LocalMemory) -> (PostWrite, usize) {
        let slot_bytes = staging.slot_bytes();
        let i = (at / slot_bytes).min(self.writes.len() - 1);
        (self.writes[i], at - i * slot_bytes)
    }
}

/// Bounds shared by both fabrics' senders: the staging slot and the remote slot must hold it.
pub(crate) fn check_bounds(
    w: &PostWrite,
    staging: SlotGeometry,
    remote: SlotGeometry,
) -> Result<(), FabricError> {
    if staging.holds(w.local.0, w.len as u64) && remote.holds(w.remote.0, w.len as u64) {
        Ok(())
    } else {
        Err(FabricError::OutOfBounds(
            w.id.0,
            format!(
                "{w:?} against staging {} x {} B and remote {} x {} B",
                staging.slots, staging.slot_bytes, remote.slots, remote.slot_bytes
            ),
        ))
    }
}

impl Transmit for InlineTransmit {
    fn check(&self, w: &PostWrite) -> Result<(), FabricError> {
        let staging = SlotGeometry {
            slots: self.staging.slots(),
            slot_bytes: self.staging.slot_bytes() as u64,
        };
        check_bounds(w, staging, self.remote)
    }

    fn staging_slot_bytes(&self) -> usize {
        self.staging.slot_bytes()
    }

    /// A write partly sent (its pieces already count as on the wire), or bytes in the pipe.
    fn backlog(&self) -> bool {
        #[cfg(target_os = "linux")]
        if self.pipe.as_ref().is_some_and(|p| p.queued() > 0) {
            return true;
        }
        self.frame.in_progress()
    }

    fn transmit(&mut self, stream: &TcpStream, pending: &mut Pending) -> io::Result<()> {
        #[cfg(target_os = "linux")]
        if self.pipe.is_some() {
            return self.transmit_spliced(stream, pending);
        }
        let mut budget = TRANSMIT_BUDGET;
        loop {
            if !self.frame.in_progress() && !self.frame.start(pending) {
                return Ok(());
            }
            let n = match self.send_frame(stream) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            };
            self.progress += n;
            if self.progress == self.frame.len() {
                self.progress = 0;
                self.frame.finish();
            }
            budget = budget.saturating_sub(n);
            if budget == 0 {
                return Ok(());
            }
        }
    }
}
