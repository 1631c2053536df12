"""``KvxPDBackend``: the class LMCache builds in place of its ``PDBackendAsync`` once
``kvx.lmcache.install()`` ran. Same constructor ``(config, metadata)``, same name
(``str(backend) == "PDBackend"``), every method LMCache's ``StorageManager``,
``LMCacheEngine`` and vLLM adapter call; the work is done by ``SenderRole`` or
``ReceiverRole``, by ``pd_role``."""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Sequence

import torch
from lmcache.utils import CacheEngineKey, get_size_bytes
from lmcache.v1.memory_management import MemoryAllocatorInterface, MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import AllocatorBackendInterface

from .receiver import ReceiverRole
from .sender import SenderRole
from .settings import KvxPDSettings, settings_from

logger = logging.getLogger("kvx.lmcache")


class KvxPDBackend(AllocatorBackendInterface):
    """LMCache's PD backend, on kvx: admission before staging (no deadlock between
    concurrent chunked-prefill requests), every wait bounded, nothing leaked on cancel or
    failure, a failure notice to the proxy instead of silence, and chunks checked end to
    end. Built by LMCache from its own ``pd_*`` keys plus kvx's ``kvx_*`` keys under
    ``extra_config`` (``settings.py``)."""

    def __init__(self, config: Any, metadata: Any) -> None:
        super().__init__(dst_device="cpu")
        self.config = config
        self.metadata = metadata
        self.tp_rank = int(metadata.worker_id)
        chunk_shape = torch.Size(metadata.kv_shape)
        self.chunk_bytes = get_size_bytes([chunk_shape], [metadata.kv_dtype])
        chunk_tokens = metadata.kv_shape[MemoryFormat.KV_2LTD.token_dim()]
        #: Read by LMCache's StorageManager (``pd_config.role``).
        self.pd_config: KvxPDSettings = settings_from(config, metadata, self.chunk_bytes, chunk_tokens)
        self.running = True
        self._sender: Optional[SenderRole] = None
        self._receiver: Optional[ReceiverRole] = None
        if self.pd_config.role == "sender":
            self._sender = SenderRole(self.pd_config, metadata)
            self.memory_allocator: MemoryAllocatorInterface = self._sender.slots
        else:
            self._receiver = ReceiverRole(self.pd_config, metadata)
            self.memory_allocator = _ReceiverAllocator()
        logger.info(
            "kvx PD backend: %s, TP rank %d, %d chunks of %d bytes, fabric %s",
            self.pd_config.role, self.tp_rank, self.pd_config.slots, self.chunk_bytes,
            self.pd_config.extra["kvx_fabric"],
        )

    def __str__(self) -> str:
        return "PDBackend"

    # --- allocator backend ------------------------------------------------------------------

    def initialize_allocator(self, config: Any, metadata: Any) -> MemoryAllocatorInterface:
        return self.memory_allocator

    def get_memory_allocator(self) -> MemoryAllocatorInterface:
        return self.memory_allocator

    def get_allocator_backend(self) -> "KvxPDBackend":
        return self

    def allocate(self, shapes: Any, dtypes: Any, fmt: MemoryFormat = MemoryFormat.KV_2LTD,
                 eviction: bool = True, busy_loop: bool = True) -> Optional[MemoryObj]:
        """Sender: a staging slot for the request being stored (see ``context.py``),
        waiting at most ``pd_allocation_timeout_sec``; ``None`` when there is none to
        give. The decode side allocates nothing (kvx fills its buffer): ``None``."""
        if self._sender is None or not self.running:
            return None
        return self._sender.allocate(shapes, dtypes, fmt)

    def batched_allocate(self, shapes: Any, dtypes: Any, batch_size: int,
                         fmt: MemoryFormat = MemoryFormat.KV_2LTD, eviction: bool = True,
                         busy_loop: bool = True) -> Optional[List[Optional[MemoryObj]]]:
        """``batch_size`` allocations in turn (each may wait, as LMCache's own do)."""
        return [self.allocate(shapes, dtypes, fmt) for _ in range(batch_size)]

    # --- storage backend -----------------------------------------------------------------

    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], memory_objs: List[MemoryObj],
                                transfer_spec: Any = None,
                                on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
                                ) -> None:
        """Sender: sends the chunks (one batch of their request; the last when
        ``transfer_spec.is_last_prefill``). Returns at once; LMCache drops its references
        afterwards, and the staging is freed when the writes complete."""
        if self._sender is None:
            logger.warning("kvx: the decode side does not store chunks; %d dropped", len(keys))
            return
        self._sender.submit(keys, memory_objs, transfer_spec, on_complete_callback)

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        assert isinstance(key, CacheEngineKey)
        return self._receiver is not None and self._receiver.contains(key, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        if self._receiver is None:
            return None
        return self._receiver.get_blocking(key)

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        if self._receiver is None:
            return False
        return self._receiver.remove(key)

    def pin(self, key: CacheEngineKey) -> bool:
        # Nothing is ever evicted here (as in LMCache's backend): pinning changes nothing.
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        return True

    def cancel_request(self, req_id: str) -> None:
        """Cancels a request in flight, by the proxy's id or by the engine's own (vLLM's
        ``request_id``, which its adapter passes): kvx frees its staging and the
        receiver's slots and tells the proxy it failed."""
        if self._sender is not None:
            self._sender.cancel(req_id)

    def close(self) -> None:
        """Stops the backend: requests still running fail (their proxy hears so)."""
        if not self.running:
            return
        self.running = False
        if self._sender is not None:
            self._sender.close()
        if self._receiver is not None:
            self._receiver.close()

    # --- for tests and operators ---------------------------------------------------------

    @property
    def sender(self) -> Optional[SenderRole]:
        return self._sender

    @property
    def receiver(self) -> Optional[ReceiverRole]:
        return self._receiver


class _ReceiverAllocator(MemoryAllocatorInterface):
    """The decode side's allocator: kvx fills the buffer, LMCache allocates nothing in it."""

    def allocate(self, shapes, dtypes, fmt=MemoryFormat.UNDEFINED, allocator_type=None):
        return None

    def batched_allocate(self, shapes, dtypes, batch_size, fmt=MemoryFormat.UNDEFINED,
                         allocator_type=None):
        return None

    def free(self, memory_obj, allocator_type=None):
        pass

    def batched_free(self, memory_objs, allocator_type=None, update_stats=True):
        pass
