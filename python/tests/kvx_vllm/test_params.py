"""kvx.vllm's kv_transfer_params contract and block runs: no vLLM needed."""

from __future__ import annotations

import pytest

from kvx.vllm import params
from kvx.vllm.params import ParamsError, RemoteDecode, RemotePrefill, parse
from runs import block_runs


SECRET = "secret-0123456789abcdef"


def test_round_trip():
    assert parse(params.for_decode("x1", SECRET)) == RemotePrefill("x1", SECRET)
    p = params.for_prefill("x1", SECRET, ["tcp://d:8400", "tcp://d:8401"], ["tcp://d:8300", "tcp://d:8301"])
    assert parse(p) == RemoteDecode(
        "x1", SECRET, ("tcp://d:8400", "tcp://d:8401"), ("tcp://d:8300", "tcp://d:8301")
    )
    assert SECRET not in repr(parse(p)), "the secret is never printed"


def test_each_request_gets_a_fresh_secret_that_params_accept():
    drawn = {params.new_claim_secret() for _ in range(100)}
    assert len(drawn) == 100
    for s in drawn:
        assert parse(params.for_decode("x", s)) == RemotePrefill("x", s)


@pytest.mark.parametrize("secret", [None, "", "short", "x" * 129, "has a space in it"])
def test_a_missing_or_malformed_claim_secret_is_refused_without_repeating_it(secret):
    value = {"do_remote_prefill": True, "kvx_request_id": "x", "kvx_claim_secret": secret}
    with pytest.raises(ParamsError, match="kvx_claim_secret") as caught:
        parse(value)
    assert not secret or secret not in str(caught.value)


@pytest.mark.parametrize("value", [None, {}, {"other": 1}, {"do_remote_prefill": False}])
def test_no_transfer(value):
    assert parse(value) is None


@pytest.mark.parametrize(
    "value,key",
    [
        ({"do_remote_prefill": True}, "kvx_request_id"),
        ({"do_remote_prefill": True, "kvx_request_id": ""}, "kvx_request_id"),
        ({"do_remote_prefill": True, "kvx_request_id": "x" * 513}, "kvx_request_id"),
        ({"do_remote_decode": True, "kvx_request_id": "x", "kvx_claim_secret": "s" * 16}, "kvx_decode_alloc"),
        (
            {"do_remote_decode": True, "kvx_request_id": "x", "kvx_claim_secret": "s" * 16,
             "kvx_decode_alloc": ["d:1"], "kvx_decode_fabric": ["tcp://d:2"]},
            "kvx_decode_alloc",
        ),
        (
            {"do_remote_decode": True, "kvx_request_id": "x", "kvx_claim_secret": "s" * 16,
             "kvx_decode_alloc": ["tcp://d:1"], "kvx_decode_fabric": []},
            "kvx_decode_fabric",
        ),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "together"),
    ],
)
def test_malformed(value, key):
    with pytest.raises(ParamsError, match=key):
        parse(value)


def test_mismatched_rank_counts():
    value = params.for_prefill("x", SECRET, ["tcp://d:1", "tcp://d:2"], ["tcp://d:3"])
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
