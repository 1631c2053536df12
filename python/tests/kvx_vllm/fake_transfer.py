"""A ``KvTransfer`` whose events the test decides (no vLLM needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Sequence, Set, Tuple

from kvx.vllm.transfer import TransferEvents


@dataclass
class FakeTransfer:
    """A ``KvTransfer`` whose events the test decides. Records every call."""

    calls: List[Tuple[Any, ...]] = field(default_factory=list)
    reserved: Dict[str, Tuple[int, Tuple[int, ...], int]] = field(default_factory=dict)
    #: The claim secret each id was reserved or claimed with.
    secrets: Dict[str, str] = field(default_factory=dict)
    pending: TransferEvents = field(default_factory=TransferEvents)
    posted: Set[str] = field(default_factory=set)

    # The test's side.
    def complete(self, kvx_id: str) -> None:
        self.pending.received.add(kvx_id)

    def fail(self, kvx_id: str, reason: str = "checksum mismatch") -> None:
        self.pending.failed[kvx_id] = reason

    def grant(self, kvx_id: str) -> None:
        self.pending.granted.add(kvx_id)

    def refuse(self, kvx_id: str, reason: str = "refused") -> None:
        self.pending.refused[kvx_id] = reason

    def deliver(self, kvx_id: str) -> None:
        self.pending.sent.add(kvx_id)

    def named(self, name: str) -> List[Tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == name]

    # KvTransfer.
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        self.calls.append(("register", tuple(kv_caches)))

    def reserve(
        self, kvx_id: str, claim_secret: str, first_block: int, block_ids: Sequence[int], num_tokens: int
    ) -> None:
        self.secrets[kvx_id] = claim_secret
        self.calls.append(("reserve", kvx_id, first_block, tuple(block_ids), num_tokens))
        self.reserved[kvx_id] = (first_block, tuple(block_ids), num_tokens)

    def release(self, kvx_id: str, reserved: bool) -> None:
        self.calls.append(("release", kvx_id, reserved))
        if reserved:  # no write can land once the grant is withdrawn (here: at once)
            self.pending.received.add(kvx_id)

    def begin(self, kvx_id: str, claim_secret: str, alloc: str, fabric: str, num_blocks: int) -> None:
        self.secrets[kvx_id] = claim_secret
        self.calls.append(("begin", kvx_id, alloc, fabric))

    def write_layer(
        self, kvx_id: str, layer_name: str, kv_layer: Any, first_block: int, block_ids: Sequence[int], last: bool
    ) -> None:
        self.calls.append(("write", kvx_id, layer_name, first_block, tuple(block_ids)))
        self.posted.add(kvx_id)

    def finish(self, kvx_id: str) -> None:
        self.calls.append(("finish", kvx_id))

    def cancel(self, kvx_id: str) -> None:
        self.calls.append(("cancel", kvx_id))
        if kvx_id in self.posted:  # drained at once
            self.pending.sent.add(kvx_id)

    def poll(self) -> TransferEvents:
        events, self.pending = self.pending, TransferEvents()
        return events

    def take_counts(self) -> Dict[str, int]:
        return {}

    def close(self) -> None:
        self.calls.append(("close",))
