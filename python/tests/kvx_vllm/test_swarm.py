"""The connector's request lifecycle under seeded interleavings of two real vLLM schedulers'
steps, kvx's events, faults and aborts on either engine (``swarm``): nothing is read that the
prefill did not compute, nothing is written where it may not be, and after the faults stop
everything ends and every block is free on both engines.

``KVX_SWARM_SEEDS`` runs more seeds (CI runs the default); a failing seed is replayed alone
with ``KVX_SWARM_SEED`` and prints its events."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from kvx.vllm.version import SUPPORTED, installed_version, parse_release

VERSION = installed_version()
if VERSION is None or parse_release(VERSION) not in SUPPORTED:
    pytest.skip("vLLM 0.32 or 0.33 is not installed (scripts/vllm-tests.sh installs vllm==0.33.0)",
                allow_module_level=True)

from swarm import World  # noqa: E402

SEEDS = int(os.environ.get("KVX_SWARM_SEEDS", "300"))
ONLY = os.environ.get("KVX_SWARM_SEED")


def run_seed(seed: int) -> World:
    world = World(seed)
    try:
        world.run(events=120)
        world.heal()
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}\nevents:\n  " + "\n  ".join(world.trace[-60:])) from None
    return world


@pytest.mark.parametrize("seed", [int(ONLY)] if ONLY else range(SEEDS))
def test_no_interleaving_reads_unwritten_kv_or_leaks_a_block(seed):
    run_seed(seed)


def test_the_swarm_reaches_the_paths_it_exists_for():
    """Across the default seeds every kind of event happens, and most requests complete
    their handover: a swarm that never lands a write, never corrupts one or never aborts
    checks nothing."""
    counts: Counter = Counter()
    for seed in range(min(SEEDS, 60)):
        counts += run_seed(seed).counts
    for kind in ("step", "add", "abort", "grant", "refuse", "land", "corrupt", "deliver", "drain",
                 "drain_withdrawn", "expire", "lose_prefill"):
        assert counts[kind] > 0, (kind, counts)
    assert counts["deliver"] > counts["expire"] + counts["lose_prefill"], counts
