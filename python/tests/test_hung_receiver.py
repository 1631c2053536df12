"""A receiver process that hangs mid-request (stopped, as a frozen decode engine is): its
connections stay open and its kernel keeps acknowledging bytes, so only the heartbeats on the
control channel can tell. The sender's request fails with a typed error within
``heartbeat_timeout`` (4 s) and a little, not after ``recv_timeout`` (60 s) or never; once
the receiver runs again, the next request succeeds. Real processes, ZeroMQ and the TCP fabric
on loopback."""

import signal
import time

import pytest

import kvx
from kvx.testing import free_port, stop_process

from test_restarted_receiver import Receiver, begin, finish

pytest.importorskip("numpy")

WAIT = 20.0
HEARTBEAT_TIMEOUT = 4.0  # kvx_transport::zmq::ZmqConfig's default


@pytest.mark.parametrize("heartbeat_timeout", [None, 1.0])
def test_a_hung_receivers_request_fails_typed_within_the_heartbeat_timeout(heartbeat_timeout):
    """With the default deadline, and with a shorter one set on the sender (the keyword
    reaches its transport: the request fails well before the default's 4 s)."""
    endpoints = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    rx = Receiver(endpoints)
    deadline = heartbeat_timeout or HEARTBEAT_TIMEOUT
    given = {} if heartbeat_timeout is None else {"heartbeat_interval": 0.25, "heartbeat_timeout": heartbeat_timeout}
    tx = kvx.Sender(slots=4, slot_bytes=4096, **given)
    try:
        peer = tx.add_receiver(*endpoints)
        rx.reserve("during")
        begin(tx, peer, "during")
        stop_process(rx.proc.pid)
        hung = time.monotonic()
        with pytest.raises(kvx.KvxError) as failed:
            finish(tx, "during")
        took = time.monotonic() - hung
        assert deadline * 0.75 <= took < deadline + 3.0, (took, failed.value)
        # It runs again: the sender's channel reconnects, and the next request goes through
        # (the receiver failed "during" too: its DEALER's heartbeats stopped reaching it).
        rx.proc.send_signal(signal.SIGCONT)
        rx.reserve("after")
        begin(tx, peer, "after")
        finish(tx, "after")
        rx.consumed()
    finally:
        tx.close()
        rx.proc.send_signal(signal.SIGCONT)
        rx.kill()


def test_heartbeat_settings_are_checked():
    assert kvx.defaults()["node"]["heartbeat_timeout"] == HEARTBEAT_TIMEOUT
    with pytest.raises(ValueError, match="at least twice heartbeat_interval"):
        kvx.Sender(slots=1, slot_bytes=64, heartbeat_interval=1.0, heartbeat_timeout=1.5)
    with pytest.raises(ValueError, match="at least twice heartbeat_interval"):
        kvx.Receiver(slots=1, slot_bytes=64, heartbeat_timeout=1.0)  # the interval's default: 1 s
    with pytest.raises(ValueError, match="heartbeat_interval must be a positive"):
        kvx.Sender(slots=1, slot_bytes=64, heartbeat_interval=0)
    with pytest.raises(ValueError, match='settings of the "zmq" transport'):
        kvx.Sender(slots=1, slot_bytes=64, transport="mem", fabric="mem", heartbeat_timeout=8.0)
