"""kvx.Sender and kvx.Receiver from Python: the protocol's scenarios over ZeroMQ and the TCP
fabric on loopback, with staging and receive buffers in memory the test owns (NumPy arrays),
read and written through zero-copy slot views."""

import threading

import pytest

import kvx

np = pytest.importorskip("numpy")

SLOT = 4096
WAIT = 10.0


def pattern(req_id: str, chunk: int) -> np.ndarray:
    seed = (sum(req_id.encode()) * 31 + chunk * 7) % 251
    return ((np.arange(SLOT, dtype=np.uint32) + seed) % 251).astype(np.uint8)


def make_pair(buffer_slots=10, staging_slots=4, share=100, **sender_kw):
    buffer = np.zeros(buffer_slots * SLOT, dtype=np.uint8)
    rx = kvx.Receiver(slots=buffer_slots, slot_bytes=SLOT, buffer=buffer, peer_share_percent=share)
    staging = np.zeros(staging_slots * SLOT, dtype=np.uint8)
    tx = kvx.Sender(slots=staging_slots, slot_bytes=SLOT, staging=staging, **sender_kw)
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    return tx, rx, peer, buffer, staging


def stage(tx, req_id, chunk):
    slot = tx.allocate(req_id, timeout=WAIT)
    np.frombuffer(slot.view, dtype=np.uint8)[:] = pattern(req_id, chunk)
    tx.add(slot, f"{req_id}@{chunk}", tokens=256)


def decode_all(rx, expect, buffer, results):
    """Reads every ready request, checks each chunk byte for byte in place, consumes it."""
    seen = 0
    for _ in range(200):
        for lease in rx.next_ready(max=8, timeout=0.2):
            with lease:
                for chunk, view in enumerate(lease.views()):
                    got = np.frombuffer(view, dtype=np.uint8)
                    results[lease.req_id] = results.get(lease.req_id, True) and bool(
                        np.array_equal(got, pattern(lease.req_id, chunk))
                    )
            seen += 1
        if seen == expect:
            return


def test_two_interleaved_requests_into_a_buffer_smaller_than_both():
    """The worked example: one sender interleaves two 8-chunk requests into a 10-slot
    buffer; the second waits for admission until the first is consumed, and both arrive
    byte-exact."""
    tx, rx, peer, buffer, _ = make_pair(buffer_slots=10, staging_slots=4)
    results = {}
    decoder = threading.Thread(target=decode_all, args=(rx, 2, buffer, results))
    decoder.start()
    ids = ["a", "b"]
    for r in ids:
        tx.begin(r, receiver=peer, total_chunks=8)
    nxt = {r: 0 for r in ids}
    admitted = {r: False for r in ids}
    for _ in range(10_000):
        if all(n == 8 for n in nxt.values()):
            break
        for r in ids:
            if nxt[r] == 8:
                continue
            if not admitted[r]:
                admitted[r] = tx.wait_admitted(r, timeout=0.02)
                if not admitted[r]:
                    continue
            stage(tx, r, nxt[r])
            nxt[r] += 1
            if nxt[r] % 2 == 0:
                tx.submit(r, last=nxt[r] == 8)
    for r in ids:
        tx.wait_outcome(r, timeout=WAIT)
    decoder.join(timeout=30)
    assert results == {"a": True, "b": True}
    snap = rx.snapshot()
    assert snap["free"] == 10 and snap["tracked_requests"] == 0, snap
    assert tx.staging_free == 4


