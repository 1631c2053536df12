//! One allocate call's wait for staging. Who gets a freed slot is the core's policy
//! (`kvx_proto::sender::StagingWaiters`: the oldest request waiting); this is only the
//! driver's side of it: a call that got `WouldBlock` registers as waiting, retries on every
//! wake-up, and leaves the queue however it ends (a slot, an error, a timeout, or the future
//! dropped), waking the calls it held back when it was the oldest, and the callers holding
//! staged chunks when it took the last free slot with no write in flight.

use kvx_proto::sender::{Age, ChunkSpec, SendError};
use kvx_proto::{Instant, ReqId, StagingSlot};

use super::{Core, Shared};

pub(super) struct StagingTurn<'a> {
    shared: &'a Shared,
    /// The age under which this call waits, once registered.
    waiting: Option<Age>,
    wake: bool,
}

impl<'a> StagingTurn<'a> {
    pub(super) fn new(shared: &'a Shared) -> Self {
        Self {
            shared,
            waiting: None,
            wake: false,
        }
    }

    /// `Some` when the call is over (a slot or an error); `None`: wait for a wake-up.
    /// `held` is what the caller staged and has not submitted: the core submits it when it
    /// alone stands between the caller and a slot (`SenderFlow::allocate_or_submit`).
    pub(super) fn attempt(
        &mut self,
        core: &mut Core,
        now: Instant,
        req_id: &ReqId,
        held: &mut Vec<ChunkSpec>,
    ) -> Option<Result<StagingSlot, SendError>> {
        let holding = !held.is_empty();
        let flushed = core.flow.stats().flushed_batches;
        let result = core.flow.allocate_or_submit(now, req_id, held);
        if (holding && held.is_empty()) || core.flow.stats().flushed_batches != flushed {
            // Submitted (the caller's batch, or pending ones): the driver has work.
            self.shared.poke.notify_one();
        }
        match result {
            Err(SendError::WouldBlock) => {
                if self.waiting.is_none() {
                    match core.flow.wait_for_staging(req_id) {
                        Ok(age) => self.waiting = Some(age),
                        Err(e) => return Some(Err(e)),
                    }
                }
                None
            }
            // Admission is awaited the same way: the `Admitted` event wakes the call.
            Err(SendError::NotAdmitted(_)) => {
                self.leave(core);
                None
            }
            other => {
                self.leave(core);
                // The last free slot taken with no write in flight: only the callers that
                // hold staged chunks can free staging now (by submitting them), so wake them.
                self.wake |= other.is_ok() && core.flow.staging_held_by_callers();
                Some(other)
            }
        }
    }

    /// The age under which this call waits for staging; `None` while it is not waiting
    /// for staging (its request not yet admitted).
    pub(super) fn waiting(&self) -> Option<Age> {
        self.waiting
    }

    pub(super) fn leave(&mut self, core: &mut Core) {
        if let Some(age) = self.waiting.take() {
            self.wake |= core.flow.stop_waiting_for_staging(age);
        }
    }
}

impl Drop for StagingTurn<'_> {
    fn drop(&mut self) {
        if self.waiting.is_some() {
            let mut core = self.shared.lock();
            self.leave(&mut core);
        }
        if self.wake {
            self.shared.wake_allocators();
        }
    }
}
