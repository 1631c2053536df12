"""The scheduler-side state machines of ``KvxConnector``: one for a decode engine
(``DecodeScheduler``), one for a prefill engine (``PrefillScheduler``). They read vLLM's
objects by attribute only (a request's ``request_id``, ``prompt_token_ids``,
``kv_transfer_params``, ``status``; a ``KVCacheBlocks``' ``get_block_ids()``; a
``SchedulerOutput``'s scheduled requests), so this module does not import vLLM.

Decode side: the blocks vLLM's scheduler allocates for a request whose prefill is remote are
that request's reservation at kvx (``Reserve``); the request waits in
``WAITING_FOR_REMOTE_KVS`` until its workers report it received (complete and verified, or
failed, with the failed blocks reported as load errors).

Prefill side: a request for a remote decode is held back (``get_num_new_matched_tokens``
answers None, "ask again") until every worker's kvx sender holds the decode engine's grant,
so that no forward pass ever waits for a grant; then its blocks are pushed as the forward
pass computes them (``Push``), and its blocks stay allocated after it finishes until the
workers report the push delivered (or cancelled and drained).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from kvx.vllm.bootstrap import CANCELLED, Registration, Registrations
from kvx.vllm.registrar import Registrar
from kvx.vllm.params import (
    AwaitRegistration,
    ParamsError,
    RemoteDecode,
    RemotePrefill,
    new_claim_secret,
    parse,
)
from kvx.vllm.plan import Begin, Push, Release, Reserve, StepPlan, WorkerReport
from kvx.vllm.reasons import ERROR
from kvx.vllm.signals import Signals

logger = logging.getLogger("kvx.vllm")

#: vLLM's request states in which a request ended by producing its output (not aborted).
FINISHED_NORMALLY = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def _params(request: Any, warned: Set[str]) -> Any:
    """The request's kvx transfer, or None; malformed params are logged once and the
    request runs locally (recomputing is slower, never wrong)."""
    try:
        return parse(getattr(request, "kv_transfer_params", None))
    except ParamsError as e:
        if request.request_id not in warned:
            warned.add(request.request_id)
            logger.error("kvx: request %s runs without kvx: %s", request.request_id, e)
        return None


def _trace_headers(request: Any) -> Optional[Dict[str, str]]:
    """The request's W3C trace context, where vLLM kept one (``kvx.vllm.tracing`` links the
    transfer's spans to it)."""
    headers = getattr(request, "trace_headers", None)
    return dict(headers) if headers else None


def _prompt_len(request: Any) -> int:
    return len(request.prompt_token_ids or ())


