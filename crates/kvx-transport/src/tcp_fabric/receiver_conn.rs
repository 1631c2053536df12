//! One sender connection on the receiving side, once it has authenticated: it reads write
//! headers (a run's all at once), checks each write against its sender's grants, lands
//! payloads (`Landing::Inline`: read from the socket straight into the slot;
//! `Landing::Pulled`: copied out of the sender's staging), announces them, and acks each
//! write after its bytes are in memory, while refused writes are read past. `receiver.rs`
//! accepts connections and runs the handshake and fences before handing one to `Conn`.

use std::collections::VecDeque;
use std::io::{self, IoSliceMut};
use std::sync::Arc;

use kvx_io::{
    AdmittedWrite, ChecksumCheck, FabricAccess, LandedWrite, LandingChecksum, LocalMemory,
    LogLimiter, SlotGeometry, SlotMemory,
};
use kvx_proto::{PeerId, SlotIndex};
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tracing::warn;

use super::wire::{Ack, AckStatus, WriteHeader, ACK_LEN, FLAGS_KNOWN, FLAG_RUN, HEADER_LEN};

/// Where a connection's writes land.
#[derive(Debug, Clone)]
pub(crate) enum Landing {
    /// The payload follows its header on the socket and is read into this memory.
    Inline(Arc<LocalMemory>),
    /// The payload is in the sender's staging (`PullSource`, per connection); the receiver
    /// copies it into this memory once the write is admitted, so nothing reaches a slot the
    /// sender holds no grant for. Weak: the connection tasks do not keep the buffer alive.
    Pulled(std::sync::Weak<dyn SlotMemory>, SlotGeometry),
}

impl Landing {
    pub(super) fn geometry(&self) -> SlotGeometry {
        match self {
            Landing::Inline(m) => SlotGeometry {
                slots: m.slots(),
                slot_bytes: m.slot_bytes() as u64,
            },
            Landing::Pulled(_, g) => *g,
        }
    }
}

/// Where an attached sender's payloads come from under `Landing::Pulled`: its staging, mapped
/// read-only by this process (`shm_fabric::map::StagingView`).
pub(crate) trait PullSource: Send + Sync {
    fn geometry(&self) -> SlotGeometry;
    /// Copies the first `dst.len()` bytes of staging slot `slot` into `dst`, with the
    /// checksum of the copy when `checksum` asks for it; the caller has checked the bounds
    /// against `geometry`.
    fn copy_out(&self, slot: u32, dst: &mut [u8], checksum: bool) -> Option<u32>;
}

/// What a fabric makes of an attaching sender's hello: a staging to pull from (shared
/// memory), or nothing (TCP, where payloads follow their headers).
pub(crate) type Source = Option<Box<dyn PullSource>>;

/// What every connection task of one exposed buffer shares.
#[derive(Debug, Clone)]
pub(crate) struct Rules {
    pub access: Arc<FabricAccess>,
    /// Refused writes and connections, logged at most once a second for the whole buffer.
    pub refusals_logged: Arc<LogLimiter>,
}

/// Acks waiting for the socket; past this many bytes the connection stops reading, so a
/// sender that does not read its acks is slowed by TCP instead of growing our memory.
const ACKS_HIGH_WATER: usize = ACK_LEN * 4096;
/// Acks are pushed out at least this often while a burst of writes is being read.
const ACKS_BATCH: usize = ACK_LEN * 64;
/// Bytes read from one connection before giving other tasks on this worker a turn.
const READ_BUDGET: usize = 16 << 20;

#[derive(Debug, Clone, Copy)]
enum RecvState {
    /// Reading a header; `filled` bytes of it are in `Conn::header`.
    Header { filled: usize },
    /// Reading the rest of a run's headers (`total` bytes, after its first) into
    /// `Conn::run_headers`; `filled` of them are in.
    RunHeaders { filled: usize, total: usize },
    /// Reading a payload straight into its slot (its running checksum is
    /// `Conn::payload_checksum`).
    Payload {
        id: u64,
        slot: u32,
        len: usize,
        got: usize,
        admitted: AdmittedWrite,
        carried: Option<u32>,
    },
    /// Skipping the payload of a refused write; `status` is its ack.
    Discard {
        id: u64,
        left: u64,
        status: AckStatus,
    },
}

#[derive(Debug, PartialEq, Eq)]
enum Flow {
    Open,
    Closed,
}

