//! The receiving side, shared by both fabrics: an accept loop per exposed buffer and a task
//! per sender connection that reads write headers, lands payloads (`Landing::Inline`: read
//! from the socket straight into the slot; `Landing::Shared`: already in the mapping),
//! announces immediates, and acks each write after its bytes are in memory.
//!
//! A connection task is the only thing that applies its sender's writes, so once it has
//! ended (end of stream, an error, a protocol violation, the listener dropped, or aborted by
//! a fence), nothing from that connection lands any more. A fence is a sender's request, over
//! a fresh connection, to abort one of its earlier connections and confirm once it has ended.

use std::collections::HashMap;
use std::io::{self, IoSliceMut};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvx_io::{HeapMemory, Landed};
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::link::{accept_handshake, answer_fence, tune, Geometry, Greeted, LinkConfig};
use super::wire::{Ack, AckStatus, WriteHeader, ACK_LEN, FLAG_IMM, HEADER_LEN};

/// Where a connection's writes land.
#[derive(Debug, Clone)]
pub(crate) enum Landing {
    /// The payload follows its header on the socket and is read into this memory.
    Inline(Arc<HeapMemory>),
    /// The sender already copied the payload into a shared mapping of this shape.
    Shared(Geometry),
}

impl Landing {
    fn geometry(&self) -> Geometry {
        match self {
            Landing::Inline(m) => Geometry {
                slots: kvx_io::SlotMemory::slots(&**m),
                slot_bytes: kvx_io::SlotMemory::slot_bytes(&**m) as u64,
            },
            Landing::Shared(g) => *g,
        }
    }
}

/// What the accept loop needs to greet senders.
#[derive(Debug, Clone)]
pub(crate) struct Greeting {
    pub magic: [u8; 4],
    /// Trailing bytes of the `Welcome` (the shm file's path).
    pub extra: Arc<[u8]>,
    pub config: LinkConfig,
}

