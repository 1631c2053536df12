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
//! `Delivery` (`spawn_delivery`) of items `OnTheirWay`: the runtime's side ends before the
//! loop knows whether its await was cancelled meanwhile, so the Python objects are made only
//! in a task of the loop (`kvx._aio.delivered`), and a `Delivery` dropped unopened gives its
//! items back to the stream they came from, through that stream's `give_back` (kvx-node's
//! `handover`, the one hand-over under every caller).

use std::future::Future;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::PyClass;

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

/// A frozen Python class whose objects any thread may read (`Py::get`): what items go back
/// to.
pub(crate) trait Owner:
    PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Sync
{
}
impl<O: PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Sync> Owner for O {}

/// Items of `owner`'s on their way to an awaiting caller: made into a list of Python objects
/// (`make`, each) in a task of the caller's loop, or, dropped before that (the await was
/// cancelled), given back to `owner` (`back`) for its next caller.
pub(crate) struct OnTheirWay<O: Owner, T: Send + 'static> {
    pub(crate) owner: Py<O>,
    pub(crate) items: Vec<T>,
    pub(crate) make: fn(&O, Python<'_>, T) -> PyResult<Py<PyAny>>,
    pub(crate) back: fn(&O, Vec<T>),
}

impl<O: Owner, T: Send + 'static> Deliverable for OnTheirWay<O, T> {
    fn deliver(mut self: Box<Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let items = std::mem::take(&mut self.items);
        let owner = self.owner.get();
        let objects = items
            .into_iter()
            .map(|item| (self.make)(owner, py, item))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(pyo3::types::PyList::new(py, objects)?.into_any().unbind())
    }
}

impl<O: Owner, T: Send + 'static> Drop for OnTheirWay<O, T> {
    fn drop(&mut self) {
        if !self.items.is_empty() {
            (self.back)(self.owner.get(), std::mem::take(&mut self.items));
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
