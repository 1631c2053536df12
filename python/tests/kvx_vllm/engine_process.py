"""One engine's connector worker side in a process of its own, for the worker-level tests
(``test_two_processes.py``): the worker side (``worker_for``) over kvx's real transfer (``transfer_for``), with
NumPy arrays as the engine's per-layer paged KV, driven line by line over stdin/stdout in
JSON. No vLLM needed.

    python engine_process.py ROLE EXTRA_JSON SEED [--corrupt-writes]

ROLE is ``kv_consumer`` (decode: KV starts zeroed) or ``kv_producer`` (prefill: KV drawn
from SEED). Commands, one JSON object a line, each answered by one:

- ``{"op": "step", "plan": {...}, "finished": [...], "forward": true}``: one engine step in
  the model runner's order (bind, save_kv_layer per layer, wait_for_save, get_finished,
  get_block_ids_with_load_errors, worker metadata, the transfer's counts); answers ``sent``,
  ``received``, ``errors``, ``granted``, ``refused``, ``counts``.
- ``{"op": "blocks", "ids": [...]}``: those blocks of every layer, base64, layer by layer.
- ``{"op": "exit"}``: shuts the worker down.

``--corrupt-writes`` flips one byte of every staged page after kvx checksummed it (and
before it is written): a write that goes wrong in between.
"""

from __future__ import annotations

import base64
import json
import sys
import types
from typing import Any, Dict

import numpy as np

from kvx.testing import corrupting_sender
from kvx.vllm.kvx_transfer import PrefillTransfer, transfer_for
from kvx.vllm.plan import Begin, Push, Release, Reserve, StepPlan
from kvx.vllm.settings import settings_from
from kvx.vllm.worker import worker_for

LAYERS = 3
BLOCKS = 16
#: One block of one layer: [heads, tokens, 2 x head size], as vLLM's CPU backend lays it out.
BLOCK_SHAPE = (2, 4, 16)


def layer_names():
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def claim_secret(kvx_id: str) -> str:
    """The claim secret the tests' router would hand both engines for ``kvx_id``."""
    return f"secret-of-{kvx_id}-0123456789"


def plan_of(d: Dict[str, Any]) -> StepPlan:
    """A step plan from JSON lists; a ``begin`` may name its claim secret sixth (a forged
    claim), else both sides use ``claim_secret(kvx_id)``."""
    return StepPlan(
        reserve=[
            Reserve(r[0], r[1], claim_secret(r[1]), r[2], tuple(r[3]), r[4]) for r in d.get("reserve", [])
        ],
        release=[Release(r[0], r[1], r[2]) for r in d.get("release", [])],
        begin=[
            Begin(b[0], b[1], b[5] if len(b) > 5 else claim_secret(b[1]), tuple(b[2]), tuple(b[3]), b[4])
            for b in d.get("begin", [])
        ],
        push=[Push(p[0], p[1], p[2], tuple(p[3]), p[4]) for p in d.get("push", [])],
        cancel=list(d.get("cancel", [])),
    )


def main() -> None:
    role, extra, seed = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    corrupt = "--corrupt-writes" in sys.argv[4:]
    settings = settings_from(types.SimpleNamespace(kv_role=role, engine_id=role, kv_connector_extra_config=extra))
    rng = np.random.default_rng(seed)
    kv = {
        name: (
            np.zeros((BLOCKS, *BLOCK_SHAPE), np.float32)
            if role == "kv_consumer"
            else rng.standard_normal((BLOCKS, *BLOCK_SHAPE)).astype(np.float32)
        )
        for name in layer_names()
    }
    if corrupt:
        transfer: Any = PrefillTransfer(
            settings, 0, BLOCKS, sender_factory=corrupting_sender, copy_staging=True
        )
    else:
        transfer = transfer_for(settings, 0, BLOCKS)
    worker = worker_for(settings.side, transfer)
    worker.register_kv_caches(kv)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "blocks":
            out = [base64.b64encode(kv[name][cmd["ids"]].tobytes()).decode() for name in layer_names()]
            print(json.dumps({"layers": out}), flush=True)
            continue
        worker.bind(plan_of(cmd.get("plan", {})))
        if cmd.get("forward", False):
            for name in layer_names():
                worker.save_kv_layer(name, kv[name])
        worker.wait_for_save()
        sent, received = worker.get_finished(set(cmd.get("finished", [])))
        errors = worker.get_block_ids_with_load_errors()
        report = worker.take_report()
        counts = worker.take_counts()
        worker.clear()
        print(json.dumps({
            "counts": counts,
            "sent": sorted(sent), "received": sorted(received), "errors": sorted(errors),
            "granted": dict(report.granted) if report else {},
            "refused": dict(report.refused) if report else {},
        }), flush=True)
    worker.shutdown()


if __name__ == "__main__":
    main()
