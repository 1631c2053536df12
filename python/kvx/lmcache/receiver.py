"""The decode side of kvx's LMCache backend: delivered requests become LMCache memory
objects over kvx's buffer, looked up by key.

A thread takes each delivered request from ``kvx.Receiver.next_ready`` (every chunk has
landed and passed its checks) and files one ``TensorMemoryObj`` per chunk under its cache
key; ``contains``/``get_blocking`` find them, and ``remove`` drops LMCache's reference. When
LMCache has freed every chunk of a request, the thread consumes its lease and kvx frees the
slots. Nothing is visible to LMCache before the whole request has landed: a key is either
absent or complete.

A request LMCache never retrieves in full would hold its slots for ever; kvx reclaims them
after ``kvx_unconsumed_ttl_sec``. The thread withdraws such a request's keys shortly
before that, so that no memory object ever views a slot kvx has reused.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj

import kvx

from .memory import LeasedChunks, lent_tensor, over_kvx_memory
from .settings import KvxPDSettings

logger = logging.getLogger("kvx.lmcache")

#: The share of the unconsumed TTL after which a request's keys are withdrawn.
WITHDRAW_AT = 0.9


class ReceiverRole:
    """One TP rank's decode side."""

    def __init__(self, settings: KvxPDSettings, metadata: Any) -> None:
        self.settings = settings
        self.metadata = metadata
        extra = settings.extra
        lent = lent_tensor(extra["kvx_fabric"], settings.slots * settings.chunk_bytes)
        self.receiver = kvx.Receiver(
            slots=settings.slots,
            slot_bytes=settings.chunk_bytes,
            buffer=None if lent is None else lent.numpy(),
            fabric=extra["kvx_fabric"],
            alloc=settings.alloc_endpoint,
            fabric_endpoint=settings.fabric_endpoint,
            peer_share_percent=extra["kvx_peer_share_percent"],
            admission_timeout=settings.allocation_timeout_sec,
            unconsumed_ttl=extra["kvx_unconsumed_ttl_sec"],
            require_checksums=extra["kvx_checksums"],
            curve_secret_key=extra["kvx_curve_secret_key"],
            curve_allow=extra["kvx_curve_allow"],
        )
        self.buffer = lent if lent is not None else over_kvx_memory(self.receiver.buffer)
        self.data: Dict[CacheEngineKey, MemoryObj] = {}
        self._leases: Dict[int, tuple] = {}  # id(lease) → (lease, deadline, keys)
        self._lock = threading.Condition()
        self._running = True
        self._pump = threading.Thread(target=self._take_delivered, name="kvx-lmcache-ready",
                                      daemon=True)
        self._pump.start()

    # --- LMCache's lookups ----------------------------------------------------------------

    def contains(self, key: CacheEngineKey, pin: bool) -> bool:
        with self._lock:
            obj = self.data.get(key)
            if obj is not None and pin:
                obj.ref_count_up()
            return obj is not None

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """The chunk under ``key``; when it is not here yet (its request is still landing,
        the proxy having heard first), waits up to ``kvx_get_wait_sec`` for it."""
        deadline = time.monotonic() + self.settings.extra["kvx_get_wait_sec"]
        with self._lock:
            while True:
                obj = self.data.get(key)
                left = deadline - time.monotonic()
                if obj is not None or left <= 0 or not self._running:
                    break
                self._lock.wait(timeout=left)
        if obj is None:
            logger.warning("kvx: get_blocking(%s): no such chunk (never delivered, or removed)", key)
        return obj

    def remove(self, key: CacheEngineKey) -> bool:
        """Drops one reference to the chunk (LMCache's reference-counted remove); the key
        goes when the count reaches zero."""
        with self._lock:
            obj = self.data.get(key)
            if obj is None:
                return False
            if obj.get_ref_count() <= 1:
                del self.data[key]
        obj.ref_count_down()
        return True

    # --- the delivery thread ----------------------------------------------------------------

    def _take_delivered(self) -> None:
        while self._running:
            try:
                leases = self.receiver.next_ready(max=16, timeout=0.05)
            except kvx.KvxError as e:
                if self._running:
                    logger.error("kvx: the receiver stopped: %s", e)
                return
            for lease in leases:
                self._file(lease)
            self._withdraw_expiring()

    def _file(self, lease: "kvx.ReadLease") -> None:
        chunks = LeasedChunks(lease, self._consume)
        try:
            objs = chunks.objects(self.buffer, self.settings.chunk_bytes, self.metadata)
            keys = [CacheEngineKey.from_string(k) for k in lease.keys]
        except (ValueError, KeyError, IndexError) as e:
            logger.error("kvx: request %s cannot be read here and is dropped: %s", lease.req_id, e)
            lease.consume()
            return
        ttl = self.settings.extra["kvx_unconsumed_ttl_sec"]
        duplicates: List[MemoryObj] = []
        with self._lock:
            self._leases[id(lease)] = (lease, time.monotonic() + WITHDRAW_AT * ttl, keys)
            for key, obj in zip(keys, objs):
                if key in self.data:
                    duplicates.append(obj)  # First writer wins, as in LMCache's backend.
                else:
                    self.data[key] = obj
            self._lock.notify_all()
        for obj in duplicates:
            obj.ref_count_down()

    def _consume(self, lease: "kvx.ReadLease") -> None:
        """Hands a request's slots back to kvx once LMCache freed its last chunk, at once and
        on the freeing thread: the slots it frees may be what the next request's admission
        waits for. Never waits: the freeing thread is LMCache's retrieve, and kvx's driver
        confirming the release would cost it a hand-off to another thread and back."""
        with self._lock:
            known = self._leases.pop(id(lease), None) is not None
        if not known:
            return  # Withdrawn at its TTL, which consumed it.
        try:
            lease.consume(wait=False)
        except kvx.KvxError as e:
            logger.warning("kvx: consuming request %s: %s", lease.req_id, e)

    def _withdraw_expiring(self) -> None:
        now = time.monotonic()
        with self._lock:
            expiring = [entry for entry in self._leases.values() if entry[1] <= now]
            for lease, _, keys in expiring:
                self._leases.pop(id(lease), None)
                for key in keys:
                    obj = self.data.get(key)
                    if obj is not None and obj.parent() is not None and getattr(obj.parent(), "lease", None) is lease:
                        del self.data[key]
        for lease, _, _ in expiring:
            logger.warning("kvx: request %s was not retrieved within the unconsumed TTL; its "
                           "keys are withdrawn and its slots freed", lease.req_id)
            try:
                lease.consume()
            except kvx.KvxError:
                pass

    def buffered_keys(self) -> int:
        with self._lock:
            return len(self.data)

    def leased_requests(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        self._running = False
        with self._lock:
            self._lock.notify_all()
        self._pump.join(timeout=5)
        self.receiver.close()
