//! A sender's connection task, shared by both fabrics: it takes posted writes, hands them to
//! a `Transmit` (TCP streams header + payload; shm copies the payload into the mapping and
//! sends the header), turns the receiver's acks into completions in posting order, and on a
//! reset or a broken connection fences the receiver and flushes everything outstanding.
//!
//! One task owns the socket and the queue, so there is no locking on the hot path, and the
//! queue's storage is reused (it never holds more than the staging pool's slots).

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use kvx_io::fabric::ConnOp;
use kvx_io::{Completion, FabricError, PostWrite, WriteRun};
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::link::fence_remote;
use super::wire::{Ack, AckStatus, ACK_LEN};

/// How a fabric puts writes on the wire.
pub(crate) trait Transmit: Send + 'static {
    /// Checks a write against local and remote bounds before it is queued; a failing write
    /// completes with that error, in order, and never reaches the wire.
    fn check(&self, w: &PostWrite) -> Result<(), FabricError>;

    /// Bytes per staging slot (what a run's pieces but the last must fill).
    fn staging_slot_bytes(&self) -> usize;

    /// Whether bytes of writes already marked sent still wait in the transmitter's own buffer
    /// (so the socket's writability matters even with no unsent write).
    fn backlog(&self) -> bool {
        false
    }

    /// Puts as many unsent writes on the wire as the socket takes now, calling
    /// `pending.mark_sent()` for each one fully handed over. Returns when the socket would
    /// block, nothing is left, or a per-call budget is spent (so acks and resets are looked at
    /// between large bursts).
    fn transmit(&mut self, stream: &TcpStream, pending: &mut Pending) -> io::Result<()>;
}

#[derive(Debug)]
enum State {
    /// Not (fully) on the wire yet.
    Queued,
    /// On the wire; its ack is awaited.
    Sent,
    /// Finished: acked, or failed locally before sending.
    Done(Result<(), FabricError>),
}

#[derive(Debug)]
struct Entry {
    write: PostWrite,
    state: State,
    /// The next entry is the next piece of the same run (`WriteRun`): they go as one write.
    continues: bool,
}

/// Outstanding writes in posting order. Entries before `next_send` are on the wire (or done
/// locally); completions leave from the front only, which is what keeps them in order.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    entries: VecDeque<Entry>,
    next_send: usize,
}

impl Pending {
    fn push(&mut self, write: PostWrite, check: Result<(), FabricError>) {
        let state = match check {
            Ok(()) => State::Queued,
            Err(e) => State::Done(Err(e)),
        };
        self.entries.push_back(Entry {
            write,
            state,
            continues: false,
        });
    }

    /// Queues a run's pieces as one write, each checked (`checks`, in piece order); a run
    /// with a piece that fails its check, or that does not `fit` the staging's
    /// `slot_bytes` (not built as `WriteRun::push` builds one), is queued piece by piece,
    /// each with its own result (the others still go).
    pub(crate) fn push_run(
        &mut self,
        run: WriteRun,
        checks: Vec<Result<(), FabricError>>,
        slot_bytes: usize,
    ) {
        let whole = checks.iter().all(Result::is_ok) && run.fits(slot_bytes);
        let pieces = run.into_pieces();
        let n = pieces.len();
        for (i, (write, check)) in pieces.into_iter().zip(checks).enumerate() {
            self.push(write, check);
            if whole && i + 1 < n {
                if let Some(e) = self.entries.back_mut() {
                    e.continues = true;
                }
            }
        }
    }

    /// The pieces of the next write to transmit (1 for a lone write, or a run's), skipping
    /// writes that failed locally; `piece` reads them.
    pub(crate) fn next_frame(&mut self) -> Option<usize> {
        self.next_unsent()?;
        let n = self
            .entries
            .iter()
            .skip(self.next_send)
            .take_while(|e| e.continues)
            .count();
        Some(n + 1)
    }

    /// Piece `i` of the write `next_frame` returned.
    pub(crate) fn piece(&self, i: usize) -> PostWrite {
        self.entries[self.next_send + i].write
    }

    /// The write `next_frame` returned, all `pieces` of it, is fully on the wire.
    pub(crate) fn mark_frame_sent(&mut self, pieces: usize) {
        for _ in 0..pieces {
            self.mark_sent();
        }
    }

