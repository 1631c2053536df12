//! Python memory lent to kvx: any writable, C-contiguous object with the buffer protocol
//! (`bytearray`, a NumPy array, `mmap`), or a CPU `torch.Tensor` (through `.numpy()`, which
//! shares its memory). Its address is taken with `ctypes` — the stable ABI of CPython 3.10
//! has no `PyObject_GetBuffer` — whose array object holds a buffer export for as long as kvx
//! keeps it, so the memory cannot be resized or freed under kvx (a `bytearray` refuses to
//! resize while exported). Slot views are slices of one byte-format `memoryview`: zero-copy,
//! and each keeps the memory alive by itself.
//!
//! Memory kvx allocates itself (the shm fabric's mapping) is viewed the same way
//! (`export`): a `ctypes` array over its address, which holds what keeps the mapping alive,
//! under one byte `memoryview`.

use std::any::Any;
use std::sync::Arc;

use kvx_embed::{Memory, MemoryView};
use kvx_io::ExternalRegion;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// What keeps lent memory alive: the `ctypes` array over it (holding the buffer export).
/// Dropped by kvx when its fabric is done with the memory; pyo3 defers the reference's
/// release to the next time a thread holds the GIL when dropped without it.
struct PyOwner {
    _export: Py<PyAny>,
}

/// A caller's buffer as kvx memory, and the byte view that slot views are cut from.
pub(crate) struct Lent {
    pub(crate) region: ExternalRegion,
    pub(crate) view: Py<PyAny>,
}

/// The byte `memoryview` of `obj` (a tensor through `.numpy()`), refusing what kvx cannot
/// write into.
fn byte_view<'py>(py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let memoryview = py.import("builtins")?.getattr("memoryview")?;
    let view = match memoryview.call1((obj,)) {
        Ok(view) => view,
        Err(e) if obj.hasattr("numpy")? && obj.hasattr("data_ptr")? => {
            // A torch.Tensor: CPU tensors share their memory with `.numpy()`.
            let is_cpu = obj
                .getattr("device")
                .and_then(|d| d.getattr("type"))
                .and_then(|t| t.extract::<String>())
                .is_ok_and(|t| t == "cpu");
            if !is_cpu {
                return Err(PyTypeError::new_err(
                    "kvx can lend only CPU memory from Python: this tensor is on another \
                     device (GPU memory needs a fabric that registers it, such as RDMA with \
                     peer memory, not available from Python yet)",
                ));
            }
            let _ = e;
            memoryview.call1((obj.call_method0("numpy")?,))?
        }
        Err(e) => {
            return Err(PyTypeError::new_err(format!(
                "kvx needs a writable buffer (bytearray, numpy array, mmap, CPU torch tensor): {e}"
            )))
        }
    };
    if view.getattr("readonly")?.extract::<bool>()? {
        return Err(PyValueError::new_err(
            "kvx needs writable memory: this buffer is read-only",
        ));
    }
    if !view.getattr("c_contiguous")?.extract::<bool>()? {
        return Err(PyValueError::new_err(
            "kvx needs contiguous memory: this buffer is strided (make it contiguous first)",
        ));
    }
    view.call_method1("cast", ("B",))
}

/// `obj`'s memory as a region of `slot_bytes` slots, which must hold exactly `slots` of them
/// (a shorter tail is allowed and left alone).
pub(crate) fn lend(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    slots: u32,
    slot_bytes: usize,
) -> PyResult<Lent> {
    let view = byte_view(py, obj)?;
    let nbytes: usize = view.getattr("nbytes")?.extract()?;
    let needed = slots as usize * slot_bytes;
    if nbytes < needed || nbytes / slot_bytes.max(1) != slots as usize {
        return Err(PyValueError::new_err(format!(
            "the buffer holds {nbytes} bytes: {slots} slots of {slot_bytes} bytes need \
             {needed} (and less than one more slot)"
        )));
    }
    let ctypes = py.import("ctypes")?;
    let array_type = ctypes.getattr("c_char")?.mul(nbytes)?;
    let export = array_type.call_method1("from_buffer", (&view,))?;
    let addr: usize = ctypes.call_method1("addressof", (&export,))?.extract()?;
    let owner = PyOwner {
        _export: export.unbind(),
    };
    // SAFETY: `addr` is the start of `nbytes` writable bytes, kept valid (and unresizable)
    // by the buffer export the ctypes array holds, which `owner` keeps until kvx drops it.
    // The Python caller promises the protocol's rule (module doc of `kvx_io::region`): it
    // writes a staging slot only while it holds it, and reads a receive slot only while
    // leased; the package's docstrings say so.
    #[allow(unsafe_code)]
    let region =
        unsafe { ExternalRegion::new(addr as *mut u8, nbytes, slot_bytes, Box::new(owner)) }
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(Lent {
        region,
        view: view.unbind(),
    })
}

