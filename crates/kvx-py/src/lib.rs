//! `kvx._kvx`: the native half of the `kvx` Python package (`python/kvx`), over kvx-embed.
//! Every blocking call releases the GIL and waits in short slices, checking for signals
//! between them, so Ctrl-C interrupts it; errors are the typed exceptions of `errors`.
//!
//! Map:
//! - `errors`: the exception classes and the mapping from kvx's errors to them.
//! - `wait`: bounded, interruptible waits with the GIL released.
//! - `runtime`: the process's shared kvx runtime.
//! - `proxy`: `Proxy` and `ProxyWait`.

use pyo3::prelude::*;

mod errors;
mod proxy;
mod runtime;
mod wait;

#[pymodule]
fn _kvx(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<proxy::Proxy>()?;
    m.add_class::<proxy::ProxyWait>()?;
    m.add_function(wrap_pyfunction!(runtime::configure, m)?)?;
    Ok(())
}
