//! `VerbsError`, how a verbs call fails: what every `Verbs` / `VerbsQp` call returns, and
//! what registering an `RdmaMemory` returns. A leaf, so that `memory` and `verbs` (which names
//! `RdmaMemory` in its seam) both import it one way.

use std::fmt;

/// A failed verbs call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {detail}")]
pub struct VerbsError {
    pub op: &'static str,
    pub detail: String,
}

impl VerbsError {
    pub fn new(op: &'static str, detail: impl fmt::Display) -> Self {
        VerbsError {
            op,
            detail: detail.to_string(),
        }
    }
}