/// The memory a sender's staging or a receiver's buffer uses: the caller's `buffer`, or a
/// fresh `bytearray` when it gave none, so that slot views work the same way. A fabric that
/// needs its own shared mapping (shm) gets kvx's allocation, viewed once started (`export`).
pub(crate) fn choose(
    py: Python<'_>,
    buffer: Option<&Bound<'_, PyAny>>,
    slots: u32,
    slot_bytes: usize,
    own_mapping: bool,
) -> PyResult<(Memory, Option<Py<PyAny>>)> {
    if slot_bytes == 0 || slots == 0 {
        return Err(PyValueError::new_err(
            "slots and slot_bytes must be positive",
        ));
    }
    if own_mapping {
        if buffer.is_some() {
            return Err(PyValueError::new_err(
                "the shm fabric cannot use memory the caller owns: it allocates a shared \
                 mapping of its own (leave buffer/staging out; the staging/buffer view and \
                 the slot views are views of that mapping), or choose the tcp fabric",
            ));
        }
        return Ok((Memory::Allocate { slot_bytes }, None));
    }
    let fresh;
    let obj = match buffer {
        Some(obj) => obj,
        None => {
            let len = (slots as usize).checked_mul(slot_bytes).ok_or_else(|| {
                PyValueError::new_err("slots × slot_bytes does not fit in memory")
            })?;
            fresh = py.import("builtins")?.getattr("bytearray")?.call1((len,))?;
            &fresh
        }
    };
    let lent = lend(py, obj, slots, slot_bytes)?;
    Ok((Memory::External(lent.region), Some(lent.view)))
}

/// A receive buffer lent as several buffers of the same size (``buffer=[...]``: a serving
/// framework's per-layer KV tensors), each holding `slots / len(parts)` slots, joined into
/// one region whose slot `p × part_slots + i` is slot i of part p
/// (`ExternalRegion::join`); with the byte views the slot views are cut from.
pub(crate) fn lend_parts(
    py: Python<'_>,
    parts: &Bound<'_, PyAny>,
    slots: u32,
    slot_bytes: usize,
) -> PyResult<(Memory, Views)> {
    let parts: Vec<Bound<'_, PyAny>> = parts.try_iter()?.collect::<PyResult<_>>()?;
    let n = parts.len() as u32;
    if n == 0 || !slots.is_multiple_of(n) {
        return Err(PyValueError::new_err(format!(
            "a buffer in {n} parts must split slots={slots} evenly among them (each part \
             holds slots / parts whole slots)"
        )));
    }
    let part_slots = slots / n;
    let mut regions = Vec::with_capacity(parts.len());
    let mut views = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        let lent = lend(py, part, part_slots, slot_bytes)
            .map_err(|e| PyValueError::new_err(format!("buffer part {i}: {e}")))?;
        regions.push(lent.region);
        views.push(lent.view);
    }
    let region = ExternalRegion::join(regions).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((
        Memory::External(region),
        Views {
            parts: views,
            part_slots,
        },
    ))
}

/// The byte views slot views are cut from: the whole buffer's, or each part's of a buffer lent
/// in parts (`lend_parts`).
pub(crate) struct Views {
    parts: Vec<Py<PyAny>>,
    part_slots: u32,
}

impl Views {
    /// One view over all `slots`.
    pub(crate) fn one(view: Py<PyAny>, slots: u32) -> Self {
        Self {
            parts: vec![view],
            part_slots: slots,
        }
    }

    /// The whole buffer's view; `None` for a buffer in several parts.
    pub(crate) fn whole(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match self.parts.as_slice() {
            [view] => Some(view.clone_ref(py)),
            _ => None,
        }
    }

    /// Slot `slot`'s view, in its part.
    pub(crate) fn slot<'py>(
        &self,
        py: Python<'py>,
        slot: u32,
        slot_bytes: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let part = &self.parts[(slot / self.part_slots) as usize];
        slot_view(py, part, slot % self.part_slots, slot_bytes)
    }

    pub(crate) fn clone_ref(&self, py: Python<'_>) -> Self {
        Self {
            parts: self.parts.iter().map(|v| v.clone_ref(py)).collect(),
            part_slots: self.part_slots,
        }
    }
}

/// Slot `slot`'s view: bytes `slot × slot_bytes .. (slot + 1) × slot_bytes` of `view`.
pub(crate) fn slot_view<'py>(
    py: Python<'py>,
    view: &Py<PyAny>,
    slot: u32,
    slot_bytes: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let start = slot as usize * slot_bytes;
    let slice = pyo3::types::PySlice::new(py, start as isize, (start + slot_bytes) as isize, 1);
    view.bind(py).get_item(slice)
}

/// Keeps kvx's own memory mapped for as long as a view of it lives: the `ctypes` array
/// under the view holds it.
#[pyclass(module = "kvx", frozen)]
pub(crate) struct MappingKeeper {
    _keep: Arc<dyn Any + Send + Sync>,
}

/// A byte `memoryview` over kvx's own memory (`MemoryView`), which keeps it mapped: the
/// view holds a `ctypes` array over the address, and the array holds the keeper.
pub(crate) fn export(py: Python<'_>, memory: MemoryView) -> PyResult<Py<PyAny>> {
    let MemoryView { addr, len, keep } = memory;
    let ctypes = py.import("ctypes")?;
    let array_type = ctypes.getattr("c_char")?.mul(len)?;
    let array = array_type.call_method1("from_address", (addr,))?;
    array.setattr("_kvx_keep", MappingKeeper { _keep: keep })?;
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((array,))?
        .call_method1("cast", ("B",))?;
    Ok(view.unbind())
}

/// The byte view slot views are cut from, once the sender or receiver started: the lent
/// memory's (`choose`), or else kvx's own memory's (the shm fabric's mapping, which exists
/// only now), or none when that cannot be viewed.
pub(crate) fn view_once_started(
    py: Python<'_>,
    lent: Option<Py<PyAny>>,
    own: impl FnOnce() -> Option<MemoryView>,
) -> PyResult<Option<Py<PyAny>>> {
    match lent {
        Some(view) => Ok(Some(view)),
        None => own().map(|m| export(py, m)).transpose(),
    }
}
