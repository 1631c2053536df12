"""A stand-in for one vLLM engine behind its OpenAI server, in a process of its own, for the
router's failure tests (``test_failure_reasons.py``): the connector's real scheduler side
(``DecodeScheduler`` or ``PrefillScheduler``) and worker side (``worker_for`` over kvx's real
transfer, NumPy arrays as the paged KV), stepped in a thread of their own as vLLM's engine
core steps apart from its server, in vLLM's order of calls. Each prompt character is one
token. No vLLM needed.

    python engine_server.py ROLE EXTRA_JSON BLOCK_SIZE

prints ``{"port": N}`` once it serves ``/v1/completions`` on loopback, and logs as the
connector does to standard error. Answers as vLLM's OpenAI server does: the prefill engine its
one token with the ``kv_transfer_params`` its connector's ``request_finished`` returned; the
decode engine, once the KV is in, a completion (server-sent events when the request streams),
and for a failed load (``kv_load_failure_policy: fail``) vLLM's own answer: 500 "Internal
server error", or a stream that opens with that error. A request whose client goes away is
aborted, as vLLM aborts it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import sys
import threading
import types
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np
from aiohttp import web

from kvx.vllm.kvx_transfer import transfer_for
from kvx.vllm.scheduler import DecodeScheduler, PrefillScheduler
from kvx.vllm.settings import settings_from
from kvx.vllm.worker import worker_for

LAYERS = 2
BLOCKS = 32
HEADS, HEAD_FLOATS = 2, 16
#: Every step of the engine waits at most this long for work.
STEP_SEC = 0.005


def layer_names() -> List[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class Blocks:
    """A ``KVCacheBlocks``, as the connector reads it."""

    def __init__(self, ids: List[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> Tuple[List[int]]:
        return (self.ids,)


class Engine:
    """The engine core: requests come and go through ``inbox`` (from the server's event
    loop); each finished one's answer is handed back through its future."""

    def __init__(self, role: str, extra: Dict[str, Any], block_size: int, loop: asyncio.AbstractEventLoop) -> None:
        self.settings = settings_from(types.SimpleNamespace(kv_role=role, engine_id=role, kv_connector_extra_config=extra))
        self.block_size = block_size
        self.loop = loop
        rng = np.random.default_rng(7)
        self.kv = {
            name: rng.standard_normal((BLOCKS, HEADS, block_size, 2 * HEAD_FLOATS)).astype(np.float32)
            for name in layer_names()
        }
        self.worker = worker_for(self.settings.side, transfer_for(self.settings, 0, BLOCKS, block_size))
        self.worker.register_kv_caches(self.kv)
        if self.settings.side == "decode":
            self.decode: Optional[DecodeScheduler] = DecodeScheduler(block_size)
            self.prefill: Optional[PrefillScheduler] = None
        else:
            self.decode = None
            self.prefill = PrefillScheduler(block_size, 1, self.settings.grant_timeout_sec)
        self.free = list(range(BLOCKS))
        self.inbox: "queue.Queue[Tuple[str, Any, Any]]" = queue.Queue()
        self.requests: Dict[str, Any] = {}
        self.answers: Dict[str, asyncio.Future] = {}
        self.blocks: Dict[str, List[int]] = {}
        self.waiting: List[Any] = []
        #: Requests finished since the last step (vLLM's ``finished_req_ids``).
        self.finished: Set[str] = set()
        #: Blocks held after their request finished, until the connector lets them go.
        self.held: Set[str] = set()
        self.stopped = threading.Event()

    # ---- the server's side ----------------------------------------------------------

    def submit(self, rid: str, tokens: int, params: Any) -> asyncio.Future:
        future = self.loop.create_future()
        self.inbox.put(("new", (rid, tokens, params), future))
        return future

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid, None))

    # ---- the engine core's side ------------------------------------------------------

    def answer(self, rid: str, outcome: Any) -> None:
        future = self.answers.pop(rid, None)
        if future is not None:
            self.loop.call_soon_threadsafe(lambda: future.done() or future.set_result(outcome))

    def allocate(self, rid: str, tokens: int) -> List[int]:
        ids = [self.free.pop(0) for _ in range(math.ceil(tokens / self.block_size))]
        self.blocks[rid] = ids
        return ids

    def release_blocks(self, rid: str) -> None:
        self.free.extend(self.blocks.pop(rid, []))

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                kind, what, future = self.inbox.get(timeout=STEP_SEC)
            except queue.Empty:
                kind = None
            if kind == "new":
                rid, tokens, params = what
                request = types.SimpleNamespace(
                    request_id=rid, prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens,
                    kv_transfer_params=params,
                )
                self.requests[rid] = request
                self.answers[rid] = future
                self.add(request)
            elif kind == "abort" and what in self.requests:
                logging.getLogger("engine").info("aborted request %s", what)
                self.finish(self.requests[what], aborted=True)
            self.step()
        self.worker.shutdown()

    def add(self, request: Any) -> None:
        if self.decode is not None:
            count, _ = self.decode.get_num_new_matched_tokens(request, 0)
            if count > 0:
                ids = self.allocate(request.request_id, request.num_prompt_tokens)
                self.decode.update_state_after_alloc(request, Blocks(ids), count)
            else:
                self.finish(request, outcome="ok")
        else:
            assert self.prefill is not None
            self.prefill.on_new_request(request)
            self.waiting.append(request)

    def finish(self, request: Any, outcome: Any = None, aborted: bool = False) -> None:
        """vLLM's end of a request: its connector's ``request_finished``, its blocks freed
        unless the connector holds them."""
        rid = request.request_id
        self.requests.pop(rid, None)
        if request in self.waiting:
            self.waiting.remove(request)
        side = self.decode or self.prefill
        assert side is not None
        delay, params = side.request_finished(request)
        self.finished.add(rid)
        if self.decode is not None and self.decode.reserved.get(rid) is not None:
            self.held.add(rid)  # withdrawn: freed once the workers report it
        elif delay:
            self.held.add(rid)
        else:
            self.release_blocks(rid)
        if not aborted:
            self.answer(rid, (outcome, params))

    def step(self) -> None:
        if self.decode is not None:
            self.worker.bind(self.decode.build_connector_meta(None))
            self.worker.wait_for_save()
            _, recving = self.worker.get_finished(self.finished)
            self.finished = set()
            errors = self.worker.get_block_ids_with_load_errors()
            self.worker.clear()
            self.decode.update_connector_output(recving)
            for rid in recving:
                if rid in self.held:
                    self.held.discard(rid)
                    self.release_blocks(rid)
                elif rid in self.requests:
                    failed = bool(errors & set(self.blocks.get(rid, ())))
                    self.finish(self.requests[rid], outcome="error" if failed else "ok")
            return
        assert self.prefill is not None
        scheduled = []
        for request in list(self.waiting):
            count, _ = self.prefill.get_num_new_matched_tokens(request, 0)
            if count is None:
                continue  # its grant is awaited: asked again next step
            self.waiting.remove(request)
            ids = self.allocate(request.request_id, request.num_prompt_tokens)
            self.prefill.update_state_after_alloc(request, Blocks(ids), 0)
            scheduled.append(request)
        output = types.SimpleNamespace(
            scheduled_new_reqs=[
                types.SimpleNamespace(req_id=r.request_id, block_ids=(self.blocks[r.request_id],), num_computed_tokens=0)
                for r in scheduled
            ],
            scheduled_cached_reqs=types.SimpleNamespace(
                req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
            ),
            num_scheduled_tokens={r.request_id: r.num_prompt_tokens for r in scheduled},
        )
        self.worker.bind(self.prefill.build_connector_meta(output))
        if scheduled:
            for name in layer_names():
                self.worker.save_kv_layer(name, self.kv[name])
        self.worker.wait_for_save()
        sending, _ = self.worker.get_finished(self.finished)
        self.finished = set()
        report = self.worker.take_report()
        self.worker.clear()
        # vLLM's order: the requests this step finished (one token each) first, then the
        # connector's output of the step.
        for request in scheduled:
            self.finish(request, outcome="ok")
        self.prefill.update_connector_output(report, sending)
        for rid in sending or ():
            if rid in self.held:
                self.held.discard(rid)
                self.release_blocks(rid)


