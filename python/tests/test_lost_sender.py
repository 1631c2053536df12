"""A sender process that dies or hangs mid-request: the receiver hears its control connection
close (or, for a stopped process, its heartbeats stop for ``heartbeat_timeout``, 4 s) and
fails what it had open, with the reason (``SenderLost``), instead of holding the reservation
for ``request_idle_timeout`` (30 s here). Real processes, ZeroMQ and the TCP fabric on
loopback."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

import kvx
from kvx.testing import stop_process

np = pytest.importorskip("numpy")

SLOT = 4096
IDLE = 30.0
WAIT = 10.0
HEARTBEAT_TIMEOUT = 4.0  # kvx_transport::zmq::ZmqConfig's default
SECRET = "secret-of-the-lost-sender-0123"

SENDER = textwrap.dedent("""
    import sys, time, kvx
    alloc, fabric, secret = sys.argv[1:4]
    tx = kvx.Sender(slots=4, slot_bytes=%d)
    peer = tx.add_receiver(alloc, fabric)
    tx.begin("r", receiver=peer, total_chunks=3, claim_secret=secret)
    assert tx.wait_admitted("r", timeout=10.0)
    slot = tx.allocate("r", timeout=10.0)
    tx.add(slot, "r@0", tokens=1)
    tx.submit("r", last=False)
    print("sent", flush=True)
    time.sleep(600)
""" % SLOT)


def start_sender(rx):
    proc = subprocess.Popen([sys.executable, "-c", SENDER, rx.alloc_endpoint, rx.fabric_endpoint, SECRET],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "sent", "the sender process did not get going"
    return proc


@pytest.mark.parametrize("how", ["killed", "exited", "stopped"])
def test_a_dead_senders_reservation_comes_back_at_once_with_the_reason(how):
    buffer = np.zeros(8 * SLOT, dtype=np.uint8)
    with kvx.Receiver(slots=8, slot_bytes=SLOT, buffer=buffer, placement="caller",
                      request_idle_timeout=IDLE) as rx:
        rx.reserve("r", [5, 2, 7], claim_secret=SECRET)
        proc = start_sender(rx)
        assert rx.returned(timeout=0.3) == [], "held while its sender lives"
        died = time.monotonic()
        if how == "killed":
            proc.kill()
        elif how == "exited":
            proc.terminate()
        else:
            # Stopped, as a hung engine is: its connections stay open and its kernel keeps
            # acknowledging; only the missing heartbeats say it is gone.
            stop_process(proc.pid)
        try:
            back = rx.returned(timeout=WAIT)
            took = time.monotonic() - died
        finally:
            proc.kill()
            proc.wait(timeout=WAIT)
        assert [b.req_id for b in back] == ["r"], f"nothing came back within {WAIT} s (idle timeout {IDLE} s)"
        assert not back[0].consumed and back[0].slots == [5, 2, 7]
        assert "control connection closed" in back[0].reason, back[0].reason
        assert took < IDLE, took
        if how == "stopped":
            assert HEARTBEAT_TIMEOUT * 0.75 <= took < HEARTBEAT_TIMEOUT + 3.0, took
