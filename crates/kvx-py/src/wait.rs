//! Waiting without holding the GIL, and without deafness to Ctrl-C: a wait runs in slices of
//! at most `SLICE` with the GIL released, and between slices Python's signal handlers run
//! (a KeyboardInterrupt then ends the wait with that exception).

use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// The longest a blocking call goes without checking for signals.
const SLICE: Duration = Duration::from_millis(50);

/// Runs `step` (which waits at most the duration it is given) until it yields a value or
/// `timeout` passes (`None`: no limit). `Ok(None)` when the time ran out.
pub(crate) fn interruptibly<T: Send>(
    py: Python<'_>,
    timeout: Option<Duration>,
    mut step: impl FnMut(Duration) -> Option<T> + Send,
) -> PyResult<Option<T>> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let slice = match deadline {
            Some(at) => at.saturating_duration_since(Instant::now()).min(SLICE),
            None => SLICE,
        };
        if let Some(value) = py.detach(|| step(slice)) {
            return Ok(Some(value));
        }
        py.check_signals()?;
        if deadline.is_some_and(|at| Instant::now() >= at) {
            return Ok(None);
        }
    }
}

/// Seconds from Python (`None`: no limit) as a duration; negative or NaN is a `ValueError`.
pub(crate) fn seconds(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) if s == f64::INFINITY => Ok(None),
        Some(s) => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "a timeout must be a non-negative number of seconds or None, not {s}"
        ))),
    }
}

/// Seconds from Python that must be positive (a setting, not a wait): a `ValueError` naming
/// `what` otherwise.
pub(crate) fn positive_seconds(s: f64, what: &str) -> PyResult<Duration> {
    seconds(Some(s))?.filter(|d| !d.is_zero()).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "{what} must be a positive number of seconds"
        ))
    })
}
