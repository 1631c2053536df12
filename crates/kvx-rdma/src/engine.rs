//! A sender connection's logic, without IO: posting writes on the queue pair, matching work
//! completions to them, and the error path (`docs/operations.md` §Failures).
//!
//! - Completions leave in posting order: one queue, emptied from the front. A write that fails
//!   its bounds check completes with `OutOfBounds` in its place and is never posted.
//! - A failed work completion (or a failed post, a reset, a broken side channel) moves the
//!   queue pair to ERROR, which makes verbs flush every outstanding write. The engine is then
//!   *failing*: writes that already succeeded still complete `Ok`, but no error leaves until
//!   the receiver confirmed the fence (its queue pair is in ERROR too, so nothing of this
//!   connection lands any more) and every outstanding write has its flush completion (or the
//!   task gave up waiting for them). Then it is *dead*: everything left completes with its
//!   error, and every later post with `Flushed`.

use std::collections::VecDeque;
use std::sync::Arc;

use kvx_io::{Completion, FabricError, PostWrite};

use crate::memory::RdmaMemory;
use crate::route;
use crate::verbs::{Qp, VerbsQp, Wc, WcStatus, WriteWr};
use kvx_io::SlotGeometry;

/// The receiver's exposed buffer, as its welcome described it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteBuffer {
    pub geometry: SlotGeometry,
    pub addr: u64,
    pub rkey: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Live,
    Failing { fenced: bool },
    Dead,
}

#[derive(Debug)]
enum State {
    /// On the send queue; its work completion is awaited.
    Posted,
    Done(Result<(), FabricError>),
}

#[derive(Debug)]
struct Entry {
    write: PostWrite,
    seq: u32,
    state: State,
}

/// One sender connection: its queue pair, staging, the remote buffer, outstanding writes.
#[derive(Debug)]
pub(crate) struct SendEngine<Q: VerbsQp> {
    // Declared before `staging`: the queue pair is destroyed (no more DMA) before the staging
    // memory can be unmapped (`memory` module doc).
    qp: Qp<Q>,
    staging: Arc<RdmaMemory>,
    remote: RemoteBuffer,
    route_key: u32,
    entries: VecDeque<Entry>,
    next_seq: u32,
    phase: Phase,
    failure: Option<String>,
}

impl<Q: VerbsQp> SendEngine<Q> {
    /// `qp` must be in RTS, connected to the receiver that exposed `remote`.
    pub(crate) fn new(
        qp: Qp<Q>,
        staging: Arc<RdmaMemory>,
        remote: RemoteBuffer,
        route_key: u32,
    ) -> Self {
        SendEngine {
            qp,
            staging,
            remote,
            route_key,
            entries: VecDeque::new(),
            next_seq: 0,
            phase: Phase::Live,
            failure: None,
        }
    }

    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    /// Why the connection failed (the first reason), once it did.
    pub(crate) fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// The receiver must be asked to fence.
    #[cfg(test)]
    pub(crate) fn needs_fence(&self) -> bool {
        self.phase == (Phase::Failing { fenced: false })
    }

