//! One kvx runtime per process, shared by every kvx object, made on first use. Its worker
//! count can be set before that (`kvx.configure`).

use std::sync::{Mutex, OnceLock};

use kvx_embed::Runtime;
use pyo3::prelude::*;

static RUNTIME: OnceLock<Runtime> = OnceLock::new();
static WORKERS: Mutex<usize> = Mutex::new(2);

/// The process's runtime, made now if it is not yet.
pub(crate) fn get() -> PyResult<&'static Runtime> {
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let workers = *WORKERS.lock().unwrap_or_else(|p| p.into_inner());
    let rt = Runtime::new(workers).map_err(crate::errors::start)?;
    let rt = RUNTIME.get_or_init(|| rt);
    // The awaitables (`Sender.admitted`, …) run on this runtime; an `Err` means a racing
    // first call set it already, to this same runtime.
    let _ = pyo3_async_runtimes::tokio::init_with_runtime(rt.tokio());
    Ok(rt)
}

/// Sets the number of threads kvx's runtime uses (default 2). Call it before making any kvx
/// object; afterwards the runtime exists and this raises `kvx.MisuseError`.
#[pyfunction]
#[pyo3(signature = (*, workers))]
pub(crate) fn configure(workers: usize) -> PyResult<()> {
    if RUNTIME.get().is_some() {
        return Err(crate::errors::MisuseError::new_err(
            "kvx.configure: the runtime already exists (call it before making any kvx object)",
        ));
    }
    if workers == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "kvx.configure: workers must be at least 1",
        ));
    }
    *WORKERS.lock().unwrap_or_else(|p| p.into_inner()) = workers;
    Ok(())
}
