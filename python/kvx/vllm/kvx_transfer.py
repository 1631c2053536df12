"""``KvTransfer`` over kvx: the decode engine's ``DecodeTransfer`` (a caller-placement
``kvx.Receiver`` over the engine's own per-layer KV tensors) and the prefill engine's
``PrefillTransfer`` (a ``kvx.Sender``).

**One kvx request per layer.** A vLLM request ``X`` is ``len(layers)`` kvx requests, ``X.0``,
``X.1``, …: the prefill engine computes and writes layer by layer (``save_kv_layer``), and a
kvx request's chunks go in order, so each layer's blocks make one request whose chunk order
is the prompt's block order whatever the scheduler's steps are. The decode engine reserves
each layer's pages of the request's blocks (``PagedLayout.block_pages``); its local prefix
hit (blocks before ``first_block``) is the reservation's ``held`` chunks, which the prefill
engine still sends and kvx answers as already sent. The request is received when every
layer's reservation came back consumed; it failed when any came back otherwise (the others
are withdrawn at once).

**No staging copy on the prefill side.** The engine's per-layer KV tensors are the sender's
staging, lent in parts as the decode side lends its buffer (``kvx.Sender(placement="caller")``,
docs/spec/protocol.md "Caller staging"): ``save_kv_layer`` names each page's slot and kvx
writes it straight from the engine's block. The engine keeps a request's blocks until the
worker reports it sent, which is only once every layer reads them no more (delivered, or
failed with its last write completed: ``Sender.wait_released``). With checksums off, or
``copy_staging=True`` (for a sender that must own its staging: a test's corrupting sender),
each page is copied into kvx's own staging first instead: vLLM may preempt a prefill request
and hand its blocks to another while a write of an earlier step still reads them, which only
the decode side's checksum can catch. Pages consecutive in both engines' KV (a run of blocks)
go as one write over TCP: the sender posts a layer's batch in runs (``kvx_io::WriteRun``).

Every wait is bounded: a claim by ``claim_timeout_sec``, a silent request by
``idle_timeout_sec``, a grant by ``grant_timeout_sec`` (the scheduler's), a staging slot by
``write_timeout_sec``, a connection by ``connect_timeout_sec``, a silent peer engine by
``heartbeat_timeout_sec``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import kvx
from kvx.vllm.pages import PagedLayout, byte_view
from kvx.vllm.reasons import connection_refused, explain
from kvx.vllm.settings import KvxVllmSettings
from kvx.vllm.transfer import TransferEvents

logger = logging.getLogger("kvx.vllm")

def layer_request(kvx_id: str, layer: int) -> str:
    """A layer's kvx request id: ``{kvx id}.{layer index}``."""
    return f"{kvx_id}.{layer}"


def split_layer_request(req_id: str) -> Tuple[str, int]:
    """``layer_request``'s inverse."""
    kvx_id, _, layer = req_id.rpartition(".")
    return kvx_id, int(layer)


def _withdrawal(reason: Optional[str]) -> bool:
    """kvx's reason for a reservation this engine withdrew itself."""
    return "withdrew the request's reservation" in (reason or "")


@dataclass
class _Load:
    """A decode request's layers whose reservations are still out, and why it failed."""

    out: Set[int]
    failure: Optional[str] = None
    #: Withdrawn (its request ended here): a layer that failed otherwise first is logged,
    #: since the worker reports a withdrawn load without its reason.
    withdrawn: bool = False


