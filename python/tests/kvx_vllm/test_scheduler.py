"""Level (a): ``KvxConnector`` in vLLM's real v1 ``Scheduler`` (vllm==0.33.0, CPU), built by
vLLM's connector factory from ``kv_connector_module_path: kvx.vllm``, with fake model
outputs and a worker-side connector over a fake transfer (``vllm_harness``). Skipped when
vLLM is not installed (``scripts/vllm-tests.sh`` installs it)."""

from __future__ import annotations

import pytest

from kvx.vllm.version import SUPPORTED, installed_version, parse_release  # noqa: E402

# By distribution (package metadata), so that the skip reason names the version found.
VERSION = installed_version()
if VERSION is None:
    pytest.skip("vLLM is not installed (scripts/vllm-tests.sh installs vllm==0.33.0)", allow_module_level=True)
if parse_release(VERSION) not in SUPPORTED:
    pytest.skip(f"vLLM {VERSION} is not one KvxConnector supports", allow_module_level=True)

from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import BLOCK_SIZE, LAYERS, Engine  # noqa: E402

from kvx.vllm import params  # noqa: E402

PROMPT = 40  # three blocks of 16: two full, one partial
ALLOC = ["tcp://10.0.0.2:8400"]
FABRIC = ["tcp://10.0.0.2:8300"]


def decode_params(kvx_id: str) -> dict:
    return params.for_decode(kvx_id, "secret-0123456789abcdef")


def prefill_params(kvx_id: str) -> dict:
    return params.for_prefill(kvx_id, "secret-0123456789abcdef", ALLOC, FABRIC)


def req_blocks(engine: Engine, req_id: str) -> list:
    (ids,) = engine.scheduler.kv_cache_manager.get_block_ids(req_id)
    return list(ids)


# ---- decode engine (kv_consumer) -------------------------------------------------------


def test_the_factory_builds_kvx_connector_from_the_module_path():
    engine = Engine("kv_consumer")
    assert type(engine.scheduler.connector).__name__ == "KvxConnector"
    assert engine.connector.settings.side == "decode"


def test_decode_waits_for_remote_kv_and_runs_once_it_is_received():
    engine = Engine("kv_consumer")
    free = engine.free_blocks()
    engine.add("r1", PROMPT, decode_params("k1"))
    so = engine.step()
    assert engine.status("r1") == "WAITING_FOR_REMOTE_KVS"
    assert so.num_scheduled_tokens == {}
    # The allocation is the reservation: exactly the request's blocks, all three.
    blocks = req_blocks(engine, "r1")
    assert engine.transfer.named("reserve") == [("reserve", "k1", 0, tuple(blocks), PROMPT)]
    assert free - engine.free_blocks() == 3
    for _ in range(3):  # nothing arrives: it keeps waiting, its blocks held
        engine.step()
        assert engine.status("r1") == "WAITING_FOR_REMOTE_KVS"
    engine.transfer.complete("k1")
    engine.step()  # the worker reports it received
    so = engine.step()  # the scheduler promotes it and runs the last prompt token
    assert engine.status("r1") == "RUNNING"
    assert so.num_scheduled_tokens == {"r1": 1}
    assert engine.scheduler.requests["r1"].num_computed_tokens == PROMPT
    for _ in range(6):
        engine.step()
    assert engine.finished_outputs() == {"r1": "length"}
    assert engine.free_blocks() == free
    assert not engine.connector._decode.reserved and not engine.connector._decode.loaded


def test_decode_reserves_only_blocks_past_a_local_prefix_hit():
    engine = Engine("kv_consumer", prefix_caching=True)
    engine.add("warm", 2 * BLOCK_SIZE + 4, None, max_tokens=1)
    for _ in range(3):
        engine.step()
    engine.add("r1", PROMPT, decode_params("k1"))
    engine.step()
    (reserve,) = engine.transfer.named("reserve")
    _, kvx_id, first_block, block_ids, num_tokens = reserve
    assert (kvx_id, first_block, num_tokens) == ("k1", 2, PROMPT)
    assert block_ids == tuple(req_blocks(engine, "r1")[2:])


def test_decode_abort_while_waiting_frees_blocks_only_once_the_reservation_is_withdrawn():
    engine = Engine("kv_consumer")
    free = engine.free_blocks()
    engine.add("r1", PROMPT, decode_params("k1"))
    engine.step()
    engine.scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    # vLLM keeps the blocks of a request waiting for remote KV until the connector reports it.
    assert engine.free_blocks() == free - 3
    engine.step()  # the plan withdraws the reservation; the transfer reports it quiesced
    assert ("release", "k1", True) in engine.transfer.calls
    assert engine.free_blocks() == free
    assert "r1" not in engine.scheduler.requests
    assert not engine.connector._decode.reserved and not engine.connector._decode.released


