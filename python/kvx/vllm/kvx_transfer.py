"""The transfers over kvx, one per side: the decode engine's ``DecodeTransfer``
(``kvx.vllm.kvx_decode``: a caller-placement ``kvx.Receiver`` over the engine's own per-layer
KV tensors) and the prefill engine's ``PrefillTransfer`` (``kvx.vllm.kvx_prefill``: a
``kvx.Sender``); ``transfer_for`` makes the one of a side. How they meet:

**One kvx request per layer.** A vLLM request ``X`` is ``len(layers)`` kvx requests, ``X.0``,
``X.1``, …: the prefill engine computes and writes layer by layer (``save_kv_layer``), and a
kvx request's chunks go in order, so each layer's blocks make one request whose chunk order
is the prompt's block order whatever the scheduler's steps are. The decode engine reserves
each layer's pages of the request's blocks (``PagedLayout.block_pages``); its local prefix
hit (blocks before ``first_block``) is the reservation's ``held`` chunks, which the prefill
engine still sends and kvx answers as already sent. The request is received when every
layer's reservation came back consumed; it failed when any came back otherwise (the others
are withdrawn at once).

**No staging copy on the prefill side.** The engine's per-layer KV tensors are the sender's
staging, lent in parts as the decode side lends its buffer (``kvx.Sender(placement="caller")``,
docs/spec/protocol.md "Caller staging"): ``save_kv_layer`` names each page's slot and kvx
writes it straight from the engine's block. The engine keeps a request's blocks until the
worker reports it sent, which is only once every layer reads them no more (delivered, or
failed with its last write completed: ``Sender.wait_released``). With checksums off, or
``copy_staging=True`` (for a sender that must own its staging: a test's corrupting sender),
each page is copied into kvx's own staging first instead: vLLM may preempt a prefill request
and hand its blocks to another while a write of an earlier step still reads them, which only
the decode side's checksum can catch. Pages consecutive in both engines' KV (a run of blocks)
go as one write over TCP: the sender posts a layer's batch in runs (``kvx_io::WriteRun``).

Every wait is bounded: a claim by ``claim_timeout_sec``, a silent request by
``idle_timeout_sec``, a grant by ``grant_timeout_sec`` (the scheduler's), a staging slot by
``write_timeout_sec``, a connection by ``connect_timeout_sec``, a silent peer engine by
``heartbeat_timeout_sec``.
"""

from __future__ import annotations

from typing import List, Optional, Union

from kvx.vllm.kvx_decode import DecodeTransfer
from kvx.vllm.kvx_prefill import PrefillTransfer
from kvx.vllm.pages import layer_request, split_layer_request
from kvx.vllm.settings import KvxVllmSettings


def transfer_for(
    settings: KvxVllmSettings, tp_rank: int, num_blocks: Optional[int], block_size: Optional[int] = None
) -> Union[DecodeTransfer, PrefillTransfer]:
    """The transfer of ``settings.side``; ``block_size`` (vLLM's) words its failures."""
    if settings.side == "decode":
        return DecodeTransfer(settings, tp_rank, num_blocks, block_size=block_size)
    return PrefillTransfer(settings, tp_rank, num_blocks, block_size=block_size)


__all__: List[str] = ["DecodeTransfer", "PrefillTransfer", "layer_request", "split_layer_request", "transfer_for"]