def prompt_tokens(body: Dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", ""))) for m in body["messages"])
    return len(str(body.get("prompt", "")))


async def serve(engine: Engine) -> web.AppRunner:
    ids = iter(range(1, 1 << 30))
    error = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}

    async def completion(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = f"req-{next(ids)}"
        future = engine.submit(rid, prompt_tokens(body), body.get("kv_transfer_params"))
        try:
            outcome, params = await future
        except asyncio.CancelledError:
            engine.abort(rid)
            raise
        if engine.settings.side == "prefill":
            return web.json_response({"choices": [{"index": 0, "text": "p"}], "kv_transfer_params": params})
        if not body.get("stream"):
            if outcome == "error":
                return web.json_response(error, status=500)
            return web.json_response({"choices": [{"index": 0, "text": "decoded"}]})
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        event = error if outcome == "error" else {"choices": [{"index": 0, "text": "decoded"}]}
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions", completion)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(json.dumps({"port": port}), flush=True)
    return runner


async def main() -> None:
    role, extra, block_size = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    engine = Engine(role, extra, block_size, asyncio.get_running_loop())
    core = threading.Thread(target=engine.run, daemon=True)
    core.start()
    runner = await serve(engine)
    try:
        # Until the test closes standard input.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        engine.stopped.set()
        core.join(timeout=10)
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
