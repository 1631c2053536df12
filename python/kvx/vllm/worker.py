"""The worker side of ``KvxConnector`` (one per TP rank), one class per side:
``DecodeWorker`` over a ``DecodeKvTransfer`` and ``PrefillWorker`` over a
``PrefillKvTransfer``. Each carries out its part of every step's ``StepPlan`` and reports
back what vLLM's scheduler asks for (``get_finished``, ``get_block_ids_with_load_errors``,
the grants as worker metadata); vLLM calls every worker method on both engines, so a call
that has nothing to do on a side is a quiet no-op there, never an error. Does not import
vLLM."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple, Union

from kvx.vllm.plan import Push, Reserve, StepPlan, WorkerReport
from kvx.vllm.tracing import Spans
from kvx.vllm.transfer import DecodeKvTransfer, PrefillKvTransfer

logger = logging.getLogger("kvx.vllm")


class _Worker:
    """What both sides do: the transfer beneath, the step's plan, the spans."""

    def __init__(self, transfer: Any, tp_rank: int = 0, spans: Optional[Spans] = None) -> None:
        self.transfer = transfer
        self.tp_rank = tp_rank
        #: Each transfer's span (``kvx.vllm.tracing``), where tracing is on.
        self.spans = spans if spans is not None else Spans(None)

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """The engine's per-layer paged KV tensors."""
        self.transfer.register_kv_caches(kv_caches)

    def clear(self) -> None:
        """The step's plan is over."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        """A layer of the step was computed."""

    def wait_for_save(self) -> None:
        """Every layer of the step was computed."""

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Blocks of loads that failed since the last call."""
        return set()

    def take_report(self) -> Optional[WorkerReport]:
        """Grants and refusals since the last call (None when there were none)."""
        return None

    def take_counts(self) -> Dict[str, Any]:
        """The transfer's counts since the last call (``take_counts`` of the transfer)."""
        return self.transfer.take_counts()

    def shutdown(self) -> None:
        """Stops the transfer; transfers still open end their spans."""
        self.spans.close_all("engine stopped")
        self.transfer.close()


class DecodeWorker(_Worker):
    """A decode engine's TP rank: its reservations, and their loads received or failed."""

    def __init__(self, transfer: DecodeKvTransfer, tp_rank: int = 0, spans: Optional[Spans] = None) -> None:
        super().__init__(transfer, tp_rank, spans)
        self.transfer: DecodeKvTransfer = transfer
        #: Reserved requests by kvx id, and those vLLM withdrew.
        self._reserved: Dict[str, Reserve] = {}
        self._withdrawn: Set[str] = set()
        self._load_errors: Set[int] = set()
        #: When each reservation was made, and the received requests' waits since
        #: (``reserve_to_received_s``, ``kvx.vllm.signals``).
        self._reserved_at: Dict[str, float] = {}
        self._waits: List[float] = []

    def bind(self, plan: StepPlan) -> None:
        """Makes the plan's reservations and releases now."""
        for r in plan.reserve:
            self._reserved[r.kvx_id] = r
            self._reserved_at[r.kvx_id] = time.monotonic()
            self.spans.open(r.kvx_id, "kvx.receive", {
                "kvx.role": "decode", "kvx.tp_rank": self.tp_rank, "vllm.request_id": r.req_id,
                "kvx.blocks": len(r.block_ids), "kvx.first_block": r.first_block,
            }, r.trace_headers)
            self.transfer.reserve(r.kvx_id, r.claim_secret, r.first_block, r.block_ids, r.num_tokens)
        for rel in plan.release:
            if rel.failed is not None:
                logger.warning("kvx: KV of request %s (kvx %s) cannot come: %s", rel.req_id, rel.kvx_id, rel.failed)
                self.spans.close(rel.kvx_id, "failed", rel.failed)
            elif rel.reserved and rel.kvx_id in self._reserved:
                self._withdrawn.add(rel.kvx_id)
            self.transfer.release(rel.kvx_id, rel.reserved and rel.kvx_id in self._reserved)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str]]:
        """(sent, received) vLLM request ids: none sent; a received one is complete and
        verified, failed (its blocks then in ``get_block_ids_with_load_errors``, in this same
        call's step), or withdrawn."""
        events = self.transfer.poll()
        recving: Set[str] = set()
        for kvx_id in events.received:
            r = self._reserved.pop(kvx_id, None)
            at = self._reserved_at.pop(kvx_id, None)
            if r is not None:
                self.spans.close(kvx_id, "withdrawn" if kvx_id in self._withdrawn else "received")
                self._withdrawn.discard(kvx_id)
                recving.add(r.req_id)
                if at is not None:
                    self._waits.append(time.monotonic() - at)
        for kvx_id, reason in events.failed.items():
            self._reserved_at.pop(kvx_id, None)
            r = self._reserved.pop(kvx_id, None)
            if r is None:
                continue
            if kvx_id not in self._withdrawn:
                logger.warning("kvx: KV of request %s (kvx %s) failed to load: %s", r.req_id, kvx_id, reason)
                self._load_errors.update(r.block_ids)
                self.spans.close(kvx_id, "failed", reason)
            else:
                self.spans.close(kvx_id, "withdrawn")
            self._withdrawn.discard(kvx_id)
            recving.add(r.req_id)
        return set(), recving

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_counts(self) -> Dict[str, Any]:
        """The transfer's counts since the last call, with the received requests' waits from
        their reservation (``reserve_to_received_s``)."""
        counts = self.transfer.take_counts()
        if self._waits:
            counts["reserve_to_received_s"], self._waits = self._waits, []
        return counts