def test_four_concurrent_requests_per_sender_from_four_threads():
    tx, rx, peer, buffer, _ = make_pair(buffer_slots=16, staging_slots=8)
    results = {}
    decoder = threading.Thread(target=decode_all, args=(rx, 8, buffer, results))
    decoder.start()
    errors = []

    def prefill(worker):
        try:
            for i in range(2):
                r = f"w{worker}-{i}"
                tx.begin(r, receiver=peer, total_chunks=6)
                assert tx.wait_admitted(r, timeout=WAIT)
                for chunk in range(6):
                    stage(tx, r, chunk)
                    if chunk % 3 == 2:
                        tx.submit(r, last=chunk == 5)
        except Exception as e:  # reported below
            errors.append(e)

    workers = [threading.Thread(target=prefill, args=(w,)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not errors, errors
    ends = []
    for _ in range(100):
        ends += tx.next_ends(max=16, timeout=0.2)
        if len(ends) == 8:
            break
    assert sorted(r for r, err in ends if err is None) == sorted(
        f"w{w}-{i}" for w in range(4) for i in range(2)
    )
    decoder.join(timeout=30)
    assert len(results) == 8 and all(results.values()), results


def test_cancel_in_flight_frees_both_sides():
    tx, rx, peer, _, _ = make_pair(buffer_slots=8, staging_slots=4)
    tx.begin("victim", receiver=peer, total_chunks=6)
    assert tx.wait_admitted("victim", timeout=WAIT)
    for chunk in range(3):
        stage(tx, "victim", chunk)
    tx.submit("victim")
    tx.cancel("victim")
    with pytest.raises(kvx.CancelledError):
        tx.wait_outcome("victim", timeout=WAIT)
    for _ in range(100):
        if rx.snapshot()["free"] == 8:
            break
        threading.Event().wait(0.05)
    assert rx.snapshot()["free"] == 8
    assert tx.staging_free == 4


def test_an_oversized_request_is_refused_with_the_reason():
    tx, rx, peer, _, _ = make_pair(buffer_slots=4, staging_slots=2)
    tx.begin("huge", receiver=peer, total_chunks=5)
    with pytest.raises(kvx.RefusedError, match="huge|exceeds|capacity|slots"):
        tx.wait_admitted("huge", timeout=WAIT)


def test_a_slot_view_is_the_staging_itself():
    """Zero-copy: writing through the view changes the caller's own array, and what the
    receiver gets is what was written through it."""
    tx, rx, peer, buffer, staging = make_pair(buffer_slots=4, staging_slots=2)
    tx.begin("z", receiver=peer, total_chunks=1)
    assert tx.wait_admitted("z", timeout=WAIT)
    slot = tx.allocate("z", timeout=WAIT)
    view = np.frombuffer(slot.view, dtype=np.uint8)
    view[:] = 0x5A
    start = slot.index * SLOT
    assert (staging[start : start + SLOT] == 0x5A).all(), "the caller's array changed"
    staging[start + 7] = 0xA5  # written through the caller's own array, not the view
    tx.add(slot, "z@0")
    tx.submit("z", last=True)
    (lease,) = rx.next_ready(max=1, timeout=WAIT)
    got = np.frombuffer(lease.views()[0], dtype=np.uint8)
    assert got[7] == 0xA5 and got[0] == 0x5A
    s = lease.slots[0] * SLOT
    assert buffer[s + 7] == 0xA5, "the lease's view is the caller's buffer"
    assert lease.read(0, 8) == bytes([0x5A] * 7 + [0xA5])
    lease.consume()
    with pytest.raises(kvx.MisuseError):
        lease.consume()
    tx.wait_outcome("z", timeout=WAIT)


def test_the_shm_fabric_is_viewed_in_place_and_its_views_outlive_the_objects():
    """With the shm fabric kvx allocates the memory itself: ``Sender.staging``,
    ``Receiver.buffer`` and the slot views are views of it (writing through one shows in
    the other, and is what the receiver gets), and a view kept after its sender and
    receiver are gone still reads the bytes (it keeps the mapping alive)."""
    import gc

    rx = kvx.Receiver(slots=4, slot_bytes=SLOT, fabric="shm", peer_share_percent=100)
    tx = kvx.Sender(slots=2, slot_bytes=SLOT, fabric="shm")
    assert tx.staging.nbytes == 2 * SLOT and rx.buffer.nbytes == 4 * SLOT
    staging = np.frombuffer(tx.staging, dtype=np.uint8)
    buffer = np.frombuffer(rx.buffer, dtype=np.uint8)
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    tx.begin("v", receiver=peer, total_chunks=2)
    assert tx.wait_admitted("v", timeout=WAIT)
    for chunk in range(2):
        slot = tx.allocate("v", timeout=WAIT)
        np.frombuffer(slot.view, dtype=np.uint8)[:] = pattern("v", chunk)
        start = slot.index * SLOT
        assert np.array_equal(staging[start : start + SLOT], pattern("v", chunk))
        staging[start + 9] = 0xC3  # through the whole staging's view, not the slot's
        tx.add(slot, f"v@{chunk}")
    tx.submit("v", last=True)
    (lease,) = rx.next_ready(max=1, timeout=WAIT)
    for chunk, view in enumerate(lease.views()):
        want = pattern("v", chunk)
        want[9] = 0xC3
        assert np.array_equal(np.frombuffer(view, dtype=np.uint8), want)
        s = lease.slots[chunk] * SLOT
        assert np.array_equal(buffer[s : s + SLOT], want), "the lease's view is the buffer"
    kept_rx = lease.views()[1]
    lease.consume()
    tx.wait_outcome("v", timeout=WAIT)
    want = bytes(kept_rx[:16])
    tx.close()
    rx.close()
    del tx, rx, lease, slot, view
    gc.collect()
    assert bytes(kept_rx[:16]) == want
    assert staging[start + 9] == 0xC3


def test_misuse_and_bad_input_say_what_is_wrong():
    with pytest.raises(ValueError, match="slots"):
        kvx.Sender(slots=4, slot_bytes=SLOT, staging=bytearray(3 * SLOT))
    with pytest.raises(ValueError, match="read-only"):
        kvx.Sender(slots=1, slot_bytes=SLOT, staging=bytes(SLOT))
    with pytest.raises(ValueError, match="fabric"):
        kvx.Sender(slots=1, slot_bytes=SLOT, fabric="carrier-pigeon")
    with pytest.raises(ValueError, match="shm"):
        kvx.Sender(slots=1, slot_bytes=SLOT, fabric="shm", staging=bytearray(SLOT))
    tx, rx, peer, _, _ = make_pair(buffer_slots=4, staging_slots=2)
    with pytest.raises(kvx.MisuseError):
        tx.allocate("never-begun", timeout=1.0)
    tx.begin("m", receiver=peer, total_chunks=1)
    assert tx.wait_admitted("m", timeout=WAIT)
    slot = tx.allocate("m", timeout=WAIT)
    free = tx.staging_free
    del slot  # dropped unused: the slot goes back
    assert tx.staging_free == free + 1
    slot = tx.allocate("m", timeout=WAIT)
    with pytest.raises(kvx.MisuseError, match="bytes"):
        tx.add(slot, "m@0", nbytes=SLOT + 1)
    with pytest.raises(kvx.MisuseError, match="already added or released"):
        tx.add(slot, "m@0")
    with pytest.raises(kvx.TimedOutError, match="not ended"):
        tx.wait_outcome("m", timeout=0.1)
    slot = tx.allocate("m", timeout=WAIT)
    with pytest.raises(kvx.MisuseError, match="declared chunks"):
        tx.allocate("m", timeout=WAIT)


def test_the_decoder_sees_the_layout_and_token_counts_the_sender_gave():
    """The chunks' shape, dtype and format reach the decoder, and so does the token count of
    each batch's last chunk (a partial last chunk is viewed with its true length)."""
    tx, rx, peer, _, _ = make_pair()
    tx.begin("lay", receiver=peer, total_chunks=3, shape=[2, 4, 16, 8], dtype="float16", fmt=1)
    assert tx.wait_admitted("lay", timeout=WAIT)
    for chunk, tokens in ((0, 16), (1, 16)):
        slot = tx.allocate("lay", timeout=WAIT)
        tx.add(slot, f"lay@{chunk}", tokens=tokens)
    tx.submit("lay")
    slot = tx.allocate("lay", timeout=WAIT)
    tx.add(slot, "lay@2", nbytes=100, tokens=5)
    tx.submit("lay", last=True)
    (lease,) = rx.next_ready(max=1, timeout=WAIT)
    with lease:
        assert (lease.shape, lease.dtype, lease.fmt) == ([2, 4, 16, 8], "float16", 1)
        assert lease.tokens == [None, 16, 5]
    tx.wait_outcome("lay", timeout=WAIT)
    tx.close()
    rx.close()


def test_consume_without_waiting_frees_the_slots_all_the_same():
    tx, rx, peer, _, _ = make_pair(buffer_slots=4, staging_slots=2)
    tx.begin("r", receiver=peer, total_chunks=2)
    assert tx.wait_admitted("r", timeout=WAIT)
    for chunk in range(2):
        stage(tx, "r", chunk)
    tx.submit("r", last=True)
    (lease,) = rx.next_ready(max=1, timeout=WAIT)
    lease.consume(wait=False)
    with pytest.raises(kvx.MisuseError, match="already consumed"):
        lease.consume()
    for _ in range(100):  # the driver frees them moments later
        if rx.snapshot()["free"] == 4:
            break
        threading.Event().wait(0.02)
    assert rx.snapshot()["free"] == 4, rx.snapshot()


def test_many_threads_on_few_staging_slots_are_each_woken_for_their_turn():
    """Twelve prefill threads share two staging slots, and every fourth request is cancelled
    midway (a cancel wakes every wait; a freed slot only the oldest request's call; a
    request's end only its own waits): every call ends within its bound, and every request
    that was not cancelled arrives byte-exact. A wake-up that went missing would only slow
    this down (a blocked call looks again at each 50 ms signal check): the Rust test
    ``async_calls_are_woken_only_by_what_they_wait_for`` (kvx-node) catches that."""
    tx, rx, peer, buffer, _ = make_pair(buffer_slots=16, staging_slots=2)
    threads, per_thread, chunks = 12, 3, 4
    kept = [f"t{t}-{i}" for t in range(threads) for i in range(per_thread) if (t + i) % 4]
    results = {}
    decoder = threading.Thread(target=decode_all, args=(rx, len(kept), buffer, results))
    decoder.start()
    errors = []

    def prefill(t):
        try:
            for i in range(per_thread):
                r = f"t{t}-{i}"
                tx.begin(r, receiver=peer, total_chunks=chunks)
                assert tx.wait_admitted(r, timeout=WAIT)
                for chunk in range(chunks):
                    if (t + i) % 4 == 0 and chunk == 2:
                        tx.cancel(r)
                        with pytest.raises(kvx.CancelledError):
                            tx.wait_outcome(r, timeout=WAIT)
                        break
                    stage(tx, r, chunk)
                    if chunk % 2 == 1:
                        tx.submit(r, last=chunk == chunks - 1)
                else:
                    tx.wait_outcome(r, timeout=WAIT)
        except Exception as e:  # reported below
            errors.append(e)

    workers = [threading.Thread(target=prefill, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors, errors
    decoder.join(timeout=30)
    assert sorted(results) == sorted(kept) and all(results.values()), results
    assert tx.staging_free == 2
