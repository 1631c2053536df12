"""The prefill side of kvx's LMCache backend: staging allocation charged to a request,
batches handed to ``kvx.Sender``, request ends followed on a thread of their own.

A request's life here: its first ``allocate`` (inside ``LMCacheEngine.store``, which names
the request: ``context.py``) begins it at kvx, whose admission probe goes out at once.

- Admitted by then (the common case): every ``allocate`` takes a staging slot for it, LMCache
  writes the chunk there in place, and ``batched_submit_put_task`` adds the written slots
  and submits them as one batch (the last when ``is_last_prefill``).
- Not admitted yet: its chunks go to the waiting room (``waiting_room.py``) and the store
  returns; a thread of its own waits for the admission, then copies the chunks into staging
  and submits them, batch by batch, in order. Once nothing of it waits any more, its later
  chunks take staging directly.

Its end (delivered, or failed with the reason) comes from ``Sender.next_ends``; kvx's
sender has by then sent the ProxyNotif, or the failure notice, to the proxy.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

import kvx

from .context import current_transfer
from .memory import StagingSlots, as_lists, lent_tensor, over_kvx_memory
from .settings import KvxPDSettings
from .waiting_room import WaitingRoom

logger = logging.getLogger("kvx.lmcache")

#: How many ended requests' ids are remembered (so that a late call for one is recognised).
ENDED_KEPT = 4096

#: One chunk of a queued batch: its key (as text), its memory object, and its staging slot
#: when it has one (None: it is in the waiting room, referenced until copied out).
_Item = Tuple[str, MemoryObj, Optional["kvx.StagingSlot"]]
#: A batch queued behind the waiting room: its chunks, and whether it is the last.
_Batch = Tuple[List[_Item], bool]


@dataclass
class _Request:
    req_id: str
    engine_req_id: Optional[str]
    total_chunks: int
    admitted: bool = False
    #: Set once it cannot go on (not admitted in time, refused, cancelled): the reason.
    failed: Optional[str] = None
    #: Batches submitted while it waited for admission, not yet moved to staging.
    waiting: Deque[_Batch] = field(default_factory=collections.deque)
    #: The thread that moves its waiting batches, once it has any.
    promoter: Optional[threading.Thread] = None
    callbacks: List[Tuple[Callable[[Any], None], List[Any]]] = field(default_factory=list)


_identities_lock = threading.Lock()
_identities_made: Dict[str, int] = {}


def _identity(derived: str) -> str:
    """The identity of a new sender of this process: LMCache's (``settings.local_id``) for the
    first that derives it, ``{derived}-{n}`` for the n-th after. Two senders made from one
    configuration in one process (the same host and init port for their TP rank) would share
    it otherwise, and a receiver refuses the second's connection while the first's lasts."""
    with _identities_lock:
        n = _identities_made.get(derived, 0) + 1
        _identities_made[derived] = n
    return derived if n == 1 else f"{derived}-{n}"


class SenderRole:
    """One TP rank's prefill side."""

    def __init__(self, settings: KvxPDSettings, metadata: Any) -> None:
        self.settings = settings
        self.metadata = metadata
        extra = settings.extra
        lent = lent_tensor(extra["kvx_fabric"], settings.slots * settings.chunk_bytes)
        self.sender = kvx.Sender(
            slots=settings.slots,
            slot_bytes=settings.chunk_bytes,
            staging=None if lent is None else lent.numpy(),
            fabric=extra["kvx_fabric"],
            proxy=settings.proxy_endpoint,
            local_id=_identity(settings.local_id),
            staging_timeout=settings.allocation_timeout_sec,
            reply_timeout=extra["kvx_reply_timeout_sec"],
            write_timeout=extra["kvx_write_timeout_sec"],
            checksums=extra["kvx_checksums"],
            failure_notices=extra["kvx_failure_notices"],
            curve_secret_key=extra["kvx_curve_secret_key"],
            curve_server_key=extra["kvx_curve_server_key"],
        )
        self.staging = lent if lent is not None else over_kvx_memory(self.sender.staging)
        self.slots = StagingSlots(self.staging, settings.chunk_bytes)
        self.room = WaitingRoom(extra["kvx_waiting_room_chunks"] or settings.slots,
                                settings.chunk_bytes)
        self._requests: Dict[str, _Request] = {}
        self._by_engine_id: Dict[str, str] = {}
        self._ended: Dict[str, str] = {}
        self._receivers: Dict[Tuple[str, int, int], int] = {}
        self._lock = threading.Condition()
        self._warned_no_context = False
        self._running = True
        self._ends = threading.Thread(target=self._follow_ends, name="kvx-lmcache-ends", daemon=True)
        self._ends.start()

    # --- allocation -------------------------------------------------------------------

    def allocate(self, shapes: Any, dtypes: Any, fmt: Optional[MemoryFormat]) -> Optional[MemoryObj]:
        """Memory to write one chunk of the request of the enclosing ``transfer`` into: a
        staging slot once it is admitted, a waiting-room slot before. ``None`` (LMCache's
        "no memory") when there is no such request, it failed, or no slot came within
        ``pd_allocation_timeout_sec``; the reason is logged."""
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
        req = self._begun(spec, engine_req_id, fmt)
        if req is None:
            return None
        if self._admitted_now(req):
            return self._staging_slot(req, shape_list, dtype_list, fmt)
        if req.failed is not None:
            return None
        obj = self.room.take(req.req_id, shape_list, dtype_list, fmt,
                             timeout=self.settings.allocation_timeout_sec,
                             give_up=lambda: req.failed is not None or self._admitted_now(req))
        if obj is not None:
            return obj
        if req.failed is None and req.admitted:
            return self._staging_slot(req, shape_list, dtype_list, fmt)
        self._fail(req, f"no waiting-room slot within {self.settings.allocation_timeout_sec} s "
                        f"(the receiver has not admitted it; kvx_waiting_room_chunks="
                        f"{self.room.capacity})")
        return None

    def _admitted_now(self, req: _Request) -> bool:
        """Whether the receiver admitted it (asked without waiting, until it did)."""
        if not req.admitted and req.failed is None:
            try:
                req.admitted = self.sender.wait_admitted(req.req_id, timeout=0)
            except kvx.KvxError as e:
                self._fail(req, f"not admitted: {e}")
        return req.admitted and req.failed is None

    def _staging_slot(self, req: _Request, shapes: List[torch.Size], dtypes: List[torch.dtype],
                      fmt: MemoryFormat) -> Optional[MemoryObj]:
        try:
            slot = self.sender.allocate(req.req_id, timeout=self.settings.allocation_timeout_sec)
        except kvx.KvxError as e:
            self._fail(req, f"no staging slot: {e}")
            return None
        return self.slots.wrap(slot, shapes, dtypes, fmt)

    def _begun(self, spec: Any, engine_req_id: Optional[str], fmt: MemoryFormat) -> Optional[_Request]:
        """The request ``spec`` names, begun at kvx (its admission probe sent); ``None`` when
        it ended or cannot begin (the reason is logged)."""
        req_id = str(getattr(spec, "req_id", "") or "")
        if not req_id:
            logger.error("kvx: a transfer_spec without req_id; the chunk is not sent")
            return None
        with self._lock:
            req = self._requests.get(req_id)
            ended = req_id in self._ended
        if ended:
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
        except (kvx.KvxError, ValueError, KeyError, AttributeError, IndexError, TypeError) as e:
            logger.error("kvx: request %s could not begin: %s", req_id, e)
            return None
        req = _Request(req_id=req_id, engine_req_id=engine_req_id, total_chunks=total)
        with self._lock:
            self._requests[req_id] = req
            if engine_req_id:
                self._by_engine_id[engine_req_id] = req_id
        # The usual answer is one round trip away: waiting that long keeps a request the
        # receiver admits at once on the zero-copy path from its first chunk.
        try:
            req.admitted = self.sender.wait_admitted(
                req_id, timeout=self.settings.extra["kvx_admission_grace_sec"])
        except kvx.KvxError as e:
            self._fail(req, f"not admitted: {e}")
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
            # kvx connects once per receiver, however many stores reach it first at once.
            peer = self.sender.add_receiver(
                f"tcp://{host}:{alloc}", f"tcp://{host}:{init}",
                timeout=self.settings.extra["kvx_connect_timeout_sec"],
            )
            with self._lock:
                self._receivers[key] = peer
        return peer

    # --- submission -------------------------------------------------------------------

    def submit(self, keys: Sequence[Any], objs: List[MemoryObj], spec: Any,
               on_complete: Optional[Callable[[Any], None]]) -> None:
        """Sends the written chunks ``objs`` (named by ``keys``) as one batch of their
        request, the last when ``spec.is_last_prefill``; a waiting request's batch is queued
        for its promoter. Never waits."""
        if len(keys) != len(objs):
            raise ValueError(f"{len(keys)} keys for {len(objs)} memory objects")
        req_id = str(getattr(spec, "req_id", "") or "") if spec is not None else ""
        last = bool(getattr(spec, "is_last_prefill", False))
        with self._lock:
            req = self._requests.get(req_id)
        waiting = [self.room.owns(obj) for obj in objs]
        staged = [self.slots.take(obj) for obj, w in zip(objs, waiting) if not w]
        if req is None or req.failed:
            # It ended (or never began): staging goes back, nothing is sent; LMCache's own
            # reference drop frees the waiting-room slots.
            for slot in staged:
                slot.release()
            if req is None and req_id not in self._ended:
                logger.error("kvx: batched_submit_put_task for request %r, which never began "
                             "(its chunks were not allocated inside its store)", req_id)
            return
        if on_complete is not None:
            with self._lock:
                req.callbacks.append((on_complete, list(keys)))
        with self._lock:
            # In order: once a batch of it waits for its promoter, later ones queue behind.
            queue_it = any(waiting) or bool(req.waiting)
        if queue_it:
            items = []
            staged_iter = iter(staged)
            for key, obj, w in zip(keys, objs, waiting):
                if w:
                    obj.ref_count_up()  # Held until its promoter copied it.
                items.append((_key_text(key), obj, None if w else next(staged_iter)))
            self._queue(req, (items, last))
            return
        try:
            for key, obj, slot in zip(keys, objs, staged):
                self.sender.add(slot, _key_text(key), nbytes=obj.get_size(),
                                tokens=obj.get_num_tokens())
            self.sender.submit(req_id, last=last)
        except kvx.KvxError as e:
            self._fail(req, f"submit refused: {e}")

    def _queue(self, req: _Request, batch: _Batch) -> None:
        with self._lock:
            req.waiting.append(batch)
            if req.promoter is None:
                req.promoter = threading.Thread(target=self._promote, args=(req,),
                                                name=f"kvx-lmcache-wait-{req.req_id}", daemon=True)
                req.promoter.start()
            self._lock.notify_all()

    def _promote(self, req: _Request) -> None:
        """Waits for ``req``'s admission, then sends its queued batches in order (copying the
        chunks that waited in the room into staging), until its last batch went or it
        ended."""
        try:
            if not self.sender.wait_admitted(req.req_id, timeout=self.settings.allocation_timeout_sec):
                self._fail(req, f"not admitted within {self.settings.allocation_timeout_sec} s")
        except kvx.KvxError as e:
            self._fail(req, f"not admitted: {e}")
        while True:
            with self._lock:
                while not req.waiting and req.failed is None and self._running:
                    if req.req_id not in self._requests:
                        return
                    self._lock.wait(timeout=0.5)
                if not req.waiting:
                    return
                items, last = req.waiting[0]
            sent = req.failed is None and self._running and self._send_batch(req, items, last)
            with self._lock:
                req.waiting.popleft()
                self._lock.notify_all()
            for _, obj, slot in items:
                if slot is None:
                    obj.ref_count_down()
                elif not sent:
                    try:
                        slot.release()
                    except kvx.MisuseError:
                        pass  # Added before the failure: kvx frees it with the request.
            if last:
                return

    def _send_batch(self, req: _Request, items: List[_Item], last: bool) -> bool:
        """Adds each chunk (a waiting-room chunk copied into a fresh staging slot) and submits
        the batch; False when it failed (the request is then failed; the caller releases
        the staging slots not added by then)."""
        cb = self.settings.chunk_bytes
        try:
            for key, obj, slot in items:
                size = obj.get_size()
                if slot is None:
                    slot = self.sender.allocate(req.req_id, timeout=self.settings.allocation_timeout_sec)
                    start = slot.index * cb
                    self.staging[start : start + size].copy_(obj.raw_data[:size])
                self.sender.add(slot, key, nbytes=size, tokens=obj.get_num_tokens())
            self.sender.submit(req.req_id, last=last)
            return True
        except kvx.KvxError as e:
            self._fail(req, f"sending what waited for admission: {e}")
            return False

    # --- ends and cancels --------------------------------------------------------------

    def _fail(self, req: _Request, why: str) -> None:
        """Ends a request that cannot go on: kvx cancels it (freeing both sides and telling
        the proxy), and later calls for it do nothing."""
        with self._lock:
            first = req.failed is None
            if first:
                req.failed = why
            self._lock.notify_all()
        self.room.wake()
        if first:
            logger.error("kvx: request %s failed: %s", req.req_id, why)
        try:
            self.sender.cancel(req.req_id)
        except kvx.KvxError:
            pass  # It ended already; its end is reported as usual.

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
            if req is not None and error is not None and req.failed is None:
                req.failed = str(error)
                logger.error("kvx: request %s failed: %s", req_id, error)
            self._lock.notify_all()
        if req is None or error is not None:
            self.room.wake()
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
        with self._lock:
            self._running = False
            promoters = [r.promoter for r in self._requests.values() if r.promoter is not None]
            self._lock.notify_all()
        self.room.wake()
        self.sender.close()
        self._ends.join(timeout=5)
        for t in promoters:
            t.join(timeout=5)


def _per_rank(ports: Any, rank: int, name: str) -> int:
    if isinstance(ports, int):
        return ports
    if rank >= len(ports):
        raise ValueError(f"transfer_spec.{name} has {len(ports)} entries; TP rank {rank} has none")
    return ports[rank]


def _key_text(key: Any) -> str:
    return key.to_string() if hasattr(key, "to_string") else str(key)
