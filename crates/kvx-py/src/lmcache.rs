//! LMCache's PD settings as kvx reads them (`kvx_embed::lmcache`), for `kvx.lmcache`: the one
//! mapping the `kvx` binary uses too.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// ``pd_buffer_size`` (bytes) as kvx's count of whole slots of ``chunk_bytes``; raises
/// ``ValueError`` saying what to set when no chunk fits or more than a buffer may hold.
#[pyfunction]
pub(crate) fn lmcache_pd_buffer_slots(pd_buffer_size: u64, chunk_bytes: u64) -> PyResult<u32> {
    kvx_embed::lmcache::pd_buffer_slots(pd_buffer_size, chunk_bytes)
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
