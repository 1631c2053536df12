"""kvx's slots as LMCache ``MemoryObj``s, in place.

Both sides hand LMCache its own ``TensorMemoryObj`` over a byte range of a tensor that kvx
moves chunks through (the sender's staging, the receiver's buffer), so nothing is copied
between LMCache's tensor and kvx's slot. Each object's ``parent_allocator`` is one of the
classes here; LMCache calls its ``free`` when the object's reference count reaches zero, and
that is where the slot goes back to kvx:

- ``StagingSlots`` (sender): a slot allocated but never submitted is released; a submitted
  one belongs to kvx until its write completes, so ``free`` leaves it alone.
- ``LeasedChunks`` (receiver): a delivered request stays leased until LMCache has freed
  every chunk of it (retrieved and removed them); then the lease is handed back to be
  consumed, which frees the request's slots.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE, get_size_bytes
from lmcache.v1.memory_management import (
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)

import kvx

Shapes = Union[torch.Size, List[torch.Size]]
Dtypes = Union[torch.dtype, List[torch.dtype]]


def as_lists(shapes: Shapes, dtypes: Dtypes) -> tuple:
    """LMCache passes one shape and dtype or a list of each (one per layer group)."""
    shape_list = [shapes] if isinstance(shapes, torch.Size) else list(shapes)
    dtype_list = [dtypes] if isinstance(dtypes, torch.dtype) else list(dtypes)
    return shape_list, dtype_list


def lent_tensor(fabric: str, nbytes: int) -> Optional[torch.Tensor]:
    """The tensor kvx moves chunks through, when the backend lends it (``None`` with the shm
    fabric, which allocates a shared mapping of its own: ``over_kvx_memory`` views it)."""
    return None if fabric == "shm" else torch.zeros(nbytes, dtype=torch.uint8)


def over_kvx_memory(view: Optional[memoryview]) -> torch.Tensor:
    """A byte tensor over kvx's own memory (a ``Sender.staging`` or ``Receiver.buffer``
    view), in place; it keeps the view, and so the memory, alive."""
    if view is None:
        raise ValueError("this fabric's memory cannot be viewed from Python")
    return torch.frombuffer(view, dtype=torch.uint8)


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype a wire dtype name (LMCache's spelling: ``"bfloat16"``) stands for."""
    try:
        return STR_DTYPE_TO_TORCH_DTYPE[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} on the wire") from None


def slot_object(
    buffer: torch.Tensor,
    index: int,
    slot_bytes: int,
    shapes: List[torch.Size],
    dtypes: List[torch.dtype],
    fmt: MemoryFormat,
    parent: MemoryAllocatorInterface,
) -> TensorMemoryObj:
    """A ``TensorMemoryObj`` of the given layout over slot ``index`` of ``buffer`` (a flat
    uint8 tensor), with reference count 1."""
    size = get_size_bytes(shapes, dtypes)
    if size > slot_bytes:
        raise ValueError(f"a chunk of {size} bytes does not fit a slot of {slot_bytes}")
    start = index * slot_bytes
    meta = MemoryObjMetadata(
        shape=shapes[0],
        dtype=dtypes[0],
        address=index,
        phy_size=slot_bytes,
        ref_count=1,
        pin_count=0,
        fmt=fmt,
        shapes=shapes,
        dtypes=dtypes,
    )
    return TensorMemoryObj(raw_data=buffer[start : start + size], metadata=meta, parent_allocator=parent)


class _NoAllocation(MemoryAllocatorInterface):
    """What kvx's slot holders answer to LMCache's allocator calls: allocation goes through
    the backend (which knows the request), never straight to the memory."""

    def allocate(self, shapes, dtypes, fmt=MemoryFormat.UNDEFINED, allocator_type=None):
        raise RuntimeError("kvx: allocate through the PD backend, which charges a request")

    def batched_allocate(
        self, shapes, dtypes, batch_size, fmt=MemoryFormat.UNDEFINED, allocator_type=None
    ):
        raise RuntimeError("kvx: allocate through the PD backend, which charges a request")

    def batched_free(self, memory_objs, allocator_type=None, update_stats=True):
        for obj in memory_objs:
            self.free(obj, allocator_type)


