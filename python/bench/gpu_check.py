"""kvx.vllm's host-buffer path with KV in CUDA memory (docs/vllm.md, "GPU engines"): needs
PyTorch with CUDA and the kvx wheel, not vLLM. Run by ``scripts/gpu-check.sh``.

Two processes, a decode engine's worker side and a prefill engine's, each a kvx transfer of
``kvx.vllm`` (``DecodeTransfer``, ``PrefillTransfer``) under ``HostBufferedDecode`` and ``HostBufferedPrefill``, with
per-layer paged KV tensors on the device, over loopback TCP (the connector's fabric). For
each attention layout vLLM's GPU backends use (FlashAttention ``[2, num_blocks, ...]``, its
HND order as strides, FlashInfer ``[num_blocks, 2, ...]``, MLA's latent cache): the prefill
process computes each layer (a matmul on the default stream, then the layer's blocks filled
from a seeded generator, also on the default stream) and saves it, so the device → host
copies run while the next layers compute; the decode process copies host → device on
receipt and compares every byte of every layer on the device with the same seeded values.

Reported, each measured in this run: pinned device → host and host → device GB/s alone; the
fabric's GB/s (the same push with the KV in host memory, moved in place); the pipeline's
GB/s (first layer computed to the decode engine's device holding the request) against the
bound min(D2H, fabric, H2D); a layer's compute time with the copies running against without
any transfer. Exits 1 when a byte differs.

    python python/bench/gpu_check.py [--device cuda|cpu] [--layers 32] [--blocks 64] [--requests 4]

``--device cpu`` runs the same code on CPU tensors (a check of the script itself; its
figures are not the GPU's).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import types
from typing import Any, Dict, List, Tuple

import torch

from kvx.testing import free_port
from kvx.vllm.host_buffer import HostBufferedDecode, HostBufferedPrefill
from kvx.vllm.kvx_transfer import DecodeTransfer, PrefillTransfer
from kvx.vllm.settings import settings_from

SECRET = "gpu-check-secret-0123456789"
BLOCK_SIZE, HEADS, HEAD = 16, 8, 128
LATENT = 576  # DeepSeek's MLA latent (512 + 64 rope)


def layer_shape(layout: str, blocks: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(the logical shape, the permutation of a contiguous allocation that gives it)."""
    if layout == "flash-attn":
        return (2, blocks, BLOCK_SIZE, HEADS, HEAD), (0, 1, 2, 3, 4)
    if layout == "flash-attn-hnd":
        return (2, blocks, HEADS, BLOCK_SIZE, HEAD), (0, 1, 3, 2, 4)
    if layout == "flashinfer":
        return (blocks, 2, BLOCK_SIZE, HEADS, HEAD), (0, 1, 2, 3, 4)
    if layout == "mla":
        return (blocks, BLOCK_SIZE, LATENT), (0, 1, 2)
    raise ValueError(layout)


LAYOUTS = ("flash-attn", "flash-attn-hnd", "flashinfer", "mla")


def kv_tensors(layout: str, layers: int, blocks: int, device: str) -> Dict[str, Any]:
    alloc, perm = layer_shape(layout, blocks)
    return {f"model.layers.{i:02d}.self_attn.attn": torch.zeros(alloc, dtype=torch.float16, device=device).permute(*perm)
            for i in range(layers)}


def block_dim(t: Any, blocks: int) -> int:
    return 1 if t.shape[0] == 2 and t.shape[1] == blocks else 0


def expected(t: Any, dim: int, n: int, request: int, layer: int, device: str) -> Any:
    """The values a request's ``n`` blocks of ``layer`` hold: seeded, made on the device."""
    shape = list(t.shape)
    shape[dim] = n
    g = torch.Generator(device=device).manual_seed(1_000 * request + layer)
    return torch.rand(shape, generator=g, device=device, dtype=torch.float32).to(t.dtype)


