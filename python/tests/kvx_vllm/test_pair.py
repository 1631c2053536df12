"""A decode engine and a prefill engine, each vLLM 0.33.0's real ``Scheduler`` with a
``KvxConnector``, joined by an in-process stand-in for kvx (``loopback``): the decode-first
handover end to end at the scheduler level, every byte of the pushed KV compared."""

from __future__ import annotations

import pytest

from kvx.vllm.version import SUPPORTED, installed_version, parse_release

VERSION = installed_version()
if VERSION is None or parse_release(VERSION) not in SUPPORTED:
    pytest.skip("vLLM 0.32 or 0.33 is not installed (scripts/vllm-tests.sh installs vllm==0.33.0)",
                allow_module_level=True)

import torch  # noqa: E402
from loopback import DecodeEnd, Hub, PrefillEnd  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import BLOCK_SIZE, LAYERS, Engine  # noqa: E402

from kvx.vllm import params  # noqa: E402

PROMPT = 3 * BLOCK_SIZE + 5  # four blocks, the last partial


def pair(**prefill_kwargs):
    hub = Hub()
    decode = Engine("kv_consumer", transfer=DecodeEnd(hub))
    prefill = Engine("kv_producer", transfer=PrefillEnd(hub), **prefill_kwargs)
    gen = torch.Generator().manual_seed(7)
    for tensor in prefill.kv_caches.values():  # the "computed" KV the prefill engine holds
        tensor.copy_(torch.rand(tensor.shape, generator=gen))
    return hub, decode, prefill


def blocks(engine, req_id):
    (ids,) = engine.scheduler.kv_cache_manager.get_block_ids(req_id)
    return list(ids)


def run_until(predicate, *engines, steps=20):
    for _ in range(steps):
        for engine in engines:
            engine.step()
        if predicate():
            return
    raise AssertionError("not reached")


@pytest.mark.parametrize("decode_first", [True, False])
def test_the_decode_engine_runs_on_the_prefill_engines_kv_byte_for_byte(decode_first):
    hub, decode, prefill = pair(max_batched_tokens=2 * BLOCK_SIZE)  # chunked: two steps
    add_decode = lambda: decode.add("d1", PROMPT, params.for_decode("X", "secret-0123456789abcdef"))  # noqa: E731
    add_prefill = lambda: prefill.add(  # noqa: E731
        "p1", PROMPT, params.for_prefill("X", "secret-0123456789abcdef", ["tcp://d:8400"], ["tcp://d:8300"]), max_tokens=1
    )
    first, second = (add_decode, add_prefill) if decode_first else (add_prefill, add_decode)
    first()
    (decode if decode_first else prefill).step()
    (decode if decode_first else prefill).step()
    second()
    p_blocks: list = []
    for _ in range(20):
        prefill.step()
        if "p1" in prefill.scheduler.requests and len(blocks(prefill, "p1")) > len(p_blocks):
            p_blocks = blocks(prefill, "p1")  # the prefill's blocks, while it holds them
        decode.step()
        if decode.status("d1") == "RUNNING":
            break
    assert decode.status("d1") == "RUNNING"
    d_blocks = blocks(decode, "d1")
    assert len(p_blocks) == 4 and len(d_blocks) >= 4
    for name in LAYERS:
        for d, p in zip(d_blocks[:4], p_blocks):
            assert torch.equal(decode.kv_caches[name][d], prefill.kv_caches[name][p]), (name, d, p)
    # Two chunks of two blocks each, one run per layer per chunk.
    assert len(hub.writes) == 2 * len(LAYERS)
    run_until(lambda: "d1" not in decode.scheduler.requests and "p1" not in prefill.scheduler.requests,
              prefill, decode)
    assert decode.finished_outputs() == {"d1": "length"}
    assert decode.free_blocks() == prefill.free_blocks() == 63  # every block back, both sides
    assert not hub.reserved and not hub.claimed


def test_a_decode_abort_while_reserved_refuses_nothing_late_and_frees_both_sides():
    hub, decode, prefill = pair()
    decode.add("d1", PROMPT, params.for_decode("X", "secret-0123456789abcdef"))
    decode.step()
    d_free = decode.free_blocks() + 4
    decode.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    prefill.add("p1", PROMPT, params.for_prefill("X", "secret-0123456789abcdef", ["tcp://d:8400"], ["tcp://d:8300"]), max_tokens=1)
    for _ in range(4):
        decode.step()
        prefill.step()
    assert decode.free_blocks() == d_free
    assert hub.writes == []  # the claim was refused: nothing written into freed blocks
    assert "p1" not in prefill.scheduler.requests  # it ran without a push and finished
    assert not prefill.connector.has_pending_push_work()
