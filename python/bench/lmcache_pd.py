"""LMCache's own PD backend (``PDBackendAsync``, its ``mock_memory`` transfer channel) against
kvx's (``kvx.lmcache``) over TCP on loopback (``kvx_fabric: tcp``, what separate processes
use) and in-process (``kvx_fabric: mem``, the like of ``mock_memory``), driven by one Python
driver through LMCache's own ``StorageManager``s on the same workload (docs/PERFORMANCE.md,
"LMCache backend"):

    target/pyenv/bin/python python/bench/lmcache_pd.py [--requests 50] [--deadline 120] [--rounds 3] [--torch-threads 1]

2 senders × ``--requests`` requests of 4–16 chunks of 1 MiB (uniform, seeded), one receiver
buffer of 64 chunks, batches of 4, with one request per sender at a time and with four. Each
backend × concurrency runs in a process of its own (LMCache's backend shares one ZeroMQ
context per process, and its close can hang). A request's latency runs from its first
``allocate`` to its ProxyNotif at the proxy's socket; the decode side then retrieves and
removes every chunk, as LMCache's retrieve does. Torch runs with ``--torch-threads`` threads
(``OMP_NUM_THREADS``; default 1, the setting vLLM gives its processes unless the environment
sets one, so that is how LMCache runs inside vLLM). Prints one JSON line per run, then a
summary line with kvx's ratios to LMCache's.
"""

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

KV_SHAPE = (8, 2, 256, 8, 16)  # bf16: 1 MiB per chunk
BATCH = 4
BACKENDS = ("lmcache", "kvx-tcp", "kvx-shm", "kvx-mem")


