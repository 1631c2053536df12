"""Caller staging from Python (``kvx.Sender(placement="caller")``, docs/spec/protocol.md
§Caller staging): the sender's staging is the program's own memory, lent as per-layer
buffers, where the chunks already are; ``submit_slots`` sends each batch straight from the
slots it names (two requests may name one, as requests sharing a prefix block do), over
ZeroMQ and the TCP fabric on loopback, every byte compared at the receiver; nothing is
allocated; ``wait_released`` says when the program may change the slots again. This is what
a vLLM prefill engine's connector does with its KV blocks."""

import pytest

import kvx

np = pytest.importorskip("numpy")

SLOT = 4096
WAIT = 10.0
LAYERS = 2
BLOCKS = 4


def pattern(slot: int) -> "np.ndarray":
    return ((np.arange(SLOT, dtype=np.uint32) + slot * 37 + 11) % 251).astype(np.uint8)


def caller_sender():
    """A pool receiver and a caller-staging sender over two layers of BLOCKS slots, each slot
    holding ``pattern(slot)``."""
    layers = [np.zeros(BLOCKS * SLOT, dtype=np.uint8) for _ in range(LAYERS)]
    for layer, buf in enumerate(layers):
        for block in range(BLOCKS):
            buf[block * SLOT:(block + 1) * SLOT] = pattern(layer * BLOCKS + block)
    rx = kvx.Receiver(slots=8, slot_bytes=SLOT, peer_share_percent=100)
    tx = kvx.Sender(slots=LAYERS * BLOCKS, slot_bytes=SLOT, staging=layers, placement="caller")
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    return tx, rx, peer, layers


def received(rx, n):
    """The next ``n`` ready requests' chunks, by request id, each lease consumed."""
    got = {}
    while len(got) < n:
        for lease in rx.next_ready(max=4, timeout=WAIT):
            with lease:
                got[lease.req_id] = [bytes(v) for v in lease.views()]
    return got


def test_two_requests_send_straight_from_the_slots_they_name_one_of_them_shared():
    tx, rx, peer, _layers = caller_sender()
    with tx, rx:
        for req_id in ("a", "b"):
            tx.begin(req_id, receiver=peer, total_chunks=2)
            assert tx.wait_admitted(req_id, timeout=WAIT)
        # Slot 5 (layer 1, block 1) is read by both requests at once.
        tx.submit_slots("a", [0, 5], ["a@0", "a@1"], last=True)
        tx.submit_slots("b", [5, 7], ["b@0", "b@1"], tokens=3, last=True)
        got = received(rx, 2)
        for req_id, slots in (("a", [0, 5]), ("b", [5, 7])):
            tx.wait_released(req_id, timeout=WAIT)
            for chunk, slot in enumerate(slots):
                assert got[req_id][chunk] == pattern(slot).tobytes(), (req_id, chunk)


def test_nothing_is_allocated_from_the_programs_staging():
    tx, rx, peer, _layers = caller_sender()
    with tx, rx:
        tx.begin("a", receiver=peer, total_chunks=1)
        assert tx.wait_admitted("a", timeout=WAIT)
        with pytest.raises(kvx.MisuseError, match="staging_placement = caller"):
            tx.allocate("a", timeout=1.0)


def test_a_cancelled_request_is_released_with_its_failure():
    tx, rx, peer, _layers = caller_sender()
    with tx, rx:
        tx.begin("a", receiver=peer, total_chunks=2)
        assert tx.wait_admitted("a", timeout=WAIT)
        tx.submit_slots("a", [3], ["a@0"])
        tx.cancel("a")
        with pytest.raises(kvx.CancelledError):
            tx.wait_released("a", timeout=WAIT)


def test_bad_batches_and_settings_are_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="own memory"):
        kvx.Sender(slots=4, slot_bytes=SLOT, placement="caller")
    with pytest.raises(ValueError, match="placement"):
        kvx.Sender(slots=4, slot_bytes=SLOT, placement="elsewhere")
    tx, rx, peer, _layers = caller_sender()
    with tx, rx:
        tx.begin("a", receiver=peer, total_chunks=2)
        assert tx.wait_admitted("a", timeout=WAIT)
        with pytest.raises(ValueError, match="one key per chunk"):
            tx.submit_slots("a", [0, 1], ["a@0"])
        with pytest.raises(kvx.MisuseError, match="slots 0..8"):
            tx.submit_slots("a", [8], ["a@0"])


def test_a_pool_sender_refuses_submit_slots_and_leaves_other_requests_slots_alone():
    """On a sender staging in kvx's pool the slots belong to the requests that took them:
    ``submit_slots`` is refused before it touches one (its checksum or length)."""
    rx = kvx.Receiver(slots=8, slot_bytes=SLOT, peer_share_percent=100)
    tx = kvx.Sender(slots=2, slot_bytes=SLOT)
    with tx, rx:
        peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
        for req_id in ("a", "b"):
            tx.begin(req_id, receiver=peer, total_chunks=1)
            assert tx.wait_admitted(req_id, timeout=WAIT)
        # A chunk shorter than its slot: a whole-slot length or checksum written over it
        # would make its write disagree with what its batch declared.
        slot = tx.allocate("a", timeout=WAIT)
        slot.write(pattern(1).tobytes()[:100])
        tx.add(slot, "a@0", nbytes=100)
        with pytest.raises(kvx.MisuseError, match="caller staging"):
            tx.submit_slots("b", [slot.index], ["b@0"], last=True)
        tx.submit("a", last=True)
        tx.wait_outcome("a", timeout=WAIT)
        [chunk] = received(rx, 1)["a"]
        assert chunk[:100] == pattern(1).tobytes()[:100]


def test_chunks_consecutive_on_both_sides_go_as_one_write():
    """Four chunks read from consecutive slots into consecutive reserved slots are one TCP
    write (``write_counts``); three whose reserved slots break after two are two."""
    layers = [np.zeros(BLOCKS * SLOT, dtype=np.uint8) for _ in range(LAYERS)]
    for layer, buf in enumerate(layers):
        for block in range(BLOCKS):
            buf[block * SLOT:(block + 1) * SLOT] = pattern(layer * BLOCKS + block)
    rx = kvx.Receiver(slots=8, slot_bytes=SLOT, placement="caller")
    tx = kvx.Sender(slots=LAYERS * BLOCKS, slot_bytes=SLOT, staging=layers, placement="caller")
    with tx, rx:
        peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
        assert tx.write_counts() == (0, 0)
        cases = {"run": ([0, 1, 2, 3], [4, 5, 6, 7]), "split": ([4, 5, 6], [0, 1, 3])}
        for req_id, (staging, reserved) in cases.items():
            secret = f"secret-of-{req_id}-0123456789"
            rx.reserve(req_id, reserved, claim_secret=secret)
            tx.begin(req_id, receiver=peer, total_chunks=len(staging), claim_secret=secret)
            assert tx.wait_admitted(req_id, timeout=WAIT)
            tx.submit_slots(req_id, staging, [f"{req_id}@{i}" for i in range(len(staging))], last=True)
            tx.wait_released(req_id, timeout=WAIT)
        assert tx.write_counts() == (1 + 2, 7 * SLOT)
        got = received(rx, 2)
        for req_id, (staging, _) in cases.items():
            for chunk, slot in enumerate(staging):
                assert got[req_id][chunk] == pattern(slot).tobytes(), (req_id, chunk)
