"""Where a request's chunks wait while the receiver has not admitted it yet.

kvx's rule is that only an admitted request may take a staging slot: staging is then only
ever held by requests whose receiver slots are guaranteed, and finite staging cannot close a
wait cycle. Through LMCache that rule meets one thread that stores every request of a
scheduler step in turn: if the store of a request that is not admitted yet (the receiver is
full of an earlier one) waited for admission, the thread could not go on to store the
earlier request's next chunks, which admission is waiting for: the seed's deadlock, moved
into the worker.

So such a request's chunks are written into this waiting room instead (plain host memory of
the same slot size, never staging), and the store returns. A thread per waiting request
(``SenderRole``) waits for its admission, then copies each chunk into a staging slot and
submits the batches as they came. Requests admitted at once (the common case) never touch
the room and stay zero-copy. A full room makes a store wait, at most
``pd_allocation_timeout_sec``, after which the request fails with the reason.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, TensorMemoryObj

from .memory import _NoAllocation, slot_object


#: How often a store blocked on a full room checks whether its request was admitted.
GIVE_UP_POLL_S = 0.005


class WaitingRoom(_NoAllocation):
    """``slots`` slots of ``slot_bytes`` for chunks of requests not yet admitted; each slot
    is owned by one request until its memory object is freed."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.memory = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
        self.slot_bytes = slot_bytes
        self.capacity = slots
        self._free: List[int] = list(range(slots - 1, -1, -1))
        self._owner: Dict[int, str] = {}
        self._cv = threading.Condition()

    def take(self, req_id: str, shapes: List[torch.Size], dtypes: List[torch.dtype],
             fmt: MemoryFormat, timeout: float,
             give_up: Optional[Callable[[], bool]] = None) -> Optional[TensorMemoryObj]:
        """A slot for ``req_id``, waiting at most ``timeout`` for one to free; ``None`` after
        that, or as soon as ``give_up()`` is true (checked at each wake-up)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0 or (give_up is not None and give_up()):
                    return None
                # A freed slot wakes this wait; the request's own admission (which ends
                # it: the chunk then goes straight to staging) is only seen by polling
                # give_up, so poll often: a store blocked here holds up the engine's step.
                self._cv.wait(timeout=min(left, GIVE_UP_POLL_S))
            index = self._free.pop()
            self._owner[index] = req_id
        return slot_object(self.memory, index, self.slot_bytes, shapes, dtypes, fmt, self)

    def held_by(self, req_id: str) -> int:
        """Slots ``req_id`` holds."""
        with self._cv:
            return sum(1 for owner in self._owner.values() if owner == req_id)

    def owns(self, obj: MemoryObj) -> bool:
        raw = getattr(obj, "raw_data", None)
        if not isinstance(raw, torch.Tensor) or raw.numel() == 0:
            return False
        return raw.data_ptr() == self.memory.data_ptr() + obj.meta.address * self.slot_bytes

    def free(self, memory_obj: MemoryObj, allocator_type: Optional[str] = None) -> None:
        if not self.owns(memory_obj):
            return
        with self._cv:
            index = memory_obj.meta.address
            if self._owner.pop(index, None) is not None:
                self._free.append(index)
                self._cv.notify_all()
        if isinstance(memory_obj, TensorMemoryObj):
            memory_obj.invalidate()

    def free_slots(self) -> int:
        with self._cv:
            return len(self._free)

    def wake(self) -> None:
        """Wakes waiting ``take`` calls (to check ``give_up``)."""
        with self._cv:
            self._cv.notify_all()

    def memcheck(self) -> bool:
        with self._cv:
            return len(self._free) + len(self._owner) == self.capacity
