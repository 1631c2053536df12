"""The prefill side of kvx's LMCache backend: staging allocation charged to an admitted
request, batches handed to ``kvx.Sender``, request ends followed on a thread of their own.

A request's life here: its first ``allocate`` (inside ``LMCacheEngine.store``, which names
the request: ``context.py``) begins it at kvx and waits for the receiver to admit it, so no
chunk takes staging before the receiver has reserved room for all of them; then every
``allocate`` takes a staging slot for it, and ``batched_submit_put_task`` adds the written
slots and submits them as one batch (the last when ``is_last_prefill``). Its end (delivered,
or failed with the reason) comes from ``Sender.next_ends``; kvx's sender has then already
sent the ProxyNotif, or the failure notice, to the proxy.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

import kvx

from .context import current_transfer
from .memory import StagingSlots, as_lists
from .settings import KvxPDSettings

logger = logging.getLogger("kvx.lmcache")

#: How many ended requests' ids are remembered (so a late allocate fails at once).
ENDED_KEPT = 4096


@dataclass
class _Request:
    req_id: str
    engine_req_id: Optional[str]
    total_chunks: int
    #: Set once admission was refused or timed out, or the request failed: the reason.
    failed: Optional[str] = None
    callbacks: List[Tuple[Callable[[Any], None], List[Any]]] = field(default_factory=list)


class SenderRole:
    """One TP rank's prefill side."""

    def __init__(self, settings: KvxPDSettings, metadata: Any) -> None:
        self.settings = settings
        self.metadata = metadata
        extra = settings.extra
        self.staging = torch.zeros(settings.slots * settings.chunk_bytes, dtype=torch.uint8)
        shm = extra["kvx_fabric"] == "shm"
        self.sender = kvx.Sender(
            slots=settings.slots,
            slot_bytes=settings.chunk_bytes,
            staging=None if shm else self.staging.numpy(),
            fabric=extra["kvx_fabric"],
            proxy=settings.proxy_endpoint,
            local_id=settings.local_id,
            staging_timeout=settings.allocation_timeout_sec,
            reply_timeout=extra["kvx_reply_timeout_sec"],
            write_timeout=extra["kvx_write_timeout_sec"],
            checksums=extra["kvx_checksums"],
        )
        if shm:
            raise kvx.StartError(
                "extra_config kvx_fabric=shm: LMCache writes chunks into the staging in place, "
                "and shm staging is kvx's own mapping; use kvx_fabric: tcp"
            )
        self.slots = StagingSlots(self.staging, settings.chunk_bytes)
        self._requests: Dict[str, _Request] = {}
        self._by_engine_id: Dict[str, str] = {}
        self._ended: Dict[str, str] = {}
        self._receivers: Dict[Tuple[str, int, int], int] = {}
        self._lock = threading.Lock()
        self._warned_no_context = False
        self._running = True
        self._ends = threading.Thread(target=self._follow_ends, name="kvx-lmcache-ends", daemon=True)
        self._ends.start()

    # --- allocation -------------------------------------------------------------------

    def allocate(self, shapes: Any, dtypes: Any, fmt: Optional[MemoryFormat]) -> Optional[MemoryObj]:
        """A staging slot for the request of the enclosing ``transfer``, as a memory object
        to write the chunk into; ``None`` (LMCache's "no memory") when there is no such
        request, it was not admitted in time, or no slot came within
        ``pd_allocation_timeout_sec``. Each refusal is logged with its reason."""
        fmt = fmt or MemoryFormat.KV_2LTD
        shape_list, dtype_list = as_lists(shapes, dtypes)
        context = current_transfer()
        if context is None:
            if not self._warned_no_context:
                self._warned_no_context = True
                logger.error(
                    "kvx: allocate() outside a store with a transfer_spec has no request to "
                    "charge and is refused (call kvx.lmcache.install() before LMCache starts, "
                    "or wrap the allocation in kvx.lmcache.transfer(spec))"
                )
            return None
        spec, engine_req_id = context
        req = self._admitted(spec, engine_req_id, fmt)
        if req is None:
            return None
        try:
            slot = self.sender.allocate(req.req_id, timeout=self.settings.allocation_timeout_sec)
        except kvx.KvxError as e:
            self._fail(req, f"no staging slot: {e}")
            return None
        return self.slots.wrap(slot, shape_list, dtype_list, fmt)

    def _admitted(self, spec: Any, engine_req_id: Optional[str], fmt: MemoryFormat) -> Optional[_Request]:
        """The request ``spec`` names, begun and admitted (waiting for admission the first
        time); ``None`` when it cannot go on (the reason is logged once)."""
        req_id = str(getattr(spec, "req_id", "") or "")
        if not req_id:
            logger.error("kvx: a transfer_spec without req_id; the chunk is not sent")
            return None
        with self._lock:
            req = self._requests.get(req_id)
            ended = self._ended.get(req_id)
        if ended is not None:
            return None
        if req is not None:
            return None if req.failed else req
        total = int(getattr(spec, "total_chunks", 0) or 0)
        if total <= 0:
            logger.error(
                "kvx: request %s has total_chunks=%s: kvx admits a request for all its chunks "
                "before the first is staged, so the transfer_spec must say how many", req_id, total,
            )
            return None
        try:
            peer = self._receiver(spec)
            full = self.metadata.get_shapes()[0]
            dtype = TORCH_DTYPE_TO_STR_DTYPE[self.metadata.get_dtypes()[0]]
            self.sender.begin(req_id, receiver=peer, total_chunks=total, shape=list(full),
                              dtype=dtype, fmt=fmt.value)
        except (kvx.KvxError, ValueError, KeyError, AttributeError, IndexError) as e:
            logger.error("kvx: request %s could not begin: %s", req_id, e)
            return None
        req = _Request(req_id=req_id, engine_req_id=engine_req_id, total_chunks=total)
        with self._lock:
            self._requests[req_id] = req
            if engine_req_id:
                self._by_engine_id[engine_req_id] = req_id
        try:
            admitted = self.sender.wait_admitted(req_id, timeout=self.settings.allocation_timeout_sec)
        except kvx.KvxError as e:
            self._fail(req, f"not admitted: {e}")
            return None
        if not admitted:
            self._fail(req, f"not admitted within {self.settings.allocation_timeout_sec} s")
            return None
        return req

    def _receiver(self, spec: Any) -> int:
        rank = self.settings.tp_rank
        host = str(spec.receiver_host)
        init = int(_per_rank(spec.receiver_init_port, rank, "receiver_init_port"))
        alloc = int(_per_rank(spec.receiver_alloc_port, rank, "receiver_alloc_port"))
        key = (host, init, alloc)
        with self._lock:
            peer = self._receivers.get(key)
        if peer is None:
            peer = self.sender.add_receiver(
                f"tcp://{host}:{alloc}", f"tcp://{host}:{init}",
                timeout=self.settings.extra["kvx_connect_timeout_sec"],
            )
            with self._lock:
                self._receivers[key] = peer
        return peer

    def _fail(self, req: _Request, why: str) -> None:
        """Ends a request that cannot go on: kvx cancels it (freeing both sides and telling
        the proxy), and later allocations for it are refused at once."""
        if req.failed is None:
            req.failed = why
            logger.error("kvx: request %s failed: %s", req.req_id, why)
        try:
            self.sender.cancel(req.req_id)
        except kvx.KvxError:
            pass  # It ended already; its end is reported as usual.

    # --- submission -------------------------------------------------------------------

    def submit(self, keys: Sequence[Any], objs: List[MemoryObj], spec: Any,
               on_complete: Optional[Callable[[Any], None]]) -> None:
        """Adds the written slots of ``objs`` (named by ``keys``) to their request and submits
        them as one batch, the last when ``spec.is_last_prefill``. Never waits."""
        if len(keys) != len(objs):
            raise ValueError(f"{len(keys)} keys for {len(objs)} memory objects")
        req_id = str(getattr(spec, "req_id", "") or "") if spec is not None else ""
        with self._lock:
            req = self._requests.get(req_id)
        slots = [self.slots.take(obj) for obj in objs]
        if req is None or req.failed:
            # The request ended (or never began): the staging goes back, nothing is sent.
            for slot in slots:
                slot.release()
            if req is None and req_id not in self._ended:
                logger.error("kvx: batched_submit_put_task for request %r, which never began "
                             "(its chunks were not allocated inside its store)", req_id)
            return
        try:
            for key, obj, slot in zip(keys, objs, slots):
                self.sender.add(slot, _key_text(key), nbytes=obj.get_size(),
                                tokens=obj.get_num_tokens())
            if on_complete is not None:
                with self._lock:
                    req.callbacks.append((on_complete, list(keys)))
            self.sender.submit(req_id, last=bool(getattr(spec, "is_last_prefill", False)))
        except kvx.KvxError as e:
            self._fail(req, f"submit refused: {e}")

    # --- ends and cancels --------------------------------------------------------------

    def cancel(self, req_id: str) -> None:
        """Cancels the request with this id: kvx's (the proxy's) or the engine's own."""
        with self._lock:
            kvx_id = req_id if req_id in self._requests else self._by_engine_id.get(req_id)
            req = self._requests.get(kvx_id) if kvx_id else None
        if req is None:
            logger.debug("kvx: cancel_request(%s): no such request in flight", req_id)
            return
        self._fail(req, "cancelled")

    def _follow_ends(self) -> None:
        while self._running:
            try:
                ends = self.sender.next_ends(max=64, timeout=0.2)
            except kvx.KvxError:
                return
            for req_id, error in ends:
                self._ended_now(req_id, error)

    def _ended_now(self, req_id: str, error: Optional[BaseException]) -> None:
        with self._lock:
            req = self._requests.pop(req_id, None)
            if req is not None and req.engine_req_id:
                self._by_engine_id.pop(req.engine_req_id, None)
            self._ended[req_id] = "delivered" if error is None else str(error)
            while len(self._ended) > ENDED_KEPT:
                self._ended.pop(next(iter(self._ended)))
        if req is None:
            return
        if error is not None:
            if req.failed is None:
                logger.error("kvx: request %s failed: %s", req_id, error)
            return
        for callback, keys in req.callbacks:
            for key in keys:
                try:
                    callback(key)
                except Exception:  # LMCache's own backend swallows callback errors too.
                    logger.exception("kvx: on_complete_callback for %s raised", key)

    def in_flight(self) -> int:
        """Requests begun and not yet ended."""
        with self._lock:
            return len(self._requests)

    def close(self) -> None:
        self._running = False
        self.sender.close()
        self._ends.join(timeout=5)


def _per_rank(ports: Any, rank: int, name: str) -> int:
    if isinstance(ports, int):
        return ports
    if rank >= len(ports):
        raise ValueError(f"transfer_spec.{name} has {len(ports)} entries; TP rank {rank} has none")
    return ports[rank]


def _key_text(key: Any) -> str:
    return key.to_string() if hasattr(key, "to_string") else str(key)
