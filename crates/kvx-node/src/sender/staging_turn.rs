//! One allocate call's wait for staging. Who gets a freed slot is the core's policy
//! (`kvx_proto::sender::StagingWaiters`: the oldest request waiting); this is only the
//! driver's side of it: a call that got `WouldBlock` registers as waiting, retries on every
//! wake-up, and leaves the queue however it ends (a slot, an error, a timeout, or the future
//! dropped), waking the calls it held back when it was the oldest.

use kvx_proto::sender::{Age, SendError};
use kvx_proto::{ReqId, StagingSlot};

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
    pub(super) fn attempt(
        &mut self,
        core: &mut Core,
        req_id: &ReqId,
    ) -> Option<Result<StagingSlot, SendError>> {
        match core.flow.try_allocate(req_id) {
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
                Some(other)
            }
        }
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
            self.shared.version.send_modify(|v| *v += 1);
            self.shared.cv.notify_all();
        }
    }
}
