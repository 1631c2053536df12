"""The decode engine's transfer over kvx (``kvx.vllm.kvx_transfer`` says how both sides
meet): ``DecodeTransfer``, a caller-placement ``kvx.Receiver`` over the engine's own per-layer
KV tensors, each request's reservation its blocks, one kvx request per layer."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Set, Tuple

import kvx
from kvx.vllm.pages import PagedLayout, byte_view, layer_request, split_layer_request
from kvx.vllm.reasons import explain
from kvx.vllm.settings import KvxVllmSettings
from kvx.vllm.transfer import TransferEvents

logger = logging.getLogger("kvx.vllm")


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
            fabric=s.fabric,
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

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()


__all__ = ["DecodeTransfer"]
