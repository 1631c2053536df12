"""Shared helpers for the kvx package's tests: LMCache's wire messages (pyzmq + msgspec,
as LMCache's own PD backend speaks them), skipped with a message when those are missing; and
the suite's skip policy: every skip is written to ``KVX_SKIP_LOG`` (when set: the README's
test command prints them at its end), and with ``KVX_NO_MODULE_SKIPS=1`` (CI) a test module
skipped whole fails the run, since a module that cannot run checks nothing."""

import os

import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq is needed to speak to kvx as LMCache does")
msgspec = pytest.importorskip("msgspec", reason="msgspec is needed for LMCache's wire format")


class PDMsgBase(msgspec.Struct, tag=True):
    pass


class ProxyNotif(PDMsgBase):
    req_id: str


class FailNotif(PDMsgBase):
    """kvx's own notice of a failed request (LMCache has none)."""

    req_id: str
    reason: str


@pytest.fixture
def push():
    """A ZeroMQ PUSH socket factory, as a sender's notice channel to a proxy."""
    ctx = zmq.Context()
    sockets = []

    def connect(endpoint: str):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 5_000)
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close()
    ctx.term()


def encode(msg) -> bytes:
    return msgspec.msgpack.encode(msg)


_skips = []


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_collectreport(report):
    if report.skipped:
        _skips.append(("module", report.nodeid, _reason(report)))


def pytest_runtest_logreport(report):
    if report.skipped and report.when in ("setup", "call"):
        _skips.append(("test", report.nodeid, _reason(report)))


def pytest_sessionfinish(session, exitstatus):
    log = os.environ.get("KVX_SKIP_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as out:
            for kind, nodeid, reason in _skips:
                out.write(f"python {kind} {nodeid}: {reason}\n")
    modules = [(n, r) for kind, n, r in _skips if kind == "module"]
    if modules and os.environ.get("KVX_NO_MODULE_SKIPS") == "1":
        for nodeid, reason in modules:
            print(f"\nkvx: module {nodeid} was skipped ({reason}); KVX_NO_MODULE_SKIPS=1: failing")
        session.exitstatus = 1
