//! What a driver or a test reads of a `SenderFlow` without changing it: counters, staging,
//! requests and channels.

use super::channel::Mode;
use super::{SenderFlow, SenderStats, State};
use crate::ids::{PeerId, ReqId, StagingSlot};

impl SenderFlow {
    /// Whether the message numbered `seq` to `receiver` is in flight: sent as far as this
    /// flow knows, its reply awaited. A driver that held the message back (its channel was
    /// down) must then send it: the channel may admit nothing else until that reply comes.
    pub fn awaits_reply(&self, receiver: PeerId, seq: u64) -> bool {
        self.channels
            .get(&receiver)
            .is_some_and(|ch| ch.in_flight.iter().any(|f| f.seq == seq))
    }

    /// Counters since start.
    pub fn stats(&self) -> &SenderStats {
        &self.stats
    }

    /// Staging slots free now.
    pub fn staging_free(&self) -> u32 {
        self.staging.free_count()
    }

    /// True when unsubmitted chunks take every staging slot: only their callers can free one,
    /// by submitting them (their allocate calls get `StagingHeldByCaller`).
    pub fn staging_held_by_callers(&self) -> bool {
        let unsubmitted = self.requests.values().map(|r| r.staged.len());
        unsubmitted.sum::<usize>() == self.staging.capacity() as usize
    }

    /// With caller staging, the submitted chunks that read `slot` now: the application must
    /// not change it while any does (0 with kvx's pool).
    pub fn staging_readers(&self, slot: StagingSlot) -> u32 {
        self.staging.readers(slot)
    }

    /// Staging slots in the pool.
    pub fn staging_capacity(&self) -> u32 {
        self.staging.capacity()
    }

    /// Whether `req_id` runs and holds its reservation (it may stage and submit).
    pub fn is_admitted(&self, req_id: &ReqId) -> bool {
        self.requests
            .get(req_id)
            .is_some_and(|r| r.state == State::Admitted)
    }

    /// Requests running, failing ones included (bounded by `requests_max`).
    pub fn tracked_requests(&self) -> usize {
        self.requests.len()
    }

    /// What the channel to `receiver` has learnt of it; `None` before its first request.
    pub fn channel_mode(&self, receiver: PeerId) -> Option<Mode> {
        self.channels.get(&receiver).map(|c| c.mode)
    }

    /// True when no request, message or write is outstanding and all staging is free.
    pub fn is_quiescent(&self) -> bool {
        self.requests.is_empty()
            && self.writes.is_empty()
            && self.staging.is_idle()
            && self
                .channels
                .values()
                .all(|c| c.queue.is_empty() && c.in_flight.is_empty())
    }
}
