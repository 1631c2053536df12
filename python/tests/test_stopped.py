"""A sender or receiver that has stopped answers every call with ``kvx.StoppedError`` (a
``KvxError``, distinct from ``ReceiverLostError``): its own driver is gone, not a peer."""

import pytest

import kvx

SLOT = 4096
WAIT = 10.0


def make_pair():
    rx = kvx.Receiver(slots=4, slot_bytes=SLOT, peer_share_percent=100)
    tx = kvx.Sender(slots=2, slot_bytes=SLOT)
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    return tx, rx, peer


def test_stopped_error_is_its_own_kvx_error():
    assert issubclass(kvx.StoppedError, kvx.KvxError)
    assert not issubclass(kvx.StoppedError, kvx.ReceiverLostError)
    assert "StoppedError" in kvx.__all__


def test_a_closed_sender_raises_stopped_error():
    tx, rx, peer = make_pair()
    with rx:
        # One chunk declared and never staged: the request cannot end on its own.
        tx.begin("r", receiver=peer, total_chunks=1)
        assert tx.wait_admitted("r", timeout=WAIT)
        tx.close()
        with pytest.raises(kvx.StoppedError):
            tx.wait_outcome("r", timeout=WAIT)
        with pytest.raises(kvx.StoppedError):
            tx.allocate("r", timeout=WAIT)
        with pytest.raises(kvx.StoppedError):
            tx.begin("later", receiver=peer, total_chunks=1)
        with pytest.raises(kvx.StoppedError):
            tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)


def test_a_closed_receiver_raises_stopped_error():
    tx, rx, peer = make_pair()
    tx.begin("r", receiver=peer, total_chunks=1)
    assert tx.wait_admitted("r", timeout=WAIT)
    slot = tx.allocate("r", timeout=WAIT)
    slot.write(bytes(SLOT))
    tx.add(slot, "r@0", tokens=1)
    tx.submit("r", last=True)
    tx.wait_outcome("r", timeout=WAIT)
    (lease,) = rx.next_ready(max=1, timeout=WAIT)
    rx.close()
    with pytest.raises(kvx.StoppedError):
        lease.consume(timeout=WAIT)
    with pytest.raises(kvx.StoppedError):
        rx.snapshot(timeout=WAIT)
    tx.close()


def test_a_stopped_receivers_next_ready_raises_at_once():
    """Not ``[]`` again and again (a decoder polling it would spin), nor a wait without end
    (``timeout=None``): ``StoppedError`` at once, from the call and from the awaitable."""
    import asyncio
    import time

    rx = kvx.Receiver(slots=4, slot_bytes=SLOT)
    rx.close()
    started = time.monotonic()
    with pytest.raises(kvx.StoppedError):
        rx.next_ready(max=4, timeout=None)
    with pytest.raises(kvx.StoppedError):
        rx.next_ready(max=4, timeout=WAIT)
    assert time.monotonic() - started < WAIT / 2

    async def ready():
        return await asyncio.wait_for(rx.ready(max=4), WAIT)

    with pytest.raises(kvx.StoppedError):
        asyncio.run(ready())