def settings(role: str, alloc: int, fabric: int, host_buffer: bool) -> Any:
    return settings_from(types.SimpleNamespace(
        kv_role=role, engine_id=role, kv_buffer_device="cpu",
        kv_connector_extra_config={"host": "127.0.0.1", "alloc_port": alloc, "fabric_port": fabric,
                                   "host_buffer": host_buffer}))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def poll_until(transfer: Any, field: str, kvx_id: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = transfer.poll()
        if kvx_id in getattr(events, field):
            return events
        if kvx_id in getattr(events, "failed", {}) or kvx_id in getattr(events, "refused", {}):
            raise RuntimeError(f"{kvx_id}: {events}")
        time.sleep(0.0005)
    raise TimeoutError(f"{kvx_id}: no {field} within {timeout} s")


def decode_side(conn: Any, a: Dict[str, Any]) -> None:
    dev = a["device"]
    t = HostBufferedDecode(DecodeTransfer(settings("kv_consumer", a["alloc"], a["fabric"], a["host_buffer"]),
                                            0, a["num_blocks"]), a["host_buffer"], "cpu")
    kv = kv_tensors(a["layout"], a["layers"], a["num_blocks"], dev)
    t.register_kv_caches(kv)
    out: Dict[str, Any] = {"done": [], "differ": []}
    for r in range(a["requests"]):
        n = a["blocks"]
        # Alternate halves of the engine's blocks, the second time in shuffled order.
        ids = list(range((r % 2) * n, (r % 2) * n + n))
        if r == 1:
            ids = ids[::-1]
        t.reserve(f"R{r}", SECRET, 0, ids, n * BLOCK_SIZE)
        conn.send(("reserved", r))
        poll_until(t, "received", f"R{r}")
        sync(dev)
        out["done"].append(time.monotonic())
        for li, (name, tensor) in enumerate(sorted(kv.items())):
            dim = block_dim(tensor, a["num_blocks"])
            got = tensor.index_select(dim, torch.tensor(ids, device=dev))
            if not torch.equal(got, expected(tensor, dim, n, r, li, dev)):
                out["differ"].append((r, name))
    conn.send(("result", out))
    conn.recv()
    t.close()


def busy(x: Any, w: Any, rounds: int) -> Any:
    for _ in range(rounds):
        x = torch.tanh(x @ w)
    return x


def prefill_side(conn: Any, a: Dict[str, Any]) -> None:
    dev = a["device"]
    t = None
    if a["connect"]:
        t = HostBufferedPrefill(PrefillTransfer(settings("kv_producer", a["alloc"], a["fabric"], a["host_buffer"]),
                                                 0, a["num_blocks"]), a["host_buffer"], "cpu")
    kv = kv_tensors(a["layout"], a["layers"], a["num_blocks"], dev)
    if t is not None:
        t.register_kv_caches(kv)
    x = torch.rand(256, 2048, device=dev)
    w = torch.rand(2048, 2048, device=dev) / 2048
    out: Dict[str, Any] = {"start": [], "layer_ms": []}
    timer = (lambda: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))) \
        if dev == "cuda" else None
    for r in range(a["requests"]):
        n = a["blocks"]
        ids = list(range(2 * n - 1, n - 1, -1)) if r % 2 else list(range(n))
        kvx_id = f"R{r}"
        if t is not None:
            assert conn.recv() == ("reserved", r)
            t.begin(kvx_id, SECRET, f"tcp://127.0.0.1:{a['alloc']}", f"tcp://127.0.0.1:{a['fabric']}", n)
            poll_until(t, "granted", kvx_id)
        sync(dev)
        out["start"].append(time.monotonic())
        for li, (name, tensor) in enumerate(sorted(kv.items())):
            marks = timer() if timer else None
            if marks:
                marks[0].record()
            busy(x, w, a["compute_rounds"])
            if marks:
                marks[1].record()
            dim = block_dim(tensor, a["num_blocks"])
            index = torch.tensor(ids, device=dev)
            tensor.index_copy_(dim, index, expected(tensor, dim, n, r, li, dev))
            if t is not None:
                t.write_layer(kvx_id, name, tensor, 0, ids, True)
            if marks:
                out["layer_ms"].append(marks)
        if t is not None:
            t.finish(kvx_id)
            poll_until(t, "sent", kvx_id)
        sync(dev)
    if timer:
        out["layer_ms"] = [s.elapsed_time(e) for s, e in out["layer_ms"]]
    conn.send(("result", out))
    conn.recv()
    if t is not None:
        t.close()


