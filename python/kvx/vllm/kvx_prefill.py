"""The prefill engine's transfer over kvx (``kvx.vllm.kvx_transfer`` says how both sides
meet): ``PrefillTransfer``, a ``kvx.Sender`` whose staging is the engine's own per-layer KV
tensors, each layer's blocks written as the layer is computed, one kvx request per layer."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import kvx
from kvx.vllm.pages import PagedLayout, byte_view, layer_request, split_layer_request
from kvx.vllm.reasons import connection_refused, explain
from kvx.vllm.settings import KvxVllmSettings
from kvx.vllm.transfer import TransferEvents

logger = logging.getLogger("kvx.vllm")


@dataclass
class _Push:
    """A prefill request's layers: those not yet ended at the sender, those admitted, and
    what went wrong first."""

    layers: int
    open: Set[int] = field(default_factory=set)
    #: Layers that failed and whose posted writes may still read the engine's blocks.
    draining: Set[int] = field(default_factory=set)
    admitted: Set[int] = field(default_factory=set)
    granted: bool = False
    failure: Optional[str] = None
    #: ``time.monotonic()`` of its first write posted, and of the last layer's last one (the
    #: forward pass is over); for the metrics' push and delivery times.
    first_posted: Optional[float] = None
    last_posted: Optional[float] = None
    layers_posted: int = 0
    nbytes: int = 0


class _NoReceiver(kvx.KvxError):
    """No kvx receiver can be reached at a decode endpoint (the message says why, in the
    connector's terms)."""


class PrefillTransfer:
    """The prefill engine's transfer (one TP rank): a ``kvx.Sender`` whose staging is the
    engine's own KV tensors (or, with ``copy_staging``, kvx's, taking a copy of each page as
    its layer is computed)."""

    #: With ``copy_staging``: enough pages for this many blocks of every layer in flight.
    STAGING_BLOCKS = 64

    def __init__(
        self,
        settings: KvxVllmSettings,
        tp_rank: int = 0,
        num_blocks: Optional[int] = None,
        sender_factory: Callable[..., kvx.Sender] = kvx.Sender,
        copy_staging: bool = False,
        block_size: Optional[int] = None,
    ) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        #: vLLM's --block-size, for reasons in its terms (``kvx.vllm.reasons``).
        self.block_size = block_size
        #: Whether a new decode receiver's port is tried before kvx connects to it
        #: (``_add_receiver``): kvx's own sender's connect only times out on a closed port.
        self.probe_ports = sender_factory is kvx.Sender
        # Whether the engine's pages are sent in place is kvx's rule, not this connector's:
        # vLLM may preempt a prefill request and give its blocks to another while a write
        # of an earlier step still reads them (``kvx.may_stage_in_place``).
        self.copy_staging = copy_staging or not kvx.may_stage_in_place(settings.checksums)
        self.layout: Optional[PagedLayout] = None
        self.sender: Optional[kvx.Sender] = None
        self._sender_factory = sender_factory
        self._views: Dict[str, Any] = {}
        self._receivers: Dict[Tuple[str, str], int] = {}
        self._pushes: Dict[str, _Push] = {}
        self._refused: Dict[str, str] = {}
        self._undelivered: Dict[str, str] = {}
        self._sent: Set[str] = set()
        self._counts: Counter = Counter()
        #: Each delivered push's times (``kvx.vllm.signals``), since the last ``take_counts``.
        self._samples: Dict[str, List[float]] = {}
        #: The sender's ``write_counts()`` at the last ``take_counts``.
        self._writes_counted: Tuple[int, int] = (0, 0)

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        layout = PagedLayout.of(kv_caches, self.num_blocks)
        s = self.settings
        self._views = {name: byte_view(kv_caches[name]) for name in layout.layer_names}
        if self.copy_staging:
            staging: Dict[str, Any] = {
                "slots": self.STAGING_BLOCKS * len(layout.layer_names) * layout.pages_per_block,
            }
        else:
            # The engine's pages, slot for slot as the decode engine lends its own.
            staging = {
                "slots": layout.slots,
                "staging": [self._views[name] for name in layout.layer_names],
                "placement": "caller",
            }
        self.sender = self._sender_factory(
            **staging,
            slot_bytes=layout.page_bytes,
            fabric=s.fabric,
            staging_timeout=s.write_timeout_sec,
            reply_timeout=s.reply_timeout_sec,
            write_timeout=s.write_timeout_sec,
            checksums=s.checksums,
            curve_secret_key=s.curve_secret_key,
            curve_server_key=s.curve_server_key,
            heartbeat_interval=s.heartbeat_interval_sec,
            heartbeat_timeout=s.heartbeat_timeout_sec,
        )
        self.layout = layout

    def _tx(self) -> Tuple[kvx.Sender, PagedLayout]:
        if self.sender is None or self.layout is None:
            raise RuntimeError("kvx.vllm: register_kv_caches has not run on this worker")
        return self.sender, self.layout

    def begin(self, kvx_id: str, claim_secret: str, alloc: str, fabric: str, num_blocks: int) -> None:
        tx, layout = self._tx()
        push = _Push(layers=len(layout.layer_names))
        self._pushes[kvx_id] = push
        try:
            peer = self._receivers.get((alloc, fabric))
            if peer is None:
                peer = self._add_receiver(tx, alloc, fabric)
                self._receivers[(alloc, fabric)] = peer
            chunks = num_blocks * layout.pages_per_block
            for layer in range(push.layers):
                tx.begin(layer_request(kvx_id, layer), receiver=peer, total_chunks=chunks,
                         shape=[layout.page_bytes], dtype="uint8", claim_secret=claim_secret,
                         report_admission=True)
                push.open.add(layer)
        except kvx.KvxError as e:
            self._fail(kvx_id, push, self._explain(e))

    #: How long the probe of a new decode receiver's port may wait for an answer.
    PROBE_TIMEOUT_SEC = 1.0

    def _add_receiver(self, tx: kvx.Sender, alloc: str, fabric: str) -> int:
        """The id of the receiver at ``alloc``; ``_NoReceiver`` saying why there is none. A
        port nothing listens on is refused at once: kvx's connect (ZeroMQ connects lazily and
        retries) would hold the engine's step for ``connect_timeout_sec`` and then report a
        timeout, not the refusal."""
        timeout = self.settings.connect_timeout_sec
        refused = connection_refused(alloc, min(timeout, self.PROBE_TIMEOUT_SEC)) if self.probe_ports else None
        if refused is not None:
            raise _NoReceiver(refused)
        try:
            return tx.add_receiver(alloc, fabric, timeout=timeout)
        except (kvx.TimedOutError, kvx.StartError) as e:
            raise _NoReceiver(
                f"no kvx receiver answered at {alloc} ({e}): a firewall drops the connection, "
                "another service holds that port, or the engines' CURVE keys do not match"
            ) from None

    def _explain(self, error: Any) -> str:
        """kvx's error, in vLLM's terms (``kvx.vllm.reasons.explain``)."""
        if isinstance(error, _NoReceiver):
            return str(error)
        layout = self.layout
        return explain(
            str(error), "prefill", self.block_size,
            layout.page_bytes if layout else None, layout.pages_per_block if layout else 1,
        )

    def write_layer(self, kvx_id: str, layer_name: str, kv_layer: Any, first_block: int,
                    block_ids: Sequence[int], last: bool) -> None:
        push = self._pushes.get(kvx_id)
        if push is None or push.failure is not None:
            return
        tx, layout = self._tx()
        layer = layout.layer_index(layer_name)
        sub = layer_request(kvx_id, layer)
        source = self._views[layer_name]
        if push.first_posted is None:
            push.first_posted = time.monotonic()
        pages = len(block_ids) * layout.pages_per_block
        try:
            if self.copy_staging:
                for index, block in enumerate(block_ids, start=first_block):
                    for part in range(layout.pages_per_block):
                        slot = tx.allocate(sub)
                        slot.write(layout.page(source, part, block))
                        tx.add(slot, f"{index}.{part}", nbytes=layout.page_bytes)
                tx.submit(sub, last=last)
            else:
                keys = [
                    f"{index}.{part}"
                    for index in range(first_block, first_block + len(block_ids))
                    for part in range(layout.pages_per_block)
                ]
                slots = layout.block_pages(layer, block_ids)
                tx.submit_slots(sub, slots, keys, last=last)
            push.nbytes += pages * layout.page_bytes
            if last:
                push.layers_posted += 1
                if push.layers_posted == push.layers:
                    push.last_posted = time.monotonic()
        except kvx.KvxError as e:
            self._fail(kvx_id, push, self._explain(e))

    def finish(self, kvx_id: str) -> None:
        # Each layer's last batch went with its last write_layer; delivery comes in `poll`.
        return None

    def cancel(self, kvx_id: str) -> None:
        push = self._pushes.get(kvx_id)
        if push is not None:
            self._fail(kvx_id, push, "cancelled by the prefill engine")

    def _fail(self, kvx_id: str, push: _Push, why: str) -> None:
        if push.failure is None:
            push.failure = why
            logger.warning("kvx: push of %s failed: %s", kvx_id, why)
        tx, _ = self._tx()
        for layer in sorted(push.open):
            try:
                tx.cancel(layer_request(kvx_id, layer))
            except kvx.KvxError:
                pass
        self._settle(kvx_id, push)

    def _settle(self, kvx_id: str, push: _Push) -> None:
        """A push whose every layer ended, and reads the engine's blocks no more, is sent
        (its blocks here may be freed)."""
        if push.open or push.draining:
            return
        del self._pushes[kvx_id]
        if push.failure is not None:
            (self._undelivered if push.granted else self._refused)[kvx_id] = push.failure
        self._counts["pushed" if push.failure is None else "push_failures"] += 1
        if push.failure is None and push.first_posted is not None and push.last_posted is not None:
            now = time.monotonic()
            self._counts["timed_pushes"] += 1
            self._counts["timed_bytes"] += push.nbytes
            self._counts["push_us"] += int(1e6 * (now - push.first_posted))
            self._counts["delivery_us"] += int(1e6 * (now - push.last_posted))
            self._samples.setdefault("push_s", []).append(now - push.first_posted)
            self._samples.setdefault("delivery_s", []).append(now - push.last_posted)
        self._sent.add(kvx_id)

    def poll(self) -> TransferEvents:
        events = TransferEvents()
        if self.sender is None:
            return events
        for req_id, error in self.sender.next_ends(max=4096, timeout=0):
            kvx_id, layer = split_layer_request(req_id)
            push = self._pushes.get(kvx_id)
            if push is None:
                continue
            push.open.discard(layer)
            if error is not None and not self.copy_staging:
                # Its posted writes may still read the engine's blocks.
                push.draining.add(layer)
            if error is not None and push.failure is None:
                self._fail(kvx_id, push, self._explain(error))
            else:
                self._settle(kvx_id, push)
        self._drain()
        # Admissions come as events (one call a step, whatever the requests and layers
        # waiting); one that will never come is told by the layer's end, in next_ends.
        for req_id, error in self.sender.next_admitted(max=4096, timeout=0):
            kvx_id, layer = split_layer_request(req_id)
            push = self._pushes.get(kvx_id)
            if push is None or error is not None or push.granted or push.failure is not None:
                continue
            push.admitted.add(layer)
            if len(push.admitted) == push.layers:
                push.granted = True
                events.granted.add(kvx_id)
        events.refused.update(self._refused)
        self._refused.clear()
        events.undelivered.update(self._undelivered)
        self._undelivered.clear()
        events.sent |= self._sent
        self._sent.clear()
        return events

    def _drain(self) -> None:
        """Failed layers whose last posted write has completed read the engine's blocks no
        more; a push with none left draining is settled."""
        assert self.sender is not None
        for kvx_id, push in list(self._pushes.items()):
            for layer in sorted(push.draining):
                try:
                    self.sender.wait_released(layer_request(kvx_id, layer), timeout=0)
                except kvx.TimedOutError:
                    continue  # a posted write still reads its blocks
                except kvx.KvxError:
                    pass  # released: the failure is what it ended with
                push.draining.discard(layer)
            self._settle(kvx_id, push)

    def take_counts(self) -> Dict[str, Any]:
        """Pushes delivered and failed, the fabric writes posted and their bytes, and each
        delivered push's times (``push_s``, ``delivery_s``), since the last call. A write is what the fabric carries as one: over TCP a run of pages
        consecutive in both engines' KV (``Sender.write_counts``), so writes per request are
        layers × runs per step, not layers × blocks."""
        counts: Dict[str, Any] = dict(self._counts)
        self._counts = Counter()
        counts.update(self._samples)
        self._samples = {}
        if self.sender is not None:
            writes, nbytes = self.sender.write_counts()
            before_writes, before_bytes = self._writes_counted
            self._writes_counted = (writes, nbytes)
            if writes > before_writes:
                counts["writes"] = writes - before_writes
                counts["write_bytes"] = nbytes - before_bytes
        return counts

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


__all__ = ["PrefillTransfer"]