class StagingSlots(_NoAllocation):
    """The sender's staging slots that LMCache holds: each allocated ``kvx.StagingSlot``
    until it is submitted (``take``) or freed unsubmitted (``free`` releases it)."""

    def __init__(self, staging: torch.Tensor, slot_bytes: int) -> None:
        self.staging = staging
        self.slot_bytes = slot_bytes
        self._held: Dict[int, "kvx.StagingSlot"] = {}
        self._lock = threading.Lock()

    def wrap(self, slot: "kvx.StagingSlot", shapes: List[torch.Size], dtypes: List[torch.dtype],
             fmt: MemoryFormat) -> TensorMemoryObj:
        """The memory object LMCache writes the chunk into: the slot itself."""
        obj = slot_object(self.staging, slot.index, self.slot_bytes, shapes, dtypes, fmt, self)
        with self._lock:
            self._held[slot.index] = slot
        return obj

    def take(self, obj: MemoryObj) -> "kvx.StagingSlot":
        """The slot under ``obj``, taken out for submission; ``ValueError`` when ``obj`` is
        not a staging slot that is held (not from this backend, or already submitted)."""
        with self._lock:
            slot = self._held.pop(obj.meta.address, None) if self._owns(obj) else None
        if slot is None:
            raise ValueError(
                "kvx: this memory object is not a held staging slot of this backend (allocated "
                "elsewhere, submitted twice, or freed)"
            )
        return slot

    def held(self) -> int:
        """Slots allocated and neither submitted nor freed."""
        with self._lock:
            return len(self._held)

    def free(self, memory_obj: MemoryObj, allocator_type: Optional[str] = None) -> None:
        with self._lock:
            slot = self._held.pop(memory_obj.meta.address, None) if self._owns(memory_obj) else None
        if slot is not None:
            slot.release()
        if isinstance(memory_obj, TensorMemoryObj):
            memory_obj.invalidate()

    def _owns(self, obj: MemoryObj) -> bool:
        raw = getattr(obj, "raw_data", None)
        if not isinstance(raw, torch.Tensor) or raw.numel() == 0:
            return False
        start = self.staging.data_ptr() + obj.meta.address * self.slot_bytes
        return raw.data_ptr() == start

    def memcheck(self) -> bool:
        return True


class LeasedChunks(_NoAllocation):
    """The chunks of one delivered request, viewed in place; when LMCache has freed every
    one of them, ``on_done(lease)`` hands the lease back (to be consumed)."""

    def __init__(self, lease: "kvx.ReadLease", on_done: Callable[["kvx.ReadLease"], None]) -> None:
        self.lease = lease
        self._left = len(lease)
        self._freed: set = set()
        self._on_done = on_done
        self._lock = threading.Lock()

    def objects(self, buffer: torch.Tensor, slot_bytes: int, metadata: Any) -> List[TensorMemoryObj]:
        """One memory object per chunk, in chunk order: the layout of ``metadata`` (both
        sides run the same model) with the token count the sender gave for the chunk."""
        fmt = MemoryFormat(self.lease.fmt) if self.lease.fmt else MemoryFormat.KV_2LTD
        full = metadata.get_shapes()[0]
        wire = torch.Size(self.lease.shape)
        if self.lease.shape and wire != full:
            raise ValueError(
                f"the sender's chunk shape {list(wire)} is not this decoder's {list(full)}: "
                "prefill and decode must run the same model and chunk size"
            )
        wire_dtype = dtype_named(self.lease.dtype) if self.lease.dtype else metadata.get_dtypes()[0]
        if wire_dtype != metadata.get_dtypes()[0]:
            raise ValueError(
                f"the sender's dtype {self.lease.dtype} is not this decoder's "
                f"{metadata.get_dtypes()[0]}"
            )
        out = []
        for slot, tokens in zip(self.lease.slots, self.lease.tokens):
            shapes = metadata.get_shapes(tokens) if tokens is not None else metadata.get_shapes()
            out.append(slot_object(buffer, slot, slot_bytes, shapes, metadata.get_dtypes(), fmt, self))
        return out

    def free(self, memory_obj: MemoryObj, allocator_type: Optional[str] = None) -> None:
        with self._lock:
            address = memory_obj.meta.address
            if address in self._freed:
                return
            self._freed.add(address)
            self._left -= 1
            done = self._left == 0
        if isinstance(memory_obj, TensorMemoryObj):
            memory_obj.invalidate()
        if done:
            self._on_done(self.lease)

    def memcheck(self) -> bool:
        return True