    /// Writes on the send queue whose work completion has not come.
    pub(crate) fn posted(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| matches!(e.state, State::Posted))
            .count()
    }

    fn check(&self, w: &PostWrite) -> Result<(), FabricError> {
        let len = w.len as u64;
        if self.staging.geometry().holds(w.local.0, len)
            && self.remote.geometry.holds(w.remote.0, len)
        {
            Ok(())
        } else {
            let (s, r) = (self.staging.geometry(), self.remote.geometry);
            Err(FabricError::OutOfBounds(
                w.id.0,
                format!(
                    "{w:?} against staging {} x {} B and remote {} x {} B",
                    s.slots, s.slot_bytes, r.slots, r.slot_bytes
                ),
            ))
        }
    }

    /// Whether `handle_post` would post `write` now (rather than complete it at once).
    pub(crate) fn would_post(&self, write: &PostWrite) -> bool {
        self.phase == Phase::Live && self.check(write).is_ok()
    }

    pub(crate) fn handle_post(&mut self, write: PostWrite) {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let state = match (self.check(&write), self.phase) {
            (Err(e), _) => State::Done(Err(e)),
            (Ok(()), Phase::Live) => {
                let wr = WriteWr {
                    wr_id: route::wr_id(self.route_key, seq),
                    staging: &self.staging,
                    local_slot: write.local.0,
                    len: write.len as u32,
                    // A bogus address from the welcome fails at the NIC, not here.
                    remote_addr: self
                        .remote
                        .addr
                        .wrapping_add(self.remote.geometry.offset(write.remote.0)),
                    rkey: self.remote.rkey,
                    imm: write.imm,
                };
                match self.qp.post_write(&wr) {
                    Ok(()) => State::Posted,
                    Err(e) => {
                        self.fail(format!("posting write {}: {e}", write.id.0));
                        State::Done(Err(FabricError::Io(e.to_string())))
                    }
                }
            }
            (Ok(()), _) => State::Done(Err(FabricError::Flushed)),
        };
        self.entries.push_back(Entry { write, seq, state });
    }

    /// A work completion routed to this connection.
    pub(crate) fn handle_wc(&mut self, wc: &Wc) {
        let (_, seq) = route::split(wc.wr_id);
        let Some(pos) = self
            .entries
            .iter()
            .position(|e| e.seq == seq && matches!(e.state, State::Posted))
        else {
            // After `handle_flush_deadline` a late flush finds nothing; anything else would be
            // a completion for a work request this connection never posted.
            tracing::debug!(wr_id = wc.wr_id, status = ?wc.status, "completion for no outstanding write");
            return;
        };
        if self
            .entries
            .iter()
            .take(pos)
            .any(|e| matches!(e.state, State::Posted))
        {
            // An RC send queue completes in order; anything else means the queue pair (or
            // the driver) cannot be trusted any more.
            self.fail(format!("completion for write sequence {seq} out of order"));
        }
        let entry = &mut self.entries[pos];
        let result = match wc.status {
            WcStatus::Success => Ok(()),
            WcStatus::Flushed => Err(FabricError::Flushed),
            WcStatus::Failed { code, name, vendor } => Err(FabricError::Io(format!(
                "RDMA write {} failed: {name} (status {code}, vendor error {vendor:#x})",
                entry.write.id.0
            ))),
        };
        let failed = result.is_err();
        entry.state = State::Done(result);
        if failed {
            self.fail(format!("work completion {:?}", wc.status));
        }
    }

    /// `FabricConn::reset`.
    pub(crate) fn handle_reset(&mut self) {
        self.fail("reset by its owner".into());
    }

    /// The side channel broke or the receiver said something impossible.
    pub(crate) fn handle_broken(&mut self, why: String) {
        self.fail(why);
    }

    /// The receiver confirmed the fence, or the fence is abandoned (timed out, unreachable).
    pub(crate) fn handle_fenced(&mut self) {
        if let Phase::Failing { .. } = self.phase {
            self.phase = Phase::Failing { fenced: true };
        }
    }

    /// Flush completions did not all come in time: whatever is still posted counts as flushed.
    /// (The queue pair is in ERROR and is destroyed with the connection.)
    pub(crate) fn handle_flush_deadline(&mut self) {
        for e in &mut self.entries {
            if matches!(e.state, State::Posted) {
                e.state = State::Done(Err(FabricError::Flushed));
            }
        }
    }

    fn fail(&mut self, why: String) {
        if self.phase == Phase::Live {
            tracing::debug!(qpn = self.qp.qpn(), %why, "rdma connection failing");
            self.failure = Some(why);
            self.phase = Phase::Failing { fenced: false };
            // Verbs flushes every outstanding work request once the queue pair is in ERROR.
            self.qp.move_to_error();
        }
    }

    /// The next completion in posting order, if it may leave now.
    pub(crate) fn poll_completion(&mut self) -> Option<Completion> {
        if self.phase == (Phase::Failing { fenced: true }) && self.posted() == 0 {
            self.phase = Phase::Dead;
        }
        let front = self.entries.front()?;
        let may_leave = match &front.state {
            State::Posted => false,
            // While failing, errors wait for the fence: a caller that sees a write fail may
            // reuse its remote slot, so nothing of this connection may land after that.
            State::Done(result) => result.is_ok() || !matches!(self.phase, Phase::Failing { .. }),
        };
        if !may_leave {
            return None;
        }
        let Entry { write, seq, state } = self.entries.pop_front()?;
        match state {
            State::Done(result) => Some(Completion {
                id: write.id,
                result,
            }),
            state => {
                self.entries.push_front(Entry { write, seq, state });
                None
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn qp(&self) -> &Qp<Q> {
        &self.qp
    }

    #[cfg(test)]
    pub(crate) fn qp_mut_for_tests(&mut self) -> &mut Q {
        self.qp.inner_mut_for_tests()
    }

    #[cfg(test)]
    pub(crate) fn set_next_seq_for_tests(&mut self, seq: u32) {
        self.next_seq = seq;
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
