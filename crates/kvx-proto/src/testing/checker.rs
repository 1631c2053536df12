//! Global checks over the whole harness, beyond each node's own `check_invariants`:
//! - no write lands outside a live grant of its own request (a quarantined slot is allowed:
//!   quarantine exists to absorb exactly such late writes);
//! - the decoder reads the bytes the prefill produced;
//! - `ProxyNotif` at most once per request, and only when every chunk was written;
//! - every request ends exactly once at its sender, at the proxy, and at its receiver.

use std::collections::BTreeMap;
use std::fmt;

use crate::ids::ReqKey;
use crate::receiver::{Outcome, ReceiverLedger};
use crate::sender::WriteOp;
use crate::slots::SlotState;

/// A broken global rule, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation(pub String);

impl Violation {
    /// The rule broken, in words.
    pub fn new(why: String) -> Self {
        Violation(why)
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The bytes chunk `chunk` of planned request `plan` carries (one u64 stands for a chunk).
pub fn content_of(plan: usize, chunk: u32) -> u64 {
    ((plan as u64 + 1) << 32) | u64::from(chunk + 1)
}

#[derive(Debug, Default, Clone)]
pub(crate) struct Checker {
    violations: Vec<Violation>,
    writes_landed: BTreeMap<String, u32>,
    notifs: BTreeMap<String, u32>,
    receiver_ends: BTreeMap<ReqKey, u32>,
}

impl Checker {
    fn flag(&mut self, why: String) {
        self.violations.push(Violation(why));
    }

    pub fn first_violation(&self) -> Result<(), Violation> {
        self.violations.first().map_or(Ok(()), |v| Err(v.clone()))
    }

    /// Called just before `op`'s bytes land in the receiver's memory.
    pub fn on_write(&mut self, ledger: &ReceiverLedger, key: &ReqKey, op: &WriteOp) {
        *self.writes_landed.entry(op.req_id.0.clone()).or_default() += 1;
        let Some(tag) = op.tag else { return };
        let granted = ledger
            .request_slots(key)
            .is_some_and(|slots| slots.iter().any(|t| t.same_grant(tag)));
        let state = ledger.slot_state(op.remote);
        let live = granted && matches!(state, SlotState::Granted { .. });
        if !live && !matches!(state, SlotState::Quarantined { .. }) {
            self.flag(format!(
                "write of {key} chunk {} into slot {} outside a live grant ({state:?})",
                op.chunk, op.remote.0
            ));
        }
    }

    pub fn on_read(&mut self, key: &ReqKey, chunk: u32, got: u64, expected: u64) {
        if got != expected {
            self.flag(format!(
                "decoder read corrupt bytes in {key} chunk {chunk}: {got:#x} != {expected:#x}"
            ));
        }
    }

    pub fn on_proxy_notif(&mut self, req_id: &str) {
        let n = self.notifs.entry(req_id.to_owned()).or_default();
        *n += 1;
        let n = *n;
        if n > 1 {
            self.flag(format!("ProxyNotif for {req_id} sent {n} times"));
        }
    }

    pub fn on_delivered(&mut self, req_id: &str, chunks: u32) {
        let landed = self.writes_landed.get(req_id).copied().unwrap_or(0);
        if landed < chunks {
            self.flag(format!(
                "{req_id} delivered with {landed} of {chunks} chunks written"
            ));
        }
    }

    pub fn on_sender_end(&mut self, req_id: &str, already: bool) {
        if already {
            self.flag(format!("{req_id} ended twice at its sender"));
        }
    }

    pub fn on_proxy_end(&mut self, req_id: &str, already: bool) {
        if already {
            self.flag(format!("{req_id} ended twice at the proxy"));
        }
    }

    pub fn on_receiver_end(&mut self, key: &ReqKey, outcome: &Outcome) {
        let n = self.receiver_ends.entry(key.clone()).or_default();
        *n += 1;
        if *n > 1 {
            self.flag(format!("{key} ended twice at its receiver (now {outcome})"));
        }
    }
}
