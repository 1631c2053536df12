"""The connector's request lifecycle searched exhaustively in small worlds (``explore``):
every interleaving of two real vLLM schedulers' steps and kvx's events, with one fault or
abort anywhere for one request under either load-failure policy, and without faults for two
requests that share a prefix block. Every reached state keeps the swarm's invariants, and
every one heals: nothing deadlocks, nothing leaks, whatever the order.

The searches are complete: a search that a bound cut short fails, as does one that stops
reaching an event it exists for."""

from __future__ import annotations

import os

import pytest

from kvx.vllm.version import SUPPORTED, installed_version, parse_release

VERSION = installed_version()
if VERSION is None or parse_release(VERSION) not in SUPPORTED:
    pytest.skip("vLLM 0.32 or 0.33 is not installed (scripts/vllm-tests.sh installs vllm==0.33.0)",
                allow_module_level=True)

from explore import Search  # noqa: E402
from swarm import BLOCK_SIZE, Shape  # noqa: E402

ONE_REQUEST = (("decode", "r0"), ("prefill", "r0"))
TWO_REQUESTS = ONE_REQUEST + (("decode", "r1"), ("prefill", "r1"))


def searched(shape: Shape, faults: int) -> Search:
    search = Search(shape, depth=100, faults=faults).run()
    print(search.summary())
    assert search.cut == 0, f"the depth bound cut the search short: {search.summary()}"
    return search


@pytest.mark.parametrize("policy,blocks", [("fail", 2), ("recompute", 1)])
def test_one_request_with_any_one_fault_or_abort_anywhere(policy, blocks):
    # Whole blocks and one token more: the last block is partial (the decode engine computes
    # that token itself, as vLLM's decode side always computes a prompt's last token).
    # Steps of one block, so the push goes in as many rounds of writes as the prefill takes
    # steps; with two whole blocks, the second round carries KV the decode engine reads.
    prompt = blocks * BLOCK_SIZE + 1
    shape = Shape(policy, False, BLOCK_SIZE, BLOCK_SIZE, (prompt,), ONE_REQUEST)
    search = searched(shape, faults=1)
    for kind in ("abort", "grant", "refuse", "land", "corrupt", "deliver", "drain",
                 "drain_withdrawn", "expire", "lose_prefill"):
        assert search.kinds.get(kind), (kind, search.summary())


def test_two_requests_sharing_a_prefix_block_in_every_order():
    # r1's first block is r0's: with prefix caching the decode engine may hold it already.
    shape = Shape("fail", True, BLOCK_SIZE, 2 * BLOCK_SIZE, (BLOCK_SIZE + 1, BLOCK_SIZE), TWO_REQUESTS)
    search = searched(shape, faults=0)
    for kind in ("grant", "land", "deliver"):
        assert search.kinds.get(kind), (kind, search.summary())


@pytest.mark.skipif(not os.environ.get("KVX_EXPLORE_LARGE"),
                    reason="about 42,500 states, 15-25 minutes on 2 cores: KVX_EXPLORE_LARGE=1 runs it")
def test_two_requests_with_any_one_fault_or_abort_anywhere():
    shape = Shape("fail", True, BLOCK_SIZE, 2 * BLOCK_SIZE, (BLOCK_SIZE + 1, BLOCK_SIZE), TWO_REQUESTS)
    search = searched(shape, faults=1)
    for kind in ("abort", "corrupt", "expire", "lose_prefill", "deliver"):
        assert search.kinds.get(kind), (kind, search.summary())
