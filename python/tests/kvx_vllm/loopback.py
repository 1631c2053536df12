"""An in-process stand-in for kvx between two engines' worker sides: a decode end and a
prefill end of ``KvTransfer`` over one hub, moving bytes between the engines' CPU paged KV
tensors, one copy per run of blocks (``runs.block_runs``). It follows the
transfer's contract (a claim is granted once the id is reserved; received once the last
writes are in; a withdrawn id refuses its claim), not kvx's wire protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Sequence, Set, Tuple

from runs import block_runs
from kvx.vllm.transfer import TransferEvents
from transfer_ends import QuietEnd, take_events


@dataclass
class Hub:
    """What both ends share: reservations, claims, and each end's pending events."""

    reserved: Dict[str, Tuple[int, Tuple[int, ...]]] = field(default_factory=dict)
    claimed: Set[str] = field(default_factory=set)
    #: The claim secrets reservations were made with, and claims carried.
    secrets: Dict[str, str] = field(default_factory=dict)
    claim_secrets: Dict[str, str] = field(default_factory=dict)
    released: Set[str] = field(default_factory=set)
    decode_kv: Dict[str, Any] = field(default_factory=dict)
    decode_events: TransferEvents = field(default_factory=TransferEvents)
    prefill_events: TransferEvents = field(default_factory=TransferEvents)
    writes: List[Tuple[str, str, int, int, int]] = field(default_factory=list)

    def settle(self) -> None:
        """Grants every claim whose id is reserved; refuses those withdrawn."""
        for kvx_id in list(self.claimed):
            if kvx_id in self.released:
                self.prefill_events.refused[kvx_id] = "request already ended"
                self.claimed.discard(kvx_id)
            elif kvx_id in self.reserved:
                if self.claim_secrets.get(kvx_id) != self.secrets.get(kvx_id):
                    self.prefill_events.refused[kvx_id] = "the claim secret is not its reservation's"
                else:
                    self.prefill_events.granted.add(kvx_id)
                self.claimed.discard(kvx_id)


@dataclass
class DecodeEnd(QuietEnd):
    """The decode engine's worker end."""

    hub: Hub

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        self.hub.decode_kv = dict(kv_caches)

    def reserve(
        self, kvx_id: str, claim_secret: str, first_block: int, block_ids: Sequence[int], num_tokens: int
    ) -> None:
        self.hub.reserved[kvx_id] = (first_block, tuple(block_ids))
        self.hub.secrets[kvx_id] = claim_secret

    def release(self, kvx_id: str, reserved: bool) -> None:
        self.hub.released.add(kvx_id)
        if self.hub.reserved.pop(kvx_id, None) is not None:
            self.hub.decode_events.received.add(kvx_id)

    def begin(self, kvx_id: str, claim_secret: str, alloc: str, fabric: str, num_blocks: int) -> None:
        raise AssertionError("a decode engine claims nothing")

    def write_layer(self, *args: Any) -> None:
        raise AssertionError("a decode engine writes nothing")

    def finish(self, kvx_id: str) -> None:
        raise AssertionError("a decode engine finishes nothing")

    def cancel(self, kvx_id: str) -> None:
        raise AssertionError("a decode engine cancels nothing")

    def poll(self) -> TransferEvents:
        self.hub.settle()
        return take_events(self.hub, "decode_events")


@dataclass
class PrefillEnd(QuietEnd):
    """The prefill engine's worker end."""

    hub: Hub

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        return None

    def reserve(self, *args: Any) -> None:
        raise AssertionError("a prefill engine reserves nothing")

    def release(self, *args: Any) -> None:
        raise AssertionError("a prefill engine releases nothing")

    def begin(self, kvx_id: str, claim_secret: str, alloc: str, fabric: str, num_blocks: int) -> None:
        self.hub.claimed.add(kvx_id)
        self.hub.claim_secrets[kvx_id] = claim_secret

    def write_layer(
        self, kvx_id: str, layer_name: str, kv_layer: Any, first_block: int, block_ids: Sequence[int], last: bool
    ) -> None:
        grant_first, granted = self.hub.reserved[kvx_id]
        src, dst = [], []
        for index, block in enumerate(block_ids, start=first_block):
            if index >= grant_first:  # blocks before the grant: the decode engine's own hit
                src.append(block)
                dst.append(granted[index - grant_first])
        target = self.hub.decode_kv[layer_name]
        for s, d, n in block_runs(src, dst):
            target[d : d + n] = kv_layer[s : s + n]
            self.hub.writes.append((kvx_id, layer_name, s, d, n))

    def finish(self, kvx_id: str) -> None:
        self.hub.reserved.pop(kvx_id)
        self.hub.decode_events.received.add(kvx_id)
        self.hub.prefill_events.sent.add(kvx_id)

    def cancel(self, kvx_id: str) -> None:
        self.hub.claimed.discard(kvx_id)
        if self.hub.reserved.pop(kvx_id, None) is not None:
            self.hub.decode_events.failed[kvx_id] = "cancelled by the prefill engine"
            self.hub.prefill_events.undelivered[kvx_id] = "cancelled by the prefill engine"
        self.hub.prefill_events.sent.add(kvx_id)

    def poll(self) -> TransferEvents:
        self.hub.settle()
        return take_events(self.hub, "prefill_events")