def test_decode_abort_before_allocation_releases_the_kvx_id():
    engine = Engine("kv_consumer", num_blocks=4)  # 3 usable blocks
    engine.add("big", 3 * BLOCK_SIZE, None, max_tokens=8)
    engine.step()
    engine.add("r1", PROMPT, decode_params("k1"))  # cannot be allocated while "big" runs
    engine.step()
    assert engine.status("r1") == "WAITING"
    engine.scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    engine.step()
    assert engine.transfer.named("reserve") == []
    assert ("release", "k1", False) in engine.transfer.calls


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_decode_load_error_applies_vllms_failure_policy(policy):
    engine = Engine("kv_consumer", failure_policy=policy)
    free = engine.free_blocks()
    engine.add("r1", PROMPT, decode_params("k1"))
    engine.step()
    engine.transfer.fail("k1", "chunk 2 failed its checksum")
    engine.step()
    if policy == "fail":
        assert engine.finished_outputs() == {"r1": "error"}
        assert "r1" not in engine.scheduler.requests
        assert engine.free_blocks() == free
    else:
        so = engine.step()  # recomputed locally: the whole prompt, never the failed KV
        assert engine.status("r1") == "RUNNING"
        assert so.num_scheduled_tokens == {"r1": PROMPT}
        for _ in range(6):
            engine.step()
        assert engine.finished_outputs() == {"r1": "length"}
        assert engine.free_blocks() == free
        # It was loaded (and failed) once: after that, kvx is never asked again.
        assert len(engine.transfer.named("reserve")) == 1


def test_malformed_params_run_the_request_locally():
    engine = Engine("kv_consumer")
    engine.add("r1", PROMPT, {"do_remote_prefill": True})  # no kvx_request_id
    so = engine.step()
    assert so.num_scheduled_tokens == {"r1": PROMPT}
    assert engine.transfer.named("reserve") == []


# ---- prefill engine (kv_producer) ------------------------------------------------------


def granted_prefill(max_batched_tokens: int = 2048) -> Engine:
    engine = Engine("kv_producer", max_batched_tokens=max_batched_tokens)
    engine.add("p1", PROMPT, prefill_params("k1"), max_tokens=1)
    so = engine.step()
    assert so.num_scheduled_tokens == {}, "a prefill must not run before its grant"
    assert engine.transfer.named("begin") == [("begin", "k1", ALLOC[0], FABRIC[0])]
    engine.transfer.grant("k1")
    return engine


def test_prefill_waits_for_its_grant_then_pushes_every_layer_as_one_run():
    engine = Engine("kv_producer")
    engine.add("p1", PROMPT, prefill_params("k1"), max_tokens=1)
    engine.add("local", PROMPT, None, max_tokens=1)
    so = engine.step()
    assert so.num_scheduled_tokens == {"local": PROMPT}  # others are not held back
    for _ in range(2):
        assert engine.step().num_scheduled_tokens == {}
    engine.transfer.grant("k1")
    engine.step()  # the grant reaches the scheduler
    so = engine.step()
    assert so.num_scheduled_tokens == {"p1": PROMPT}
    blocks = tuple(req_blocks(engine, "p1"))
    # One write per layer: the three blocks are one run here.
    assert engine.transfer.named("write") == [("write", "k1", name, 0, blocks) for name in LAYERS]
    assert engine.transfer.named("finish") == [("finish", "k1")]


def test_prefill_holds_its_blocks_after_finishing_until_the_push_is_delivered():
    engine = granted_prefill()
    free = engine.free_blocks()
    engine.step()
    engine.step()  # computes the prompt, samples its one token, finishes
    assert engine.finished_outputs() == {"p1": "length"}
    assert engine.free_blocks() == free - 3
    assert engine.connector.has_pending_push_work()
    for _ in range(3):
        engine.step()
        assert engine.free_blocks() == free - 3
    engine.transfer.deliver("k1")
    engine.step()
    assert engine.free_blocks() == free
    assert not engine.connector.has_pending_push_work()
    assert "p1" not in engine.scheduler.requests


def test_prefill_chunked_pushes_blocks_as_each_step_completes_them():
    engine = granted_prefill(max_batched_tokens=BLOCK_SIZE + 8)  # 24 tokens a step
    engine.step()  # the grant reaches the scheduler
    assert engine.step().num_scheduled_tokens == {"p1": 24}
    assert engine.step().num_scheduled_tokens == {"p1": 16}
    assert engine.finished_outputs() == {"p1": "length"}
    blocks = tuple(req_blocks(engine, "p1"))  # still allocated: the push is not delivered
    assert len(blocks) == 3
    engine.step()
    writes = engine.transfer.named("write")
    # Step 1 computes tokens 0..24: block 0 complete. Step 2, 24..40: blocks 1 and 2 (the
    # partial last one with the prompt's end).
    assert [w[3:] for w in writes] == [(0, blocks[:1])] * 2 + [(1, blocks[1:])] * 2
    assert engine.transfer.named("finish") == [("finish", "k1")]


