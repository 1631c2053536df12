"""The connector's request lifecycle under every kind of interleaving: a seeded swarm over two
real vLLM 0.33 schedulers (``vllm_harness.Engine``) and a model of kvx between their workers
(``KvxModel``) in which every step of the transfer is an event the seed orders: a claim
granted or refused, one write landing, corrupted or refused, a delivery confirmed, a
withdrawal drained, a reservation that nobody claims expiring, the prefill engine's kvx
connection lost. Requests are added and aborted on either engine at any moment.

The model follows ``KvTransfer``'s contract as ``kvx.vllm.kvx_transfer`` meets it over kvx
(``docs/vllm.md`` §Failures, aborts, epochs), with one stricter choice: a write reads its
prefill block when it lands, not when it is posted, so a prefill engine that frees a block
before its push is delivered is caught whether or not the transfer copies it into staging.

Checked after every event (``World.check``):

- a write lands only in decode blocks the decode request holds, and reads only prefill blocks
  the prefill request holds;
- a running decode request's computed prompt tokens hold exactly the KV its prefill computed
  (the fake forward pass writes, for each token and layer, a value of the tokens up to it):
  nothing lands late, nothing lands in the wrong request, no failed load goes unreported;
- no forward pass pushes a request whose grant is still awaited.

Checked at the end, after a healing phase with no more faults or aborts (``World.heal``):
every request ended on both engines, every block is free on both, and the connector's and
the model's books are empty: nothing deadlocks, nothing leaks.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from vllm.v1.request import RequestStatus
from vllm_harness import BLOCK_SIZE, LAYERS, Engine

from kvx.vllm import params
from kvx.vllm.transfer import TransferEvents
from transfer_ends import QuietEnd, take_events


@dataclass
class Write:
    """One posted write: one layer's block of a push."""

    kvx_id: str
    layer: str
    src: int  # the prefill engine's block
    dst: int  # the decode engine's block


@dataclass
class Reservation:
    """A decode request's granted blocks at kvx."""

    first_block: int
    block_ids: Tuple[int, ...]
    withdrawn: bool = False
    #: The load ended (received, failed or drained): the decode end reported it.
    over: bool = False


@dataclass
class Claim:
    """A prefill request's claim of a reservation, and its writes in flight."""

    state: str = "pending"  # pending → granted → (done | failed)
    writes: List[Write] = field(default_factory=list)
    layers_done: Set[str] = field(default_factory=set)


