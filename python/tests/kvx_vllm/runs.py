"""Runs of blocks, for the loopback transfer (``loopback.py``), which copies one run at a
time as kvx's sender writes one (``kvx_io::WriteRun``, docs/spec/fabrics.md §3 "Runs"). A
request's blocks on the prefill engine and its granted blocks on the decode engine are each
a list of block ids; wherever both lists step by one together, the blocks are contiguous in
both engines' per-layer KV tensors."""

from __future__ import annotations

from typing import List, Sequence, Tuple


def block_runs(src: Sequence[int], dst: Sequence[int]) -> List[Tuple[int, int, int]]:
    """``(src_start, dst_start, count)`` for each maximal run where ``src`` and ``dst`` both
    ascend by one; the runs cover both lists in order. ``len(src) == len(dst)``."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    runs: List[Tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs
