"""Level (b) of docs/vllm.md "Tests": the connector's worker side in two processes, a decode
engine's and a prefill engine's (``engine_process.py``: the worker side over kvx's real
transfer, NumPy arrays as the paged KV), kvx over loopback TCP between them; the test plays
both schedulers. Every byte of the pushed blocks is compared; blocks outside the grant stay
untouched. Then the failures: a write corrupted after its checksum, a prefill engine killed
mid-push, an abort on the decode side; each engine killed and hung (stopped) mid-push, the
survivor's outcome within its bound. No vLLM needed."""

from __future__ import annotations

import base64
import collections
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import pytest

from kvx.testing import free_port, stop_process

np = pytest.importorskip("numpy")

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS, BLOCK_FLOATS = 3, 2 * 4 * 16


class Engine:
    """One engine process, a JSON line per command and answer, each answer awaited at most
    20 s."""

    def __init__(self, role: str, extra: Dict[str, Any], seed: int = 0, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "engine_process.py"), role, json.dumps(extra), str(seed), *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self._read() == {"ready": True}
        #: The transfer's counts over every step so far.
        self.counts: collections.Counter = collections.Counter()
        #: Its samples (phase times, kvx.vllm.signals) over every step so far.
        self.samples: Dict[str, List[float]] = {}

    def _read(self) -> Dict[str, Any]:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=20):
            self.proc.kill()
            raise AssertionError("the engine process did not answer within 20 s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the engine process exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, **cmd: Any) -> Dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def step(self, plan: Optional[Dict[str, Any]] = None, finished: List[str] = (), forward: bool = False) -> Dict[str, Any]:
        out = self.ask(op="step", plan=plan or {}, finished=list(finished), forward=forward)
        for key, value in out["counts"].items():
            if isinstance(value, list):  # samples in seconds (kvx.vllm.signals)
                self.samples.setdefault(key, []).extend(value)
            else:
                self.counts[key] += value
        return out

    def until(self, what: str, plan=None, finished=(), timeout: float = 15.0) -> Dict[str, Any]:
        """Steps (the first with ``plan``) until an answer's ``what`` is non-empty."""
        deadline = time.monotonic() + timeout
        out = self.step(plan, finished)
        while not out[what]:
            assert time.monotonic() < deadline, f"no {what} within {timeout} s: {out}"
            time.sleep(0.02)
            out = self.step(None, finished)
        return out

    def blocks(self, ids: List[int]):
        layers = self.ask(op="blocks", ids=ids)["layers"]
        return [np.frombuffer(base64.b64decode(b), np.float32).reshape(len(ids), BLOCK_FLOATS) for b in layers]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def engines():
    started: List[Engine] = []
    alloc, fabric = free_port(), free_port()

    def start(role: str, *flags: str, **extra: Any) -> Engine:
        if role == "kv_consumer":
            extra = {"alloc_port": alloc, "fabric_port": fabric, **extra}
        e = Engine(role, extra, 11, *flags)
        started.append(e)
        return e

    start.endpoints = ([f"tcp://127.0.0.1:{alloc}"], [f"tcp://127.0.0.1:{fabric}"])  # type: ignore[attr-defined]
    yield start
    for e in started:
        e.close()


def begin(start, kvx_id: str, blocks: int):
    alloc, fabric = start.endpoints
    return {"begin": [["p-" + kvx_id, kvx_id, alloc, fabric, blocks]]}


def test_every_byte_of_a_pushed_request_lands_in_the_granted_blocks(engines):
    decode, prefill = engines("kv_consumer"), engines("kv_producer")
    # Four prompt blocks; the decode engine holds the first already (a local prefix hit) and
    # reserves blocks 5, 6 and 9 for the other three.
    decode.step({"reserve": [["d-k1", "k1", 1, [5, 6, 9], 3 * 4]]})
    granted = prefill.until("granted", begin(engines, "k1", 4))
    assert granted["granted"] == {"p-k1": 1}
    # Chunked prefill: blocks 0-1 (this engine's 2 and 3), then 2-3 (7 and 8), layer by layer.
    prefill.step({"push": [["p-k1", "k1", 0, [2, 3], False]]}, forward=True)
    prefill.step({"push": [["p-k1", "k1", 2, [7, 8], True]]}, forward=True)
    done = decode.until("received")
    assert done["received"] == ["d-k1"] and done["errors"] == []
    sent = prefill.until("sent", finished=["p-k1"])
    assert sent["sent"] == ["p-k1"]
    assert decode.counts == {"received": 1}
    assert len(decode.samples["reserve_to_received_s"]) == 1
    assert len(prefill.samples["push_s"]) == len(prefill.samples["delivery_s"]) == 1
    # Per layer three writes: the held block is answered, not written, and no two of the
    # others are consecutive in both engines (3 -> 5 in one step; 7 -> 6 and 8 -> 9 in the next).
    timed = {k: prefill.counts.pop(k) for k in ("push_us", "delivery_us")}
    assert prefill.counts == {"pushed": 1, "writes": 3 * LAYERS, "write_bytes": 3 * LAYERS * BLOCK_FLOATS * 4,
                              "timed_pushes": 1, "timed_bytes": 4 * LAYERS * BLOCK_FLOATS * 4}
    assert 0 <= timed["delivery_us"] <= timed["push_us"] < 60_000_000, timed
    want = prefill.blocks([3, 7, 8])
    got = decode.blocks([5, 6, 9])
    for layer in range(LAYERS):
        assert np.array_equal(got[layer], want[layer]), f"layer {layer}"
        assert got[layer].any()
    untouched = decode.blocks([b for b in range(16) if b not in (5, 6, 9)])
    assert not any(layer.any() for layer in untouched), "a write outside the granted blocks"


def test_a_prefill_engine_without_the_routers_secret_claims_nothing(engines):
    """Another prefill engine that knows the request's kvx id (it travels in clear), but not
    the claim secret the router handed the chosen one, is refused with the reason; the
    chosen engine's claim is then granted and its push delivered."""
    decode, forger, prefill = engines("kv_consumer"), engines("kv_producer"), engines("kv_producer")
    decode.step({"reserve": [["d-f", "f", 0, [3, 4], 2 * 4]]})
    alloc, fabric = engines.endpoints
    forged = {"begin": [["p-f", "f", alloc, fabric, 2, "guessed-0123456789abcdef"]]}
    refused = forger.until("refused", forged)["refused"]
    assert "not its reservation's" in refused["p-f"], refused
    assert prefill.until("granted", begin(engines, "f", 2))["granted"] == {"p-f": 1}
    prefill.step({"push": [["p-f", "f", 0, [6, 7], True]]}, forward=True)
    assert decode.until("received")["received"] == ["d-f"]
    assert prefill.until("sent", finished=["p-f"])["sent"] == ["p-f"]
    want, got = prefill.blocks([6, 7]), decode.blocks([3, 4])
    for layer in range(LAYERS):
        assert np.array_equal(got[layer], want[layer]), f"layer {layer}"


def test_a_run_of_blocks_consecutive_in_both_engines_is_one_write_per_layer(engines):
    decode, prefill = engines("kv_consumer"), engines("kv_producer")
    decode.step({"reserve": [["d-r", "r", 0, [4, 5, 6, 7, 10], 5 * 4]]})
    assert prefill.until("granted", begin(engines, "r", 5))["granted"] == {"p-r": 1}
    # Blocks 0-3 run 8..11 -> 4..7; block 4 (12 -> 10) breaks the run on the decode side.
    prefill.step({"push": [["p-r", "r", 0, [8, 9, 10, 11, 12], True]]}, forward=True)
    assert decode.until("received")["received"] == ["d-r"]
    assert prefill.until("sent", finished=["p-r"])["sent"] == ["p-r"]
    assert prefill.counts["writes"] == 2 * LAYERS, prefill.counts
    assert prefill.counts["write_bytes"] == 5 * LAYERS * BLOCK_FLOATS * 4
    want, got = prefill.blocks([8, 9, 10, 11, 12]), decode.blocks([4, 5, 6, 7, 10])
    for layer in range(LAYERS):
        assert np.array_equal(got[layer], want[layer]), f"layer {layer}"


def test_a_write_corrupted_after_its_checksum_is_a_load_error(engines):
    decode = engines("kv_consumer")
    prefill = engines("kv_producer", "--corrupt-writes")
    decode.step({"reserve": [["d-k2", "k2", 0, [4, 5], 8]]})
    prefill.until("granted", begin(engines, "k2", 2))
    prefill.step({"push": [["p-k2", "k2", 0, [0, 1], True]]}, forward=True)
    failed = decode.until("received")
    assert failed["received"] == ["d-k2"]
    assert failed["errors"] == [4, 5], "the failed load's blocks go to vLLM's failure policy"
    prefill.until("sent", finished=["p-k2"])


def test_a_prefill_engine_that_dies_mid_push_fails_the_load(engines):
    # With kvx's idle timeout (30 s): the decode engine hears the prefill engine's control
    # connection close and fails the load at once (well within ``until``'s 15 s).
    decode = engines("kv_consumer")
    prefill = engines("kv_producer")
    decode.step({"reserve": [["d-k3", "k3", 0, [1, 2, 3], 12]]})
    prefill.until("granted", begin(engines, "k3", 3))
    prefill.step({"push": [["p-k3", "k3", 0, [0], False]]}, forward=True)
    prefill.proc.kill()
    prefill.proc.wait()
    failed = decode.until("received")
    assert failed["received"] == ["d-k3"] and failed["errors"] == [1, 2, 3]


#: kvx's liveness deadline on the control channel (``ZmqConfig::heartbeat_timeout``), and
#: what the survivor's outcome may take beyond it (steps, a loaded machine).
HEARTBEAT_TIMEOUT, SLACK = 4.0, 3.0


def test_a_prefill_engine_that_hangs_mid_push_fails_the_load_within_the_heartbeat_bound(engines):
    # A stopped process keeps its connections open: only its heartbeats' silence says so.
    decode = engines("kv_consumer")
    prefill = engines("kv_producer")
    decode.step({"reserve": [["d-k5", "k5", 0, [1, 2, 3], 12]]})
    prefill.until("granted", begin(engines, "k5", 3))
    prefill.step({"push": [["p-k5", "k5", 0, [0], False]]}, forward=True)
    stop_process(prefill.proc.pid)
    hung = time.monotonic()
    try:
        failed = decode.until("received", timeout=HEARTBEAT_TIMEOUT + SLACK + 5)
        took = time.monotonic() - hung
    finally:
        prefill.proc.kill()
        prefill.proc.wait()
    assert failed["received"] == ["d-k5"] and failed["errors"] == [1, 2, 3]
    assert took < HEARTBEAT_TIMEOUT + SLACK, took


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_decode_engine_that_dies_or_hangs_mid_push_frees_the_prefill_engines_blocks(engines, fault):
    # The prefill engine's push of the first layers went out; the decode engine goes before
    # the rest. The push ends (its blocks come back to vLLM: finished sending) within the
    # bound: at once for a closed connection, the heartbeat deadline for a stopped process.
    decode = engines("kv_consumer")
    prefill = engines("kv_producer")
    decode.step({"reserve": [["d-k6", "k6", 0, [4, 5], 8]]})
    prefill.until("granted", begin(engines, "k6", 2))
    if fault == "killed":
        decode.proc.kill()
        decode.proc.wait()
    else:
        stop_process(decode.proc.pid)
    gone = time.monotonic()
    try:
        prefill.step({"push": [["p-k6", "k6", 0, [0, 1], True]]}, forward=True)
        prefill.until("sent", finished=["p-k6"], timeout=HEARTBEAT_TIMEOUT + SLACK + 5)
        took = time.monotonic() - gone
    finally:
        decode.proc.kill()
        decode.proc.wait()
    bound = SLACK if fault == "killed" else HEARTBEAT_TIMEOUT + SLACK
    assert took < bound, (fault, took)


def test_an_abort_on_the_decode_side_ends_the_push_and_frees_both_sides(engines):
    decode, prefill = engines("kv_consumer"), engines("kv_producer")
    decode.step({"reserve": [["d-k4", "k4", 0, [7, 8], 8]]})
    prefill.until("granted", begin(engines, "k4", 2))
    back = decode.until("received", {"release": [["d-k4", "k4", True]]})
    assert back["received"] == ["d-k4"] and back["errors"] == [], "withdrawn: no load error"
    prefill.step({"push": [["p-k4", "k4", 0, [0, 1], True]]}, forward=True)
    prefill.until("sent", finished=["p-k4"])
    assert not any(layer.any() for layer in decode.blocks([7, 8])), "nothing landed after the withdrawal"
