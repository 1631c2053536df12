"""kvx.Proxy against notices pushed the way LMCache's senders push them."""

import time

import pytest

import kvx
from conftest import FailNotif, ProxyNotif, encode


def test_a_request_is_ready_once_every_rank_reported(push):
    proxy = kvx.Proxy()
    wait = proxy.expect("r1", tp_ranks=2)
    rank0, rank1 = push(proxy.endpoint), push(proxy.endpoint)
    rank0.send(encode(ProxyNotif(req_id="r1")))
    with pytest.raises(kvx.TimedOutError):
        wait.wait(timeout=0.2)
    # Each TP rank's sender pushes on a connection of its own: a second notice on rank 0's
    # is a repeat, refused, not the other rank.
    rank0.send(encode(ProxyNotif(req_id="r1")))
    with pytest.raises(kvx.TimedOutError):
        wait.wait(timeout=0.2)
    rank1.send(encode(ProxyNotif(req_id="r1")))
    wait.wait(timeout=5)
    with pytest.raises(kvx.MisuseError):
        wait.wait(timeout=0)


def test_one_connection_speaks_for_as_many_ranks_as_configured(push):
    proxy = kvx.Proxy(ranks_per_connection=2)
    assert kvx.defaults()["proxy"]["ranks_per_connection"] == 1
    wait = proxy.expect("both", tp_ranks=2)
    sock = push(proxy.endpoint)
    sock.send(encode(ProxyNotif(req_id="both")))
    sock.send(encode(ProxyNotif(req_id="both")))
    wait.wait(timeout=5)
    with pytest.raises(kvx.StartError):
        kvx.Proxy(ranks_per_connection=0)


def test_a_reported_failure_raises_refused_with_the_reason(push):
    proxy = kvx.Proxy()
    wait = proxy.expect("r2")
    push(proxy.endpoint).send(encode(FailNotif(req_id="r2", reason="refused: too large")))
    with pytest.raises(kvx.RefusedError, match="too large"):
        wait.wait(timeout=5)


def test_a_standalone_proxy_reports_outcomes_as_events(push):
    proxy = kvx.Proxy(standalone_tp_ranks=1)
    assert proxy.next_event(timeout=0.05) is None
    sock = push(proxy.endpoint)
    sock.send(encode(ProxyNotif(req_id="a")))
    sock.send(encode(FailNotif(req_id="b", reason="cancelled")))
    assert proxy.next_event(timeout=5) == ("a", None)
    req, reason = proxy.next_event(timeout=5)
    assert req == "b" and "cancelled" in reason


def test_kv_ready_timeout_fails_the_wait():
    proxy = kvx.Proxy(kv_ready_timeout=0.2)
    wait = proxy.expect("slow")
    started = time.monotonic()
    with pytest.raises(kvx.TimedOutError, match="kv_ready_timeout"):
        wait.wait(timeout=5)
    assert time.monotonic() - started < 3


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="timeout"):
        kvx.Proxy().expect("x").wait(timeout=-1)
    with pytest.raises(kvx.StartError):
        kvx.Proxy("not an endpoint")
    with pytest.raises(kvx.MisuseError):
        kvx.Proxy().expect("x", tp_ranks=0)