pub(super) struct Conn {
    stream: TcpStream,
    landing: Landing,
    geometry: SlotGeometry,
    landed: mpsc::Sender<LandedWrite>,
    /// The control peer this connection authenticated as.
    peer: PeerId,
    /// Its staging, under `Landing::Pulled`.
    source: Source,
    rules: Rules,
    /// Its place in the buffer's `ConnectionBudget`: a landed write marks it heard.
    held: Arc<kvx_io::Held>,
    header: [u8; HEADER_LEN],
    /// A run's pieces announced and not yet started (`FLAG_RUN`): their payloads follow the
    /// run's last header, in order, and each is admitted and landed as a write of its own.
    run: VecDeque<WriteHeader>,
    /// Where a run's headers after its first are read, all at once; grown once, to at most
    /// `WriteRun::MAX_PIECES - 1` headers.
    run_headers: Vec<u8>,
    state: RecvState,
    /// The checksum of the current payload's bytes so far, when its header carries one.
    payload_checksum: Option<LandingChecksum>,
    /// The current payload's checksum, once its last byte has landed.
    payload_computed: Option<u32>,
    acks: AckWriter,
    /// Only for discarding refused payloads; allocated the first time one comes.
    scratch: Vec<u8>,
}

impl Conn {
    /// The connection of `peer`, authenticated, about to read its first write header.
    pub(super) fn new(
        stream: TcpStream,
        landing: Landing,
        landed: mpsc::Sender<LandedWrite>,
        peer: PeerId,
        source: Source,
        rules: Rules,
        held: Arc<kvx_io::Held>,
    ) -> Self {
        Conn {
            stream,
            geometry: landing.geometry(),
            landing,
            landed,
            peer,
            source,
            rules,
            held,
            header: [0; HEADER_LEN],
            run: VecDeque::new(),
            run_headers: Vec::new(),
            state: RecvState::Header { filled: 0 },
            payload_checksum: None,
            payload_computed: None,
            acks: AckWriter::new(),
            scratch: Vec::new(),
        }
    }

    pub(super) async fn run(&mut self) -> Result<(), String> {
        loop {
            let reading = self.acks.unsent() < ACKS_HIGH_WATER;
            let interest = match (reading, self.acks.unsent() > 0) {
                (true, true) => Interest::READABLE | Interest::WRITABLE,
                (true, false) => Interest::READABLE,
                (false, _) => Interest::WRITABLE,
            };
            let ready = tokio::select! {
                biased;
                // The listener is gone: stop applying this sender's writes now.
                () = self.landed.closed() => return Ok(()),
                r = self.stream.ready(interest) => r.map_err(|e| e.to_string())?,
            };
            if ready.is_writable() {
                self.acks.flush(&self.stream).map_err(|e| e.to_string())?;
            }
            if reading && ready.is_readable() && self.read()? == Flow::Closed {
                // Best effort: a sender that half-closed after a reset ignores them anyway.
                let _ = self.acks.flush(&self.stream);
                return Ok(());
            }
        }
    }