class KvxModel:
    """kvx between one decode and one prefill engine, as a set of events a swarm orders."""

    def __init__(self) -> None:
        self.reservations: Dict[str, Reservation] = {}
        #: Ids whose reservation ended and went, or that were released unreserved: a claim of
        #: one waits for a reservation that never comes, and is refused at the receiver's
        #: admission timeout.
        self.gone: Set[str] = set()
        self.claims: Dict[str, Claim] = {}
        #: The claim secret each id was reserved or first claimed with.
        self.secrets: Dict[str, str] = {}
        self.decode_events = TransferEvents()
        self.prefill_events = TransferEvents()
        #: Called with each write as it lands (the world's safety checks).
        self.on_land: Callable[[Write], None] = lambda w: None
        self.decode_kv: Dict[str, Any] = {}
        self.prefill_kv: Dict[str, Any] = {}
        #: Pushes delivered whole.
        self.delivered: Set[str] = set()

    # -- the decode end ------------------------------------------------------------------
    def reserve(self, kvx_id: str, claim_secret: str, first_block: int, block_ids: Sequence[int]) -> None:
        assert kvx_id not in self.reservations, f"{kvx_id} reserved twice"
        self.reservations[kvx_id] = Reservation(first_block, tuple(block_ids))
        self.secrets[kvx_id] = claim_secret

    def release(self, kvx_id: str, reserved: bool) -> None:
        res = self.reservations.get(kvx_id)
        if res is None or res.over:
            if not reserved:
                self.gone.add(kvx_id)
            return
        res.withdrawn = True

    # -- the prefill end -----------------------------------------------------------------
    def begin(self, kvx_id: str, claim_secret: str) -> None:
        assert kvx_id not in self.claims, f"{kvx_id} claimed twice"
        # The claim proves the secret the decode engine reserved with (kvx refuses it else).
        assert self.secrets.setdefault(kvx_id, claim_secret) == claim_secret, \
            f"{kvx_id}: claimed with another secret than its reservation's"
        self.claims[kvx_id] = Claim()

    def write_layer(self, kvx_id: str, layer: str, first_block: int, block_ids: Sequence[int],
                    last: bool) -> None:
        claim = self.claims.get(kvx_id)
        assert claim is None or claim.state != "pending", \
            f"{kvx_id}: a forward pass pushes before its grant (it would wait for the decode engine)"
        if claim is None or claim.state != "granted":
            return  # the real transfer drops writes of a failed push
        res = self.reservations[kvx_id]
        for index, block in enumerate(block_ids, start=first_block):
            if index >= res.first_block:  # those before: the decode engine's own prefix hit
                claim.writes.append(Write(kvx_id, layer, block, res.block_ids[index - res.first_block]))
        if last:
            claim.layers_done.add(layer)

    def cancel(self, kvx_id: str) -> None:
        claim = self.claims.get(kvx_id)
        if claim is not None and claim.state in ("pending", "granted"):
            self._fail_claim(kvx_id, claim, "cancelled by the prefill engine")

    # -- events --------------------------------------------------------------------------
    def _fail_claim(self, kvx_id: str, claim: Claim, why: str) -> None:
        """The push failed; the decode load fails with it (a receiver fails a request whose
        sender cancelled or broke). Posted writes still drain (``drain``)."""
        was_granted = claim.state == "granted"
        claim.state = "failed"
        if not was_granted:
            self.prefill_events.refused[kvx_id] = why
        res = self.reservations.get(kvx_id)
        if res is not None and not res.over and was_granted and not res.withdrawn:
            self._end_load(kvx_id, res, failed=why)

    def _end_load(self, kvx_id: str, res: Reservation, failed: Optional[str]) -> None:
        res.over = True
        if failed is None:
            self.decode_events.received.add(kvx_id)
        else:
            self.decode_events.failed[kvx_id] = failed

    def enabled(self, faults: bool) -> List[Tuple[str, Any]]:
        """Every event that may happen now; faults only when ``faults``."""
        out: List[Tuple[str, Any]] = []
        for kvx_id, claim in self.claims.items():
            res = self.reservations.get(kvx_id)
            if claim.state == "pending":
                if res is not None and not res.withdrawn and not res.over:
                    out.append(("grant", kvx_id))
                if kvx_id in self.gone or (res is not None and (res.withdrawn or res.over)):
                    out.append(("refuse", kvx_id))
            if claim.writes:
                out.append(("land", kvx_id))
                if faults:
                    out.append(("corrupt", kvx_id))
            if claim.state == "granted" and not claim.writes and len(claim.layers_done) == len(LAYERS):
                out.append(("deliver", kvx_id))
            if claim.state == "failed" and not claim.writes:
                out.append(("drain", kvx_id))
        for kvx_id, res in self.reservations.items():
            if res.withdrawn and not res.over:
                claim = self.claims.get(kvx_id)
                if claim is None or not claim.writes:
                    out.append(("drain_withdrawn", kvx_id))
            claim = self.claims.get(kvx_id)
            if not res.over and (faults or claim is None or claim.state == "failed"):
                # The receiver's timeout: nobody claimed it, or its sender went quiet.
                out.append(("expire", kvx_id))
        if faults and any(c.state in ("pending", "granted") for c in self.claims.values()):
            out.append(("lose_prefill", None))
        return out

    def fire(self, event: str, kvx_id: Any) -> None:
        if event == "lose_prefill":
            # Its connection broke: posted writes never land (a reconnected sender is a new
            # epoch), every push in progress fails.
            for cid, claim in self.claims.items():
                claim.writes.clear()
                if claim.state in ("pending", "granted"):
                    self._fail_claim(cid, claim, "the prefill engine's connection was lost")
            return
        claim = self.claims.get(kvx_id)
        res = self.reservations.get(kvx_id)
        if event == "grant":
            assert claim is not None
            claim.state = "granted"
            self.prefill_events.granted.add(kvx_id)
        elif event == "refuse":
            assert claim is not None
            self._fail_claim(kvx_id, claim, "the decode engine's request ended")
        elif event in ("land", "corrupt"):
            assert claim is not None and res is not None
            write = claim.writes.pop(0)
            if res.withdrawn or res.over:  # the grant is gone: the write is refused
                if claim.state == "granted":
                    self._fail_claim(kvx_id, claim, "write refused: grant withdrawn")
                return
            self.on_land(write)
            target = self.decode_kv[write.layer][write.dst]
            target.copy_(self.prefill_kv[write.layer][write.src])
            if event == "corrupt":
                target.zero_()  # the receiver's checksum fails: it fails the load
                self._end_load(kvx_id, res, failed="checksum mismatch")
                if claim.state == "granted":
                    self._fail_claim(kvx_id, claim, "the receiver failed the request")
        elif event == "deliver":
            assert claim is not None and res is not None
            claim.state = "done"
            self.delivered.add(kvx_id)
            if not res.over:
                self._end_load(kvx_id, res, failed=None)
            self.prefill_events.sent.add(kvx_id)
            del self.claims[kvx_id]
        elif event == "drain":
            assert claim is not None
            self.prefill_events.sent.add(kvx_id)
            del self.claims[kvx_id]
        elif event == "drain_withdrawn":
            assert res is not None
            self._end_load(kvx_id, res, failed=None)  # withdrawn: reported received
        elif event == "expire":
            assert res is not None
            self._end_load(kvx_id, res, failed="request idle timeout")
            if claim is not None and claim.state in ("pending", "granted"):
                self._fail_claim(kvx_id, claim, "the receiver timed the request out")
        else:
            raise AssertionError(event)
        if res is not None and res.over and kvx_id not in self.claims:
            del self.reservations[kvx_id]
            self.gone.add(kvx_id)


