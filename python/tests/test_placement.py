"""Caller placement from Python (``kvx.Receiver(placement="caller")``, docs/spec/protocol.md
§Caller placement): the program owns the receive buffer's slots and lends each request's
(``reserve``), a real ``kvx.Sender`` fills exactly those slots in chunk order over ZeroMQ and
the TCP fabric on loopback, and every reservation comes back (``returned``) consumed or with
the reason it was not (``returned``, or awaited: ``returned_async``). This is what a vLLM
decode engine's connector does with its KV blocks."""

import asyncio
import threading
import time

import pytest

import kvx

np = pytest.importorskip("numpy")

SLOT = 4096
WAIT = 10.0


def secret(req_id: str) -> str:
    """The claim secret of ``req_id``'s reservation, which its sender is handed."""
    return f"secret-of-{req_id}-0123456789"


def pattern(req_id: str, chunk: int) -> "np.ndarray":
    seed = (sum(req_id.encode()) * 31 + chunk * 7) % 251
    return ((np.arange(SLOT, dtype=np.uint32) + seed) % 251).astype(np.uint8)


def caller_pair(slots=8):
    buffer = np.zeros(slots * SLOT, dtype=np.uint8)
    rx = kvx.Receiver(slots=slots, slot_bytes=SLOT, buffer=buffer, placement="caller")
    tx = kvx.Sender(slots=4, slot_bytes=SLOT)
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    return tx, rx, peer, buffer


def send(tx, peer, req_id, chunks):
    tx.begin(req_id, receiver=peer, total_chunks=chunks, claim_secret=secret(req_id))
    assert tx.wait_admitted(req_id, timeout=WAIT)
    for c in range(chunks):
        slot = tx.allocate(req_id, timeout=WAIT)
        np.frombuffer(slot.view, dtype=np.uint8)[:] = pattern(req_id, c)
        tx.add(slot, f"{req_id}@{c}", tokens=1)
    tx.submit(req_id, last=True)


def slot_bytes(buffer, slot):
    return buffer[slot * SLOT:(slot + 1) * SLOT]


def test_chunks_land_in_the_reserved_slots_in_order_and_the_slots_come_back():
    tx, rx, peer, buffer = caller_pair()
    rx.reserve("r", [6, 1, 4], claim_secret=secret("r"))
    send(tx, peer, "r", 3)
    [lease] = rx.next_ready(max=1, timeout=WAIT)
    assert lease.slots == [6, 1, 4]
    for chunk, slot in enumerate([6, 1, 4]):
        assert np.array_equal(slot_bytes(buffer, slot), pattern("r", chunk)), chunk
    assert rx.returned(timeout=0.05) == [], "lent until consumed"
    lease.consume()
    tx.wait_outcome("r", timeout=WAIT)
    [back] = rx.returned(timeout=WAIT)
    assert isinstance(back, kvx.Returned)
    assert (back.req_id, back.slots, back.consumed, back.reason) == ("r", [6, 1, 4], True, None)
    for slot in (0, 2, 3, 5, 7):
        assert not slot_bytes(buffer, slot).any(), f"slot {slot} was never lent"


def test_a_sender_that_comes_first_waits_for_its_reservation():
    tx, rx, peer, _ = caller_pair()
    tx.begin("early", receiver=peer, total_chunks=1, claim_secret=secret("early"))
    assert not tx.wait_admitted("early", timeout=0.2)
    rx.reserve("early", [3], claim_secret=secret("early"))
    assert tx.wait_admitted("early", timeout=WAIT)


def test_admissions_asked_to_be_reported_come_as_events_each_once():
    """``begin(report_admission=True)``: a sender with many requests waiting learns of each
    admission from ``next_admitted`` as it comes, instead of asking each in turn."""
    tx, rx, peer, _ = caller_pair()
    for req_id, report in (("a", True), ("b", True), ("quiet", False), ("f", True)):
        tx.begin(req_id, receiver=peer, total_chunks=1, claim_secret=secret(req_id), report_admission=report)
    assert tx.next_admitted(timeout=0.2) == []
    rx.reserve("a", [3], claim_secret=secret("a"))
    assert tx.next_admitted(timeout=WAIT) == [("a", None)]
    rx.reserve("b", [2], claim_secret=secret("b"))
    assert tx.next_admitted(timeout=WAIT) == [("b", None)]
    tx.cancel("f")  # it will never be admitted: reported with why
    [(req_id, error)] = tx.next_admitted(timeout=WAIT)
    assert req_id == "f" and isinstance(error, kvx.KvxError), error
    rx.reserve("quiet", [5], claim_secret=secret("quiet"))
    assert tx.wait_admitted("quiet", timeout=WAIT)
    assert tx.next_admitted(timeout=0.2) == []  # "quiet" asked for no report; each came once


