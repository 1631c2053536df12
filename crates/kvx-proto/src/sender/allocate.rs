//! A caller's staging slots: taking one (only for an admitted request, oldest waiting
//! requests first: S2, S9), registering a call that waits for one, and handing one back —
//! from a running request, or from a failed one whose caller still held it (S12).

use crate::ids::{ReqId, StagingSlot};

use super::{Age, SendError, SenderFlow};

impl SenderFlow {
    /// Takes a staging slot for an admitted request. `WouldBlock` means wait for a write to
    /// complete, or for older requests' waiting calls to take the free slots (a driver waits,
    /// bounded by `staging_timeout`, registered with `wait_for_staging`).
    pub fn try_allocate(&mut self, req_id: &ReqId) -> Result<StagingSlot, SendError> {
        let req = self.admitted(req_id)?;
        if self.staging.is_callers() {
            return Err(SendError::Misuse {
                req_id: req_id.clone(),
                why: super::batching::CALLER_STAGING_IS_NAMED.to_owned(),
            });
        }
        let age = req.age;
        let needed = req.submitted as usize + req.staged.len();
        if req.last_submitted || needed >= req.spec.total_chunks as usize {
            let why = format!(
                "all {} declared chunks already have staging",
                req.spec.total_chunks
            );
            return Err(SendError::Misuse {
                req_id: req_id.clone(),
                why,
            });
        }
        // Free slots go to the oldest requests with waiting calls first: a younger request
        // takes one only while more are free than older requests' calls wait for (a caller
        // refused a slot it could have had is woken again for nothing; from Python, that is
        // a thread's sleep).
        let older_waiting = self.waiters.calls_older_than(age);
        let free = self.staging.free_count();
        if free > 0 && older_waiting >= free {
            return Err(SendError::WouldBlock);
        }
        let Some(slot) = self.staging.take(req_id) else {
            // Only unsubmitted chunks hold the pool: tell the callers that hold some (they can
            // submit a partial batch); a caller that holds none waits for them.
            let holds_some = self
                .requests
                .get(req_id)
                .is_some_and(|r| !r.staged.is_empty());
            if self.staging_held_by_callers() && holds_some {
                return Err(SendError::StagingHeldByCaller(self.staging.capacity()));
            }
            return Err(SendError::WouldBlock);
        };
        self.requests
            .get_mut(req_id)
            .expect("invariant: checked above")
            .staged
            .insert(slot);
        Ok(slot)
    }

    /// Registers one allocate call of `req_id` as waiting for staging (after `WouldBlock`),
    /// so that a freed slot goes to the oldest request waiting. Returns the request's age,
    /// for `stop_waiting_for_staging`.
    pub fn wait_for_staging(&mut self, req_id: &ReqId) -> Result<Age, SendError> {
        let age = self.admitted(req_id)?.age;
        self.waiters.add(age, req_id);
        Ok(age)
    }

    /// Removes one waiting call registered by `wait_for_staging` (a no-op once its request
    /// ended). True when its request was the oldest waiting: younger callers may go ahead
    /// now, so wake them.
    pub fn stop_waiting_for_staging(&mut self, age: Age) -> bool {
        self.waiters.remove_one(age)
    }

    /// Hands back a staging slot the caller took but will not submit.
    pub fn release_staging(&mut self, req_id: &ReqId, slot: StagingSlot) -> Result<(), SendError> {
        if self.staging.is_callers() {
            return Err(SendError::Misuse {
                req_id: req_id.clone(),
                why: super::batching::CALLER_STAGING_IS_NAMED.to_owned(),
            });
        }
        if self.take_back_lent(req_id, slot) {
            return Ok(());
        }
        let req = self
            .requests
            .get_mut(req_id)
            .ok_or_else(|| SendError::Unknown(req_id.clone()))?;
        if req.added.iter().any(|c| c.staging == slot) {
            let why = format!("staging slot {} holds a chunk already added", slot.0);
            return Err(SendError::Misuse {
                req_id: req_id.clone(),
                why,
            });
        }
        if !req.staged.remove(&slot) {
            let why = format!("staging slot {} is not held by this request", slot.0);
            return Err(SendError::Misuse {
                req_id: req_id.clone(),
                why,
            });
        }
        self.staging.give_back(slot);
        Ok(())
    }
}