@dataclass
class DecodeEnd(QuietEnd):
    """``KvTransfer`` of the decode engine's worker over the model."""

    kvx: KvxModel

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        self.kvx.decode_kv = dict(kv_caches)

    def reserve(
        self, kvx_id: str, claim_secret: str, first_block: int, block_ids: Sequence[int], num_tokens: int
    ) -> None:
        self.kvx.reserve(kvx_id, claim_secret, first_block, block_ids)

    def release(self, kvx_id: str, reserved: bool) -> None:
        self.kvx.release(kvx_id, reserved)

    def poll(self) -> TransferEvents:
        return take_events(self.kvx, "decode_events")


@dataclass
class PrefillEnd(QuietEnd):
    """``KvTransfer`` of the prefill engine's worker over the model."""

    kvx: KvxModel

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        self.kvx.prefill_kv = dict(kv_caches)

    def begin(self, kvx_id: str, claim_secret: str, alloc: str, fabric: str, num_blocks: int) -> None:
        self.kvx.begin(kvx_id, claim_secret)

    def write_layer(self, kvx_id: str, layer_name: str, kv_layer: Any, first_block: int,
                    block_ids: Sequence[int], last: bool) -> None:
        self.kvx.write_layer(kvx_id, layer_name, first_block, block_ids, last)

    def finish(self, kvx_id: str) -> None:
        return None

    def cancel(self, kvx_id: str) -> None:
        self.kvx.cancel(kvx_id)

    def poll(self) -> TransferEvents:
        return take_events(self.kvx, "prefill_events")


