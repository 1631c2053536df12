//! asyncio awaitables over kvx's async calls (`Sender.admitted`, `Sender.outcome`,
//! `Sender.released`, `Sender.allocate_async`, `Receiver.ready`, `Receiver.returned_async`).
//!
//! A call that can finish at once (a free staging slot) returns a future that is already
//! done: no task, no wake-up of the loop from another thread. Otherwise the Rust future runs
//! on kvx's runtime (pyo3-async-runtimes, set up in `runtime::get`) and its result is set on
//! the loop's thread; cancelling the asyncio future drops the Rust one, and with it whatever
//! it held (a staging slot goes back to the pool).
//!
//! What must reach the caller or go back (leases, returned reservations) travels as a
//! `Delivery` (`spawn_delivery`): the runtime's side ends before the loop knows whether its
//! await was cancelled meanwhile, so the Python objects are made only in a task of the loop
//! (`kvx._aio.delivered`), and a `Delivery` dropped unopened hands its contents
//! back.

use std::future::Future;
use std::sync::Mutex;

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

/// What an awaitable hands over that must reach its caller or go back where it came from.
pub(crate) trait Deliverable: Send + 'static {
    /// The contents as Python objects, made on the caller's thread.
    fn deliver(self: Box<Self>, py: Python<'_>) -> PyResult<Py<PyAny>>;
}

/// Contents on their way to an awaiting caller: opened by ``kvx._aio.delivered``'s task once
/// it has resumed; dropped unopened (the await was cancelled), the contents'
/// own drop hands them back.
#[pyclass(module = "kvx._kvx", frozen)]
pub(crate) struct Delivery {
    contents: Mutex<Option<Box<dyn Deliverable>>>,
}

#[pymethods]
impl Delivery {
    /// The contents as Python objects; a second call raises ``RuntimeError``.
    fn take(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let contents = self
            .contents
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match contents {
            Some(c) => c.deliver(py),
            None => Err(pyo3::exceptions::PyRuntimeError::new_err(
                "this delivery was already taken",
            )),
        }
    }
}

/// `fut` as an awaitable of the running loop whose result is `fut`'s contents, delivered
/// (`Delivery`): a task of the loop that opens the runtime's result.
pub(crate) fn spawn_delivery<'py, F, D>(py: Python<'py>, fut: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = PyResult<D>> + Send + 'static,
    D: Deliverable,
{
    let inner = spawn(py, async move {
        let contents: Box<dyn Deliverable> = Box::new(fut.await?);
        Ok(Delivery {
            contents: Mutex::new(Some(contents)),
        })
    })?;
    py.import("kvx._aio")?.getattr("delivered")?.call1((inner,))
}
