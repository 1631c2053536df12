//! Caller placement's Python side: the ``placement=`` names and ``kvx.Returned``, a
//! reservation back with the program (``Receiver.reserve``, ``withdraw``, ``returned``).

use kvx_proto::receiver::Outcome;
use kvx_proto::{ClaimSecret, Placement};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// ``placement=`` as the core's `Placement`; a `ValueError` naming both otherwise.
pub(crate) fn named(name: &str) -> PyResult<Placement> {
    match name {
        "pool" => Ok(Placement::Pool),
        "caller" => Ok(Placement::Caller),
        other => Err(PyValueError::new_err(format!(
            "placement must be \"pool\" or \"caller\", not {other:?}"
        ))),
    }
}

/// ``claim_secret=`` as the core's `ClaimSecret`; a `ValueError` saying what a secret is
/// otherwise (the secret itself is not repeated).
pub(crate) fn claim_secret(secret: String) -> PyResult<ClaimSecret> {
    ClaimSecret::new(secret).map_err(|e| PyValueError::new_err(format!("claim_secret: {e}")))
}

/// A reservation back with the program (``Receiver.returned``): its ``slots`` are the
/// program's again and no write can land in them any more. ``consumed``: its request was
/// read (its lease consumed); otherwise ``reason`` says why not (withdrawn, never claimed,
/// a chunk that failed its checksum, the sender's cancel, a lost sender, …) and the slots
/// hold nothing to read.
#[pyclass(module = "kvx", frozen, get_all)]
pub(crate) struct Returned {
    /// The reservation's request id.
    req_id: String,
    /// Its slots, as reserved (chunk order).
    slots: Vec<u32>,
    /// Whether its request was consumed.
    consumed: bool,
    /// Why not, when it was not.
    reason: Option<String>,
}

#[pymethods]
impl Returned {
    fn __repr__(&self) -> String {
        match &self.reason {
            None => format!(
                "Returned({:?}, slots={:?}, consumed)",
                self.req_id, self.slots
            ),
            Some(why) => format!("Returned({:?}, slots={:?}, {why})", self.req_id, self.slots),
        }
    }
}

impl From<kvx_node::Returned> for Returned {
    fn from(r: kvx_node::Returned) -> Self {
        let reason = match &r.outcome {
            Outcome::Consumed => None,
            Outcome::Failed(why) => Some(why.to_string()),
        };
        Self {
            req_id: r.req_id.0,
            slots: r.slots.iter().map(|s| s.0).collect(),
            consumed: reason.is_none(),
            reason,
        }
    }
}