    /// Reads and applies as much as the socket has, up to `READ_BUDGET`.
    fn read(&mut self) -> Result<Flow, String> {
        let mut budget = READ_BUDGET;
        loop {
            if budget == 0 || self.acks.unsent() >= ACKS_HIGH_WATER {
                return Ok(Flow::Open);
            }
            let n = match self.read_once() {
                Ok(Some(n)) => n,
                Ok(None) => return Ok(Flow::Closed),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // The socket is drained: a good moment to tell the sender.
                    self.acks.flush(&self.stream).map_err(|e| e.to_string())?;
                    return Ok(Flow::Open);
                }
                Err(e) => return Err(e.to_string()),
            };
            budget = budget.saturating_sub(n);
            self.advance(n)?;
            if self.acks.unsent() >= ACKS_BATCH {
                self.acks.flush(&self.stream).map_err(|e| e.to_string())?;
            }
        }
    }

    /// One non-blocking read for the current state; `None` is a clean end of stream.
    fn read_once(&mut self) -> io::Result<Option<usize>> {
        let n = match self.state {
            RecvState::Header { filled } => self.stream.try_read(&mut self.header[filled..])?,
            RecvState::RunHeaders { filled, total } => {
                self.stream.try_read(&mut self.run_headers[filled..total])?
            }
            RecvState::Payload {
                id,
                slot,
                len,
                got,
                admitted,
                ..
            } => {
                let Landing::Inline(memory) = &self.landing else {
                    unreachable!("invariant: shared landings never stream payloads")
                };
                // Within a run the next bytes are the next piece's payload, not a header.
                let next_header = if self.run.is_empty() { HEADER_LEN } else { 0 };
                let (stream, header) = (&self.stream, &mut self.header[..next_header]);
                let (checksum, computed) = (&mut self.payload_checksum, &mut self.payload_computed);
                // Read the rest of the payload and, in the same call, the next header, which
                // halves the syscalls for small writes. The checksum takes the new bytes
                // while they are still in the CPU's caches. All of it only while the write's
                // grant stands (a non-blocking read: the cell lock is held for no longer
                // than a copy).
                let landed = self.rules.access.land(&admitted, || {
                    memory.with_slot(slot, |s| {
                        let mut bufs = [IoSliceMut::new(&mut s[got..len]), IoSliceMut::new(header)];
                        let n = stream.try_read_vectored(&mut bufs)?;
                        if let Some(c) = checksum {
                            let end = got + n.min(len - got);
                            c.advance(&s[..end]);
                            if end == len {
                                *computed = Some(c.value(&s[..len]));
                            }
                        }
                        Ok::<_, io::Error>(n)
                    })
                });
                match landed {
                    Ok(read) => read?,
                    Err(refusal) => {
                        // Revoked mid-write: the rest of its bytes are read past.
                        if let Some(left_out) = self.rules.refusals_logged.allow() {
                            warn!(%refusal, left_out, "fabric write cut off");
                        }
                        self.payload_checksum = None;
                        self.state = RecvState::Discard {
                            id,
                            left: (len - got) as u64,
                            status: AckStatus::Refused,
                        };
                        return self.read_once();
                    }
                }
            }
            RecvState::Discard { left, .. } => {
                if self.scratch.is_empty() {
                    self.scratch = vec![0; 64 << 10];
                }
                let take = self
                    .scratch
                    .len()
                    .min(usize::try_from(left).unwrap_or(usize::MAX));
                self.stream.try_read(&mut self.scratch[..take])?
            }
        };
        if n == 0 {
            return match self.state {
                RecvState::Header { filled: 0 } if self.run.is_empty() => Ok(None),
                _ => Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "the sender closed in the middle of a write ({:?})",
                        self.state
                    ),
                )),
            };
        }
        Ok(Some(n))
    }

    /// Accounts for `n` bytes just read in the current state.
    fn advance(&mut self, n: usize) -> Result<(), String> {
        match self.state {
            RecvState::RunHeaders { filled, total } => {
                let filled = filled + n;
                self.state = RecvState::RunHeaders { filled, total };
                if filled == total {
                    self.state = RecvState::Header { filled: 0 };
                    self.queue_run_headers(total)?;
                    self.next_piece()?;
                }
            }
            RecvState::Header { filled } => {
                let filled = filled + n;
                self.state = RecvState::Header { filled };
                if filled == HEADER_LEN {
                    self.start_write()?;
                }
            }
            RecvState::Payload {
                id,
                slot,
                len,
                got,
                admitted,
                carried,
            } => {
                let got = got + n;
                if got < len {
                    self.state = RecvState::Payload {
                        id,
                        slot,
                        len,
                        got,
                        admitted,
                        carried,
                    };
                } else {
                    // Whatever went past the payload is the start of the next header.
                    self.state = RecvState::Header { filled: got - len };
                    self.payload_checksum = None;
                    let computed = self.payload_computed.take();
                    let check = compare(carried, computed);
                    self.landed(id, slot, len as u64, admitted.tag.to_imm(), check)?;
                    if got - len == HEADER_LEN {
                        self.start_write()?;
                    } else {
                        self.next_piece()?;
                    }
                }
            }
            RecvState::Discard { id, left, status } => {
                let left = left - n as u64;
                if left > 0 {
                    self.state = RecvState::Discard { id, left, status };
                } else {
                    self.state = RecvState::Header { filled: 0 };
                    self.acks.push(Ack { id, status });
                    self.next_piece()?;
                }
            }
        }
        Ok(())
    }

    /// A whole header is in: validate it and decide what to do with the write (a run's
    /// pieces wait for its last header, then go one by one).
    fn start_write(&mut self) -> Result<(), String> {
        let h = WriteHeader::decode(&self.header);
        self.state = RecvState::Header { filled: 0 };
        if h.flags & !FLAGS_KNOWN != 0 {
            return Err(format!("unknown write flags {:#x}", h.flags));
        }
        let inline = matches!(self.landing, Landing::Inline(_));
        if h.flags & FLAG_RUN == 0 {
            if h.run != 0 {
                return Err(format!(
                    "a lone write {} announcing a run of {}",
                    h.id, h.run
                ));
            }
            return self.start_piece(h);
        }
        if !inline {
            return Err("a run of writes over a fabric that carries none".to_owned());
        }
        let pieces = h.run as usize;
        if !(2..=kvx_io::WriteRun::MAX_PIECES).contains(&pieces) {
            return Err(format!(
                "a run of {pieces} writes (2 to {} are carried)",
                kvx_io::WriteRun::MAX_PIECES
            ));
        }
        // The run's other headers follow at once: read them in one go.
        let total = (pieces - 1) * HEADER_LEN;
        if self.run_headers.len() < total {
            self.run_headers.resize(total, 0);
        }
        self.run.push_back(h);
        self.state = RecvState::RunHeaders { filled: 0, total };
        Ok(())
    }

    /// Queues the run's headers after its first, all `total` bytes of them in: each must
    /// be a write of this version, flagged as continued but the last, naming no run of its
    /// own.
    fn queue_run_headers(&mut self, total: usize) -> Result<(), String> {
        let count = total / HEADER_LEN;
        for i in 0..count {
            let mut b = [0u8; HEADER_LEN];
            b.copy_from_slice(&self.run_headers[i * HEADER_LEN..(i + 1) * HEADER_LEN]);
            let h = WriteHeader::decode(&b);
            let continued = h.flags & FLAG_RUN != 0;
            if h.flags & !FLAGS_KNOWN != 0 || continued != (i + 1 < count) || h.run != 0 {
                return Err(format!(
                    "piece {} of a run of {}: flags {:#x}, run {}",
                    i + 2,
                    count + 1,
                    h.flags,
                    h.run
                ));
            }
            self.run.push_back(h);
        }
        Ok(())
    }

    /// Starts the run's next piece, if one waits and the previous write is done with; a
    /// piece answered at once (refused with no payload) moves on to the next.
    fn next_piece(&mut self) -> Result<(), String> {
        while matches!(self.state, RecvState::Header { filled: 0 }) {
            let Some(h) = self.run.pop_front() else {
                break;
            };
            self.start_piece(h)?;
        }
        Ok(())
    }

    /// One write (or one piece of a run): bounds, admission, then its landing.
    fn start_piece(&mut self, h: WriteHeader) -> Result<(), String> {
        let inline = matches!(self.landing, Landing::Inline(_));
        // A payload beyond any slot means the stream is not what it claims to be; skipping
        // that many bytes would only prolong the damage. (When payloads are pulled nothing
        // follows a header, so such a write is merely out of bounds.)
        if inline && h.len > self.geometry.slot_bytes {
            return Err(format!("write {} of {} bytes exceeds a slot", h.id, h.len));
        }
        let staged = self
            .source
            .as_ref()
            .is_none_or(|s| s.geometry().holds(h.local, h.len));
        if !self.geometry.holds(h.remote, h.len) || !staged {
            self.refuse(&h, inline, AckStatus::OutOfBounds);
            return Ok(());
        }
        let admitted = match self.rules.access.admit(self.peer, h.remote, h.len, h.imm()) {
            Ok(admitted) => admitted,
            Err(refusal) => {
                if let Some(left_out) = self.rules.refusals_logged.allow() {
                    warn!(%refusal, left_out, "fabric write refused");
                }
                self.refuse(&h, inline, AckStatus::Refused);
                return Ok(());
            }
        };
        let imm = admitted.tag.to_imm();
        match &self.landing {
            Landing::Pulled(memory, _) => {
                let memory = memory.upgrade().ok_or("the listener is gone")?;
                let source = self
                    .source
                    .as_ref()
                    .ok_or("a pulled landing without a staging")?;
                // Admitted: copy the bytes out of the sender's staging into the slot while
                // the grant stands, taking the checksum during the copy.
                let mut computed = None;
                let copied = self.rules.access.land(&admitted, || {
                    memory.fill_slot(h.remote, h.len as usize, &mut |dst| {
                        computed = source.copy_out(h.local, dst, h.checksum().is_some());
                    });
                });
                if let Err(refusal) = copied {
                    if let Some(left_out) = self.rules.refusals_logged.allow() {
                        warn!(%refusal, left_out, "fabric write cut off");
                    }
                    self.acks.push(Ack {
                        id: h.id,
                        status: AckStatus::Refused,
                    });
                    return Ok(());
                }
                let check = compare(h.checksum(), computed);
                self.landed(h.id, h.remote, h.len, imm, check)?;
            }
            Landing::Inline(_) => {
                self.payload_checksum = h.checksum().map(|_| LandingChecksum::new(h.len as usize));
                self.payload_computed = None;
                self.state = RecvState::Payload {
                    id: h.id,
                    slot: h.remote,
                    len: h.len as usize,
                    got: 0,
                    admitted,
                    carried: h.checksum(),
                };
            }
        }
        Ok(())
    }

    /// Acks a refused write with `status`, after reading past its payload if one follows (at
    /// most one slot's worth).
    fn refuse(&mut self, h: &WriteHeader, inline: bool, status: AckStatus) {
        if inline && h.len > 0 {
            self.state = RecvState::Discard {
                id: h.id,
                left: h.len,
                status,
            };
        } else {
            self.acks.push(Ack { id: h.id, status });
        }
    }

    /// An admitted write's bytes are all in memory: announce it, then ack it (as corrupt
    /// when its checksum did not match; the receiver fails its request).
    fn landed(
        &mut self,
        id: u64,
        slot: u32,
        bytes: u64,
        imm: u32,
        checksum: ChecksumCheck,
    ) -> Result<(), String> {
        self.held.heard();
        let notice = LandedWrite {
            peer: self.peer,
            slot: SlotIndex(slot),
            tag: kvx_proto::WriteTag::from_imm(imm),
            bytes,
            checksum,
        };
        match self.landed.try_send(notice) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Closed(_)) => {
                return Err("the listener is gone".to_owned())
            }
            // Cannot happen within the access rules' bound (`kvx_io::landing_channel`); if it
            // does, the request times out rather than anything landing unannounced as read.
            Err(mpsc::error::TrySendError::Full(_)) => {
                if let Some(left_out) = self.rules.refusals_logged.allow() {
                    warn!(
                        slot,
                        left_out, "landing notice dropped: the notice channel is full"
                    );
                }
            }
        }
        let status = match checksum {
            ChecksumCheck::Mismatch { .. } => AckStatus::Corrupt,
            ChecksumCheck::Absent | ChecksumCheck::Match => AckStatus::Ok,
        };
        self.acks.push(Ack { id, status });
        Ok(())
    }
}