    /// The next write to transmit, skipping writes that failed locally.
    pub(crate) fn next_unsent(&mut self) -> Option<PostWrite> {
        while let Some(e) = self.entries.get(self.next_send) {
            if matches!(e.state, State::Queued) {
                return Some(e.write);
            }
            self.next_send += 1;
        }
        None
    }

    /// The write `next_unsent` returned is fully on the wire.
    pub(crate) fn mark_sent(&mut self) {
        let e = self
            .entries
            .get_mut(self.next_send)
            .expect("invariant: mark_sent follows next_unsent");
        debug_assert!(matches!(e.state, State::Queued));
        e.state = State::Sent;
        self.next_send += 1;
    }

    fn has_unsent(&self) -> bool {
        self.entries
            .iter()
            .skip(self.next_send)
            .any(|e| matches!(e.state, State::Queued))
    }

    /// Applies an ack: it must be for the oldest write on the wire (the receiver handles a
    /// connection's writes in order).
    fn on_ack(&mut self, ack: Ack) -> Result<(), String> {
        let oldest = self
            .entries
            .iter_mut()
            .take(self.next_send)
            .find(|e| matches!(e.state, State::Sent));
        let Some(entry) = oldest else {
            return Err(format!("ack for write {} with none on the wire", ack.id));
        };
        if entry.write.id.0 != ack.id {
            return Err(format!(
                "ack for write {} while write {} is the oldest on the wire",
                ack.id, entry.write.id.0
            ));
        }
        entry.state = State::Done(match ack.status {
            AckStatus::Ok => Ok(()),
            AckStatus::OutOfBounds => Err(FabricError::OutOfBounds(
                ack.id,
                format!("refused by the receiver: {:?}", entry.write),
            )),
            AckStatus::Refused => Err(FabricError::Refused(format!(
                "no current grant of this sender's for slot {} (write {})",
                entry.write.remote.0, ack.id
            ))),
            AckStatus::Corrupt => Err(FabricError::Corrupt(format!(
                "the bytes that landed in slot {} do not match the checksum sent (write {})",
                entry.write.remote.0, ack.id
            ))),
            AckStatus::Unknown(code) => return Err(format!("unknown ack status {code}")),
        });
        Ok(())
    }

    /// Emits finished writes from the front, in posting order.
    fn drain(&mut self, mut emit: impl FnMut(Completion)) {
        while let Some(front) = self.entries.front() {
            if !matches!(front.state, State::Done(_)) {
                break;
            }
            let e = self
                .entries
                .pop_front()
                .expect("invariant: the front was just seen");
            // A write that failed locally may be popped before `next_unsent` skipped it.
            self.next_send = self.next_send.saturating_sub(1);
            if let State::Done(result) = e.state {
                emit(Completion {
                    id: e.write.id,
                    result,
                });
            }
        }
    }

    /// Completes everything outstanding: a local failure keeps its error, the rest is flushed.
    fn flush_all(&mut self, mut emit: impl FnMut(Completion)) {
        for e in self.entries.drain(..) {
            let result = match e.state {
                State::Done(r) => r,
                State::Queued | State::Sent => Err(FabricError::Flushed),
            };
            emit(Completion {
                id: e.write.id,
                result,
            });
        }
        self.next_send = 0;
    }
}

/// Acks as they come off the socket; a fixed buffer, refilled in place.
#[derive(Debug)]
struct AckReader {
    buf: [u8; ACK_LEN * 256],
    start: usize,
    end: usize,
}

impl AckReader {
    fn new() -> Self {
        AckReader {
            buf: [0; ACK_LEN * 256],
            start: 0,
            end: 0,
        }
    }

    /// One non-blocking read; Ok(0) is the end of the stream.
    fn read(&mut self, stream: &TcpStream) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let n = stream.try_read(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n)
    }

    fn next(&mut self) -> Option<Ack> {
        if self.end - self.start < ACK_LEN {
            return None;
        }
        let ack = Ack::decode(&self.buf[self.start..self.start + ACK_LEN]);
        self.start += ACK_LEN;
        Some(ack)
    }
}

