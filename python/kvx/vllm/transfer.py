"""The interface between ``KvxConnector``'s worker side and the bytes' transport, one per
side: ``DecodeKvTransfer`` and ``PrefillKvTransfer``. The worker side (``kvx.vllm.worker``) turns vLLM's calls into these; an
implementation moves the KV: ``kvx.vllm.kvx_transfer`` over kvx; tests give their own.

Identities are kvx ids (the router's ``kvx_request_id``), never vLLM's request ids. A block
index is the index of a block in the request's prompt (block ``i`` holds tokens
``i * block_size`` up to ``(i + 1) * block_size``); the decode side's grant maps block
indexes to its own block ids, the prefill side names its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Protocol, Sequence, Set, Union


@dataclass
class TransferEvents:
    """What happened since the last ``poll``, by kvx id."""

    #: Prefill: this rank's sender holds the decode engine's grant.
    granted: Set[str] = field(default_factory=set)
    #: Prefill: the decode engine refused the claim (reason).
    refused: Dict[str, str] = field(default_factory=dict)
    #: Prefill: every write landed and the decode engine confirmed (or a cancel drained):
    #: the request's blocks here may be freed.
    sent: Set[str] = field(default_factory=set)
    #: Prefill: of those sent, the granted pushes that ended undelivered (a write failed, the
    #: decode engine was lost, a cancel): why.
    undelivered: Dict[str, str] = field(default_factory=dict)
    #: Decode: every write landed and passed its checksum, or a withdrawn reservation can
    #: no longer be written: the blocks may be read, or freed.
    received: Set[str] = field(default_factory=set)
    #: Decode: the load failed (a checksum, a timeout, the prefill engine lost, a cancel):
    #: no write can land any more; the reason.
    failed: Dict[str, str] = field(default_factory=dict)


class _Transfer(Protocol):
    """What both sides' transfers do: one worker's (one TP rank's) transport of KV."""

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """The engine's paged KV, one tensor per layer name: the decode side's receive
        memory, the prefill side's write source."""

    def poll(self) -> TransferEvents:
        """Events since the last call."""

    def take_counts(self) -> Dict[str, Any]:
        """What it counted since the last call (pushes, writes and their bytes; loads
        received and failed), for vLLM's KV transfer metrics."""

    def close(self) -> None:
        """Stops; pending transfers fail on the other side."""


class DecodeKvTransfer(_Transfer, Protocol):
    """A decode engine's transfer: its blocks are reservations the prefill engine writes."""

    def reserve(
        self, kvx_id: str, claim_secret: str, first_block: int, block_ids: Sequence[int], num_tokens: int
    ) -> None:
        """Blocks ``block_ids`` (block indexes ``first_block`` on) are reserved for
        ``kvx_id``'s ``num_tokens``; grant them to the prefill engine that claims it with
        ``claim_secret``, and to no other."""

    def release(self, kvx_id: str, reserved: bool) -> None:
        """Withdraw ``kvx_id``; when ``reserved``, report it ``received`` once no write can
        land in its blocks, else refuse any later claim of it."""


class PrefillKvTransfer(_Transfer, Protocol):
    """A prefill engine's transfer: it claims a decode engine's reservation and writes it."""

    def begin(self, kvx_id: str, claim_secret: str, alloc: str, fabric: str, num_blocks: int) -> None:
        """Claim ``kvx_id``'s reservation, proving ``claim_secret``, at the decode receiver at
        ``alloc`` for the prompt's ``num_blocks`` blocks, every one of which will be written
        (the decode engine answers those it holds already); report ``granted`` or
        ``refused``."""

    def write_layer(
        self,
        kvx_id: str,
        layer_name: str,
        kv_layer: Any,
        first_block: int,
        block_ids: Sequence[int],
        last: bool,
    ) -> None:
        """Post the writes of one layer's blocks ``block_ids`` (this engine's, block indexes
        ``first_block`` on) into the decode engine's granted blocks; ``last``: the layer's
        last blocks of the prompt. Returns without waiting for the writes."""

    def finish(self, kvx_id: str) -> None:
        """Every write of ``kvx_id`` is posted; report ``sent`` once delivered."""

    def cancel(self, kvx_id: str) -> None:
        """Abandon ``kvx_id`` (the decode engine's load fails); report ``sent`` once no posted
        write still reads this engine's blocks, if any were posted."""


#: Either side's transfer.
KvTransfer = Union[DecodeKvTransfer, PrefillKvTransfer]