def run(backend: str, interleave: int, requests: int, deadline_s: float) -> dict:
    import logging

    logging.disable(logging.CRITICAL)
    import msgspec
    import torch
    import zmq

    import kvx.lmcache
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    from lmcache_cluster import chunk_key, config, free_port, metadata

    extra = {}
    if backend.startswith("kvx-"):
        kvx.lmcache.install()
        extra = {"kvx_fabric": backend.split("-", 1)[1]}
    meta = metadata(kv_shape=KV_SHAPE)
    chunk_bytes = meta.get_shapes()[0].numel() * 2
    proxy_port = free_port()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{proxy_port}")
    init, alloc = [free_port()], [free_port()]
    rx = StorageManager(config("receiver", 64, init, alloc, proxy_port, 30.0, kv_shape=KV_SHAPE,
                               **extra),
                        meta, EventManager())
    senders = [
        StorageManager(config("sender", 64, [free_port()], [free_port()], proxy_port, 30.0,
                              kv_shape=KV_SHAPE, **extra), meta, EventManager())
        for _ in range(2)
    ]
    rng = random.Random(1)
    plans = [[(f"s{s}-r{i:03}", rng.randint(4, 16)) for i in range(requests)] for s in range(2)]
    totals = {r: n for plan in plans for r, n in plan}
    first_alloc: dict = {}
    latency: dict = {}
    lost: set = set()
    lock = threading.Lock()

    def spec(req_id, total, last):
        import types

        return types.SimpleNamespace(
            req_id=req_id, receiver_id=f"127.0.0.1{init[0]}", receiver_host="127.0.0.1",
            receiver_init_port=init, receiver_alloc_port=alloc, is_last_prefill=last,
            num_transferred_tokens=0, total_chunks=total, receiver_query_port=None)

    def prefill(sm, work):
        while True:
            with lock:
                if not work:
                    return
                req_id, total = work.pop(0)
            for start in range(0, total, BATCH):
                last = start + BATCH >= total
                s = spec(req_id, total, last)
                keys, objs = [], []
                with kvx.lmcache.transfer(s):
                    for c in range(start, min(start + BATCH, total)):
                        with lock:
                            first_alloc.setdefault(req_id, time.monotonic())
                        obj = sm.allocate(meta.get_shapes(), meta.get_dtypes(), fmt=MemoryFormat.KV_2LTD)
                        if obj is None:
                            break
                        obj.tensor.view(-1).view(torch.uint8).fill_(c & 0xFF)
                        keys.append(chunk_key(req_id, c))
                        objs.append(obj)
                if objs:
                    sm.batched_put(keys, objs, transfer_spec=s)
                if len(objs) < min(BATCH, total - start):
                    with lock:
                        lost.add(req_id)
                    break

    def decode():
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and len(latency) + len(lost) < len(totals):
            if not pull.poll(100):
                continue
            msg = msgspec.msgpack.decode(pull.recv())
            req_id = msg["req_id"]
            if msg["type"] != "ProxyNotif":
                with lock:
                    lost.add(req_id)
                continue
            now = time.monotonic()
            complete = True
            for c in range(totals[req_id]):
                key = chunk_key(req_id, c)
                try:
                    obj = rx.get(key)
                except AssertionError:  # LMCache's own backend asserts on a missing key.
                    obj = None
                if obj is None:
                    complete = False
                    continue
                rx.remove(key)
            with lock:
                if complete:
                    latency[req_id] = now - first_alloc[req_id]
                else:
                    lost.add(req_id)

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    decoder = threading.Thread(target=decode, daemon=True)
    decoder.start()
    workers = []
    for sm, plan in zip(senders, plans):
        work = list(plan)
        workers += [threading.Thread(target=prefill, args=(sm, work), daemon=True) for _ in range(interleave)]
    for w in workers:
        w.start()
    decoder.join(timeout=deadline_s + 5)
    elapsed = time.monotonic() - started
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    delivered = sum(totals[r] for r in latency) * chunk_bytes
    lat = sorted(latency.values())
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {
        "backend": backend,
        "interleave": interleave,
        "requests": len(totals),
        "delivered": len(latency),
        "lost": len(totals) - len(latency),
        "seconds": elapsed,
        "gb_per_s": delivered / elapsed / 1e9,
        "latency_ms_p50": 1e3 * statistics.median(lat) if lat else None,
        "latency_ms_p99": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "cpu_s_per_gb": cpu / (delivered / 1e9) if delivered else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=50, help="requests per sender")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds a run may take")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds with one request in flight per sender (alternating backends; "
                         "medians reported); the four-in-flight runs go once")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch's intra-op threads in every run (OMP_NUM_THREADS; default 1, "
                         "as vLLM sets it for its processes)")
    ap.add_argument("--run", nargs=2, metavar=("BACKEND", "INTERLEAVE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        try:
            print(json.dumps(run(args.run[0], int(args.run[1]), args.requests, args.deadline)), flush=True)
        finally:
            os._exit(0)
    results: dict = {}
    plan = [1] * args.rounds + [4]
    for interleave in plan:
        for backend in BACKENDS:
            out = subprocess.run(
                [sys.executable, __file__, "--requests", str(args.requests), "--deadline",
                 str(args.deadline), "--run", backend, str(interleave)],
                capture_output=True, text=True, timeout=args.deadline + 120,
                # Read by torch at import: set before the run's process starts.
                env={**os.environ, "OMP_NUM_THREADS": str(args.torch_threads)})
            lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
            if not lines:
                raise SystemExit(f"{backend} × {interleave}: no result\n{out.stderr[-2000:]}")
            results.setdefault((backend, interleave), []).append(json.loads(lines[-1]))
            print(lines[-1], flush=True)

    def median(backend, interleave, field):
        values = [r[field] for r in results[(backend, interleave)] if r[field] is not None]
        return statistics.median(values) if values else None

    summary = {}
    for interleave in (1, 4):
        l_gbs, l_p99 = median("lmcache", interleave, "gb_per_s"), median("lmcache", interleave, "latency_ms_p99")
        for backend in BACKENDS[1:]:
            k_gbs, k_p99 = median(backend, interleave, "gb_per_s"), median(backend, interleave, "latency_ms_p99")
            summary[f"{backend}_interleave_{interleave}"] = {
                "gb_per_s_ratio_of_medians": k_gbs / l_gbs if l_gbs else None,
                "p99_ratio_of_medians": k_p99 / l_p99 if k_p99 and l_p99 else None,
                "lmcache_lost": sum(r["lost"] for r in results[("lmcache", interleave)]),
                "kvx_lost": sum(r["lost"] for r in results[(backend, interleave)]),
            }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
