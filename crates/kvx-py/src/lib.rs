//! `kvx._kvx`: the native half of the `kvx` Python package (`python/kvx`), over kvx-embed.
//! Every blocking call is one bounded future waited on with the GIL released, and Python's
//! signal handlers run every 50 ms meanwhile, so Ctrl-C interrupts it (`wait`); the waits also
//! come as asyncio awaitables (`aio`); errors are the typed exceptions of `errors`.
//!
//! Map:
//! - `defaults`: `defaults()`, every setting's default, read from the core and kvx-embed.
//! - `errors`: the exception classes and the mapping from kvx's errors to them.
//! - `wait`: bounded, interruptible waits with the GIL released.
//! - `aio`: asyncio futures over kvx's async calls (the awaitable methods).
//! - `runtime`: the process's shared kvx runtime.
//! - `proxy`: `Proxy` and `ProxyWait`.
//! - `sender`: `Sender` and `StagingSlot`; `receiver`: `Receiver` and `ReadLease`;
//!   `placement`: the `placement=` names and `Returned` (caller placement).
//! - `memory`: Python buffers lent to kvx, and zero-copy slot views of them.
//! - `env`: transport and fabric by name.
//! - `lmcache`: LMCache's `pd_buffer_size` as a slot count, for `kvx.lmcache`.
//! - `synthetic`: kvx's synthetic workload bytes, filled and checked in place (tests, benchmarks).

#![warn(missing_docs)]

use pyo3::prelude::*;

mod aio;
mod defaults;
mod env;
mod errors;
mod lmcache;
mod memory;
mod placement;
mod proxy;
mod receiver;
mod runtime;
mod sender;
mod synthetic;
mod wait;

#[pymodule]
fn _kvx(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<proxy::Proxy>()?;
    m.add_class::<proxy::ProxyWait>()?;
    m.add_class::<sender::Sender>()?;
    m.add_class::<sender::StagingSlot>()?;
    m.add_class::<receiver::Receiver>()?;
    m.add_class::<receiver::ReadLease>()?;
    m.add_class::<placement::Returned>()?;
    m.add_function(wrap_pyfunction!(defaults::defaults, m)?)?;
    m.add_function(wrap_pyfunction!(defaults::may_stage_in_place, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::configure, m)?)?;
    m.add_function(wrap_pyfunction!(synthetic::synthetic_fill, m)?)?;
    m.add_function(wrap_pyfunction!(synthetic::synthetic_check, m)?)?;
    m.add_function(wrap_pyfunction!(lmcache::lmcache_pd_buffer_slots, m)?)?;
    Ok(())
}
