"""`kvx demo`'s workload driven from Python through the kvx package, against `kvx demo`
itself in the same run (docs/PERFORMANCE.md, "Python").

    target/pyenv/bin/python python/bench/demo.py [--kvx target/release/kvx] [--rounds 3] [--fabric tcp|shm] [--driver threads|asyncio] [--cpus 0]
    target/pyenv/bin/python python/bench/demo.py --baseline-kvx BIN --baseline-package DIR [--rounds 20]

Both sides: 2 senders × 50 requests of 4..16 chunks of 1 MiB (uniform, seeded), 4 requests
in flight per sender, batches of 4, 4 staging slots per sender, one receiver of 64 slots,
ZeroMQ + the TCP fabric on loopback (or both on the shm fabric), every byte checked by the
decoder. The Python side runs each sender's in-flight requests on threads of their own and
decodes on one (`--driver asyncio`: each request and the decoder a coroutine on one event
loop, through the awaitables); it makes and checks each chunk's bytes in place with
`kvx.testing` (the code `kvx demo` runs), so the two differ in the driving only.

Also measures the Python-side cost of one staging round (allocate + add, and a submit per
batch) per chunk, over the in-process transport and fabric with 4 KiB chunks, so that the
figure is the binding's overhead and not the bytes' movement.

Prints one JSON object: each round's bytes/s for both, the ratio of their medians and the
median of each round's ratio, and the per-chunk cost in µs.

`--baseline-kvx BIN --baseline-package DIR` compares a change with a baseline build in the
same run: BIN is the baseline's `kvx` binary, DIR holds its `kvx` package (its wheel
unpacked there, `python -m zipfile -e kvx-*.whl DIR`). Each round then runs four in turn: the baseline's `kvx demo`, this
build's, the baseline's Python run and this build's, each Python run in a process of its
own (the baseline's package first on its path), and the JSON holds each round's four
figures, both builds' Python/Rust ratios (medians of the rounds' ratios) and the medians of
the rounds' this-build/baseline ratios.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import kvx
import kvx.testing

CHUNK = 1 << 20
DECODERS = 1
IN_FLIGHT = 4


def python_demo(seed: int, fabric: str = "tcp", driver: str = "threads",
                threads_per_sender: int = IN_FLIGHT) -> dict:
    rng = random.Random(seed)
    rx = kvx.Receiver(slots=64, slot_bytes=CHUNK, fabric=fabric)
    senders = [
        kvx.Sender(slots=4, slot_bytes=CHUNK, local_id=f"py-{s}", fabric=fabric) for s in range(2)
    ]
    plans = [
        [(f"s{s}-r{i:03}", rng.randint(4, 16)) for i in range(50)] for s in range(2)
    ]
    total = sum(c for plan in plans for _, c in plan)
    verified = [0]
    corrupt = [0]
    seen = [0]
    want = sum(len(p) for p in plans)
    tally = threading.Lock()
    # The clock stops when the last request is verified, as `kvx demo`'s does: not when
    # the threads have joined (a second decoder would add its last `next_ready` timeout).
    done_at = [None]

    def finish(start):
        elapsed = (done_at[0] or time.perf_counter()) - start
        for tx in senders:
            tx.close()
        return {
            "bytes_verified": verified[0],
            "chunks_corrupted": corrupt[0],
            "bytes_expected": total * CHUNK,
            "bytes_per_sec": verified[0] / elapsed,
        }

    def decoder():
        deadline = time.monotonic() + 300
        while seen[0] < want and time.monotonic() < deadline:
            for lease in rx.next_ready(max=4, timeout=0.1):
                good = sum(kvx.testing.check(lease, c) for c in range(len(lease)))
                # Without waiting for the driver's confirmation, as kvx.lmcache's retrieve
                # path does: `kvx demo` awaits it in a task per request, where it holds up
                # no other request's check; here it would hold up this thread's next one.
                lease.consume(wait=False)
                with tally:
                    verified[0] += good * CHUNK
                    corrupt[0] += len(lease) - good
                    seen[0] += 1
                    if seen[0] == want:
                        done_at[0] = time.perf_counter()

    def prefill(tx, peer, work, lock, per_thread):
        # `per_thread` of the sender's requests in flight on this thread, a chunk of each in
        # turn (the core keeps each request's pending batch apart).
        while True:
            with lock:
                mine = [work.pop(0) for _ in range(min(per_thread, len(work)))]
            if not mine:
                return
            for req_id, chunks in mine:
                tx.begin(req_id, receiver=peer, total_chunks=chunks)
            for req_id, _ in mine:
                if not tx.wait_admitted(req_id, timeout=60):
                    raise RuntimeError(f"{req_id} not admitted")
            for c in range(max(chunks for _, chunks in mine)):
                for req_id, chunks in mine:
                    if c >= chunks:
                        continue
                    slot = tx.allocate(req_id)
                    kvx.testing.fill(slot, req_id, c)
                    tx.add(slot, f"{req_id}@{c}", tokens=256)
                    if (c + 1) % 4 == 0 or c + 1 == chunks:
                        tx.submit(req_id, last=c + 1 == chunks)
            for req_id, _ in mine:
                tx.wait_outcome(req_id, timeout=60)

    async def prefill_async(tx, peer, work):
        while work:
            req_id, chunks = work.pop(0)
            tx.begin(req_id, receiver=peer, total_chunks=chunks)
            await asyncio.wait_for(tx.admitted(req_id), 60)
            for c in range(chunks):
                slot = await tx.allocate_async(req_id)
                kvx.testing.fill(slot, req_id, c)
                tx.add(slot, f"{req_id}@{c}", tokens=256)
                if (c + 1) % 4 == 0 or c + 1 == chunks:
                    tx.submit(req_id, last=c + 1 == chunks)
            await asyncio.wait_for(tx.outcome(req_id), 60)

    async def decoder_async():
        while seen[0] < want:
            for lease in await rx.ready(max=4):
                with lease:
                    good = sum(kvx.testing.check(lease, c) for c in range(len(lease)))
                verified[0] += good * CHUNK
                corrupt[0] += len(lease) - good
                seen[0] += 1
        done_at[0] = time.perf_counter()

    if driver == "asyncio":
        async def run_all():
            peers = [tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint) for tx in senders]
            works = [list(p) for p in plans]
            return await asyncio.wait_for(asyncio.gather(
                decoder_async(),
                *(prefill_async(tx, peer, work)
                  for tx, peer, work in zip(senders, peers, works) for _ in range(IN_FLIGHT))),
                300)

        start = time.perf_counter()
        asyncio.run(run_all())
        return finish(start)

    # One decoder thread: two or four were no faster (docs/PERFORMANCE.md, "Python").
    decoders = [threading.Thread(target=decoder) for _ in range(DECODERS)]
    threads = []
    start = time.perf_counter()
    for d in decoders:
        d.start()
    for s, tx in enumerate(senders):
        peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
        work, lock = list(plans[s]), threading.Lock()
        per_thread = IN_FLIGHT // threads_per_sender
        threads += [threading.Thread(target=prefill, args=(tx, peer, work, lock, per_thread))
                    for _ in range(threads_per_sender)]
    for t in threads:
        t.start()
    for t in threads + decoders:
        t.join()
    return finish(start)


def rust_demo(kvx_bin: str, seed: int, fabric: str = "tcp") -> dict:
    out = subprocess.run(
        [kvx_bin, "demo", "--json", "--seed", str(seed), "--fabric", fabric],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def python_demo_in_subprocess(seed: int, fabric: str, package_dir: str = "") -> float:
    """`python_demo` in a fresh interpreter whose `kvx` is the one in `package_dir` (this
    build's when empty): bytes/s."""
    env = dict(os.environ)
    if package_dir:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_dir, env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, __file__, "--one-python-round", str(seed), "--fabric", fabric],
        capture_output=True, text=True, timeout=300, check=True, env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["bytes_per_sec"]


