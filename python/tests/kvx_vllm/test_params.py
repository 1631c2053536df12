"""kvx.vllm's kv_transfer_params contract and block runs: no vLLM needed."""

from __future__ import annotations

import pytest

from kvx.vllm import params
from kvx.vllm.params import ParamsError, RemoteDecode, RemotePrefill, parse
from runs import block_runs


def test_round_trip():
    assert parse(params.for_decode("x1")) == RemotePrefill("x1")
    p = params.for_prefill("x1", ["tcp://d:8400", "tcp://d:8401"], ["tcp://d:8300", "tcp://d:8301"])
    assert parse(p) == RemoteDecode("x1", ("tcp://d:8400", "tcp://d:8401"), ("tcp://d:8300", "tcp://d:8301"))


@pytest.mark.parametrize("value", [None, {}, {"other": 1}, {"do_remote_prefill": False}])
def test_no_transfer(value):
    assert parse(value) is None


@pytest.mark.parametrize(
    "value,key",
    [
        ({"do_remote_prefill": True}, "kvx_request_id"),
        ({"do_remote_prefill": True, "kvx_request_id": ""}, "kvx_request_id"),
        ({"do_remote_prefill": True, "kvx_request_id": "x" * 513}, "kvx_request_id"),
        ({"do_remote_decode": True, "kvx_request_id": "x"}, "kvx_decode_alloc"),
        (
            {"do_remote_decode": True, "kvx_request_id": "x", "kvx_decode_alloc": ["d:1"], "kvx_decode_fabric": ["tcp://d:2"]},
            "kvx_decode_alloc",
        ),
        (
            {"do_remote_decode": True, "kvx_request_id": "x", "kvx_decode_alloc": ["tcp://d:1"], "kvx_decode_fabric": []},
            "kvx_decode_fabric",
        ),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "together"),
    ],
)
def test_malformed(value, key):
    with pytest.raises(ParamsError, match=key):
        parse(value)


def test_mismatched_rank_counts():
    value = params.for_prefill("x", ["tcp://d:1", "tcp://d:2"], ["tcp://d:3"])
    with pytest.raises(ParamsError, match="one of each per decode TP rank"):
        parse(value)


def test_block_runs():
    assert block_runs([], []) == []
    assert block_runs([4, 5, 6], [10, 11, 12]) == [(4, 10, 3)]
    # A break on either side starts a new run.
    assert block_runs([4, 5, 9, 10], [10, 11, 12, 13]) == [(4, 10, 2), (9, 12, 2)]
    assert block_runs([4, 5, 6], [10, 20, 21]) == [(4, 10, 1), (5, 20, 2)]
    with pytest.raises(ValueError):
        block_runs([1], [])