/// The connection tasks of one exposed buffer, by connection id, for fences.
type Registry = Arc<Mutex<HashMap<u64, JoinHandle<()>>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Accepts senders until the listener's owner drops its `landed` receiver.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    landing: Landing,
    landed: mpsc::UnboundedSender<Landed>,
    greeting: Greeting,
) {
    let registry: Registry = Arc::default();
    // Ids start at a random base: a receiver restarted at the same address must not take a
    // fence meant for its previous incarnation's connection as one for a live connection.
    let mut next_conn = random_u64();
    loop {
        let accepted = tokio::select! {
            biased;
            () = landed.closed() => break,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                // 0 is what an attaching hello carries; never an id.
                if next_conn == 0 {
                    next_conn = 1;
                }
                let conn = next_conn;
                next_conn = next_conn.wrapping_add(1);
                let landing = landing.clone();
                let landed = landed.clone();
                let greeting = greeting.clone();
                let reg = registry.clone();
                let task = tokio::spawn(async move {
                    let peer = peer.to_string();
                    match serve_sender(stream, landing, landed, &greeting, conn, reg).await {
                        Ok(()) => debug!(%peer, conn, "fabric sender left"),
                        Err(why) => warn!(%peer, conn, %why, "fabric sender dropped"),
                    }
                });
                // No await between spawn and insert: a fence naming `conn` is accepted by this
                // loop, so it always finds the entry (or the task already ended).
                let mut reg = lock(&registry);
                reg.retain(|_, t| !t.is_finished());
                reg.insert(conn, task);
            }
            Err(e) => {
                // Out of descriptors or similar: wait instead of spinning on the error.
                warn!(error = %e, "fabric accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    debug!("fabric listener dropped; no more senders accepted");
}

/// 64 random bits from the OS-seeded keys std gives every `RandomState`.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

async fn serve_sender(
    mut stream: TcpStream,
    landing: Landing,
    landed: mpsc::UnboundedSender<Landed>,
    greeting: &Greeting,
    conn: u64,
    registry: Registry,
) -> Result<(), String> {
    tune(&stream).map_err(|e| e.to_string())?;
    let ours = landing.geometry();
    let greeted = accept_handshake(
        &mut stream,
        greeting.magic,
        ours,
        &greeting.extra,
        conn,
        &greeting.config,
    )
    .await?;
    if let Greeted::Fence(target) = greeted {
        let task = lock(&registry).remove(&target);
        let stopped = match task {
            // Never existed or already ended: it applies nothing.
            None => true,
            Some(task) => {
                // Abort takes effect at the task's next await; it never stops mid-syscall,
                // and once the handle resolves its future is gone.
                task.abort();
                tokio::time::timeout(greeting.config.fence_timeout, task)
                    .await
                    .is_ok()
            }
        };
        debug!(conn, target, stopped, "fabric fence");
        return answer_fence(&mut stream, greeting.magic, target, stopped)
            .await
            .map_err(|e| e.to_string());
    }
    let mut conn = Conn {
        stream,
        landing,
        geometry: ours,
        landed,
        header: [0; HEADER_LEN],
        state: RecvState::Header { filled: 0 },
        acks: AckWriter::new(),
        scratch: Vec::new(),
    };
    conn.run().await
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
    /// Reading a payload straight into its slot.
    Payload {
        id: u64,
        slot: u32,
        len: usize,
        got: usize,
        imm: Option<u32>,
    },
    /// Skipping the payload of a write refused as out of bounds.
    Discard { id: u64, left: u64 },
}

#[derive(Debug, PartialEq, Eq)]
enum Flow {
    Open,
    Closed,
}

struct Conn {
    stream: TcpStream,
    landing: Landing,
    geometry: Geometry,
    landed: mpsc::UnboundedSender<Landed>,
    header: [u8; HEADER_LEN],
    state: RecvState,
    acks: AckWriter,
    /// Only for discarding refused payloads; allocated the first time one comes.
    scratch: Vec<u8>,
}

impl Conn {
    async fn run(&mut self) -> Result<(), String> {
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
            RecvState::Payload { slot, len, got, .. } => {
                let Landing::Inline(memory) = &self.landing else {
                    unreachable!("invariant: shared landings never stream payloads")
                };
                let (stream, header) = (&self.stream, &mut self.header);
                // Read the rest of the payload and, in the same call, the next header, which
                // halves the syscalls for small writes.
                memory.with_slot(slot, |s| {
                    let mut bufs = [IoSliceMut::new(&mut s[got..len]), IoSliceMut::new(header)];
                    stream.try_read_vectored(&mut bufs)
                })?
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
                RecvState::Header { filled: 0 } => Ok(None),
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
                imm,
            } => {
                let got = got + n;
                if got < len {
                    self.state = RecvState::Payload {
                        id,
                        slot,
                        len,
                        got,
                        imm,
                    };
                } else {
                    // Whatever went past the payload is the start of the next header.
                    self.state = RecvState::Header { filled: got - len };
                    self.landed_ok(id, imm)?;
                    if got - len == HEADER_LEN {
                        self.start_write()?;
                    }
                }
            }
            RecvState::Discard { id, left } => {
                let left = left - n as u64;
                if left > 0 {
                    self.state = RecvState::Discard { id, left };
                } else {
                    self.state = RecvState::Header { filled: 0 };
                    self.acks.push(Ack {
                        id,
                        status: AckStatus::OutOfBounds,
                    });
                }
            }
        }
        Ok(())
    }

    /// A whole header is in: validate it and decide what to do with the write.
    fn start_write(&mut self) -> Result<(), String> {
        let h = WriteHeader::decode(&self.header);
        if h.flags & !FLAG_IMM != 0 {
            return Err(format!("unknown write flags {:#x}", h.flags));
        }
        let fits = self.geometry.holds(h.remote, h.len);
        self.state = RecvState::Header { filled: 0 };
        match &self.landing {
            Landing::Shared(_) if fits => self.landed_ok(h.id, h.imm())?,
            Landing::Shared(_) => self.acks.push(Ack {
                id: h.id,
                status: AckStatus::OutOfBounds,
            }),
            // A length beyond any slot means the stream is not what it claims to be; skipping
            // that many bytes would only prolong the damage.
            Landing::Inline(_) if h.len > self.geometry.slot_bytes => {
                return Err(format!("write {} of {} bytes exceeds a slot", h.id, h.len))
            }
            Landing::Inline(_) if !fits => {
                if h.len == 0 {
                    self.acks.push(Ack {
                        id: h.id,
                        status: AckStatus::OutOfBounds,
                    });
                } else {
                    self.state = RecvState::Discard {
                        id: h.id,
                        left: h.len,
                    };
                }
            }
            Landing::Inline(_) if h.len == 0 => self.landed_ok(h.id, h.imm())?,
            Landing::Inline(_) => {
                self.state = RecvState::Payload {
                    id: h.id,
                    slot: h.remote,
                    len: h.len as usize,
                    got: 0,
                    imm: h.imm(),
                };
            }
        }
        Ok(())
    }

    /// The write's bytes are in memory: announce its immediate, then ack it.
    fn landed_ok(&mut self, id: u64, imm: Option<u32>) -> Result<(), String> {
        if let Some(imm) = imm {
            self.landed
                .send(Landed { imm })
                .map_err(|_| "the listener is gone".to_owned())?;
        }
        self.acks.push(Ack {
            id,
            status: AckStatus::Ok,
        });
        Ok(())
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
            // `read` stops at the high water mark, and one read finishes at most two writes.
            buf: Vec::with_capacity(ACKS_HIGH_WATER + 2 * ACK_LEN),
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