/// Why a connection stopped serving.
#[derive(Debug)]
enum Stop {
    /// `FabricConn::reset`.
    Reset,
    /// The `FabricConn` was dropped: nobody waits for completions.
    Dropped,
    /// The receiver closed, or the socket failed somewhere on the way.
    Broken(String),
    /// The receiver said something impossible.
    Violation(String),
}

/// One sender connection; `run` is its task.
pub(crate) struct SenderLink<T> {
    pub stream: TcpStream,
    pub transmit: T,
    pub ops: mpsc::UnboundedReceiver<ConnOp>,
    pub done: mpsc::UnboundedSender<Completion>,
    pub fence_timeout: Duration,
    /// The receiver's address (for the fence) and its id for this connection.
    pub peer: SocketAddr,
    pub conn: u64,
    /// The fabric's magic, for the fence's handshake.
    pub magic: [u8; 4],
    /// The credential this connection attached with; a fence must present it too.
    pub credential: kvx_io::FabricCredential,
}

impl<T: Transmit> SenderLink<T> {
    pub(crate) async fn run(self) {
        let SenderLink {
            stream,
            mut transmit,
            mut ops,
            done,
            fence_timeout,
            peer,
            conn,
            magic,
            credential,
        } = self;
        let mut pending = Pending::default();
        let stop = serve(&stream, &mut transmit, &mut pending, &mut ops, &done).await;
        match &stop {
            Stop::Reset => debug!(%peer, conn, "fabric connection reset"),
            Stop::Dropped => debug!(%peer, conn, "fabric connection dropped by its owner"),
            Stop::Broken(why) => warn!(%peer, conn, %why, "fabric connection broken"),
            Stop::Violation(why) => warn!(%peer, conn, %why, "fabric receiver misbehaved"),
        }
        // Abort rather than close: RST drops our unsent bytes instead of delivering them.
        // Best effort: on a dead socket there is nothing left to drop.
        let _ = stream.set_zero_linger();
        drop(stream);
        // The shm transmitter copies nothing once dropped; nobody waits on a dropped owner.
        drop(transmit);
        if !matches!(stop, Stop::Dropped) {
            if let Err(why) = fence_remote(peer, magic, conn, credential, fence_timeout).await {
                warn!(
                    %peer,
                    conn,
                    %why,
                    "the receiver did not confirm the fence; flushing anyway"
                );
            }
        }
        // Nothing can land any more: flush, then answer later posts the same way until the
        // owner lets go (writes posted before it saw the reset still need a completion).
        pending.flush_all(|c| {
            // The owner may be gone; then nobody needs the completion.
            let _ = done.send(c);
        });
        'ops: while let Some(op) = ops.recv().await {
            for op in op.unrolled() {
                if let ConnOp::Write(w) = op {
                    let flushed = Completion {
                        id: w.id,
                        result: Err(FabricError::Flushed),
                    };
                    if done.send(flushed).is_err() {
                        break 'ops;
                    }
                }
            }
        }
    }
}

