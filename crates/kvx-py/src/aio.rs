//! asyncio awaitables over kvx's async calls (`Sender.admitted`, `Sender.outcome`,
//! `Sender.allocate_async`, `Receiver.ready`).
//!
//! A call that can finish at once (a free staging slot) returns a future that is already
//! done: no task, no wake-up of the loop from another thread. Otherwise the Rust future runs
//! on kvx's runtime (pyo3-async-runtimes, set up in `runtime::get`) and its result is set on
//! the loop's thread; cancelling the asyncio future drops the Rust one, and with it whatever
//! it held (a staging slot goes back to the pool).

use std::future::Future;

use pyo3::prelude::*;

/// An asyncio future of the running loop that is already done with `result`. Raises
/// `RuntimeError` outside a running loop, as asyncio's own calls do.
pub(crate) fn done<'py>(
    py: Python<'py>,
    result: PyResult<Py<PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let fut = pyo3_async_runtimes::get_running_loop(py)?.call_method0("create_future")?;
    match result {
        Ok(value) => fut.call_method1("set_result", (value,))?,
        Err(e) => fut.call_method1("set_exception", (e.into_value(py),))?,
    };
    Ok(fut)
}

/// `fut` as an awaitable of the running loop, run on kvx's runtime.
pub(crate) fn spawn<'py, F, T>(py: Python<'py>, fut: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    // Outside a running loop this raises at once, as `done` does.
    pyo3_async_runtimes::tokio::future_into_py(py, fut)
}
