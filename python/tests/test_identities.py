"""Sender identities from Python: several ``kvx.Sender`` objects in one process, each left
to its default identity, all deliver to one ``kvx.Receiver``; two given the same
``local_id`` cannot both use it, and the second hears why (``kvx.IdentityRefusedError``, a
``kvx.RefusedError``), not a lost connection."""

import pytest

import kvx

np = pytest.importorskip("numpy")

SLOT = 1024
WAIT = 10.0


def test_four_senders_in_one_process_all_deliver_to_one_receiver():
    rx = kvx.Receiver(slots=16, slot_bytes=SLOT, peer_share_percent=100)
    senders = [kvx.Sender(slots=2, slot_bytes=SLOT) for _ in range(4)]
    for s, tx in enumerate(senders):
        peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
        req = f"req-{s}"
        tx.begin(req, receiver=peer, total_chunks=1)
        assert tx.wait_admitted(req, timeout=WAIT)
        slot = tx.allocate(req, timeout=WAIT)
        np.frombuffer(slot.view, dtype=np.uint8)[:] = s
        tx.add(slot, f"{req}@0", tokens=256)
        tx.submit(req, last=True)
    delivered = {}
    for _ in range(100):  # bounded: 100 waits of at most 0.2 s
        for lease in rx.next_ready(max=4, timeout=0.2):
            with lease:
                delivered[lease.req_id] = bytes(lease.views()[0])
        if len(delivered) == 4:
            break
    assert sorted(delivered) == [f"req-{s}" for s in range(4)]
    for s in range(4):
        assert delivered[f"req-{s}"] == bytes([s]) * SLOT
    for s, tx in enumerate(senders):
        tx.wait_outcome(f"req-{s}", timeout=WAIT)


def test_a_second_sender_with_the_same_local_id_is_refused_with_a_typed_error():
    rx = kvx.Receiver(slots=4, slot_bytes=SLOT)
    first = kvx.Sender(slots=2, slot_bytes=SLOT, local_id="same-id")
    first.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    second = kvx.Sender(slots=2, slot_bytes=SLOT, local_id="same-id")
    with pytest.raises(kvx.IdentityRefusedError, match="another connection holds it") as caught:
        second.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    assert isinstance(caught.value, kvx.RefusedError)
    assert not isinstance(caught.value, kvx.ReceiverLostError)