def kv_value(tokens: Sequence[int], pos: int, layer: int) -> float:
    """What the fake forward pass writes for the token at ``pos`` in ``layer``: a function of
    the tokens up to it, as real KV is, so that a prefix-cache hit holds the same value as a
    fresh computation."""
    digest = zlib.crc32(bytes(str(list(tokens[: pos + 1])), "ascii"))
    return float((digest % 1_000_000) * 4 + layer + 1)  # exact in float32


def token_kv(engine: Engine, layer: str, block: int, pos: int) -> Any:
    """The token at prompt position ``pos`` in ``block`` of ``layer`` (the harness's CPU
    layout: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``)."""
    return engine.kv_caches[layer][block][:, pos % BLOCK_SIZE, :]


@dataclass(frozen=True)
class Shape:
    """What a world is made of: the engines' settings, the prompts' lengths, and the order in
    which the requests reach the engines."""

    failure_policy: str
    prefix_caching: bool
    decode_batch: int  # max_num_batched_tokens
    prefill_batch: int
    prompt_lengths: Tuple[int, ...]
    #: (side, request) in the order ``add`` takes them.
    adds: Tuple[Tuple[str, str], ...]

    @staticmethod
    def drawn(rng: random.Random, requests: int) -> "Shape":
        failure_policy = rng.choice(("fail", "recompute"))
        prefix_caching = rng.random() < 0.5
        decode_batch = rng.choice((BLOCK_SIZE, 8 * BLOCK_SIZE))
        prefill_batch = rng.choice((BLOCK_SIZE, 2 * BLOCK_SIZE, 8 * BLOCK_SIZE))
        lengths = tuple(rng.randint(1, 3 * BLOCK_SIZE + 5) for _ in range(requests))
        adds = [(side, f"r{i}") for i in range(requests) for side in ("decode", "prefill")]
        rng.shuffle(adds)
        return Shape(failure_policy, prefix_caching, decode_batch, prefill_batch, lengths, tuple(adds))