/// How a carried checksum compares with the one computed over the landed bytes.
fn compare(carried: Option<u32>, computed: Option<u32>) -> ChecksumCheck {
    match (carried, computed) {
        (Some(carried), Some(computed)) if carried != computed => {
            ChecksumCheck::Mismatch { carried, computed }
        }
        (Some(_), Some(_)) => ChecksumCheck::Match,
        _ => ChecksumCheck::Absent,
    }
}

/// Acks waiting to go out; one buffer, reused.
#[derive(Debug)]
struct AckWriter {
    buf: Vec<u8>,
    sent: usize,
}

impl AckWriter {
    fn new() -> Self {
        AckWriter {
            // Grown as the connection's bursts need, once: `read` stops at the high water
            // mark and one read finishes at most two writes, or a run's last header all its
            // pieces refused at once, so it never holds more than `ACKS_HIGH_WATER` +
            // `WriteRun::MAX_PIECES` acks; a connection that never writes holds none.
            buf: Vec::new(),
            sent: 0,
        }
    }

    fn unsent(&self) -> usize {
        self.buf.len() - self.sent
    }

    fn push(&mut self, ack: Ack) {
        self.buf.extend_from_slice(&ack.encode());
    }

    /// Writes what the socket takes without blocking.
    fn flush(&mut self, stream: &TcpStream) -> io::Result<()> {
        while self.sent < self.buf.len() {
            match stream.try_write(&self.buf[self.sent..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Keep only the unsent tail, so a steady backlog cannot grow the buffer.
                    self.buf.drain(..self.sent);
                    self.sent = 0;
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
        self.buf.clear();
        self.sent = 0;
        Ok(())
    }
}
