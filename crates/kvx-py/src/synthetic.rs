//! `kvx._kvx.synthetic_fill` and `synthetic_check`: kvx's synthetic workload bytes
//! (`kvx_node::synthetic`: each chunk's bytes derive from its request id and index), written
//! into a staging slot and checked in a leased chunk by the same code `kvx demo` runs. For
//! tests and benchmarks that drive kvx from Python and must compare with `kvx demo` on equal
//! terms: the bytes are made and checked at the same cost, so what differs is the binding.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::receiver::ReadLease;
use crate::sender::StagingSlot;

/// Writes chunk ``chunk`` of request ``req_id``'s synthetic bytes into the first ``nbytes``
/// of ``slot`` (None: all of it), in place.
#[pyfunction]
#[pyo3(signature = (slot, req_id, chunk, nbytes = None))]
pub(crate) fn synthetic_fill(
    py: Python<'_>,
    slot: &StagingSlot,
    req_id: &str,
    chunk: u32,
    nbytes: Option<usize>,
) -> PyResult<()> {
    slot.with_bytes(py, &mut |bytes| {
        let len = nbytes.unwrap_or(bytes.len());
        let out = bytes
            .get_mut(..len)
            .ok_or_else(|| PyValueError::new_err("nbytes exceeds the slot"))?;
        kvx_node::synthetic::chunk_bytes(req_id, chunk, out);
        Ok(())
    })
}

/// True when the first ``nbytes`` of chunk ``chunk`` of ``lease`` (None: the whole slot) hold
/// exactly request ``lease.req_id``'s synthetic bytes for that chunk.
#[pyfunction]
#[pyo3(signature = (lease, chunk, nbytes = None))]
pub(crate) fn synthetic_check(
    py: Python<'_>,
    lease: &ReadLease,
    chunk: usize,
    nbytes: Option<usize>,
) -> PyResult<bool> {
    let req_id = lease.req_id_str().to_owned();
    lease.with_chunk_bytes(py, chunk, &mut |bytes| {
        let len = nbytes.unwrap_or(bytes.len());
        let got = bytes
            .get(..len)
            .ok_or_else(|| PyValueError::new_err("nbytes exceeds the slot"))?;
        Ok(kvx_node::synthetic::chunk_matches(
            &req_id,
            chunk as u32,
            got,
        ))
    })
}