def test_prefill_abort_after_pushes_began_cancels_and_holds_blocks_until_drained():
    engine = granted_prefill(max_batched_tokens=BLOCK_SIZE + 8)
    free = engine.free_blocks()
    engine.step()
    engine.step()  # first chunk pushed
    assert len(engine.transfer.named("write")) == len(LAYERS)
    engine.scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    assert engine.free_blocks() < free  # a posted write may still read them
    engine.step()
    assert ("cancel", "k1") in engine.transfer.calls
    engine.step()
    assert engine.free_blocks() == free
    assert "p1" not in engine.scheduler.requests


def test_prefill_abort_while_claiming_cancels_and_frees_at_once():
    engine = Engine("kv_producer")
    engine.add("p1", PROMPT, prefill_params("k1"), max_tokens=1)
    engine.step()
    engine.scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    engine.step()
    assert ("cancel", "k1") in engine.transfer.calls
    assert "p1" not in engine.scheduler.requests
    assert not engine.connector.has_pending_push_work()


def test_prefill_abort_after_the_grant_before_it_ran_cancels_and_frees_at_once():
    engine = granted_prefill()
    free = engine.free_blocks()
    engine.step()  # the grant reaches the scheduler; the request runs from the next step
    assert engine.connector._prefill.granted
    engine.scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    engine.step()
    assert ("cancel", "k1") in engine.transfer.calls  # the decode engine's grant is let go
    assert "p1" not in engine.scheduler.requests and engine.free_blocks() >= free
    engine.transfer.deliver("k1")  # the cancelled push's end: vLLM no longer knows p1
    engine.step()  # vLLM's scheduler asserts on a finished_sending it does not know
    assert not engine.connector.has_pending_push_work()


def finished_params(engine: Engine, req_id: str):
    """The kv_transfer_params of ``req_id``'s finished output (what vLLM's server answers
    with)."""
    for out in engine.outputs:
        for engine_outputs in out.values():
            for o in engine_outputs.outputs:
                if o.request_id == req_id and o.finish_reason is not None:
                    return o.kv_transfer_params
    raise AssertionError(f"{req_id} has not finished")


def test_prefill_refused_runs_without_a_push_and_its_answer_says_why():
    engine = Engine("kv_producer")
    engine.add("p1", PROMPT, prefill_params("k1"), max_tokens=1)
    engine.step()
    engine.transfer.refuse("k1", "request already ended")
    engine.step()
    free = engine.free_blocks()
    so = engine.step()
    assert so.num_scheduled_tokens == {"p1": PROMPT}
    engine.step()
    assert engine.transfer.named("write") == []
    assert "p1" not in engine.scheduler.requests
    assert engine.free_blocks() == free + 0 and not engine.connector.has_pending_push_work()
    # For the router, which hands it to its client.
    assert finished_params(engine, "p1") == {"kvx_request_id": "k1", "kvx_error": "request already ended"}


def test_prefill_without_a_grant_in_time_runs_without_a_push():
    engine = Engine("kv_producer", extra={"grant_timeout_sec": 5})
    now = [1000.0]
    engine.connector._prefill.clock = lambda: now[0]
    engine.add("p1", PROMPT, prefill_params("k1"), max_tokens=1)
    assert engine.step().num_scheduled_tokens == {}
    now[0] += 6
    assert engine.step().num_scheduled_tokens == {"p1": PROMPT}
    assert ("cancel", "k1") in engine.transfer.calls
    assert engine.transfer.named("write") == []
    engine.step()
    assert "grant_timeout_sec" in finished_params(engine, "p1")["kvx_error"]


def test_prefill_with_two_tp_ranks_waits_for_both_grants():
    engine = Engine("kv_producer")
    engine.connector._prefill.tp_size = 2
    engine.add("p1", PROMPT, prefill_params("k1"), max_tokens=1)
    engine.step()
    engine.transfer.grant("k1")  # one rank only
    for _ in range(3):
        assert engine.step().num_scheduled_tokens == {}
    engine.transfer.grant("k1")  # the second rank
    engine.step()
    assert engine.step().num_scheduled_tokens == {"p1": PROMPT}


# ---- as a child of vLLM's MultiConnector -----------------------------------------------


def test_as_a_multiconnector_child_decode_waits_and_runs():
    engine = Engine("kv_consumer", multi=True)
    assert type(engine.scheduler.connector).__name__ == "MultiConnector"
    engine.add("r1", PROMPT, decode_params("k1"))
    engine.step()
    assert engine.status("r1") == "WAITING_FOR_REMOTE_KVS"
    engine.transfer.complete("k1")
    engine.step()
    assert engine.step().num_scheduled_tokens == {"r1": 1}


def test_as_a_multiconnector_child_prefill_gets_its_grant_and_pushes():
    engine = Engine("kv_producer", multi=True)
    free = engine.free_blocks()
    engine.add("p1", PROMPT, prefill_params("k1"), max_tokens=1)
    assert engine.step().num_scheduled_tokens == {}
    engine.transfer.grant("k1")  # reaches the scheduler through MultiConnector's worker metadata
    engine.step()
    assert engine.step().num_scheduled_tokens == {"p1": PROMPT}
    assert len(engine.transfer.named("write")) == len(LAYERS)
    engine.transfer.deliver("k1")
    engine.step()
    assert engine.free_blocks() == free