def against_baseline(baseline_kvx: str, baseline_package: str, kvx_bin: str, rounds: int,
                     fabric: str) -> dict:
    rows = []
    for r in range(rounds):  # the four in turn, so that all see the same machine
        rows.append((
            rust_demo(baseline_kvx, r, fabric)["bytes_per_sec"],
            rust_demo(kvx_bin, r, fabric)["bytes_per_sec"],
            python_demo_in_subprocess(r, fabric, baseline_package),
            python_demo_in_subprocess(r, fabric),
        ))
    med = statistics.median
    return {
        "rounds_baseline_rust_rust_baseline_python_python": rows,
        "baseline_ratio_median_of_rounds": med(bp / br for br, _, bp, _ in rows),
        "ratio_median_of_rounds": med(p / r for _, r, _, p in rows),
        "python_over_baseline_python": med(p / bp for _, _, bp, p in rows),
        "rust_over_baseline_rust": med(r / br for br, r, _, _ in rows),
    }


def staging_round_cost(chunks: int = 20_000) -> float:
    """µs of Python-side time per chunk for allocate + add (+ a submit per 8 chunks)."""
    rx = kvx.Receiver(slots=256, slot_bytes=4096, transport="mem", fabric="mem",
                      alloc="bench-rx", fabric_endpoint="bench-rx-fabric", peer_share_percent=100,
                      require_checksums=False)
    # Without checksums: the cost measured is the Python side's alone.
    tx = kvx.Sender(slots=64, slot_bytes=4096, transport="mem", fabric="mem", checksums=False)
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    stop = threading.Event()

    def consume():
        while not stop.is_set():
            for lease in rx.next_ready(max=64, timeout=0.05):
                lease.consume()

    t = threading.Thread(target=consume)
    t.start()
    spent = 0.0
    per_request = 128
    for r in range(chunks // per_request):
        req_id = f"cost-{r}"
        tx.begin(req_id, receiver=peer, total_chunks=per_request)
        tx.wait_admitted(req_id, timeout=30)
        for c in range(per_request):
            t0 = time.perf_counter()
            slot = tx.allocate(req_id)
            tx.add(slot, "k", tokens=1)
            if (c + 1) % 8 == 0:
                tx.submit(req_id, last=c + 1 == per_request)
            spent += time.perf_counter() - t0
        tx.wait_outcome(req_id, timeout=30)
    stop.set()
    t.join()
    return spent / ((chunks // per_request) * per_request) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvx", default=str(Path(__file__).resolve().parents[2] / "target/release/kvx"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fabric", choices=("tcp", "shm"), default="tcp",
                    help="the fabric of both runs (default tcp)")
    ap.add_argument("--driver", choices=("threads", "asyncio"), default="threads",
                    help="threads: each request in flight a thread of its own (default); "
                    "asyncio: each a coroutine on one event loop, through the awaitables")
    ap.add_argument("--threads-per-sender", type=int, choices=(1, 2, 4), default=IN_FLIGHT,
                    help="threads driving each sender's 4 requests in flight (default 4: one "
                    "each; 2 or 1: two or four requests per thread, a chunk of each in turn)")
    ap.add_argument("--baseline-kvx", metavar="BIN",
                    help="a baseline build's kvx binary, to compare with (needs --baseline-package)")
    ap.add_argument("--baseline-package", metavar="DIR",
                    help="the directory holding that build's kvx package (its wheel unpacked)")
    ap.add_argument("--cpus", metavar="LIST",
                    help="run both on these CPUs only, e.g. 0 (one core) or 0,1: the affinity "
                    "is set on this process and inherited by every run it starts")
    ap.add_argument("--one-python-round", type=int, metavar="SEED", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cpus:
        try:
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        except (ValueError, OSError) as e:
            ap.error(f"--cpus {args.cpus}: {e}")
    if args.one_python_round is not None:
        p = python_demo(args.one_python_round, args.fabric)
        if p["bytes_verified"] != p["bytes_expected"] or p["chunks_corrupted"]:
            raise SystemExit(f"python demo lost or corrupted bytes: {p}")
        print(json.dumps(p))
        return
    if bool(args.baseline_kvx) != bool(args.baseline_package):
        ap.error("--baseline-kvx and --baseline-package go together")
    if args.baseline_kvx:
        print(json.dumps(against_baseline(args.baseline_kvx, args.baseline_package, args.kvx,
                                          args.rounds, args.fabric)))
        return
    rust, py = [], []
    for r in range(args.rounds):  # alternated, so that both see the same machine
        rust.append(rust_demo(args.kvx, r, args.fabric)["bytes_per_sec"])
        p = python_demo(r, args.fabric, args.driver, args.threads_per_sender)
        if p["bytes_verified"] != p["bytes_expected"] or p["chunks_corrupted"]:
            raise SystemExit(f"python demo lost or corrupted bytes: {p}")
        py.append(p["bytes_per_sec"])
    cost = staging_round_cost()
    result = {
        "kvx_demo_bytes_per_sec": rust,
        "python_demo_bytes_per_sec": py,
        "ratio_of_medians": statistics.median(py) / statistics.median(rust),
        # Each round runs the two back to back: the median of the rounds' own ratios is the
        # figure least moved by a host whose load drifts between rounds.
        "median_of_round_ratios": statistics.median(p / r for p, r in zip(py, rust)),
        "python_staging_round_us_per_chunk": cost,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
