"""kvx's synthetic workload and fault injection, for tests and benchmarks that drive kvx from
Python.

Each chunk's bytes derive from its request id and index, so a decoder can check every byte it
reads without knowing anything else. These are the functions ``kvx demo`` itself runs (native
code, in place, the GIL released), so that a Python-driven run and ``kvx demo`` make and check
their bytes at the same cost.

``corrupting_sender`` makes a sender whose writes go wrong after their checksum (zeroed), to test what
a receiving program does with a load that failed it. ``free_port`` picks a loopback port for a
test's server.
"""

import os
import random
import socket
import time
from typing import Any

from kvx._kvx import Sender, StagingSlot
from kvx._kvx import synthetic_check as check
from kvx._kvx import synthetic_fill as fill


class _CorruptingSender:
    """A ``Sender`` (every attribute is the wrapped one's) whose ``add`` zeroes the chunk's
    staging slot after kvx checksummed it."""

    def __init__(self, sender: Sender) -> None:
        self._sender = sender

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sender, name)

    def add(self, slot: StagingSlot, key: str, **kwargs: Any) -> None:
        index = slot.index
        self._sender.add(slot, key, **kwargs)
        staging = self._sender.staging
        assert staging is not None, "a sender's staging is always viewable"
        size = self._sender.slot_bytes
        staging[index * size : (index + 1) * size] = bytes(size)


def corrupting_sender(**kwargs: Any) -> Sender:
    """``Sender(**kwargs)`` whose every chunk is zeroed between its checksum and its write: each
    write of a chunk that was not all zeros then fails the receiver's checksum (with checksums
    on), and a receiver that did not check would hold very different bytes. For tests of what
    a receiving program does with a failed load; never for real traffic. It corrupts what
    ``add`` staged, so it needs kvx's own staging (``placement="pool"``)."""
    return _CorruptingSender(Sender(**kwargs))  # type: ignore[return-value]


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOPs ``pid`` (a hung process, for tests) and returns once every one of its threads
    is stopped: the signal is only queued when ``kill`` returns, and a thread still running
    meanwhile may answer one more message. Linux only (``/proc``)."""
    import glob
    import signal

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(stat) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass  # a thread that ended
        if states and all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped within {timeout} s: {states}")
        time.sleep(0.001)


def free_port() -> int:
    """A free loopback port below Linux's ephemeral range (32768 on), so that no port the OS
    hands out in the meantime (to sockets bound to port 0, such as vLLM's own) takes it before
    the test's server binds it."""
    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port in 20000..32000")


__all__ = ["check", "corrupting_sender", "fill", "free_port"]