def test_a_withdrawn_reservation_comes_back_and_fails_its_sender_with_the_reason():
    tx, rx, peer, _ = caller_pair()
    rx.reserve("w", [0, 1], claim_secret=secret("w"))
    tx.begin("w", receiver=peer, total_chunks=2, claim_secret=secret("w"))
    assert tx.wait_admitted("w", timeout=WAIT)
    rx.withdraw("w")
    [back] = rx.returned(timeout=WAIT)
    assert back.slots == [0, 1] and not back.consumed
    assert "withdrew" in back.reason, back
    slot = tx.allocate("w", timeout=WAIT)
    tx.add(slot, "w@0", tokens=1)
    tx.submit("w", last=False)
    with pytest.raises(kvx.RefusedError, match="withdrew"):
        tx.wait_outcome("w", timeout=WAIT)
    with pytest.raises(kvx.MisuseError, match="not reserved"):
        rx.withdraw("w")


@pytest.mark.parametrize("order", ["reserved first", "claimed first"])
def test_the_request_id_alone_claims_nothing(order):
    """A sender of its own, with no relation to the request, that knows its id (it crosses
    HTTP and logs in clear): without the reservation's secret, or with another, its claim is
    refused with the reason, its bytes land nowhere, and the real sender's claim then
    succeeds, whether the reservation came before the forged claims or after them."""
    tx, rx, peer, buffer = caller_pair()
    forged = {"x-none": None, "x-wrong": "guessed-0123456789abcdef"}
    if order == "reserved first":
        rx.reserve("x", [5, 2], claim_secret=secret("x"))
    for name, claim in forged.items():
        # A sender of its own per forged claim (one sender runs one request of an id).
        mallory = kvx.Sender(slots=2, slot_bytes=SLOT, local_id=name)
        p = mallory.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
        mallory.begin("x", receiver=p, total_chunks=2, claim_secret=claim)
        forged[name] = mallory
    if order == "claimed first":
        # The claim without a secret is refused at once; the wrong one waits.
        with pytest.raises(kvx.RefusedError, match="no claim secret"):
            forged["x-none"].wait_admitted("x", timeout=WAIT)
        assert not forged["x-wrong"].wait_admitted("x", timeout=0.2)
        rx.reserve("x", [5, 2], claim_secret=secret("x"))
    with pytest.raises(kvx.RefusedError, match="no claim secret"):
        forged["x-none"].wait_admitted("x", timeout=WAIT)
    with pytest.raises(kvx.RefusedError, match="not its reservation's"):
        forged["x-wrong"].wait_admitted("x", timeout=WAIT)
    assert rx.snapshot()["tracked_requests"] <= 1
    send(tx, peer, "x", 2)
    [lease] = rx.next_ready(max=1, timeout=WAIT)
    assert lease.slots == [5, 2]
    assert np.array_equal(slot_bytes(buffer, 5), pattern("x", 0))
    assert np.array_equal(slot_bytes(buffer, 2), pattern("x", 1))
    lease.consume()
    tx.wait_outcome("x", timeout=WAIT)
    [back] = rx.returned(timeout=WAIT)
    assert back.consumed


def test_a_malformed_claim_secret_is_refused_without_repeating_it():
    _, rx, _, _ = caller_pair(slots=4)
    for bad in ["short", "x" * 129, "has space in it!!"]:
        with pytest.raises(ValueError, match="claim_secret") as caught:
            rx.reserve("r", [0], claim_secret=bad)
        assert bad not in str(caught.value)
    tx = kvx.Sender(slots=1, slot_bytes=SLOT)
    with pytest.raises(ValueError, match="claim_secret"):
        tx.begin("r", receiver=0, total_chunks=1, claim_secret="short")