class DecodeTransfer:
    """The decode engine's transfer (one TP rank): the engine's KV tensors are kvx's
    receive buffer under caller placement; each request's reservation is its blocks."""

    def __init__(
        self,
        settings: KvxVllmSettings,
        tp_rank: int = 0,
        num_blocks: Optional[int] = None,
        block_size: Optional[int] = None,
    ) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        #: vLLM's --block-size, for reasons in its terms (``kvx.vllm.reasons``).
        self.block_size = block_size
        self.layout: Optional[PagedLayout] = None
        self.receiver: Optional[kvx.Receiver] = None
        self._loads: Dict[str, _Load] = {}
        #: Loads that ended without a reservation out (their first reservation failed).
        self._ended: Dict[str, Optional[str]] = {}
        self._counts: Counter = Counter()

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        layout = PagedLayout.of(kv_caches, self.num_blocks)
        s = self.settings
        self.receiver = kvx.Receiver(
            slots=layout.slots,
            slot_bytes=layout.page_bytes,
            buffer=[byte_view(kv_caches[name]) for name in layout.layer_names],
            placement="caller",
            alloc=s.alloc_endpoint(self.tp_rank),
            fabric_endpoint=s.fabric_endpoint(self.tp_rank),
            admission_timeout=s.claim_timeout_sec,
            request_idle_timeout=s.idle_timeout_sec,
            require_checksums=s.checksums,
            curve_secret_key=s.curve_secret_key,
            curve_allow=s.curve_allow,
            heartbeat_interval=s.heartbeat_interval_sec,
            heartbeat_timeout=s.heartbeat_timeout_sec,
        )
        self.layout = layout
        logger.info(
            "kvx: decode rank %d receives at %s (%d layers x %d blocks, %d-byte pages)",
            self.tp_rank, self.receiver.alloc_endpoint, len(layout.layer_names),
            layout.num_blocks, layout.page_bytes,
        )

    def _rx(self) -> Tuple[kvx.Receiver, PagedLayout]:
        if self.receiver is None or self.layout is None:
            raise RuntimeError("kvx.vllm: register_kv_caches has not run on this worker")
        return self.receiver, self.layout

    def reserve(
        self, kvx_id: str, claim_secret: str, first_block: int, block_ids: Sequence[int], num_tokens: int
    ) -> None:
        rx, layout = self._rx()
        load = _Load(out=set())
        self._loads[kvx_id] = load
        held = first_block * layout.pages_per_block
        for layer in range(len(layout.layer_names)):
            try:
                rx.reserve(
                    layer_request(kvx_id, layer), layout.block_pages(layer, block_ids),
                    claim_secret=claim_secret, held=held,
                )
            except kvx.KvxError as e:
                load.failure = load.failure or f"reserving layer {layer}: {e}"
                break
            load.out.add(layer)
        if load.failure is not None:
            self._withdraw_rest(kvx_id, load)

    def release(self, kvx_id: str, reserved: bool) -> None:
        load = self._loads.get(kvx_id)
        if load is None:
            # Never reserved here: the prefill engine's claim waits for a reservation that
            # never comes and is refused at claim_timeout_sec.
            return
        load.failure = load.failure or "withdrawn: the request ended on the decode engine"
        load.withdrawn = True
        self._withdraw_rest(kvx_id, load)

    def _withdraw_rest(self, kvx_id: str, load: _Load) -> None:
        rx, _ = self._rx()
        for layer in sorted(load.out):
            try:
                rx.withdraw(layer_request(kvx_id, layer))
            except kvx.MisuseError:
                pass  # returned already: its Returned is on its way
        if not load.out:
            # Nothing was reserved (the first reservation failed): it ends now.
            self._loads.pop(kvx_id, None)
            self._ended[kvx_id] = load.failure

    def poll(self) -> TransferEvents:
        events = TransferEvents()
        for kvx_id, failure in self._ended.items():
            events.failed[kvx_id] = failure or "not reserved"
        self._ended.clear()
        if self.receiver is None:
            return events
        # A ready layer is complete and verified: consuming its lease returns its blocks to
        # the engine (no write can land any more) with `consumed` set.
        for lease in self.receiver.next_ready(max=1024, timeout=0):
            lease.consume(wait=False)
        for back in self.receiver.returned(max=4096, timeout=0):
            kvx_id, layer = split_layer_request(back.req_id)
            load = self._loads.get(kvx_id)
            if load is None:
                continue
            load.out.discard(layer)
            if not back.consumed and load.failure is None:
                load.failure = self._explain(back.reason)
                self._withdraw_rest(kvx_id, load)
            elif not back.consumed and load.withdrawn and not _withdrawal(back.reason):
                # It had failed before the request ended here (the router ends it at once
                # when the prefill engine reports a failed claim): the reason is this one.
                load.withdrawn = False
                logger.warning("kvx: KV of kvx %s had failed to load before it was withdrawn: %s",
                               kvx_id, self._explain(back.reason))
            if not load.out and kvx_id in self._loads:
                del self._loads[kvx_id]
                if load.failure is None:
                    events.received.add(kvx_id)
                    self._counts["received"] += 1
                else:
                    events.failed[kvx_id] = load.failure
                    self._counts["load_failures"] += 1
        return events

    def _explain(self, reason: Optional[str]) -> str:
        layout = self.layout
        return explain(
            reason or "no reason given", "decode", self.block_size,
            layout.page_bytes if layout else None, layout.pages_per_block if layout else 1,
        )

    def take_counts(self) -> Dict[str, Any]:
        """Loads received and failed (withdrawals among them) since the last call."""
        counts, self._counts = dict(self._counts), Counter()
        return counts

    def begin(self, kvx_id: str, claim_secret: str, alloc: str, fabric: str, num_blocks: int) -> None:
        raise RuntimeError("kvx.vllm: a decode engine (kv_consumer) claims nothing")

    def write_layer(self, kvx_id: str, layer_name: str, kv_layer: Any, first_block: int,
                    block_ids: Sequence[int], last: bool) -> None:
        raise RuntimeError("kvx.vllm: a decode engine (kv_consumer) writes nothing")

    def finish(self, kvx_id: str) -> None:
        raise RuntimeError("kvx.vllm: a decode engine (kv_consumer) finishes nothing")

    def cancel(self, kvx_id: str) -> None:
        raise RuntimeError("kvx.vllm: a decode engine (kv_consumer) cancels nothing")

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()


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
        # Without checksums, pages are copied: vLLM may preempt a prefill request and give
        # its blocks to another while a write of an earlier step still reads them, and only
        # a checksum lets the decode engine tell (the load then fails, never answers wrong).
        self.copy_staging = copy_staging or not settings.checksums
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

    def reserve(
        self, kvx_id: str, claim_secret: str, first_block: int, block_ids: Sequence[int], num_tokens: int
    ) -> None:
        raise RuntimeError("kvx.vllm: a prefill engine (kv_producer) reserves nothing")

    def release(self, kvx_id: str, reserved: bool) -> None:
        raise RuntimeError("kvx.vllm: a prefill engine (kv_producer) releases nothing")

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
                         shape=[layout.page_bytes], dtype="uint8", claim_secret=claim_secret)
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
        for kvx_id, push in list(self._pushes.items()):
            if push.granted or push.failure is not None:
                continue
            for layer in list(push.open - push.admitted):
                try:
                    if self.sender.wait_admitted(layer_request(kvx_id, layer), timeout=0):
                        push.admitted.add(layer)
                except kvx.KvxError:
                    pass  # its end comes through next_ends
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


def transfer_for(
    settings: KvxVllmSettings, tp_rank: int, num_blocks: Optional[int], block_size: Optional[int] = None
) -> Any:
    """The transfer of ``settings.side``; ``block_size`` (vLLM's) words its failures."""
    if settings.side == "decode":
        return DecodeTransfer(settings, tp_rank, num_blocks, block_size=block_size)
    return PrefillTransfer(settings, tp_rank, num_blocks, block_size=block_size)


__all__: List[str] = ["DecodeTransfer", "PrefillTransfer", "layer_request", "transfer_for"]
