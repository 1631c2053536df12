"""Shared helpers for the kvx package's tests: LMCache's wire messages (pyzmq + msgspec,
as LMCache's own PD backend speaks them), skipped with a message when those are missing."""

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
