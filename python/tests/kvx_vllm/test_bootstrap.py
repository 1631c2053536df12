"""llm-d's P/D protocol engine to engine (``kvx.vllm.bootstrap``): the parameters llm-d's
routing sidecar puts on each leg, the prefill engine's bootstrap server over real HTTP on
loopback, the decode engine's registrar against it, and both scheduler sides driven by it.
No vLLM needed."""

from __future__ import annotations

import http.client
import json
import socket
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import pytest

from kvx.vllm import params
from kvx.vllm.bootstrap import (
    CANCELLED,
    RESERVATIONS,
    SECRET_HEADER,
    BootstrapServer,
    Registration,
    Registrations,
)
from kvx.vllm.registrar import Registrar
from kvx.vllm.params import AwaitRegistration, Bootstrap, ParamsError, RemotePrefill, parse
from kvx.vllm.scheduler import DecodeScheduler, PrefillScheduler
from kvx.testing import free_port

SECRET = "s" * 32
ALLOC, FABRIC = ("tcp://10.0.0.2:8400",), ("tcp://10.0.0.2:8300",)
ENGINE = "kvx-prefill-8998"


def sidecar_decode(transfer_id: str, addr: str = "http://10.0.0.1:8998") -> Dict[str, Any]:
    """The decode leg's kv_transfer_params, as llm-d-router's mooncake connector builds them."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
            "remote_bootstrap_addr": addr, "remote_engine_id": ENGINE}


def sidecar_prefill(transfer_id: str) -> Dict[str, Any]:
    return {"do_remote_prefill": False, "do_remote_decode": True, "transfer_id": transfer_id}


# ---- parameters ------------------------------------------------------------------------


def test_the_sidecars_legs_are_read():
    assert parse(sidecar_decode("xfer-1")) == RemotePrefill(
        "xfer-1", None, Bootstrap("http://10.0.0.1:8998", ENGINE))
    assert parse(sidecar_prefill("xfer-1")) == AwaitRegistration("xfer-1")
    # kvx's router's shape is unchanged beside it.
    assert parse(params.for_decode("k", SECRET)) == RemotePrefill("k", SECRET)


@pytest.mark.parametrize("key,value", [("remote_bootstrap_addr", None), ("remote_bootstrap_addr", "10.0.0.1:8998"),
                                       ("remote_engine_id", ""), ("transfer_id", ""), ("transfer_id", "x" * 600)])
def test_a_malformed_decode_leg_names_the_key(key, value):
    with pytest.raises(ParamsError, match=key):
        parse({**sidecar_decode("xfer-1"), key: value})


# ---- the registrations table -----------------------------------------------------------


def reg(secret: str = SECRET) -> Registration:
    return Registration(secret, ALLOC, FABRIC)


def test_registrations_first_wins_and_a_retry_is_accepted():
    r = Registrations()
    assert r.put("t", reg()) is None
    assert r.put("t", reg()) is None  # the same registration again
    assert r.put("t", reg("o" * 32))[0] == 409
    assert r.take("t") == reg() and r.take("t") is None


def test_registrations_are_bounded_and_expire():
    now = [0.0]
    r = Registrations(capacity=2, ttl_sec=10, clock=lambda: now[0])
    assert r.put("a", reg()) is None and r.put("b", reg()) is None
    assert r.put("c", reg())[0] == 503
    now[0] = 10.5
    assert r.put("c", reg()) is None and len(r) == 1 and r.take("a") is None


def test_only_the_registrations_secret_cancels_it():
    r = Registrations()
    assert r.cancel("t", SECRET)[0] == 404
    r.put("t", reg())
    assert r.cancel("t", "o" * 32)[0] == 403
    assert r.cancel("t", SECRET) is None
    assert r.take("t") is CANCELLED


# ---- the bootstrap server, over HTTP ---------------------------------------------------


@pytest.fixture
def server():
    s = BootstrapServer(Registrations(), "127.0.0.1", free_port(), ENGINE)
    yield s
    s.close()


def call(port: int, method: str, path: str, body: Any = None, headers: Optional[Dict[str, str]] = None,
         raw: Optional[bytes] = None) -> Tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = r.status, json.loads(r.read() or b"null")
    conn.close()
    return out


def registration(transfer_id: str = "xfer-1", **over: Any) -> Dict[str, Any]:
    return {"transfer_id": transfer_id, "engine_id": ENGINE, "claim_secret": SECRET,
            "decode_alloc": list(ALLOC), "decode_fabric": list(FABRIC), **over}


def test_query_answers_as_the_sidecar_reads_it(server):
    status, body = call(server.port, "GET", "/query")
    # llm-d-router: every top-level value an object with a string engine_id.
    assert status == 200 and set(body) == {"0"} and body["0"]["engine_id"] == ENGINE
    assert all(isinstance(v, dict) for v in body.values())


def test_a_registration_is_taken_by_the_scheduler_and_cancelled_by_its_secret(server):
    assert call(server.port, "POST", RESERVATIONS, registration()) == (201, {"status": "registered",
                                                                            "instance": server.instance})
    assert call(server.port, "POST", RESERVATIONS, registration(claim_secret="o" * 32))[0] == 409
    assert call(server.port, "DELETE", RESERVATIONS + "/xfer-1", headers={SECRET_HEADER: "o" * 32})[0] == 403
    assert call(server.port, "DELETE", RESERVATIONS + "/xfer-1", headers={SECRET_HEADER: SECRET})[0] == 200
    assert server.registrations.take("xfer-1") is CANCELLED
    call(server.port, "POST", RESERVATIONS, registration("xfer-2"))
    assert server.registrations.take("xfer-2") == reg()


@pytest.mark.parametrize("body,status,says", [
    (registration(engine_id="another"), 404, "engine_id"),
    (registration(claim_secret="short"), 400, "claim_secret"),
    (registration(decode_alloc=["http://x"]), 400, "decode_alloc"),
    (registration(decode_fabric=list(FABRIC) * 2), 400, "one of each"),
    (registration(transfer_id=7), 400, "transfer_id"),
    ([1, 2], 400, "object"),
])
def test_bad_registrations_are_refused_with_the_reason(server, body, status, says):
    got, answer = call(server.port, "POST", RESERVATIONS, body)
    assert got == status and says in answer["error"]
    assert len(server.registrations) == 0


def test_bodies_that_are_not_json_or_too_large_are_refused(server):
    assert call(server.port, "POST", RESERVATIONS, raw=b"{not json")[0] == 400
    assert call(server.port, "POST", RESERVATIONS, raw=b"x" * (17 * 1024))[0] == 413
    assert call(server.port, "GET", "/kvx/v1/reservations")[0] == 404
    # The server still answers.
    assert call(server.port, "GET", "/query")[0] == 200


def test_registrations_from_outside_the_allowed_networks_are_refused():
    s = BootstrapServer(Registrations(), "127.0.0.1", free_port(), ENGINE, allow=["10.0.0.0/8"])
    try:
        assert call(s.port, "POST", RESERVATIONS, registration())[0] == 403
        assert call(s.port, "GET", "/query")[0] == 200  # the sidecar's read is not a right
    finally:
        s.close()
    with pytest.raises(ValueError, match="bootstrap_allow"):
        BootstrapServer(Registrations(), "127.0.0.1", 0, ENGINE, allow=["not-a-network"])


# ---- the registrar -----------------------------------------------------------------------


def wait_for(predicate: Any, bound: float = 10.0) -> None:
    deadline = time.monotonic() + bound
    while not predicate():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.01)


def test_the_registrar_registers_then_cancels(server):
    boot = Bootstrap(f"http://127.0.0.1:{server.port}", ENGINE)
    r = Registrar(timeout_sec=5)
    r.register("r1", boot, "xfer-9", SECRET, ALLOC, FABRIC)
    r.cancel("r1", boot, "xfer-9", SECRET)  # sent after the registration, never before
    r.close(wait=True)
    assert server.registrations.take("xfer-9") is CANCELLED
    assert r.failures() == []


def test_a_registration_nobody_takes_is_a_failure_reported_at_once():
    boot = Bootstrap(f"http://127.0.0.1:{free_port()}", ENGINE)  # nothing listens
    r = Registrar(timeout_sec=2)
    began = time.monotonic()
    r.register("r1", boot, "xfer-9", SECRET, ALLOC, FABRIC)
    failures: List[Tuple[str, str]] = []
    wait_for(lambda: bool(failures.extend(r.failures()) or failures))
    assert time.monotonic() - began < 3
    assert failures[0][0] == "r1" and "did not answer" in failures[0][1]
    r.close()


@pytest.mark.parametrize("fate", ["killed", "restarted", "silent"])
def test_registrations_held_by_a_prefill_engine_that_dies_or_restarts_fail_within_the_heartbeat_timeout(fate):
    """A registration lives in the prefill engine's memory until it is claimed: an engine that
    goes away (its port refuses), restarts (another instance on the same port: its
    registrations are gone) or stops answering fails the loads it held within the heartbeat
    timeout, not after claim_timeout_sec; one that answers, and a registration cancelled or
    forgotten, fail nothing."""
    port = free_port()
    first = BootstrapServer(Registrations(), "127.0.0.1", port, ENGINE)
    boot = Bootstrap(f"http://127.0.0.1:{port}", ENGINE)
    r = Registrar(timeout_sec=2, probe_interval_sec=0.1, dead_after_sec=0.6)
    silence: List[socket.socket] = []
    try:
        for rid in ("held", "cancelled", "forgotten"):
            r.register(rid, boot, "xfer-" + rid, SECRET, ALLOC, FABRIC)
        wait_for(lambda: sum(len(held) for held in r._held.values()) == 3)  # all three taken
        time.sleep(0.5)  # probes of a live engine: nothing fails
        assert r.failures() == []
        r.cancel("cancelled", boot, "xfer-cancelled", SECRET)
        r.forget("forgotten")
        first.close()
        began = time.monotonic()
        second = None
        if fate == "restarted":
            second = BootstrapServer(Registrations(), "127.0.0.1", port, ENGINE)
        elif fate == "silent":  # a listener that never answers: the engine is hung
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(16)
            silence.append(listener)
        failures: List[Tuple[str, str]] = []
        wait_for(lambda: bool(failures.extend(r.failures()) or failures), bound=5)
        took = time.monotonic() - began
        time.sleep(0.3)
        failures += r.failures()
        assert [f[0] for f in failures] == ["held"], failures
        words = {"killed": "is gone", "restarted": "restarted", "silent": "did not answer"}[fate]
        assert words in failures[0][1] and f"127.0.0.1:{port}" in failures[0][1], failures
        assert took < (1.5 if fate != "silent" else 3.0), took
        if second is not None:
            second.close()
    finally:
        r.close()
        for listener in silence:
            listener.close()


def test_a_live_prefill_engine_holding_registrations_fails_none():
    port = free_port()
    s = BootstrapServer(Registrations(), "127.0.0.1", port, ENGINE)
    r = Registrar(timeout_sec=2, probe_interval_sec=0.05, dead_after_sec=0.3)
    try:
        r.register("r1", Bootstrap(f"http://127.0.0.1:{port}", ENGINE), "xfer-1", SECRET, ALLOC, FABRIC)
        time.sleep(1.0)  # twenty probes, each answered by the same instance
        assert r.failures() == []
    finally:
        r.close()
        s.close()


# ---- both scheduler sides ----------------------------------------------------------------


class FakeRegistrar:
    def __init__(self) -> None:
        self.calls: List[Tuple[Any, ...]] = []
        self.failed: List[Tuple[str, str]] = []

    def register(self, *args: Any) -> None:
        self.calls.append(("register",) + args)

    def cancel(self, *args: Any) -> None:
        self.calls.append(("cancel",) + args)

    def forget(self, rid: str) -> None:
        self.calls.append(("forget", rid))

    def failures(self) -> List[Tuple[str, str]]:
        out, self.failed = self.failed, []
        return out


def request(rid: str, kv: Dict[str, Any], tokens: int = 40) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens,
                           kv_transfer_params=kv, status="WAITING")


def blocks(*ids: int) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def test_the_decode_side_draws_the_secret_and_registers_it_with_its_endpoints():
    fake = FakeRegistrar()
    d = DecodeScheduler(16, fake, (ALLOC, FABRIC))  # type: ignore[arg-type]
    req = request("r1", sidecar_decode("xfer-1"))
    assert d.get_num_new_matched_tokens(req, 0) == (40, True)
    d.update_state_after_alloc(req, blocks(4, 5, 6), 40)
    (reserve,) = d.build_connector_meta(None).reserve
    assert reserve.kvx_id == "xfer-1" and len(reserve.claim_secret) >= 16
    kind, rid, boot, transfer_id, secret, alloc, fabric = fake.calls[0]
    assert (kind, rid, transfer_id, secret, alloc, fabric) == (
        "register", "r1", "xfer-1", reserve.claim_secret, ALLOC, FABRIC)
    assert boot == Bootstrap("http://10.0.0.1:8998", ENGINE)
    # Another request draws another secret.
    d.update_state_after_alloc(request("r2", sidecar_decode("xfer-2")), blocks(7, 8, 9), 40)
    assert d.build_connector_meta(None).reserve[0].claim_secret != reserve.claim_secret


def test_a_failed_registration_fails_the_load_at_once_and_an_abort_cancels():
    fake = FakeRegistrar()
    d = DecodeScheduler(16, fake, (ALLOC, FABRIC))  # type: ignore[arg-type]
    for rid in ("r1", "r2"):
        d.update_state_after_alloc(request(rid, sidecar_decode("x-" + rid)), blocks(1, 2, 3), 40)
    d.build_connector_meta(None)
    fake.failed.append(("r1", "refused"))
    (release,) = d.build_connector_meta(None).release
    # Failed, not withdrawn: the workers report its blocks as load errors (recomputed).
    assert (release.req_id, release.reserved, release.failed) == ("r1", True, "refused")
    d.request_finished(request("r2", sidecar_decode("x-r2")))
    assert fake.calls[-1][:2] == ("cancel", "r2")
    assert d.build_connector_meta(None).release[0].failed is None  # r2's: a withdrawal


def test_the_prefill_side_claims_once_registered_with_the_registered_secret():
    now = [0.0]
    regs = Registrations(clock=lambda: now[0])
    p = PrefillScheduler(16, 1, 5.0, clock=lambda: now[0], registrations=regs)
    req = request("p1", sidecar_prefill("xfer-1"))
    p.on_new_request(req)
    assert p.get_num_new_matched_tokens(req, 0) == (None, False)  # ask again
    assert p.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
        req_ids=[]), num_scheduled_tokens={})).begin == []
    assert p.has_pending_push_work()
    regs.put("xfer-1", reg())
    assert p.get_num_new_matched_tokens(req, 0) == (None, False)  # now the grant is awaited
    plan = p.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
        req_ids=[]), num_scheduled_tokens={}))
    (begin,) = plan.begin
    assert (begin.kvx_id, begin.claim_secret, begin.decode_alloc, begin.decode_fabric, begin.num_blocks) == (
        "xfer-1", SECRET, ALLOC, FABRIC, 3)


def test_the_prefill_side_runs_without_a_push_when_no_registration_comes_or_it_was_cancelled():
    now = [0.0]
    regs = Registrations(clock=lambda: now[0])
    p = PrefillScheduler(16, 1, 5.0, clock=lambda: now[0], registrations=regs)
    late, gone = request("p1", sidecar_prefill("x-late")), request("p2", sidecar_prefill("x-gone"))
    for r in (late, gone):
        p.on_new_request(r)
    regs.put("x-gone", reg())
    regs.cancel("x-gone", SECRET)
    assert p.get_num_new_matched_tokens(gone, 0) == (0, False)
    now[0] = 5.0
    assert p.get_num_new_matched_tokens(late, 0) == (0, False)
    assert "registered" in p.request_finished(late)[1]["kvx_error"]
    assert "ended before" in p.request_finished(gone)[1]["kvx_error"]
    assert not p.has_pending_push_work()
    # Without a bootstrap server, llm-d's leg cannot be served: it says so at once.
    q = PrefillScheduler(16, 1, 5.0)
    r = request("p3", sidecar_prefill("x"))
    q.on_new_request(r)
    assert q.get_num_new_matched_tokens(r, 0) == (0, False)
    assert "bootstrap_port" in q.request_finished(r)[1]["kvx_error"]


def test_connections_are_bounded_in_number_and_idleness(monkeypatch):
    import socket

    import kvx.vllm.bootstrap as bootstrap

    monkeypatch.setattr(bootstrap, "CONNECTIONS_MAX", 4)
    monkeypatch.setattr(bootstrap, "CONNECTION_IDLE_SEC", 1.0)
    s = BootstrapServer(Registrations(), "127.0.0.1", free_port(), ENGINE)
    idlers = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
    try:
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", s.port))
        extra.settimeout(5)
        extra.sendall(b"GET /query HTTP/1.1\r\nHost: x\r\n\r\n")
        assert extra.recv(64) == b"", "past the cap, closed unanswered"
        extra.close()
        time.sleep(1.5)  # the idlers are closed: the server answers again
        assert call(s.port, "GET", "/query")[0] == 200
    finally:
        for c in idlers:
            c.close()
        s.close()
