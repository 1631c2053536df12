"""kvx's reasons for a failed transfer, in vLLM's terms (``kvx.vllm.reasons``), as each engine
reads them, and a closed port told from a silent one. The last test takes kvx's words from a
real sender and receiver, so that a change of kvx's wording shows here. No vLLM needed."""

from __future__ import annotations

import socket
import time

import pytest

import kvx
from kvx.testing import free_port
from kvx.vllm.reasons import connection_refused, explain, kvx_setting_names

#: kvx's words, as its sender raises them and its receiver returns them.
SIZES = ("a write failed: the fabric at 127.0.0.1:1 is incompatible: the sender's chunks are 2048 "
         "bytes but the receiver's slots are 1024 bytes: start both with the same chunk size")
COUNTS = ("refused by the receiver: request peer1/k.0: request needs 3 chunks but its reservation "
          "lends 2 slots: the prefill and decode sides disagree on the request's size")


def test_page_sizes_become_both_engines_block_sizes_on_either_side():
    # Prefill pages of 2048 bytes at block size 8: 256 bytes a token; the decode engine's
    # 1024-byte pages are then 4 tokens. Both engines say the same.
    prefill = explain(SIZES, "prefill", block_size=8, page_bytes=2048)
    decode = explain("the sender's chunks are 2048 bytes but the receiver's slots are 1024 bytes",
                     "decode", block_size=4, page_bytes=1024)
    assert prefill == decode
    assert prefill.startswith("block size 8 on the prefill engine, 4 on the decode engine: start both "
                              "with the same --block-size")
    assert "chunk" not in prefill and "slot" not in prefill


def test_page_sizes_that_no_block_size_explains_are_named_as_pages():
    # Unknown block size, or a ratio that is no whole block size: the pages, and what differs.
    for said in (explain(SIZES, "prefill"), explain(SIZES, "prefill", block_size=3, page_bytes=2048),
                 explain(SIZES, "prefill", block_size=8, page_bytes=4096)):
        assert said.startswith("KV pages of 2048 bytes on the prefill engine but 1024 on the decode engine")
        assert "--block-size" in said


def test_a_claim_larger_than_its_reservation_is_blocks_and_each_engine_adds_its_block_size():
    prefill = explain(COUNTS, "prefill", block_size=4, page_bytes=1024)
    decode = explain("request needs 3 chunks but its reservation lends 2 slots: ...", "decode",
                     block_size=8, page_bytes=2048)
    shared = ("block sizes differ: the prefill engine has 3 of the prompt's blocks to send where the "
              "decode engine reserved 2, so the decode engine's --block-size is the larger")
    assert prefill.startswith(shared) and prefill.endswith("(the prefill engine's is 4)")
    assert decode.startswith(shared) and decode.endswith("(the decode engine's is 8)")
    # K and V apart: two pages a block.
    assert "has 3 of the prompt's blocks to send where the decode engine reserved 2" in explain(
        "request needs 6 chunks but its reservation lends 4 slots", "prefill", pages_per_block=2)


def test_kvx_phrases_and_setting_names_become_the_connectors():
    assert explain("cancelled by the sender", "decode").startswith("the prefill engine cancelled its push")
    assert "claim_timeout_sec" in explain(
        "no sender claimed the reservation within admission_timeout: the prefill side never sent "
        "the request, or sent it elsewhere", "decode")
    said = explain("a write failed: this sender's timeouts do not fit the receiver's: sender write_timeout "
                   "10s must be below the receiver's request_idle_timeout 3s", "prefill")
    assert "write_timeout_sec (prefill) 10s must be below the receiver's idle_timeout_sec (decode) 3s" in said
    assert kvx_setting_names("connect_timeout_sec stays") == "connect_timeout_sec stays"
    assert explain("something else entirely", "prefill") == "something else entirely"


def test_a_closed_port_is_refused_at_once_and_an_open_one_is_not():
    closed = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    said = connection_refused(closed, timeout=5.0)
    assert said is not None and said.startswith(f"connection refused at {closed}") and "kvx_alloc" in said
    assert time.monotonic() - start < 1.0
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        assert connection_refused(f"tcp://127.0.0.1:{listening.getsockname()[1]}", timeout=5.0) is None
    assert connection_refused("ipc:///tmp/x", timeout=1.0) is None