class DecodeScheduler:
    """A decode engine's scheduler side: allocations become reservations. Under llm-d
    (``RemotePrefill.bootstrap``) each reservation's secret is drawn here and registered with
    the prefill engine by ``registrar``, with this engine's ``endpoints`` (alloc and fabric,
    one per TP rank)."""

    def __init__(
        self,
        block_size: int,
        registrar: Optional[Registrar] = None,
        endpoints: Tuple[Tuple[str, ...], Tuple[str, ...]] = ((), ()),
    ) -> None:
        self.block_size = block_size
        self.registrar, self.endpoints = registrar, endpoints
        #: What this side adds to vLLM's metrics (``kvx.vllm.signals``).
        self.signals = Signals(time.monotonic)
        #: llm-d: each registered request's (bootstrap, secret), for its cancel.
        self.registered: Dict[str, Tuple[Any, str]] = {}
        #: Requests whose blocks are reserved and whose KV has not been reported received.
        self.reserved: Dict[str, Reserve] = {}
        #: Requests whose remote load is over (received, failed or withdrawn): after a
        #: preemption they recompute locally and never ask kvx again.
        self.loaded: Set[str] = set()
        #: Aborted while reserved: withdrawn, awaiting the workers' report.
        self.released: Set[str] = set()
        self._plan = StepPlan()
        self._warned: Set[str] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        """(tokens to come from the prefill engine, True) for a remote-prefill request not
        yet reserved; (0, False) otherwise. No side effect."""
        rid = request.request_id
        if rid in self.reserved or rid in self.loaded:
            return 0, False
        if not isinstance(_params(request, self._warned), RemotePrefill):
            return 0, False
        count = _prompt_len(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Records the allocated blocks of the tokens to come as the request's reservation."""
        rid = request.request_id
        if num_external_tokens <= 0 or rid in self.reserved or rid in self.loaded:
            return
        params = _params(request, self._warned)
        if not isinstance(params, RemotePrefill):
            return
        end = _prompt_len(request)
        start = end - num_external_tokens
        first, last = start // self.block_size, math.ceil(end / self.block_size)
        (block_ids, *_) = blocks.get_block_ids()
        if len(block_ids) < last:
            raise AssertionError(
                f"kvx: request {rid} has {len(block_ids)} blocks for {end} tokens "
                f"({last} needed)"
            )
        secret = params.claim_secret
        if params.bootstrap is not None:
            secret = new_claim_secret()
        assert secret is not None
        reserve = Reserve(rid, params.kvx_id, secret, first, tuple(block_ids[first:last]), end,
                          _trace_headers(request))
        self.reserved[rid] = reserve
        self._plan.reserve.append(reserve)
        if params.bootstrap is not None:
            if self.registrar is None:
                self._plan.release.append(Release(
                    rid, params.kvx_id, reserved=True,
                    failed="llm-d's transfer_id reached an engine without a registrar"))
                return
            self.registered[rid] = (params.bootstrap, secret)
            self.registrar.register(rid, params.bootstrap, params.kvx_id, secret, *self.endpoints)

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        """This step's plan for the workers (and a fresh one for the next step), with the
        loads whose registration failed since the last step."""
        for rid, why in self.registrar.failures() if self.registrar is not None else ():
            self.signals.count("registrations_failed")
            reserve = self.reserved.get(rid)
            registered = self.registered.pop(rid, None)
            if reserve is not None and registered is not None and rid not in self.released:
                self._plan.release.append(Release(rid, reserve.kvx_id, reserved=True, failed=why))
        self.signals.gauge("now_reserved_blocks", sum(len(r.block_ids) for r in self.reserved.values()))
        plan, self._plan = self._plan, StepPlan()
        return plan

    def update_connector_output(self, finished_recving: Any) -> None:
        """Requests the workers reported received (complete, failed or withdrawn)."""
        for rid in finished_recving or ():
            if self.registered.pop(rid, None) is not None and self.registrar is not None:
                self.registrar.forget(rid)
            if self.reserved.pop(rid, None) is None:
                continue
            if rid in self.released:
                self.released.discard(rid)  # vLLM frees the aborted request's blocks now
            else:
                self.loaded.add(rid)

    def request_finished(self, request: Any) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """A decode request ended. Still waiting for its KV (aborted): its reservation is
        withdrawn, and vLLM keeps its blocks until the workers report it received, which
        they do once no write can land in them. Never reserved: nothing to withdraw; the
        prefill engine's claim is refused after ``claim_timeout_sec`` (the router aborts
        the prefill request itself when its client goes away). vLLM's own delay covers the
        first case, so this never asks for one."""
        rid = request.request_id
        self._warned.discard(rid)
        reserve = self.reserved.get(rid)
        if reserve is not None:
            self._plan.release.append(Release(rid, reserve.kvx_id, reserved=True))
            self.released.add(rid)
            registered = self.registered.pop(rid, None)
            if registered is not None and self.registrar is not None:
                self.registrar.cancel(rid, registered[0], reserve.kvx_id, registered[1])
            return False, None
        if rid in self.loaded:
            self.loaded.discard(rid)
            return False, None
        params = _params(request, set())
        if isinstance(params, RemotePrefill):
            self._plan.release.append(Release(rid, params.kvx_id, reserved=False))
        return False, None


@dataclass
class _Pushing:
    """A granted prefill request's progress: its blocks here, and the next prompt block to
    push."""

    kvx_id: str
    prompt_len: int
    blocks: List[int] = field(default_factory=list)
    next_block: int = 0
    last_planned: bool = False


class PrefillScheduler:
    """A prefill engine's scheduler side: claim, push as computed, hold blocks until
    delivered."""

    def __init__(
        self,
        block_size: int,
        tp_size: int,
        grant_timeout_sec: float,
        clock: Callable[[], float] = time.monotonic,
        registrations: Optional[Registrations] = None,
    ) -> None:
        self.block_size = block_size
        self.tp_size = tp_size
        self.grant_timeout_sec = grant_timeout_sec
        self.clock = clock
        #: llm-d: the decode engines' registrations (``kvx.vllm.bootstrap``); None without
        #: a bootstrap server.
        self.registrations = registrations
        #: llm-d: requests whose decode engine has not registered yet: request id →
        #: (transfer id, prompt blocks, deadline).
        self.awaiting: Dict[str, Tuple[str, int, float]] = {}
        #: What this side adds to vLLM's metrics (``kvx.vllm.signals``).
        self.signals = Signals(clock)
        #: Claimed, not yet granted by every rank: request id → (transfer, deadline).
        self.claiming: Dict[str, Tuple[RemoteDecode, float]] = {}
        self.grant_counts: Dict[str, int] = {}
        #: Granted (may run), not yet scheduled.
        self.granted: Dict[str, RemoteDecode] = {}
        #: Runs without a push: refused by the decode engine or not granted in time.
        self.refused: Set[str] = set()
        #: Why each of those runs without a push (request id → (kvx id, reason)): its answer
        #: carries the reason (``request_finished``), for the router to hand its client.
        self.failures: Dict[str, Tuple[str, str]] = {}
        self.pushing: Dict[str, _Pushing] = {}
        #: Finished; blocks held until the workers report the push delivered or drained.
        self.sending: Set[str] = set()
        #: Requests' trace contexts, until their claim is planned (``kvx.vllm.tracing``).
        self._trace_headers: Dict[str, Dict[str, str]] = {}
        self._plan = StepPlan()
        self._warned: Set[str] = set()

    def on_new_request(self, request: Any) -> None:
        """A request for a remote decode claims its reservation at once (under llm-d, once
        its decode engine has registered it)."""
        params = _params(request, self._warned)
        rid = request.request_id
        if rid in self.claiming or rid in self.awaiting:
            return
        blocks = -(-request.num_prompt_tokens // self.block_size)
        deadline = self.clock() + self.grant_timeout_sec
        headers = _trace_headers(request)
        if headers is not None and isinstance(params, (RemoteDecode, AwaitRegistration)):
            self._trace_headers[rid] = headers
        if isinstance(params, RemoteDecode):
            self._claim(rid, params, blocks, deadline)
        elif isinstance(params, AwaitRegistration):
            self.awaiting[rid] = (params.kvx_id, blocks, deadline)
            self._take_registration(rid)

    def _claim(self, rid: str, params: RemoteDecode, blocks: int, deadline: float) -> None:
        self.claiming[rid] = (params, deadline)
        self.signals.start("claim_to_grant_s", rid)
        self._plan.begin.append(
            Begin(rid, params.kvx_id, params.claim_secret, params.decode_alloc, params.decode_fabric, blocks,
                  self._trace_headers.pop(rid, None))
        )

    def _take_registration(self, rid: str) -> None:
        """Claims ``rid`` if its decode engine has registered; refuses it if the decode
        request ended first, or if no registration can come."""
        kvx_id, blocks, deadline = self.awaiting[rid]
        if self.registrations is None:
            self._refuse(rid, "llm-d's transfer_id needs the bootstrap server: set bootstrap_port (prefill)")
            return
        got = self.registrations.take(kvx_id)
        if got is CANCELLED:
            self._refuse(rid, "the decode engine's request ended before it was claimed")
        elif isinstance(got, Registration):
            del self.awaiting[rid]
            self._claim(rid, RemoteDecode(kvx_id, got.claim_secret, got.decode_alloc, got.decode_fabric),
                        blocks, deadline)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        """(None, False), "ask again", while the request's grant is awaited; (0, False)
        otherwise: the prefill engine computes everything itself."""
        rid = request.request_id
        if rid in self.granted or rid in self.refused or rid in self.pushing:
            return 0, False
        if rid not in self.claiming and rid not in self.awaiting:
            self.on_new_request(request)  # a vLLM that did not call on_new_request
        if rid in self.awaiting:
            self._take_registration(rid)
        if rid in self.awaiting:
            kvx_id, _, deadline = self.awaiting[rid]
            if self.clock() >= deadline:
                reason = (f"no decode engine registered a reservation within grant_timeout_sec "
                          f"(prefill) ({self.grant_timeout_sec:g} s)")
                logger.warning("kvx: request %s (transfer %s): %s: it runs without a push", rid, kvx_id, reason)
                self._refuse(rid, reason)
                return 0, False
            return None, False
        if rid not in self.claiming:
            return 0, False
        params, deadline = self.claiming[rid]
        if self.clock() >= deadline:
            reason = (
                f"the decode engine granted no blocks within grant_timeout_sec (prefill) "
                f"({self.grant_timeout_sec:g} s)"
            )
            logger.warning("kvx: request %s (kvx %s): %s: it runs without a push", rid, params.kvx_id, reason)
            self._refuse(rid, reason)
            return 0, False
        return None, False

    def _refuse(self, rid: str, reason: str) -> None:
        self.signals.refused(reason)
        self.signals.drop(rid)
        entry = self.claiming.pop(rid, None)
        self.grant_counts.pop(rid, None)
        self.granted.pop(rid, None)
        if entry is not None:
            self._plan.cancel.append(rid)
            self.failures[rid] = (entry[0].kvx_id, reason)
        awaited = self.awaiting.pop(rid, None)
        if awaited is not None:  # never claimed: nothing to cancel
            self.failures[rid] = (awaited[0], reason)
        self.refused.add(rid)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """A granted request is scheduled: its push starts with this step's forward pass."""
        rid = request.request_id
        params = self.granted.pop(rid, None)
        if params is not None:
            self.pushing[rid] = _Pushing(params.kvx_id, _prompt_len(request))

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        """This step's plan: claims, cancels, and each pushing request's blocks that this
        step completes (full blocks; the partial last one with the prompt's end)."""
        bs = self.block_size
        scheduled: Dict[str, int] = {}  # request id → tokens computed before this step
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self.pushing:
                self.pushing[new.req_id].blocks = list(new.block_ids[0])
                scheduled[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed: Set[str] = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            st = self.pushing.get(rid)
            if st is None:
                continue
            ids = cached.new_block_ids[i]
            if ids is not None:
                st.blocks = list(ids[0]) if rid in resumed else st.blocks + list(ids[0])
            scheduled[rid] = cached.num_computed_tokens[i]
        for rid, computed in scheduled.items():
            st = self.pushing[rid]
            end = computed + scheduler_output.num_scheduled_tokens.get(rid, 0)
            last = end >= st.prompt_len
            upto = math.ceil(st.prompt_len / bs) if last else end // bs
            if upto > st.next_block and not st.last_planned:
                self._plan.push.append(
                    Push(rid, st.kvx_id, st.next_block, tuple(st.blocks[st.next_block:upto]), last)
                )
                st.next_block, st.last_planned = upto, last
        self.signals.gauge("now_waiting_claims", len(self.claiming) + len(self.awaiting))
        plan, self._plan = self._plan, StepPlan()
        return plan

    def update_connector_output(self, report: Optional[WorkerReport], finished_sending: Any) -> None:
        """Grants and refusals from the workers; pushes delivered."""
        if report is not None:
            for rid, count in report.granted.items():
                if rid not in self.claiming:
                    continue
                self.grant_counts[rid] = self.grant_counts.get(rid, 0) + count
                if self.grant_counts[rid] >= self.tp_size:
                    params, _ = self.claiming.pop(rid)
                    del self.grant_counts[rid]
                    self.granted[rid] = params
                    self.signals.end("claim_to_grant_s", rid)
            for rid, reason in report.refused.items():
                if rid in self.claiming:
                    logger.warning("kvx: request %s (kvx %s) cannot push its KV: %s; it runs "
                                   "without a push", rid, self.claiming[rid][0].kvx_id, reason)
                    self._refuse(rid, reason)
        for rid in finished_sending or ():
            self.sending.discard(rid)

    def request_finished(self, request: Any) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """A prefill request ended. Its last push planned: the blocks stay until delivered.
        Claimed or granted but never scheduled: cancelled, and the blocks free at once.
        Pushes begun but not all planned (aborted, preempted out): the transfer is cancelled
        and the blocks stay until the cancel is drained. Nothing pushed yet: cancelled, and
        the blocks free at once. Run without a push because its claim failed: its answer's
        ``kv_transfer_params`` say why (``kvx_error``), for the router's client."""
        rid = request.request_id
        self._warned.discard(rid)
        self.refused.discard(rid)
        self.signals.drop(rid)
        self._trace_headers.pop(rid, None)
        failure = self.failures.pop(rid, None)
        if failure is not None:
            kvx_id, reason = failure
            return False, {"kvx_request_id": kvx_id, ERROR: reason}
        if self.granted.pop(rid, None) is not None:
            # Granted, never scheduled: nothing was pushed, but the claim holds the decode
            # engine's grant until cancelled, and a push that ends later must not be
            # reported for a request vLLM has freed.
            self._plan.cancel.append(rid)
            return False, None
        if self.claiming.pop(rid, None) is not None:
            self.grant_counts.pop(rid, None)
            self._plan.cancel.append(rid)
            return False, None
        if self.awaiting.pop(rid, None) is not None:
            return False, None  # never claimed
        st = self.pushing.pop(rid, None)
        if st is None:
            return False, None
        if not st.last_planned:
            self._plan.cancel.append(rid)
            if st.next_block == 0:
                return False, None
        self.sending.add(rid)
        return True, {"kvx_request_id": st.kvx_id, "kvx_pushed_tokens": st.prompt_len if st.last_planned else 0}

    def has_pending_push_work(self) -> bool:
        """True while a registration or a grant is awaited or a finished request's blocks
        are held."""
        return bool(self.claiming or self.awaiting or self.sending)