def test_reservations_that_cannot_be_lent_are_refused_with_the_reason():
    _, rx, _, _ = caller_pair(slots=4)
    rx.reserve("held", [1], claim_secret=secret("held"))
    for req_id, slots, why in [
        ("r", [4], "outside the buffer's 4 slots"),
        ("r", [0, 0], "named twice"),
        ("r", [1], "reserved (for request held)"),
        ("held", [2], "already reserved"),
        ("r", [], "at least one slot"),
    ]:
        with pytest.raises(kvx.MisuseError, match=why.replace("(", r"\(").replace(")", r"\)")):
            rx.reserve(req_id, slots, claim_secret=secret(req_id))
    pool = kvx.Receiver(slots=4, slot_bytes=SLOT)
    with pytest.raises(kvx.MisuseError, match="placement = caller"):
        pool.reserve("r", [0], claim_secret=secret("r"))
    with pytest.raises(ValueError, match='"pool" or "caller"'):
        kvx.Receiver(slots=4, slot_bytes=SLOT, placement="vllm")
    rx.close()
    with pytest.raises(kvx.StoppedError):
        rx.reserve("late", [2], claim_secret=secret("late"))


def test_a_buffer_lent_in_per_layer_parts_takes_each_chunk_into_its_layer():
    """Two "layer" arrays of four slots each, as a decode engine's per-layer KV tensors: a
    reservation across both layers puts each chunk's bytes in its own layer, and the lease's
    views are views of the layers themselves."""
    layers = [np.zeros(4 * SLOT, dtype=np.uint8) for _ in range(2)]
    rx = kvx.Receiver(slots=8, slot_bytes=SLOT, buffer=layers, placement="caller")
    assert rx.buffer is None, "no one view spans two layers"
    tx = kvx.Sender(slots=2, slot_bytes=SLOT)
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    # Block 3 of layer 1, block 1 of layer 0.
    rx.reserve("r", [7, 1], claim_secret=secret("r"))
    send(tx, peer, "r", 2)
    [lease] = rx.next_ready(max=1, timeout=WAIT)
    views = lease.views()
    assert np.array_equal(np.frombuffer(views[0], dtype=np.uint8), pattern("r", 0))
    assert np.array_equal(layers[1][3 * SLOT:4 * SLOT], pattern("r", 0))
    assert np.array_equal(layers[0][1 * SLOT:2 * SLOT], pattern("r", 1))
    lease.consume()
    [back] = rx.returned(timeout=WAIT)
    assert back.consumed and back.slots == [7, 1]
    untouched = [(0, 0), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]
    assert all(not layers[l][b * SLOT:(b + 1) * SLOT].any() for l, b in untouched)


def test_a_buffer_in_parts_must_split_evenly_into_equal_parts():
    with pytest.raises(ValueError, match="split slots=8 evenly"):
        kvx.Receiver(slots=8, slot_bytes=SLOT, buffer=[np.zeros(8 * SLOT, dtype=np.uint8)] * 3)
    with pytest.raises(ValueError, match="buffer part 1"):
        kvx.Receiver(slots=8, slot_bytes=SLOT,
                     buffer=[np.zeros(4 * SLOT, dtype=np.uint8), np.zeros(2 * SLOT, dtype=np.uint8)])


def test_returns_are_awaitable_and_a_cancelled_await_loses_none():
    """``returned_async``: an awaited return, and the narrow case of an await cancelled after
    its returns were taken (the loop blocked meanwhile, so the cancel lands first). Those
    go back, and a caller already waiting in ``returned`` is woken with them."""
    _, rx, _, _ = caller_pair()

    async def main():
        rx.reserve("a", [0], claim_secret=secret("a"))
        waiting = asyncio.ensure_future(rx.returned_async())
        await asyncio.sleep(0.05)
        rx.withdraw("a")
        [back] = await asyncio.wait_for(waiting, WAIT)
        assert (back.req_id, back.slots, back.consumed) == ("a", [0], False)

        rx.reserve("b", [1], claim_secret=secret("b"))
        rx.withdraw("b")
        cancelled = asyncio.ensure_future(rx.returned_async())
        await asyncio.sleep(0)  # the await starts and takes b's return
        time.sleep(0.3)  # the loop blocked: the result waits for it, behind the cancel
        got = []
        other = threading.Thread(target=lambda: got.extend(rx.returned(timeout=WAIT)))
        other.start()
        time.sleep(0.1)  # the other caller waits for the next return
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        started = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, other.join)
        return got, time.monotonic() - started

    got, waited = asyncio.run(asyncio.wait_for(main(), 60))
    assert [r.req_id for r in got] == ["b"]
    assert waited < WAIT / 2, "woken by the return handed back, not by its timeout"