class World:
    """Two engines, the model of kvx between them, and a seed's requests and events."""

    def __init__(self, seed: int, requests: int = 3, num_blocks: int = 24,
                 shape: Optional[Shape] = None) -> None:
        self.rng = random.Random(seed)
        self.shape = shape if shape is not None else Shape.drawn(self.rng, requests)
        self.kvx = KvxModel()
        self.kvx.on_land = self._check_landing
        self.decode = Engine("kv_consumer", num_blocks=num_blocks, transfer=DecodeEnd(self.kvx),
                             failure_policy=self.shape.failure_policy,
                             prefix_caching=self.shape.prefix_caching,
                             max_batched_tokens=self.shape.decode_batch)
        self.prefill = Engine("kv_producer", num_blocks=num_blocks, transfer=PrefillEnd(self.kvx),
                              max_batched_tokens=self.shape.prefill_batch)
        #: Request ``r{i}`` on both engines, ``k{i}`` at kvx: its prompt.
        self.prompts: Dict[str, List[int]] = {}
        for i, n in enumerate(self.shape.prompt_lengths):
            # r0 and r1 share their first block: a prefix hit on the decode engine.
            self.prompts[f"r{i}"] = [10 + ((0 if (t < BLOCK_SIZE and i < 2) else 100 * (i + 1)) + t) % 900
                                     for t in range(n)]
        self.to_add = list(self.shape.adds)
        self.trace: List[str] = []
        #: Requests a fault or an abort touched; every other one must be served by a push.
        self.touched: Set[str] = set()
        #: Events fired, by kind (``step``, ``add``, ``abort`` and kvx's).
        self.counts: Counter = Counter()

    # -- the engines -----------------------------------------------------------------------
    def _forward(self, engine: Engine) -> Callable[[Any], None]:
        """The fake forward pass: fills the prompt blocks this step computes."""
        def forward(so: Any) -> None:
            computed: Dict[str, int] = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
            cached = so.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens))
            for rid, before in computed.items():
                tokens = self.prompts[rid]
                end = min(before + so.num_scheduled_tokens.get(rid, 0), len(tokens))
                (blocks,) = engine.scheduler.kv_cache_manager.get_block_ids(rid)
                for pos in range(before, end):
                    for li, layer in enumerate(LAYERS):
                        token_kv(engine, layer, blocks[pos // BLOCK_SIZE], pos).fill_(kv_value(tokens, pos, li))
        return forward

    def add(self, side: str, rid: str) -> None:
        i = rid[1:]
        if side == "decode":
            self.decode.add(rid, 0, params.for_decode(f"k{i}", "secret-0123456789abcdef"), max_tokens=3, tokens=self.prompts[rid])
        else:
            self.prefill.add(rid, 0, params.for_prefill(f"k{i}", "secret-0123456789abcdef", ["tcp://d:1"], ["tcp://d:2"]),
                             max_tokens=1, tokens=self.prompts[rid])

    def abort(self, side: str, rid: str) -> None:
        engine = self.decode if side == "decode" else self.prefill
        engine.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    # -- the swarm -------------------------------------------------------------------------
    def choices(self, faults: bool) -> List[Tuple[str, Any]]:
        out: List[Tuple[str, Any]] = [("step", "decode"), ("step", "prefill")]
        if self.to_add:
            out.append(("add", self.to_add[0]))
        if faults:
            for side, engine in (("decode", self.decode), ("prefill", self.prefill)):
                for rid, request in engine.scheduler.requests.items():
                    if not request.is_finished():
                        out.append(("abort", (side, rid)))
        for event in self.kvx.enabled(faults):
            if not faults and event[0] == "expire" and self._claim_to_come(event[1]):
                continue  # the healed world waits for the claim instead of timing out
            out.append(("kvx", event))
        return out

    def _claim_to_come(self, kvx_id: str) -> bool:
        rid = "r" + kvx_id[1:]
        waiting = ("prefill", rid) in self.to_add or rid in self.prefill.scheduler.requests
        return waiting and kvx_id not in self.kvx.claims and rid not in self.touched

    def fire(self, choice: Tuple[str, Any]) -> None:
        kind, arg = choice
        self.trace.append(f"{kind} {arg}")
        self.counts[arg[0] if kind == "kvx" else kind] += 1
        if kind == "abort":
            self.touched.add(arg[1])
        elif kind == "kvx" and arg[0] in ("corrupt", "expire"):
            self.touched.add("r" + arg[1][1:])
        elif kind == "kvx" and arg[0] == "lose_prefill":
            self.touched |= {"r" + k[1:] for k, c in self.kvx.claims.items() if c.state in ("pending", "granted")}
        if kind == "step":
            engine = self.decode if arg == "decode" else self.prefill
            engine.step(self._forward(engine))
        elif kind == "add":
            self.to_add.pop(0)
            self.add(*arg)
        elif kind == "abort":
            self.abort(*arg)
        else:
            self.kvx.fire(*arg)
        self.check()

    def run(self, events: int) -> None:
        """``events`` events of the seed's choosing, faults and aborts included, at a rate the
        seed chooses too (from none to one event in five)."""
        fault_rate = self.rng.choice((0.0, 0.02, 0.05, 0.2))
        for _ in range(events):
            options = self.choices(faults=True)
            faults = [o for o in options if o[0] == "abort" or (o[0] == "kvx" and o[1][0] in FAULTS)]
            normal = [o for o in options if o not in faults]
            pool = faults if faults and self.rng.random() < fault_rate else normal
            self.fire(self.rng.choice(pool))

    def heal(self, rounds: int = 400) -> None:
        """No more faults or aborts: every engine steps and every kvx event happens, until
        nothing is left; then nothing may be left anywhere."""
        for _ in range(rounds):
            if self.idle():
                break
            options = self.choices(faults=False)
            self.rng.shuffle(options)
            for choice in options:
                if choice[0] != "kvx" or choice in self.choices(faults=False):
                    self.fire(choice)
        assert self.idle(), f"not settled after {rounds} rounds: {self.leftovers()}"
        self.check_books()
        served = self.decode.finished_outputs()
        for rid in sorted(set(self.prompts) - self.touched):
            assert f"k{rid[1:]}" in self.kvx.delivered and served.get(rid) == "length", (
                f"{rid}, untouched by any fault, was not served by a push "
                f"(delivered: {sorted(self.kvx.delivered)}, decode: {served.get(rid)})")

    def idle(self) -> bool:
        return not (self.to_add or self.decode.scheduler.requests or self.prefill.scheduler.requests
                    or self.kvx.claims or self.kvx.reservations)

    def leftovers(self) -> Dict[str, Any]:
        return {
            "decode": {r: q.status.name for r, q in self.decode.scheduler.requests.items()},
            "prefill": {r: q.status.name for r, q in self.prefill.scheduler.requests.items()},
            "claims": {k: c.state for k, c in self.kvx.claims.items()},
            "reservations": {k: (r.withdrawn, r.over) for k, r in self.kvx.reservations.items()},
        }

    # -- the state, for the exhaustive search (``explore``) ----------------------------------
    def fingerprint(self) -> Any:
        """Everything that decides what the world does next, as one hashable value: two
        worlds with the same fingerprint have the same futures. Wall-clock times (the
        connector's grant deadlines, which no bounded search reaches) are left out."""
        engines = []
        for engine in (self.decode, self.prefill):
            scheduler = engine.scheduler
            manager = scheduler.kv_cache_manager
            requests = tuple(
                (rid, r.status.name, r.num_computed_tokens, len(r.output_token_ids),
                 tuple(manager.get_block_ids(rid)[0]), freeze(r.kv_transfer_params))
                for rid, r in sorted(scheduler.requests.items()))
            pool = manager.block_pool
            cached = getattr(pool.cached_block_hash_to_block, "_cache", {})
            engines.append((
                requests,
                tuple(r.request_id for r in scheduler.waiting),
                tuple(r.request_id for r in scheduler.running),
                freeze({name: getattr(scheduler, name, None) for name in SCHEDULER_SETS}),
                tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
                freeze(cached),
                freeze(engine.connector._decode or engine.connector._prefill),
                freeze(engine.worker._worker),
                tuple(zlib.crc32(t.numpy().tobytes()) for t in engine.kv_caches.values()),
                freeze(engine.finished_outputs()),
            ))
        return (tuple(engines), freeze(vars(self.kvx)), tuple(self.to_add), freeze(self.touched))

    # -- checks ----------------------------------------------------------------------------
    def _check_landing(self, w: Write) -> None:
        rid = "r" + w.kvx_id[1:]
        assert rid in self.decode.scheduler.requests, \
            f"a write of {w.kvx_id} lands after the decode request freed its blocks"
        (d_blocks,) = self.decode.scheduler.kv_cache_manager.get_block_ids(rid)
        assert w.dst in d_blocks, f"a write of {w.kvx_id} lands in decode block {w.dst}, not the request's"
        assert rid in self.prefill.scheduler.requests, \
            f"a write of {w.kvx_id} reads prefill block {w.src} after the prefill request freed it"
        (p_blocks,) = self.prefill.scheduler.kv_cache_manager.get_block_ids(rid)
        assert w.src in p_blocks, f"a write of {w.kvx_id} reads prefill block {w.src}, not the request's"

    def check(self) -> None:
        """A running decode request's computed prompt blocks hold exactly its prompt's KV."""
        for rid, request in self.decode.scheduler.requests.items():
            if request.status != RequestStatus.RUNNING:
                continue
            tokens = self.prompts[rid]
            (blocks,) = self.decode.scheduler.kv_cache_manager.get_block_ids(rid)
            for pos in range(min(request.num_computed_tokens, len(tokens))):
                for li, layer in enumerate(LAYERS):
                    got = token_kv(self.decode, layer, blocks[pos // BLOCK_SIZE], pos)
                    want = kv_value(tokens, pos, li)
                    assert bool((got == want).all()), (
                        f"decode request {rid} runs on prompt token {pos} (layer {li}) holding "
                        f"{float(got.flatten()[0])}, not its KV {want}")

    def check_books(self) -> None:
        """Every block free on both engines; the connector's books empty."""
        for engine in (self.decode, self.prefill):
            pool = engine.scheduler.kv_cache_manager.block_pool
            assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "blocks leaked"
        d, p = self.decode.connector._decode, self.prefill.connector._prefill
        assert not (d.reserved or d.released), (d.reserved, d.released)
        assert not (p.claiming or p.granted or p.pushing or p.sending), vars(p)
        dw, pw = self.decode.worker._worker, self.prefill.worker._worker
        assert not (dw._reserved or dw._withdrawn or dw._reserved_at), vars(dw)
        assert not (pw._claimed or pw._by_kvx or pw._posted or pw._finished_by_vllm or pw._sent_early), vars(pw)


#: kvx events that are faults (the swarm's heal phase leaves them out).
FAULTS = ("corrupt", "expire", "lose_prefill")

#: The scheduler's sets of request ids that a step reads.
SCHEDULER_SETS = ("kv_holding_waiting", "deferred_waiting", "finished_req_ids",
                  "finished_recving_kv_req_ids", "failed_recving_kv_req_ids")

#: Attributes a fingerprint leaves out: references to the rest of the world (llm-d's
#: registrar is an HTTP client), and clocks.
UNFROZEN = {"transfer", "clock", "on_land", "decode_kv", "prefill_kv", "registrar", "_registrar"}


def freeze(x: Any, depth: int = 0) -> Any:
    """``x`` as a hashable value that two equal states share: containers by their contents
    (sets and dicts sorted), objects by their attributes, floats (times) left out, a block by
    its id, a vLLM request by its id (the engine's part of the fingerprint holds its state),
    a tensor by its bytes' CRC. What it cannot read fails loudly rather than hash an address."""
    import enum

    import torch

    if depth > 8:
        raise AssertionError(f"state nested deeper than the fingerprint reads: {type(x)}")
    if x is None or isinstance(x, (bool, int, str, bytes)):
        return x
    if isinstance(x, float):
        return "float"
    if isinstance(x, enum.Enum):
        return x.name
    if isinstance(x, torch.Tensor):
        return zlib.crc32(x.numpy().tobytes())
    if hasattr(x, "block_id") and hasattr(x, "ref_cnt"):
        return ("block", x.block_id, x.ref_cnt)
    if hasattr(x, "request_id") and hasattr(x, "num_computed_tokens"):
        return ("request", x.request_id)  # its state is in the engine's part
    if callable(x):
        return ("fn", getattr(x, "__qualname__", type(x).__name__))
    if isinstance(x, dict):
        return ("d",) + tuple(sorted(((freeze(k, depth + 1), freeze(v, depth + 1)) for k, v in x.items()), key=repr))
    if isinstance(x, (set, frozenset)):
        return ("s",) + tuple(sorted((freeze(v, depth + 1) for v in x), key=repr))
    if isinstance(x, (list, tuple)) or type(x).__name__ == "deque":
        return ("l",) + tuple(freeze(v, depth + 1) for v in x)
    if hasattr(x, "__dict__"):
        fields = {k: v for k, v in vars(x).items() if k not in UNFROZEN}
        return (type(x).__name__, freeze(fields, depth + 1))
    if hasattr(x, "__slots__"):
        return (type(x).__name__,) + tuple(freeze(getattr(x, k, None), depth + 1) for k in x.__slots__)
    raise AssertionError(f"a fingerprint cannot read a {type(x).__name__}")
