//! Each request's pending batch, kept by the core: the chunks its caller staged and added
//! (`handle_add`) and has not submitted; and the flush rule (`docs/invariants.md` S10, S11).
//!
//! Why the core keeps it: a caller that builds batches may interleave more requests than
//! there are staging slots (one thread, many requests). When every slot then holds a chunk
//! nobody submitted, no write is in flight to free one, and an allocate call would wait for
//! ever on its own caller. The core sees every pending batch, so it decides, without a
//! clock: when an allocate call finds no free slot and every taken slot holds an
//! unsubmitted chunk, or a chunk is added while such a call waits, every pending batch is
//! submitted (none as the last). Its writes then free staging. The explorer, the `Cluster`
//! harness and the simulation drive the same rule that Python's callers run.

use crate::ids::{ReqId, StagingSlot};
use crate::time::Instant;

use super::{ChunkSpec, SendError, SenderFlow};

/// Why a caller-staging sender refuses `allocate`, `add` and `release`.
pub(super) const CALLER_STAGING_IS_NAMED: &str =
    "the staging is the caller's (staging_placement = caller): a batch names the slots its \
     chunks are read from; nothing is allocated, added or released";

impl SenderFlow {
    /// Adds a chunk staged in a slot `req_id` holds to the request's pending batch, which
    /// the next `handle_submit` of the request sends first. When an allocate call waits for
    /// staging and only unsubmitted chunks hold it, every pending batch is submitted at
    /// once (S11). Misuse — a slot the request does not hold, one already added, a chunk of
    /// 0 bytes — cancels the request.
    pub fn handle_add(
        &mut self,
        now: Instant,
        req_id: &ReqId,
        chunk: ChunkSpec,
    ) -> Result<(), SendError> {
        let req = match self.admitted(req_id) {
            Ok(req) => req,
            Err(refused) => {
                // A failed request's caller hands back the slot it was still holding (S12).
                self.take_back_lent(req_id, chunk.staging);
                return Err(refused);
            }
        };
        let why = if self.staging.is_callers() {
            Some(CALLER_STAGING_IS_NAMED.to_owned())
        } else if chunk.bytes == 0 {
            Some(format!("chunk {} declares 0 bytes", chunk.key))
        } else if !req.staged.contains(&chunk.staging) {
            Some(format!(
                "staging slot {} is not held by this request",
                chunk.staging.0
            ))
        } else if req.added.iter().any(|c| c.staging == chunk.staging) {
            Some(format!(
                "staging slot {} holds a chunk already added",
                chunk.staging.0
            ))
        } else {
            None
        };
        if let Some(why) = why {
            self.fail(now, req_id, super::SendFailure::Misuse(why.clone()));
            return Err(SendError::Misuse {
                req_id: req_id.clone(),
                why: format!("{why} (the request was cancelled)"),
            });
        }
        self.requests
            .get_mut(req_id)
            .expect("invariant: checked above")
            .added
            .push(chunk);
        if !self.waiters.is_empty() {
            self.flush_when_only_callers_hold_staging(now);
        }
        Ok(())
    }

    /// Submits `req_id`'s pending batch (`last`: it completes the request, whose declared
    /// chunk count must then be reached). An empty batch that is not the last is a no-op.
    pub fn submit_added(
        &mut self,
        now: Instant,
        req_id: &ReqId,
        last: bool,
    ) -> Result<(), SendError> {
        let pending = self.admitted(req_id)?.added.len();
        if pending == 0 && !last {
            return Ok(());
        }
        self.handle_submit(now, req_id, Vec::new(), last)
    }

    /// Chunks in `req_id`'s pending batch (0 when it is not running).
    pub fn added_count(&self, req_id: &ReqId) -> usize {
        self.requests.get(req_id).map_or(0, |r| r.added.len())
    }

    /// Whether some request's pending batch holds chunks (an allocate attempt that finds
    /// every slot held by unsubmitted chunks then submits them, S11).
    pub fn has_pending_batches(&self) -> bool {
        self.requests.values().any(|r| !r.added.is_empty())
    }

    /// Takes a staging slot for `req_id` as `try_allocate` does. When none is free and
    /// every taken slot holds an unsubmitted chunk, first submits what can free staging
    /// (none of it as the last batch) and tries again (usually `WouldBlock` then, until
    /// the writes complete): `held`, the chunks this caller staged outside the core's
    /// pending batches, when some of the request's chunks hold staging
    /// (`StagingHeldByCaller`); and every request's pending batch (S11). `held` is left
    /// empty when it was submitted; that submit's error is returned. The one form of the
    /// "allocate; when unsubmitted chunks hold staging, submit them; retry" step every
    /// caller needs: a caller that waited holding its chunks would wait on itself.
    pub fn allocate_or_submit(
        &mut self,
        now: Instant,
        req_id: &ReqId,
        held: &mut Vec<ChunkSpec>,
    ) -> Result<StagingSlot, SendError> {
        let first = self.try_allocate(req_id);
        let mut submitted = false;
        match &first {
            Err(SendError::StagingHeldByCaller(_)) if !held.is_empty() => {
                self.handle_submit(now, req_id, std::mem::take(held), false)?;
                submitted = true;
            }
            Err(SendError::StagingHeldByCaller(_) | SendError::WouldBlock) => {}
            _ => return first,
        }
        submitted |= self.flush_when_only_callers_hold_staging(now);
        if submitted {
            self.try_allocate(req_id)
        } else {
            first
        }
    }

    /// S11: when no staging slot is free and every taken one holds an unsubmitted chunk,
    /// submits every request's pending batch (none as the last). True when one went.
    fn flush_when_only_callers_hold_staging(&mut self, now: Instant) -> bool {
        if broken_variant!(NoPendingFlush)
            || self.staging.free_count() > 0
            || !self.staging_held_by_callers()
        {
            return false;
        }
        let pending: Vec<ReqId> = self
            .requests
            .iter()
            .filter(|(_, r)| !r.added.is_empty())
            .map(|(id, _)| id.clone())
            .collect();
        let mut any = false;
        for req_id in pending {
            // An error leaves the batch pending (a full channel) or ends the request; either
            // way its end is reported as usual, and a later call tries again.
            if self.handle_submit(now, &req_id, Vec::new(), false).is_ok() {
                self.stats.flushed_batches += 1;
                any = true;
            }
        }
        any
    }
}
