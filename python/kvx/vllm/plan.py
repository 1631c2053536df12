"""What the scheduler-side connector tells its workers each step (a ``StepPlan``, carried in
vLLM's connector metadata) and what the workers tell it back (``WorkerReport``, carried in
vLLM's worker metadata and summed over TP ranks). Plain data: no vLLM import, so the state
machines that build and read them are testable on their own."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Reserve:
    """Decode: the scheduler allocated ``block_ids`` for tokens ``first_block * block_size``
    up to ``num_tokens`` of request ``req_id`` (kvx's ``kvx_id``); they are the request's
    reservation, granted to the prefill engine that claims ``kvx_id``."""

    req_id: str
    kvx_id: str
    #: What the claiming prefill engine must prove (the router's, per request).
    claim_secret: str = field(repr=False)
    first_block: int
    block_ids: Tuple[int, ...]
    num_tokens: int
    #: The request's W3C trace context, where vLLM kept one (``kvx.vllm.tracing``).
    trace_headers: Optional[Dict[str, str]] = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Release:
    """Decode: withdraw ``kvx_id`` (its request ended first). ``reserved``: its blocks were
    reserved, and the workers report the request received once no write can land in them;
    else there is nothing to withdraw (the prefill engine's claim is refused after
    ``claim_timeout_sec``). ``failed``: the request goes on, its load failed (its
    registration was refused under llm-d): the workers report its blocks as load errors."""

    req_id: str
    kvx_id: str
    reserved: bool
    failed: Optional[str] = None


@dataclass(frozen=True)
class Begin:
    """Prefill: claim the decode engine's reservation of ``kvx_id`` (kvx's admission probe
    to the receiver of this worker's TP rank)."""

    req_id: str
    kvx_id: str
    #: Proves to the decode engine's receiver that this claim is the router's choice.
    claim_secret: str = field(repr=False)
    decode_alloc: Tuple[str, ...]
    decode_fabric: Tuple[str, ...]
    #: The prompt's blocks: every one is pushed (the decode engine answers those it holds).
    num_blocks: int
    #: The request's W3C trace context, where vLLM kept one (``kvx.vllm.tracing``).
    trace_headers: Optional[Dict[str, str]] = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Push:
    """Prefill: in this step's forward pass, write blocks ``first_block ..
    first_block + len(block_ids)`` of the request's prompt from this engine's ``block_ids``
    into the decode engine's granted blocks, layer by layer; ``last``: the prompt's KV is
    complete with them (the request's last writes)."""

    req_id: str
    kvx_id: str
    first_block: int
    block_ids: Tuple[int, ...]
    last: bool


@dataclass
class StepPlan:
    """One step's work for every worker of the engine."""

    reserve: List[Reserve] = field(default_factory=list)
    release: List[Release] = field(default_factory=list)
    begin: List[Begin] = field(default_factory=list)
    push: List[Push] = field(default_factory=list)
    #: Prefill: transfers to cancel (aborted, or finished without its last push).
    cancel: List[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        """True when the plan asks nothing of the workers."""
        return not (self.reserve or self.release or self.begin or self.push or self.cancel)


@dataclass
class WorkerReport:
    """Prefill workers' answers to ``Begin``, by vLLM request id, counted over TP ranks: a
    request is granted once every rank's receiver granted it; refused as soon as one rank's
    refused it."""

    granted: "Counter[str]" = field(default_factory=Counter)
    refused: Dict[str, str] = field(default_factory=dict)

    def merge(self, other: "WorkerReport") -> "WorkerReport":
        """The sum of two ranks' reports (vLLM aggregates worker metadata pairwise)."""
        return WorkerReport(self.granted + other.granted, {**self.refused, **other.refused})
