"""A receiver process restarted on the same ports, as a decode engine restarts: the sender's
request in flight at the restart fails at once with a typed error, and the next request,
begun while the sender's control channel is still reconnecting, waits for it and succeeds
(it does not fail for a channel that is about to come back). Real processes, ZeroMQ and the
TCP fabric on loopback."""

import subprocess
import sys
import textwrap
import time

import pytest

import kvx
from kvx.testing import free_port

pytest.importorskip("numpy")

SLOT = 4096
WAIT = 20.0

RECEIVER = textwrap.dedent("""
    import sys, kvx, numpy as np
    alloc, fabric = sys.argv[1:3]
    buf = np.zeros(8 * %d, dtype=np.uint8)
    rx = kvx.Receiver(slots=8, slot_bytes=%d, buffer=buf, placement="caller", alloc=alloc,
                      fabric_endpoint=fabric)
    print("up", flush=True)
    reserved = 0
    for line in sys.stdin:
        cmd, req = line.split()
        if cmd == "reserve":
            # A slot of its own each: an earlier request's may not have come back yet (a
            # receiver that was stopped notices its failed request only when it runs again).
            rx.reserve(req, [reserved %% 8], claim_secret="secret-of-" + req + "-0123456789")
            reserved += 1
            print("reserved", flush=True)
        else:  # consume: the next ready request's lease, waited for at most 30 s
            leases = rx.next_ready(max=1, timeout=30)
            for lease in leases:
                lease.consume()
            print("consumed" if leases else "nothing ready", flush=True)
""" % (SLOT, SLOT))


def secret(req):
    return "secret-of-" + req + "-0123456789"


class Receiver:
    def __init__(self, endpoints):
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER, *endpoints],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "up"

    def reserve(self, req):
        self.proc.stdin.write(f"reserve {req}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "reserved"

    def consumed(self):
        """Waits until the receiver has read the next ready request (at most 30 s)."""
        self.proc.stdin.write("consume -\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "consumed"

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=WAIT)


def begin(tx, peer, req):
    tx.begin(req, receiver=peer, total_chunks=1, claim_secret=secret(req))
    assert tx.wait_admitted(req, timeout=WAIT), f"{req} admitted"


def finish(tx, req):
    slot = tx.allocate(req, timeout=WAIT)
    tx.add(slot, req + "@0", tokens=1)
    tx.submit(req, last=True)
    tx.wait_outcome(req, timeout=WAIT)


def test_after_a_receiver_restart_the_next_request_waits_for_the_channel_and_succeeds():
    endpoints = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    rx = Receiver(endpoints)
    tx = kvx.Sender(slots=4, slot_bytes=SLOT)
    try:
        peer = tx.add_receiver(*endpoints)
        rx.reserve("before")
        begin(tx, peer, "before")
        finish(tx, "before")
        rx.consumed()
        # In flight when the receiver dies: a typed failure, at once.
        rx.reserve("during")
        begin(tx, peer, "during")
        rx.kill()
        died = time.monotonic()
        with pytest.raises(kvx.KvxError):
            finish(tx, "during")
        assert time.monotonic() - died < WAIT / 2
        # Back on the same ports (a new process: new credentials, nothing of the old one
        # accepted); the sender's channel is still in its reconnect backoff.
        rx = Receiver(endpoints)
        rx.reserve("after")
        begin(tx, peer, "after")
        finish(tx, "after")
        rx.consumed()
    finally:
        tx.close()
        rx.kill()
