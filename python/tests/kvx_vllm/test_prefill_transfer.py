"""``PrefillTransfer`` over a scripted sender (no sockets): the prefill engine's pages are
the sender's staging (``placement="caller"``), each layer's pages go as one batch naming the
engine's own slots, and a push is reported sent only once none of its layers reads the
engine's blocks any more — a failed layer only after its last posted write has completed
(``Sender.wait_released``), since vLLM frees the blocks when it hears the request was sent."""

from __future__ import annotations

import types
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

import kvx
from kvx.vllm.kvx_transfer import PrefillTransfer, layer_request
from kvx.vllm.settings import settings_from

LAYERS = 2
BLOCKS = 8
BLOCK_SHAPE = (2, 4, 16)


class ScriptedSender:
    """The parts of ``kvx.Sender`` ``PrefillTransfer`` uses, whose ends and drains the test
    decides."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.batches: List[Tuple[str, List[int], List[str], bool]] = []
        self.cancelled: List[str] = []
        self.ends: List[Tuple[str, Optional[kvx.KvxError]]] = []
        self.reading: Set[str] = set()
        self.admitted: List[Tuple[str, Optional[kvx.KvxError]]] = []

    def add_receiver(self, alloc: str, fabric: str, *, timeout: float = 10.0) -> int:
        return 1

    def begin(self, req_id: str, *, report_admission: bool = False, **kwargs: Any) -> None:
        assert report_admission, "admissions come as events"
        self.admitted.append((req_id, None))

    def next_admitted(self, max: int = 64, timeout: Optional[float] = None):
        admitted, self.admitted = self.admitted[:max], self.admitted[max:]
        return admitted

    def submit_slots(self, req_id: str, slots, keys, *, tokens=0, last=False) -> None:
        self.batches.append((req_id, list(slots), list(keys), last))
        self.reading.add(req_id)

    def cancel(self, req_id: str) -> None:
        self.cancelled.append(req_id)
        self.ends.append((req_id, kvx.CancelledError(f"{req_id} cancelled")))

    def next_ends(self, max: int = 64, timeout: Optional[float] = None):
        ends, self.ends = self.ends[:max], self.ends[max:]
        return ends

    def write_counts(self) -> Tuple[int, int]:
        return (0, 0)

    def wait_released(self, req_id: str, timeout: Optional[float] = None) -> None:
        if req_id in self.reading:
            raise kvx.TimedOutError(f"{req_id} still reads the sender's staging")
        raise kvx.CancelledError(f"{req_id} cancelled")

    def close(self) -> None:
        pass


def transfer(extra: Optional[Dict[str, Any]] = None) -> Tuple[PrefillTransfer, ScriptedSender]:
    settings = settings_from(
        types.SimpleNamespace(kv_role="kv_producer", engine_id="p", kv_connector_extra_config=extra or {})
    )
    made: Dict[str, ScriptedSender] = {}

    def factory(**kwargs: Any) -> ScriptedSender:
        made["sender"] = ScriptedSender(**kwargs)
        return made["sender"]

    t = PrefillTransfer(settings, 0, BLOCKS, sender_factory=factory)  # type: ignore[arg-type]
    kv = {
        f"model.layers.{i}.self_attn.attn": np.zeros((BLOCKS, *BLOCK_SHAPE), np.float32)
        for i in range(LAYERS)
    }
    t.register_kv_caches(kv)
    return t, made["sender"]


def pushed(t: PrefillTransfer, tx: ScriptedSender, kvx_id: str, blocks: List[int]) -> None:
    t.begin(kvx_id, "secret-0123456789abcdef", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", len(blocks))
    assert kvx_id in t.poll().granted
    for layer in range(LAYERS):
        t.write_layer(kvx_id, f"model.layers.{layer}.self_attn.attn", None, 0, blocks, last=True)


def test_the_engines_pages_are_the_staging_and_each_layer_names_its_own_slots():
    t, tx = transfer()
    assert tx.kwargs["placement"] == "caller"
    assert len(tx.kwargs["staging"]) == LAYERS, "one part per layer"
    assert tx.kwargs["slots"] == LAYERS * BLOCKS
    pushed(t, tx, "X", [5, 2])
    layout = t.layout
    assert layout is not None
    assert tx.batches == [
        (layer_request("X", layer), layout.block_pages(layer, [5, 2]), ["0.0", "1.0"], True)
        for layer in range(LAYERS)
    ]


def test_a_failed_push_is_sent_only_once_no_posted_write_reads_the_engines_blocks():
    t, tx = transfer()
    pushed(t, tx, "X", [3])
    # Layer 0's write fails; the transfer cancels layer 1. Both still have writes posted.
    tx.ends.append((layer_request("X", 0), kvx.ReceiverLostError("write failed")))
    assert "X" not in t.poll().sent, "posted writes still read the blocks"
    assert tx.cancelled == [layer_request("X", 1)]
    assert "X" not in t.poll().sent
    tx.reading.discard(layer_request("X", 0))
    assert "X" not in t.poll().sent, "layer 1 still reads them"
    tx.reading.discard(layer_request("X", 1))
    events = t.poll()
    assert "X" in events.sent
    # Granted, then failed: undelivered, with kvx's reason (the span's error), not refused.
    assert "write failed" in events.undelivered["X"] and not events.refused
    events = t.poll()
    assert "X" not in events.sent and not events.undelivered, "reported once"


def test_a_push_is_granted_once_every_layers_admission_came_and_never_on_a_failed_one():
    t, tx = transfer()
    t.begin("X", "secret-0123456789abcdef", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", 1)
    t.begin("Y", "secret-0123456789abcdef", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", 1)
    x = [a for a in tx.admitted if a[0].startswith("X.")]
    y = [(req_id, kvx.RefusedError(f"{req_id} refused")) for req_id, _ in tx.admitted if req_id.startswith("Y.")]
    tx.admitted = x[:1]  # one layer of X admitted so far; Y's admissions failed
    assert not t.poll().granted
    tx.admitted = x[1:] + y
    assert t.poll().granted == {"X"}  # Y's end comes through next_ends


def test_a_delivered_push_is_sent_at_once():
    t, tx = transfer()
    pushed(t, tx, "X", [1, 4])
    tx.ends += [(layer_request("X", layer), None) for layer in range(LAYERS)]
    events = t.poll()
    assert "X" in events.sent and not events.undelivered and not events.refused


def test_without_checksums_the_pages_are_copied_into_kvxs_own_staging():
    """vLLM may preempt a prefill request and give its blocks to another while a write of an
    earlier step still reads them: only a checksum lets the decode engine tell, so without
    checksums the engine's pages are never sent in place."""
    _, tx = transfer({"checksums": False})
    assert "placement" not in tx.kwargs and "staging" not in tx.kwargs, tx.kwargs
    assert tx.kwargs["checksums"] is False
