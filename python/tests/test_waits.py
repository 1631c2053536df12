"""Blocking calls release the GIL (other Python threads run meanwhile) and Ctrl-C ends them
with KeyboardInterrupt, even without a timeout."""

import _thread
import signal
import threading
import time

import pytest

import kvx


def test_a_blocking_wait_lets_other_threads_run():
    rx = kvx.Receiver(slots=2, slot_bytes=4096)
    ticks = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        before = ticks[0]
        assert rx.next_ready(max=1, timeout=0.5) == []
        during = ticks[0] - before
    finally:
        stop.set()
        t.join()
    # With the GIL held through the wait, the counter would stand still for 0.5 s.
    assert during > 10_000, during


def test_ctrl_c_interrupts_a_wait_without_timeout():
    # Python's own SIGINT handler, whatever this process inherited: a process started in the
    # background of a non-interactive shell inherits SIGINT ignored, and then neither Ctrl-C
    # nor interrupt_main reaches it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    rx = kvx.Receiver(slots=2, slot_bytes=4096)
    interrupt = threading.Timer(0.3, _thread.interrupt_main)
    # Bounded: should the interrupt not end the wait, closing the receiver does (and the
    # test fails on that error rather than hanging).
    watchdog = threading.Timer(10.0, rx.close)
    interrupt.start()
    watchdog.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            rx.next_ready(max=1, timeout=None)
    finally:
        watchdog.cancel()
        interrupt.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 3.0


def test_close_releases_the_receivers_ports():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    rx = kvx.Receiver(slots=2, slot_bytes=4096, alloc=endpoint)
    with pytest.raises(kvx.StartError):
        kvx.Receiver(slots=2, slot_bytes=4096, alloc=endpoint)
    with rx:  # its end closes it, though `rx` itself lives on
        pass
    for _ in range(100):  # the socket closes as the driver ends, within moments
        try:
            again = kvx.Receiver(slots=2, slot_bytes=4096, alloc=endpoint)
            break
        except kvx.StartError:
            time.sleep(0.05)
    else:
        pytest.fail("the closed receiver's port stayed bound")
    again.close()
    assert rx.slots == 2