class PrefillWorker(_Worker):
    """A prefill engine's TP rank: its claims, each step's pushes layer by layer, and the
    requests sent once vLLM finished them and no write reads their blocks any more."""

    def __init__(self, transfer: PrefillKvTransfer, tp_rank: int = 0, spans: Optional[Spans] = None) -> None:
        super().__init__(transfer, tp_rank, spans)
        self.transfer: PrefillKvTransfer = transfer
        # vLLM request id ↔ kvx id of claimed transfers.
        self._claimed: Dict[str, str] = {}
        self._by_kvx: Dict[str, str] = {}
        self._pushes: List[Push] = []
        self._posted: Set[str] = set()
        self._finished_by_vllm: Set[str] = set()
        self._sent_early: Set[str] = set()
        self._report = WorkerReport()

    def bind(self, plan: StepPlan) -> None:
        """Makes the plan's claims and cancels now; keeps its pushes for this step's
        layers."""
        for b in plan.begin:
            self._claimed[b.req_id] = b.kvx_id
            self._by_kvx[b.kvx_id] = b.req_id
            rank = self.tp_rank % len(b.decode_alloc)
            self.spans.open(b.kvx_id, "kvx.push", {
                "kvx.role": "prefill", "kvx.tp_rank": self.tp_rank, "vllm.request_id": b.req_id,
                "kvx.blocks": b.num_blocks, "kvx.decode_alloc": b.decode_alloc[rank],
            }, b.trace_headers)
            self.transfer.begin(
                b.kvx_id, b.claim_secret, b.decode_alloc[rank], b.decode_fabric[rank], b.num_blocks
            )
        for rid in plan.cancel:
            kvx_id = self._claimed.get(rid)
            if kvx_id is None:
                continue
            self.transfer.cancel(kvx_id)
            if kvx_id not in self._posted:  # nothing reads this engine's blocks: forget it
                self._forget(rid)
        self._pushes = list(plan.push)

    def clear(self) -> None:
        self._pushes = []

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        """Posts this layer's writes of every push of the step (without waiting)."""
        for p in self._pushes:
            self._posted.add(p.kvx_id)
            self.spans.event(p.kvx_id, "first write posted")
            self.transfer.write_layer(p.kvx_id, layer_name, kv_layer, p.first_block, p.block_ids, p.last)

    def wait_for_save(self) -> None:
        """Every layer of the step is posted: requests whose last blocks these were are
        finished at the transfer (delivery is reported later, through ``get_finished``)."""
        for p in self._pushes:
            if p.last:
                self.transfer.finish(p.kvx_id)
                self.spans.event(p.kvx_id, "last write posted")

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str]]:
        """(sent, received) vLLM request ids: none received; a sent request is reported only
        once vLLM has told the workers it finished (vLLM's rule)."""
        self._finished_by_vllm |= set(finished_req_ids) & self._claimed.keys()
        events = self.transfer.poll()
        for kvx_id in events.granted:
            self.spans.event(kvx_id, "granted")
            rid = self._by_kvx.get(kvx_id)
            if rid is not None:
                self._report.granted[rid] += 1
        for kvx_id, reason in events.refused.items():
            self.spans.close(kvx_id, "refused", reason)
            rid = self._by_kvx.get(kvx_id)
            if rid is not None:
                self._report.refused[rid] = reason
        for kvx_id, reason in events.undelivered.items():
            self.spans.close(kvx_id, "failed", reason)
        for kvx_id in events.sent:
            self.spans.close(kvx_id, "delivered")
        self._sent_early |= {self._by_kvx[k] for k in events.sent if k in self._by_kvx}
        sending = self._sent_early & self._finished_by_vllm
        self._sent_early -= sending
        self._finished_by_vllm -= sending
        for rid in sending:
            self._forget(rid)
        return sending, set()

    def _forget(self, rid: str) -> None:
        """Drops every trace of ``rid``'s push (a push refused before any write may have
        reported its end already: nothing waits for that report any more)."""
        self._sent_early.discard(rid)
        self._finished_by_vllm.discard(rid)
        kvx_id = self._claimed.pop(rid, None)
        if kvx_id is not None:
            self._by_kvx.pop(kvx_id, None)
            self._posted.discard(kvx_id)

    def take_report(self) -> Optional[WorkerReport]:
        report, self._report = self._report, WorkerReport()
        return report if (report.granted or report.refused) else None


#: Either side's worker.
KvxWorker = Union[DecodeWorker, PrefillWorker]


def worker_for(side: str, transfer: Any, tp_rank: int = 0, spans: Optional[Spans] = None) -> KvxWorker:
    """The worker of ``side`` (``"decode"`` or ``"prefill"``, ``KvxVllmSettings.side``)."""
    if side == "decode":
        return DecodeWorker(transfer, tp_rank, spans)
    return PrefillWorker(transfer, tp_rank, spans)


__all__ = ["DecodeWorker", "KvxWorker", "PrefillWorker", "worker_for"]
