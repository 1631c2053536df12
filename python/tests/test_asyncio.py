"""kvx's awaitables (``Sender.admitted``, ``allocate_async``, ``outcome``,
``Receiver.ready``) on one asyncio event loop: the worked example with every wait awaited,
typed errors, and cancellation that leaves nothing held and loses nothing."""

import asyncio
import time

import pytest

import kvx

np = pytest.importorskip("numpy")

from test_transfer import SLOT, WAIT, make_pair, pattern  # noqa: E402


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def stage(tx, req_id, chunk):
    slot = await tx.allocate_async(req_id, timeout=WAIT)
    np.frombuffer(slot.view, dtype=np.uint8)[:] = pattern(req_id, chunk)
    tx.add(slot, f"{req_id}@{chunk}", tokens=256)


async def send_one(tx, peer, req_id):
    """Begins ``req_id`` as a request of one chunk and submits it."""
    tx.begin(req_id, receiver=peer, total_chunks=1)
    await tx.admitted(req_id)
    await stage(tx, req_id, 0)
    tx.submit(req_id, last=True)


async def decode(rx, expect):
    """Awaits ready requests until ``expect`` came; each chunk checked byte for byte."""
    results = {}
    while len(results) < expect:
        for lease in await rx.ready(max=4):
            with lease:
                results[lease.req_id] = all(
                    np.array_equal(np.frombuffer(v, dtype=np.uint8), pattern(lease.req_id, c))
                    for c, v in enumerate(lease.views())
                )
    return results


def test_two_interleaved_requests_as_coroutines_on_one_loop():
    """The worked example (two 8-chunk requests, a 10-slot buffer, 4 staging slots), each
    request a coroutine of its own and the decoder a third, on one thread."""
    tx, rx, peer, _, _ = make_pair(buffer_slots=10, staging_slots=4)

    async def prefill(req_id):
        tx.begin(req_id, receiver=peer, total_chunks=8)
        await tx.admitted(req_id)
        for chunk in range(8):
            await stage(tx, req_id, chunk)
            if chunk % 2 == 1:
                tx.submit(req_id, last=chunk == 7)
        await tx.outcome(req_id)

    async def main():
        decoded, *_ = await asyncio.gather(decode(rx, 2), prefill("a"), prefill("b"))
        return decoded

    assert run(main()) == {"a": True, "b": True}
    snap = rx.snapshot()
    assert snap["free"] == 10 and snap["tracked_requests"] == 0, snap
    assert tx.staging_free == 4


def test_a_free_slot_is_a_future_already_done():
    tx, rx, peer, _, _ = make_pair(buffer_slots=4, staging_slots=2)

    async def main():
        tx.begin("r", receiver=peer, total_chunks=2)
        await tx.admitted("r")
        pending = tx.allocate_async("r")
        done_at_once = pending.done()
        slot = await pending
        slot.release()
        return done_at_once

    assert run(main())


def test_cancelled_allocate_holds_nothing_and_a_timeout_is_typed():
    tx, rx, peer, _, _ = make_pair(buffer_slots=4, staging_slots=1)

    async def main():
        # "a" holds the only staging slot; "b" waits for it.
        for r in ("a", "b"):
            tx.begin(r, receiver=peer, total_chunks=2)
            await tx.admitted(r)
        held = await tx.allocate_async("a")
        with pytest.raises(kvx.TimedOutError):
            await tx.allocate_async("b", timeout=0.2)
        waiting = asyncio.ensure_future(tx.allocate_async("b"))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        held.release()
        # The cancelled wait holds no slot. The cancel reaches the Rust future on kvx's runtime
        # a moment later, so it may still have taken the slot released here: then it hands
        # it back when it is dropped. Either way the slot is free soon, and taken at once.
        for _ in range(100):
            if tx.staging_free == 1:
                break
            await asyncio.sleep(0.05)
        assert tx.staging_free == 1
        again = tx.allocate_async("b")
        assert again.done()
        (await again).release()

    run(main())


def test_a_cancelled_ready_loses_no_request():
    tx, rx, peer, _, _ = make_pair(buffer_slots=4, staging_slots=2)

    async def main():
        waiting = asyncio.ensure_future(rx.ready())
        await asyncio.sleep(0.1)
        waiting.cancel()
        await send_one(tx, peer, "r")
        await tx.outcome("r")
        return await asyncio.wait_for(decode(rx, 1), WAIT)

    assert run(main()) == {"r": True}


def test_a_ready_cancelled_after_it_took_its_leases_loses_none():
    """The narrow case: the leases are taken and on their way to the loop when the await is
    cancelled (the loop is blocked meanwhile, so the cancel lands before the result). They
    go back to the receiver, and the next call gets them."""
    tx, rx, peer, _, _ = make_pair(buffer_slots=4, staging_slots=2)

    async def main():
        await send_one(tx, peer, "r")
        await tx.outcome("r")
        waiting = asyncio.ensure_future(rx.ready())
        await asyncio.sleep(0)  # the await starts; its leases are ready to be taken
        time.sleep(0.3)  # the loop blocked: the result waits for it, behind the cancel
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return await asyncio.wait_for(decode(rx, 1), WAIT)

    assert run(main()) == {"r": True}


def test_ready_waits_past_the_notice_of_a_consumed_request():
    # Every request's end is noticed, a consumed one's too; such a notice leases nothing,
    # so ``ready()`` after a consume still waits for a ready request.
    tx, rx, peer, _, _ = make_pair(buffer_slots=4, staging_slots=2)

    async def main():
        await send_one(tx, peer, "r")
        assert await asyncio.wait_for(decode(rx, 1), WAIT) == {"r": True}
        with pytest.raises(asyncio.TimeoutError):
            early = await asyncio.wait_for(rx.ready(), 0.3)
            pytest.fail(f"ready() returned {early!r} with nothing ready")

    run(main())


def test_awaitables_raise_why_and_need_a_running_loop():
    tx, rx, peer, _, _ = make_pair(buffer_slots=4, staging_slots=2)

    async def main():
        tx.begin("huge", receiver=peer, total_chunks=5)
        with pytest.raises(kvx.RefusedError, match="huge|exceeds|capacity|slots"):
            await tx.admitted("huge")
        with pytest.raises(kvx.RefusedError):
            await tx.outcome("huge")

    run(main())
    with pytest.raises(RuntimeError):
        tx.admitted("huge")
    with pytest.raises(RuntimeError):
        rx.ready()
