//! The prefill callers of the byte-driven world: beginning requests and taking staging for
//! them — a batch staged and submitted at once, one out of the oldest-first order, or a chunk
//! added to its request's pending batch — as a driver's caller would, with the staging order
//! (S9) checked on every slot handed out.

use crate::ids::StagingSlot;
use crate::ids::{PeerId, ReqId};
use crate::sender::{ChunkSpec, RequestSpec, SendError, SenderFlow};
use crate::time::Instant;

use super::OpWorld;

impl OpWorld {
    pub(super) fn begin(&mut self, s: usize, total: u32) {
        self.begun += 1;
        let req_id = ReqId(format!("r{}", self.begun));
        let spec = RequestSpec {
            req_id: req_id.clone(),
            receiver: PeerId(0),
            total_chunks: total,
            fmt: 1,
            shape: vec![1],
            dtype: "bf16".into(),
            // Every sender proves its request's reservation (under caller placement).
            claim: Some(super::placed::claim_secret(&req_id)),
        };
        if self.sides[s].flow.handle_begin(self.now, spec).is_ok() {
            self.sides[s].requests.push((req_id, total, 0));
        }
    }

    /// Stages and submits up to `n` chunks of the first admitted request with chunks left.
    pub(super) fn submit(&mut self, s: usize, n: u32) {
        let side = &mut self.sides[s];
        // A caller that does not wait for `Admitted` asks for staging for its other requests
        // too: the core must refuse (S2). Whatever it hands out anyway stays staged, where the
        // sender's invariant sees it.
        for (id, total, done) in &side.requests {
            if done < total && !side.flow.is_admitted(id) {
                let _ = side.flow.try_allocate(id);
            }
        }
        let Some(i) = side
            .requests
            .iter()
            .position(|(id, total, done)| done < total && side.flow.is_admitted(id))
        else {
            return;
        };
        let (req_id, total, done) = side.requests[i].clone();
        let mut chunks = Vec::new();
        for k in 0..n.min(total - done) {
            let taken = match callers_slot(&side.flow, done + k) {
                Some(slot) => Ok(slot),
                None => allocate_in_order(self.now, &mut side.flow, &req_id),
            };
            match taken {
                Ok(slot) => chunks.push(ChunkSpec {
                    key: format!("{req_id}@{}", done + k),
                    staging: slot,
                    tokens: 1,
                    // The explorer's landings say 1 byte (`complete_write`).
                    bytes: 1,
                }),
                // Out of staging with nothing staged: wait for it, as a driver's allocate
                // call does, so that a freed slot comes here first.
                Err(SendError::WouldBlock) if chunks.is_empty() => {
                    wait_for_staging_once(&mut side.flow, &req_id);
                    break;
                }
                Err(_) => break,
            }
        }
        if chunks.is_empty() {
            return;
        }
        let count = chunks.len() as u32;
        let last = done + count == total;
        if side
            .flow
            .handle_submit(self.now, &req_id, chunks, last)
            .is_ok()
        {
            side.requests[i].2 += count;
        }
    }

    /// Stages and submits one chunk of the youngest admitted request with chunks left.
    pub(super) fn submit_youngest(&mut self, s: usize) {
        let side = &mut self.sides[s];
        let Some(i) = side
            .requests
            .iter()
            .rposition(|(id, total, done)| done < total && side.flow.is_admitted(id))
        else {
            return;
        };
        let (req_id, total, done) = side.requests[i].clone();
        let taken = match callers_slot(&side.flow, done) {
            Some(slot) => Ok(slot),
            None => allocate_in_order(self.now, &mut side.flow, &req_id),
        };
        let Ok(slot) = taken else {
            return;
        };
        let chunk = ChunkSpec {
            key: format!("{req_id}@{done}"),
            staging: slot,
            tokens: 1,
            bytes: 1,
        };
        let last = done + 1 == total;
        if side
            .flow
            .handle_submit(self.now, &req_id, vec![chunk], last)
            .is_ok()
        {
            side.requests[i].2 += 1;
        }
    }

    /// Stages one chunk of the youngest admitted request with two or more chunks left and
    /// adds it to the request's pending batch (`handle_add`) without submitting; out of
    /// staging, waits for it as `submit` does.
    pub(super) fn add(&mut self, s: usize) {
        let now = self.now;
        let side = &mut self.sides[s];
        // With caller staging nothing is added (misuse: the request would only fail).
        if callers_slot(&side.flow, 0).is_some() {
            return;
        }
        let Some(i) = side
            .requests
            .iter()
            .rposition(|(id, total, done)| done + 1 < *total && side.flow.is_admitted(id))
        else {
            return;
        };
        let (req_id, _, done) = side.requests[i].clone();
        match allocate_in_order(now, &mut side.flow, &req_id) {
            Ok(slot) => {
                let chunk = ChunkSpec {
                    key: format!("{req_id}@{done}"),
                    staging: slot,
                    tokens: 1,
                    bytes: 1,
                };
                if side.flow.handle_add(now, &req_id, chunk).is_ok() {
                    side.requests[i].2 += 1;
                }
            }
            Err(SendError::WouldBlock) => wait_for_staging_once(&mut side.flow, &req_id),
            Err(_) => {}
        }
    }
}

/// With caller staging, the slot chunk `chunk` of every request reads (`OpWorld::
/// caller_staging`); `None` with kvx's pool, where it is allocated.
fn callers_slot(flow: &SenderFlow, chunk: u32) -> Option<StagingSlot> {
    let callers = flow.config().staging_placement == crate::config::Placement::Caller;
    callers.then(|| StagingSlot(chunk % flow.staging_capacity()))
}

/// Registers `req_id` as waiting for staging, once (as one driver call that waits does).
fn wait_for_staging_once(flow: &mut SenderFlow, req_id: &ReqId) {
    if !flow.staging_waiters().iter().any(|(_, id, _)| id == req_id) {
        flow.wait_for_staging(req_id)
            .expect("invariant: an admitted request may wait for staging");
    }
}

/// `allocate_or_submit`, checking the staging order (S9): a slot never goes to a request while
/// older requests' waiting calls are as many as the free slots or more. A request that gets
/// one stops waiting.
fn allocate_in_order(
    now: Instant,
    flow: &mut SenderFlow,
    req_id: &ReqId,
) -> Result<StagingSlot, SendError> {
    let age = flow.age(req_id);
    let older_waiting = age.map_or(0, |age| {
        let waiting = flow.staging_waiters().iter();
        waiting
            .filter(|&(a, _, _)| a < age)
            .map(|(_, _, n)| n)
            .sum()
    });
    let free = flow.staging_free();
    // With no caller-held batch: the core's pending batches are flushed when they alone
    // hold staging (S11).
    let result = flow.allocate_or_submit(now, req_id, &mut Vec::new());
    if result.is_ok() {
        assert!(
            older_waiting < free,
            "S9: a staging slot went to {req_id} while older requests' {older_waiting} \
             waiting calls had only {free} free slots"
        );
        if let Some(age) = age {
            while flow.staging_waiters().iter().any(|(a, _, _)| a == age) {
                flow.stop_waiting_for_staging(age);
            }
        }
    }
    result
}
