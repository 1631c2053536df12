"""An engine's paged KV as kvx slots: ``PagedLayout``.

vLLM hands each worker its paged KV as one tensor per layer (``register_kv_caches``). A kvx
slot is one *page*: the part of one block of one layer that is contiguous in memory. vLLM's
CPU attention backend lays a layer out as ``[num_blocks, ...]``: a block is one page. A layout
with K and V apart, ``[2, num_blocks, ...]`` (vLLM's GPU flash-attention backend), makes a
block two pages, its K page and its V page.

Both engines run the same model, so both derive the same layout: the layers in the order of
their names, and within layer ``l`` part ``k`` of block ``b`` at slot
``l * pages_per_layer + k * num_blocks + b``, which is where ``kvx.Receiver(buffer=[one byte
view per layer])`` numbers it (parts end to end). A request's pages go in chunk order block by
block (``block_pages``), so the decode engine's reservation and the prefill engine's writes
agree on chunk ``j * pages_per_block + k``. Does not import vLLM or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np


def layer_request(kvx_id: str, layer: int) -> str:
    """A layer's kvx request id: ``{kvx id}.{layer index}``."""
    return f"{kvx_id}.{layer}"


def split_layer_request(req_id: str) -> Tuple[str, int]:
    """``layer_request``'s inverse."""
    kvx_id, _, layer = req_id.rpartition(".")
    return kvx_id, int(layer)


class LayoutError(ValueError):
    """The engine's KV tensors cannot be moved by kvx as they are laid out."""


def byte_view(tensor: Any) -> np.ndarray:
    """The tensor's memory as a flat ``uint8`` array (no copy): a CPU ``torch.Tensor``
    through ``.numpy()``, or a NumPy array. Refuses GPU tensors and non-contiguous memory."""
    if hasattr(tensor, "device") and hasattr(tensor, "numpy"):
        if str(tensor.device) != "cpu":
            raise LayoutError(
                f"a KV tensor on {tensor.device}: kvx moves KV from host memory; with KV on a "
                "GPU set \"kv_buffer_device\": \"cpu\" in --kv-transfer-config (a host buffer, "
                "docs/vllm.md, 'GPU engines')"
            )
        tensor = tensor.detach().numpy()
    array = np.asarray(tensor)
    if not array.flags.c_contiguous:
        raise LayoutError("a KV tensor that is not contiguous in memory")
    if not array.flags.writeable:
        raise LayoutError("a KV tensor that is not writable")
    return array.reshape(-1).view(np.uint8)


@dataclass(frozen=True)
class PagedLayout:
    """Where each block of each layer lies, as kvx slots of ``page_bytes``."""

    layer_names: Tuple[str, ...]
    num_blocks: int
    pages_per_block: int
    page_bytes: int

    @classmethod
    def of(cls, kv_caches: Mapping[str, Any], num_blocks: Optional[int] = None) -> "PagedLayout":
        """The layout of ``kv_caches`` (layer name → tensor). ``num_blocks``: the engine's
        block count (vLLM's ``KVCacheConfig.num_blocks``); None takes a ``[num_blocks, ...]``
        layout's first dimension."""
        if not kv_caches:
            raise LayoutError("no KV tensors to move")
        names = tuple(sorted(kv_caches))
        shapes = {tuple(kv_caches[n].shape) for n in names}
        dtypes = {str(kv_caches[n].dtype) for n in names}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise LayoutError(
                f"the layers' KV tensors differ (shapes {sorted(shapes)}, dtypes {sorted(dtypes)}); "
                "kvx.vllm needs one shape and dtype for every layer (one KV cache group)"
            )
        shape = shapes.pop()
        nbytes = byte_view(kv_caches[names[0]]).size
        blocks = num_blocks if num_blocks is not None else (shape[0] if shape else 0)
        if len(shape) >= 2 and shape[0] == blocks:
            parts = 1
        elif len(shape) >= 3 and shape[0] == 2 and shape[1] == blocks:
            parts = 2
        else:
            raise LayoutError(
                f"a KV tensor of shape {list(shape)} for {blocks} blocks: kvx.vllm knows "
                "[num_blocks, ...] (vLLM's CPU backend) and [2, num_blocks, ...] (K and V apart)"
            )
        if blocks <= 0 or nbytes % (parts * blocks):
            raise LayoutError(f"{nbytes} bytes per layer do not split into {parts} x {blocks} pages")
        return cls(names, blocks, parts, nbytes // (parts * blocks))

    @property
    def pages_per_layer(self) -> int:
        return self.pages_per_block * self.num_blocks

    @property
    def slots(self) -> int:
        """kvx slots over every layer."""
        return len(self.layer_names) * self.pages_per_layer

    def layer_index(self, name: str) -> int:
        try:
            return self.layer_names.index(name)
        except ValueError:
            raise LayoutError(f"layer {name!r} is not one of the registered KV tensors") from None

    def block_pages(self, layer: int, block_ids: Sequence[int]) -> List[int]:
        """The slots of ``block_ids`` of ``layer``, in chunk order: block by block, a block's
        parts in order."""
        base = layer * self.pages_per_layer
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise LayoutError(f"block {b} is outside the engine's {self.num_blocks} blocks")
        return [
            base + part * self.num_blocks + b for b in block_ids for part in range(self.pages_per_block)
        ]

    def page(self, layer_bytes: np.ndarray, part: int, block: int) -> np.ndarray:
        """Part ``part`` of block ``block`` within one layer's byte view."""
        at = (part * self.num_blocks + block) * self.page_bytes
        return layer_bytes[at : at + self.page_bytes]
