"""A KV transfer that fails reaches the router's client as its reason, and both engines log
the same one, in vLLM's terms. The router in this process in front of a decode and a prefill
engine, each in a process of its own (``engine_server.py``: the connector's real scheduler
and worker sides over kvx's real transfer, kvx over loopback TCP, answering as vLLM's OpenAI
server does, bare "Internal server error" for a failed load included). No vLLM needed."""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("numpy")

from kvx.testing import free_port  # noqa: E402
from kvx.vllm.reasons import block_count_mismatch, block_size_mismatch  # noqa: E402
from kvx.vllm.router import Router  # noqa: E402
from kvx.vllm.router_config import config_from  # noqa: E402

from test_router import serve  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
#: The decode engine's claim timeout: what a failed claim cost its client before the router
#: answered it at once.
CLAIM_TIMEOUT_SEC = 20.0
#: Every wait of these tests is bounded by this.
BOUND = 40.0
#: Each prompt character is one token: 12 tokens.
PROMPT = "twelve chars"


class EngineServer:
    """One engine process (``engine_server.py``); its log is its standard error."""

    def __init__(self, role: str, extra: Dict[str, Any], block_size: int, log_path: str) -> None:
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "engine_server.py"), role, json.dumps(extra), str(block_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True,
        )
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=30):
            self.close()
            raise AssertionError(f"the {role} engine did not start within 30 s: {self.log()}")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the {role} engine exited: {self.log()}")
        self.url = f"http://127.0.0.1:{json.loads(line)['port']}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def pair(tmp_path):
    """``start(prefill_block_size, decode_block_size, alloc=None)``: a decode and a prefill
    engine; ``alloc`` replaces the decode engine's alloc endpoint in the router's
    configuration. Returns (prefill, decode, kvx_alloc, kvx_fabric)."""
    started: List[EngineServer] = []

    def start(prefill_bs: int, decode_bs: int, alloc: Optional[str] = None):
        alloc_port, fabric_port = free_port(), free_port()
        decode = EngineServer(
            "kv_consumer",
            {"alloc_port": alloc_port, "fabric_port": fabric_port, "claim_timeout_sec": CLAIM_TIMEOUT_SEC},
            decode_bs, str(tmp_path / "decode.log"),
        )
        started.append(decode)
        prefill = EngineServer("kv_producer", {}, prefill_bs, str(tmp_path / "prefill.log"))
        started.append(prefill)
        return prefill, decode, alloc or f"tcp://127.0.0.1:{alloc_port}", f"tcp://127.0.0.1:{fabric_port}"

    yield start
    for e in started:
        e.close()


async def ask(prefill: EngineServer, decode: EngineServer, alloc: str, fabric: str, **request: Any):
    """One completion through the router: (status, JSON answer or raw bytes, seconds)."""
    config = config_from({
        "listen": "127.0.0.1:1",
        "prefill": [{"url": prefill.url}],
        "decode": [{"url": decode.url, "kvx_alloc": [alloc], "kvx_fabric": [fabric]}],
    })
    router = Router(config)
    runner, url = await serve(router.app())
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND)) as client:
            start = time.monotonic()
            async with client.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **request}) as r:
                raw = await r.read()
                took = time.monotonic() - start
                try:
                    answer = json.loads(raw)
                except ValueError:
                    answer = raw
                return r.status, answer, took
    finally:
        await runner.cleanup()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 2 * BOUND))


def until_logged(engine: EngineServer, text: str) -> str:
    """Its log, once it holds ``text`` (bounded)."""
    deadline = time.monotonic() + 10
    while text not in engine.log():
        assert time.monotonic() < deadline, f"not logged within 10 s: {text!r}\n{engine.log()}"
        time.sleep(0.05)
    return engine.log()


def openai_error(status: int, answer: Any) -> Dict[str, Any]:
    """The error of an answer in OpenAI's shape, checked."""
    assert 500 <= status < 600, (status, answer)
    assert isinstance(answer, dict) and isinstance(answer.get("error"), dict), answer
    error = answer["error"]
    assert {"message", "type", "code"} <= error.keys() and error["code"] == status, error
    return error


def test_a_pair_that_agrees_answers_through_the_router(pair):
    prefill, decode, alloc, fabric = pair(4, 4)
    status, answer, _ = run(ask(prefill, decode, alloc, fabric))
    assert status == 200 and answer["choices"][0]["text"] == "decoded", answer


def test_a_wrong_alloc_port_is_answered_at_once_as_a_refused_connection(pair):
    wrong = f"tcp://127.0.0.1:{free_port()}"
    prefill, decode, _, fabric = pair(4, 4)
    status, answer, took = run(ask(prefill, decode, wrong, fabric))
    error = openai_error(status, answer)
    assert f"connection refused at {wrong}" in error["message"], error
    assert "kvx_alloc" in error["message"], "it names the router's key to fix"
    # Not after kvx's connect timeout (10 s), nor after the decode engine's claim timeout.
    assert took < 5.0, f"{took:.1f} s"
    until_logged(prefill, f"connection refused at {wrong}")
    # The decode engine's request was closed at once (its reservation withdrawn), not left
    # to its claim timeout.
    until_logged(decode, "aborted request")


def test_a_smaller_prefill_block_size_is_named_to_the_client_and_in_both_engines_logs(pair):
    # 12 tokens: 3 blocks of 4 on the prefill engine, 2 of 8 reserved on the decode engine.
    prefill, decode, alloc, fabric = pair(4, 8)
    status, answer, took = run(ask(prefill, decode, alloc, fabric))
    error = openai_error(status, answer)
    reason = block_count_mismatch(3, 2, 1)
    assert reason + " (the prefill engine's is 4)" in error["message"], error
    assert error["type"] == "kv_transfer_failed"
    assert took < 5.0, f"{took:.1f} s"
    until_logged(prefill, reason)
    assert reason + " (the decode engine's is 8)" in until_logged(decode, reason)


@pytest.mark.parametrize("stream", [False, True])
def test_a_larger_prefill_block_size_is_an_openai_error_and_both_logs_name_both(pair, stream):
    # 12 tokens: 2 blocks of 8 on the prefill engine, 3 of 4 on the decode engine; the claim
    # is granted and the first batch declares pages of 2 x 8 x 32 floats where the decode
    # engine's are half that: kvx's receiver refuses it naming both sizes, before any write,
    # and its reservation comes back with that reason. The prefill engine's answer was sent
    # already: the decode engine answers vLLM's bare error, the router an OpenAI error with
    # the kvx id, and both engines log the same sentence in vLLM's terms.
    prefill, decode, alloc, fabric = pair(8, 4)
    status, answer, took = run(ask(prefill, decode, alloc, fabric, stream=stream))
    error = openai_error(status, answer)
    assert "Internal server error" in error["message"] and "kvx request kvx-" in error["message"], error
    kvx_id = error["message"].split("kvx request ")[1].split(":")[0].split(";")[0].split(")")[0]
    assert took < 5.0, f"{took:.1f} s"
    page = 2 * 2 * 16 * 4  # heads x 2 x head size x float32, per token
    log = until_logged(prefill, block_size_mismatch(8 * page, 4 * page, "prefill", 8, 8 * page))
    assert "block size 8 on the prefill engine, 4 on the decode engine" in log
    assert kvx_id in log
    decode_log = until_logged(decode, "block size 8 on the prefill engine, 4 on the decode engine")
    assert kvx_id in decode_log