async fn serve<T: Transmit>(
    stream: &TcpStream,
    transmit: &mut T,
    pending: &mut Pending,
    ops: &mut mpsc::UnboundedReceiver<ConnOp>,
    done: &mpsc::UnboundedSender<Completion>,
) -> Stop {
    let mut acks = AckReader::new();
    let emit = |c| {
        // A closed channel means the owner dropped the connection; `ops` says so next.
        let _ = done.send(c);
    };
    loop {
        let interest = if transmit.backlog() || pending.has_unsent() {
            Interest::READABLE | Interest::WRITABLE
        } else {
            // Always readable: acks, and the receiver closing on us while we are idle.
            Interest::READABLE
        };
        tokio::select! {
            biased;
            op = ops.recv() => {
                let mut op = op;
                loop {
                    match op {
                        None => return Stop::Dropped,
                        Some(ConnOp::Reset) => return Stop::Reset,
                        Some(ConnOp::Write(w)) => {
                            let check = transmit.check(&w);
                            pending.push(w, check);
                        }
                        Some(ConnOp::Run(run)) => {
                            let checks = run.pieces().iter().map(|w| transmit.check(w)).collect();
                            pending.push_run(run, checks, transmit.staging_slot_bytes());
                        }
                    }
                    // Take everything already posted, so a burst costs one wakeup.
                    match ops.try_recv() {
                        Ok(next) => op = Some(next),
                        Err(_) => break,
                    }
                }
            }
            ready = stream.ready(interest) => {
                let ready = match ready {
                    Ok(r) => r,
                    Err(e) => return Stop::Broken(e.to_string()),
                };
                if ready.is_readable() {
                    loop {
                        match acks.read(stream) {
                            Ok(0) => return Stop::Broken("the receiver closed the connection".into()),
                            Ok(_) => {
                                while let Some(ack) = acks.next() {
                                    if let Err(why) = pending.on_ack(ack) {
                                        return Stop::Violation(why);
                                    }
                                    // Pop as we go so `on_ack` finds the oldest at the front.
                                    pending.drain(emit);
                                }
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                            Err(e) => return Stop::Broken(e.to_string()),
                        }
                    }
                }
                if ready.is_writable() {
                    if let Err(e) = transmit.transmit(stream, pending) {
                        return Stop::Broken(e.to_string());
                    }
                }
            }
        }
        pending.drain(emit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_proto::{SlotIndex, StagingSlot, WriteId};

    fn w(id: u64) -> PostWrite {
        PostWrite {
            id: WriteId(id),
            local: StagingSlot(0),
            remote: SlotIndex(0),
            len: 1,
            imm: None,
            checksum: None,
        }
    }

    fn ok(id: u64) -> Ack {
        Ack {
            id,
            status: AckStatus::Ok,
        }
    }

    #[test]
    fn completions_leave_in_posting_order_around_local_failures() {
        let mut p = Pending::default();
        let mut out = Vec::new();
        p.push(w(1), Ok(()));
        p.push(w(2), Err(FabricError::OutOfBounds(2, "x".into())));
        p.push(w(3), Ok(()));
        assert_eq!(p.next_unsent().map(|w| w.id), Some(WriteId(1)));
        p.mark_sent();
        assert_eq!(p.next_unsent().map(|w| w.id), Some(WriteId(3)));
        p.mark_sent();
        assert!(!p.has_unsent());
        p.drain(|c| out.push(c));
        assert!(out.is_empty(), "nothing before write 1 is acked");
        p.on_ack(ok(1)).expect("ack 1");
        p.drain(|c| out.push(c));
        let ids: Vec<u64> = out.iter().map(|c| c.id.0).collect();
        assert_eq!(ids, vec![1, 2], "the local failure follows write 1");
        assert!(
            p.on_ack(ok(4)).is_err(),
            "an ack out of order is a violation"
        );
        p.on_ack(ok(3)).expect("ack 3");
        p.drain(|c| out.push(c));
        assert_eq!(out.len(), 3);
        assert_eq!(out[2].result, Ok(()));
    }

    #[test]
    fn a_local_failure_at_the_front_leaves_at_once() {
        let mut p = Pending::default();
        let mut out = Vec::new();
        p.push(w(1), Err(FabricError::OutOfBounds(1, "x".into())));
        p.push(w(2), Ok(()));
        p.drain(|c| out.push(c));
        assert_eq!(out.len(), 1);
        assert_eq!(p.next_unsent().map(|w| w.id), Some(WriteId(2)));
        p.mark_sent();
        p.on_ack(ok(2)).expect("ack 2");
        p.drain(|c| out.push(c));
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn flush_keeps_local_errors_and_flushes_the_rest() {
        let mut p = Pending::default();
        let mut out = Vec::new();
        p.push(w(1), Ok(()));
        p.push(w(2), Err(FabricError::OutOfBounds(2, "x".into())));
        p.push(w(3), Ok(()));
        let _ = p.next_unsent();
        p.mark_sent();
        assert!(p.on_ack(ok(9)).is_err());
        p.flush_all(|c| out.push(c));
        let results: Vec<_> = out.iter().map(|c| c.result.clone()).collect();
        assert_eq!(results[0], Err(FabricError::Flushed));
        assert!(matches!(results[1], Err(FabricError::OutOfBounds(2, _))));
        assert_eq!(results[2], Err(FabricError::Flushed));
        assert!(p.next_unsent().is_none());
    }
}
