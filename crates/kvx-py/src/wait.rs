//! Waiting without holding the GIL, and without deafness to Ctrl-C: each blocking call is one
//! future with its own bound (the core's staging timeout, the caller's `timeout`), run on
//! kvx's runtime with the GIL released. Every `SIGNAL_CHECK` the thread takes the GIL back
//! for a moment so that Python's signal handlers run (a KeyboardInterrupt ends the wait with
//! that exception, dropping the future), then goes on with the same future: the wait is
//! one, however many layers it crosses, and its bound is never restarted.

use std::future::Future;
use std::time::Duration;

use pyo3::prelude::*;

use crate::runtime;

/// The longest a blocking call goes without letting Python's signal handlers run.
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

/// Runs `fut` to its end, or until `timeout` passes (`None`: no limit; `Ok(None)` then).
pub(crate) fn interruptibly<F>(
    py: Python<'_>,
    timeout: Option<Duration>,
    fut: F,
) -> PyResult<Option<F::Output>>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime::get()?;
    let bounded = async move {
        match timeout {
            Some(limit) => tokio::time::timeout(limit, fut).await.ok(),
            None => Some(fut.await),
        }
    };
    let mut bounded = std::pin::pin!(bounded);
    loop {
        let polled = py.detach(|| {
            rt.block_on(async {
                tokio::time::timeout(SIGNAL_CHECK, bounded.as_mut())
                    .await
                    .ok()
            })
        });
        if let Some(out) = polled {
            return Ok(out);
        }
        py.check_signals()?;
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