def run_pair(a: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    ctx = mp.get_context("spawn")
    a = dict(a, alloc=free_port(), fabric=free_port())
    (d_here, d_there), (p_here, p_there) = ctx.Pipe(), ctx.Pipe()
    procs = []
    if a["connect"]:
        procs.append(ctx.Process(target=decode_side, args=(d_there, a)))
    procs.append(ctx.Process(target=prefill_side, args=(p_there, a)))
    for p in procs:
        p.start()
    try:
        if a["connect"]:
            # The decode side's messages go to the prefill side as they come.
            results: Dict[str, Any] = {}
            while len(results) < 2:
                for name, here in (("decode", d_here), ("prefill", p_here)):
                    if name in results or not here.poll(0.001):
                        continue
                    kind, body = here.recv()
                    if kind == "reserved":
                        p_here.send((kind, body))
                    else:
                        results[name] = body
            d_here.send("bye")
            p_here.send("bye")
            return results["decode"], results["prefill"]
        kind, body = p_here.recv()
        p_here.send("bye")
        return {}, body
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def copy_gbps(device: str, mib: int = 512) -> Tuple[float, float]:
    """Pinned device → host and host → device GB/s, one large copy each (best of 5)."""
    if device != "cuda":
        return float("nan"), float("nan")
    d = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    h = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    best = {"d2h": 0.0, "h2d": 0.0}
    for _ in range(5):
        for name, (dst, src) in (("d2h", (h, d)), ("h2d", (d, h))):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src, non_blocking=True)
            e.record()
            e.synchronize()
            best[name] = max(best[name], d.numel() / (s.elapsed_time(e) / 1e3) / 1e9)
    return best["d2h"], best["h2d"]


def push_gbps(decode: Dict[str, Any], prefill: Dict[str, Any], nbytes: int) -> List[float]:
    return [nbytes / (done - start) / 1e9 for start, done in zip(prefill["start"], decode["done"])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per request (default 64, 1,024 tokens)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--compute-rounds", type=int, default=4, help="matmuls per layer on the default stream")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    dev = args.device
    base = {"device": dev, "layers": args.layers, "blocks": args.blocks, "num_blocks": 2 * args.blocks,
            "requests": args.requests, "compute_rounds": args.compute_rounds}
    report: Dict[str, Any] = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                              "torch": torch.__version__, "layouts": {}}
    d2h, h2d = copy_gbps(dev)
    report["d2h_gbps"], report["h2d_gbps"] = d2h, h2d
    print(f"gpu-check: {report['device']}, torch {torch.__version__}; pinned copies alone: "
          f"D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s", flush=True)
    # The compute alone (no transfer), for the layers' time with copies running.
    _, alone = run_pair(dict(base, layout="flash-attn", connect=False, host_buffer=False))
    failed = False
    for layout in args.layouts.split(","):
        kv = kv_tensors(layout, 1, base["num_blocks"], "cpu")
        tensor = next(iter(kv.values()))
        nbytes = tensor.numel() * tensor.element_size() // 2 * args.layers  # half the blocks per request
        # The fabric alone: the same push with the KV in host memory, moved in place.
        # (HND's strided view cannot be lent in place: its bytes are FlashAttention's.)
        in_place = "flash-attn" if layout == "flash-attn-hnd" else layout
        fd, fp = run_pair(dict(base, device="cpu", layout=in_place, connect=True, host_buffer=False, compute_rounds=0))
        d, p = run_pair(dict(base, layout=layout, connect=True, host_buffer=True))
        fabric = statistics.median(push_gbps(fd, fp, nbytes))
        pipeline = statistics.median(push_gbps(d, p, nbytes))
        bound = min(x for x in (d2h, fabric, h2d) if x == x)
        row: Dict[str, Any] = {"bytes_per_request": nbytes, "differ": d["differ"] + fd["differ"],
                               "fabric_gbps": fabric, "pipeline_gbps": pipeline, "bound_gbps": bound,
                               "pipeline_to_bound": pipeline / bound}
        if alone.get("layer_ms") and p.get("layer_ms"):
            row["layer_ms_alone"] = statistics.median(alone["layer_ms"])
            row["layer_ms_with_copies"] = statistics.median(p["layer_ms"])
            row["layer_delay"] = row["layer_ms_with_copies"] / row["layer_ms_alone"] - 1
        report["layouts"][layout] = row
        failed |= bool(row["differ"])
        delay = f", a layer's compute {row['layer_delay'] * 100:+.1f} % with copies running" if "layer_delay" in row else ""
        print(f"gpu-check: {layout:15s} {nbytes / 2**20:7.1f} MiB/request, "
              f"{'every byte equal' if not row['differ'] else 'BYTES DIFFER: ' + str(row['differ'][:4])}; "
              f"fabric {fabric:.2f} GB/s, pipeline {pipeline:.2f} GB/s = {row['pipeline_to_bound']:.2f}x "
              f"the bound {bound:.2f}{delay}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print("gpu-check: " + ("FAILED: bytes differ" if failed else "passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