def kvx_words(receiver_slot_bytes: int, sender_chunk_bytes: int, reserved: int, declared: int):
    """What kvx itself says, on either side, of one claim under caller placement: the
    sender's error, and the reason its reservation came back with."""
    np = pytest.importorskip("numpy")
    secret = "s" * 24
    with kvx.Receiver(slots=8, slot_bytes=receiver_slot_bytes, buffer=np.zeros(8 * receiver_slot_bytes, np.uint8),
                      placement="caller") as rx, \
            kvx.Sender(slots=8, slot_bytes=sender_chunk_bytes, staging=np.ones(8 * sender_chunk_bytes, np.uint8),
                       placement="caller") as tx:
        rx.reserve("k.0", list(range(reserved)), claim_secret=secret)
        peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint, timeout=5)
        tx.begin("k.0", receiver=peer, total_chunks=declared, shape=[sender_chunk_bytes], dtype="uint8",
                 claim_secret=secret)
        sender_said = None
        try:
            if tx.wait_admitted("k.0", timeout=5):
                tx.submit_slots("k.0", list(range(declared)), [str(i) for i in range(declared)], last=True)
                ends = tx.next_ends(timeout=5)
                sender_said = str(ends[0][1]) if ends and ends[0][1] is not None else None
        except kvx.RefusedError as e:
            sender_said = str(e)
        back = rx.returned(timeout=5)
        return sender_said, (back[0].reason if back else None)


def test_kvxs_own_words_are_recognized_on_both_sides():
    sender_said, returned = kvx_words(receiver_slot_bytes=2048, sender_chunk_bytes=1024, reserved=2, declared=3)
    shared = explain(sender_said, "prefill").split(" (the")[0]
    assert shared.startswith("block sizes differ: the prefill engine has 3 of the prompt's blocks"), sender_said
    assert explain(returned, "decode").split(" (the")[0] == shared, returned
    sender_said, returned = kvx_words(receiver_slot_bytes=1024, sender_chunk_bytes=2048, reserved=3, declared=2)
    said = explain(sender_said, "prefill", block_size=8, page_bytes=2048)
    assert said.startswith("block size 8 on the prefill engine, 4 on the decode engine"), sender_said
    # The decode engine hears the sizes too: kvx's receiver refuses the first batch of longer
    # chunks and the reservation comes back with that reason (ChunkSizeMismatch).
    heard = explain(returned, "decode", block_size=4, page_bytes=1024)
    assert heard.startswith("block size 8 on the prefill engine, 4 on the decode engine"), returned


def test_a_load_that_failed_before_its_withdrawal_is_logged_with_its_reason(caplog):
    # The router closes the decode request at once when the prefill engine's claim was
    # refused; the decode engine may see the withdrawal before the failure. It logs kvx's
    # reason all the same (the worker reports a withdrawn load without one).
    import logging
    import types

    np = pytest.importorskip("numpy")
    from kvx.vllm.kvx_transfer import DecodeTransfer, layer_request
    from kvx.vllm.settings import settings_from

    extra = {"alloc_port": free_port(), "fabric_port": free_port()}
    settings = settings_from(types.SimpleNamespace(kv_role="kv_consumer", engine_id="d", kv_connector_extra_config=extra))
    decode = DecodeTransfer(settings, 0, 16, block_size=8)
    decode.register_kv_caches({"model.layers.0.self_attn.attn": np.zeros((16, 2, 8, 32), np.float32)})
    secret = "s" * 24
    try:
        decode.reserve("k", secret, 0, [3, 4], 16)
        page = decode.layout.page_bytes
        with kvx.Sender(slots=4, slot_bytes=page) as tx:
            peer = tx.add_receiver(settings.alloc_endpoint(0), settings.fabric_endpoint(0), timeout=5)
            tx.begin(layer_request("k", 0), receiver=peer, total_chunks=3, shape=[page], dtype="uint8",
                     claim_secret=secret)
            with pytest.raises(kvx.RefusedError):
                tx.wait_admitted(layer_request("k", 0), timeout=5)
        decode.release("k", reserved=True)
        with caplog.at_level(logging.WARNING, logger="kvx.vllm"):
            deadline = time.monotonic() + 10
            failed = {}
            while not failed:
                assert time.monotonic() < deadline, "the load did not end within 10 s"
                failed = decode.poll().failed
                time.sleep(0.01)
        assert failed == {"k": "withdrawn: the request ended on the decode engine"}
        assert "had failed to load before it was withdrawn: block sizes differ: the prefill engine has 3" in caplog.text
        assert "(the decode engine's is 8)" in caplog.text
    finally:
        decode.close()
