"""KV on a GPU, moved through a host buffer: ``HostBufferedDecode`` and
``HostBufferedPrefill`` (``host_buffered`` makes the one of a side).

kvx's fabrics move host memory. When an engine's paged KV lives on a device (a CUDA GPU),
the connector keeps a **host buffer**: one host tensor per layer, of the layer's logical
shape and dtype (pinned where the device is CUDA), all in one allocation (kvx sees one
range: RDMA registers it once; ``fabric: rdma`` always moves KV through it, on CPU engines
too), and hands *those* to the transfer beneath
(``kvx.vllm.kvx_transfer``), which then runs exactly as it does on a CPU engine. This
module only adds the copies between the device's blocks and the host buffer's:

- **prefill:** ``write_layer`` copies the layer's blocks device → host as the layer is
  saved, and posts the writes once the copy completed (never before: a write would read
  the host block's old bytes, and its checksum would cover them). On CUDA the copy runs on a
  stream of its own, ordered after the layer's compute by an event, so the forward pass
  never waits for it; the writes of a copy still running go out at the next call that
  finds it complete, and at the latest when the request finishes (``finish``, at the end
  of the step).
- **decode:** kvx lands into the reservation's host blocks; when a request is received
  complete, its blocks are copied host → device on the compute stream, before the worker
  reports it received, so the request's first forward (queued after the copy on the same
  stream) reads them.

Block ``b`` of the host buffer is block ``b`` of the engine (a mirror, not a pool), so a
host block lives exactly as long as its engine block: vLLM frees a prefill request's blocks
only once the worker reports it sent (delivered, or no write still reads them), and a
decode request's only after it ran. Nothing here decides when a host block may be reused.
The cost is host memory: as much as the engine's KV cache (docs/vllm.md, "GPU engines").

The host buffer's layout is the layer's *logical* shape, contiguous, whatever the device
tensor's strides (vLLM's HND and NHD orders differ in strides only), so two engines with
different attention backends agree on it. The copies are torch's own (``narrow`` and
``copy_`` over runs of consecutive blocks), which run on the CPU tensors of CI and on a CUDA
device alike: the same code path, one ``Copier``.

vLLM also hands connectors its platform's block copy (``set_host_xfer_buffer_ops``); it is
not used: vLLM's CPU platform has none (so CI could not run this path), it copies
synchronously, and it indexes blocks on the first dimension only, while K and V apart
(``[2, num_blocks, ...]``) keep blocks on the second. Does not import vLLM.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from kvx.vllm.pages import LayoutError, PagedLayout
from kvx.vllm.settings import ConfigError
from kvx.vllm.transfer import DecodeKvTransfer, PrefillKvTransfer, TransferEvents


def _parts(tensor: Any, block_dim: int) -> List[Any]:
    """The tensor as parts whose first dimension is the blocks: itself when blocks come
    first, else each part of its first dimension (K, V). A run of blocks of a part of a
    contiguous host tensor is contiguous, so a copy between it and the device never goes
    through a staging copy of torch's own."""
    return [tensor] if block_dim == 0 else [tensor.select(0, i) for i in range(tensor.shape[0])]


def block_runs(block_ids: Sequence[int]) -> List[Tuple[int, int]]:
    """``block_ids`` as runs of consecutive blocks, in order: (first block, length)."""
    runs: List[Tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


class PendingCopy:
    """A copy that was started: ``ready()`` without waiting, ``wait()`` until it is."""

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _CudaCopy(PendingCopy):
    def __init__(self, event: Any) -> None:
        self._event = event

    def ready(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()


class Copier:
    """Block copies between an engine's KV tensors and the host buffer, with torch's own
    operations. On a CUDA device, device → host runs on a copy stream after an event recorded
    on the compute stream (the layer's kernels), and reports completion by an event; host →
    device runs on the compute stream, so what runs after it reads the copied blocks. On the
    CPU both are plain copies, complete on return."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    def host_buffer(self, kv_caches: Mapping[str, Any]) -> Dict[str, Any]:
        """Host tensors of the layers' logical shape and dtype, contiguous (pinned when the KV
        is on CUDA, so that copies can run asynchronously), by layer name: one allocation,
        the layers end to end in the order of their names (kvx's slot order), so that kvx
        sees one range, which RDMA registers once. Layers of different shapes (refused by
        ``PagedLayout`` right after) get a tensor each."""
        torch = self._torch
        names = sorted(kv_caches)
        shapes = {(tuple(t.shape), t.dtype) for t in kv_caches.values()}
        if len(shapes) != 1:
            return {n: torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu", pin_memory=self.cuda)
                    for n, t in kv_caches.items()}
        ((shape, dtype),) = shapes
        whole = torch.empty((len(names), *shape), dtype=dtype, device="cpu", pin_memory=self.cuda)
        return {name: whole[i] for i, name in enumerate(names)}

    def to_host(self, src: Any, dst: Any, block_dim: int, block_ids: Sequence[int]) -> PendingCopy:
        """Starts copying ``block_ids`` of ``src`` (the engine's) into ``dst`` (the host's)."""
        torch = self._torch
        if not self.cuda:
            self._copy(src, dst, block_dim, block_ids)
            return PendingCopy()
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(src.device))
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(computed)
            self._copy(src, dst, block_dim, block_ids)
            done = torch.cuda.Event()
            done.record(self._stream)
        return _CudaCopy(done)

    def to_device(self, src: Any, dst: Any, block_dim: int, block_ids: Sequence[int]) -> None:
        """Copies ``block_ids`` of ``src`` (the host's) into ``dst`` (the engine's), ordered
        before whatever the compute stream runs next."""
        self._copy(src, dst, block_dim, block_ids)

    def _copy(self, src: Any, dst: Any, block_dim: int, block_ids: Sequence[int]) -> None:
        """Copies the runs of ``block_ids``, part by part, on the current stream
        (asynchronously from and to pinned memory on CUDA)."""
        for s_part, d_part in zip(_parts(src, block_dim), _parts(dst, block_dim)):
            for first, n in block_runs(block_ids):
                d_part.narrow(0, first, n).copy_(s_part.narrow(0, first, n), non_blocking=self.cuda)


def _device_type(tensor: Any) -> str:
    device = getattr(tensor, "device", None)
    return "cpu" if device is None else getattr(device, "type", str(device))


def asks_for_host_buffer(settings: Any) -> bool:
    """Whether the settings send KV in host memory through the host buffer too: when
    ``host_buffer`` says so, and always over RDMA, which registers what it moves once, as one
    range (the host buffer is one allocation; an engine's per-layer tensors are not)."""
    return bool(settings.host_buffer or settings.fabric == "rdma")


def needs_host_buffer(kv_caches: Mapping[str, Any], host_buffer: bool, kv_buffer_device: Optional[str]) -> bool:
    """Whether the engine's KV goes through a host buffer: always for KV on a device, which
    needs vLLM's ``kv_buffer_device: cpu`` (refused otherwise, saying what to set); for KV in
    host memory only when the ``host_buffer`` setting asks for it (the GPU path on a CPU
    engine)."""
    devices = sorted({_device_type(t) for t in kv_caches.values()})
    if devices == ["cpu"]:
        return host_buffer
    if len(devices) != 1:
        raise LayoutError(f"the layers' KV tensors are on several devices ({devices})")
    if (kv_buffer_device or "").lower() != "cpu":
        gib = sum(t.numel() * t.element_size() for t in kv_caches.values()) / 2**30
        raise ConfigError(
            f"KvxConnector: the KV cache is on {devices[0]} and kv_buffer_device is "
            f"{kv_buffer_device!r}; kvx moves KV from host memory: set \"kv_buffer_device\": "
            f"\"cpu\" in --kv-transfer-config (the connector then keeps a host copy of the KV "
            f"cache, {gib:.2f} GiB of pinned memory; docs/vllm.md, \"GPU engines\")"
        )
    return True


@dataclass
class _Write:
    """A layer's writes whose host copy may still be running."""

    copy: PendingCopy
    kvx_id: str
    layer_name: str
    first_block: int
    block_ids: Sequence[int]
    last: bool


class _HostBuffered:
    """What both sides' host-buffered transfers share: whether the engine's KV goes through
    a host buffer (``needs_host_buffer``, decided when the KV tensors are registered), the
    buffer, and the copier. ``inner`` is the transfer beneath, which moves the host
    buffer's bytes (or the engine's own, when no host buffer is needed). ``copier`` makes
    the ``Copier`` for the KV's device (tests give one whose copies complete late)."""

    def __init__(
        self,
        inner: Any,
        host_buffer: bool = False,
        kv_buffer_device: Optional[str] = None,
        copier: Callable[[Any], Copier] = Copier,
    ) -> None:
        self.inner = inner
        self.host_buffer = host_buffer
        self.kv_buffer_device = kv_buffer_device
        self._make_copier = copier
        self.copier: Optional[Copier] = None
        #: The engine's KV tensors and their host buffer, by layer name (staged only).
        self.device: Dict[str, Any] = {}
        self.host: Dict[str, Any] = {}
        self._block_dim = 0

    @property
    def staged(self) -> bool:
        return self.copier is not None

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        if not needs_host_buffer(kv_caches, self.host_buffer, self.kv_buffer_device):
            self.inner.register_kv_caches(kv_caches)
            return
        first = next(iter(kv_caches.values()))
        copier = self._make_copier(first.device)
        host = copier.host_buffer(kv_caches)
        num_blocks = getattr(self.inner, "num_blocks", None)
        layout = PagedLayout.of(host, num_blocks)
        # [num_blocks, ...]: blocks on the first dimension; [2, num_blocks, ...]: the second.
        self._block_dim = 0 if layout.pages_per_block == 1 else 1
        self.device, self.host, self.copier = dict(kv_caches), host, copier
        self.inner.register_kv_caches(host)

    def take_counts(self) -> Dict[str, Any]:
        return self.inner.take_counts()

    def close(self) -> None:
        self.inner.close()


class HostBufferedDecode(_HostBuffered):
    """A decode engine's ``DecodeKvTransfer`` through the host buffer: kvx lands into the
    reservation's host blocks, copied host → device when the request is received."""

    def __init__(self, inner: DecodeKvTransfer, host_buffer: bool = False, kv_buffer_device: Optional[str] = None,
                 copier: Callable[[Any], Copier] = Copier) -> None:
        super().__init__(inner, host_buffer, kv_buffer_device, copier)
        self.inner: DecodeKvTransfer = inner
        #: The blocks each reservation writes, and the reservations withdrawn.
        self._reserved: Dict[str, Sequence[int]] = {}
        self._withdrawn: Set[str] = set()

    def reserve(self, kvx_id: str, claim_secret: str, first_block: int, block_ids: Sequence[int],
                num_tokens: int) -> None:
        if self.staged:
            self._reserved[kvx_id] = list(block_ids)
        self.inner.reserve(kvx_id, claim_secret, first_block, block_ids, num_tokens)

    def release(self, kvx_id: str, reserved: bool) -> None:
        if kvx_id in self._reserved:
            self._withdrawn.add(kvx_id)
        self.inner.release(kvx_id, reserved)

    def poll(self) -> TransferEvents:
        events = self.inner.poll()
        if not self.staged:
            return events
        assert self.copier is not None
        for kvx_id in events.received:
            blocks = self._reserved.pop(kvx_id, None)
            if blocks is None or kvx_id in self._withdrawn:
                self._withdrawn.discard(kvx_id)
                continue
            for name, host in self.host.items():
                self.copier.to_device(host, self.device[name], self._block_dim, blocks)
        for kvx_id in events.failed:
            self._reserved.pop(kvx_id, None)
            self._withdrawn.discard(kvx_id)
        return events


class HostBufferedPrefill(_HostBuffered):
    """A prefill engine's ``PrefillKvTransfer`` through the host buffer: each layer's blocks
    copied device → host as it is saved, its writes posted once the copy completed."""

    def __init__(self, inner: PrefillKvTransfer, host_buffer: bool = False, kv_buffer_device: Optional[str] = None,
                 copier: Callable[[Any], Copier] = Copier) -> None:
        super().__init__(inner, host_buffer, kv_buffer_device, copier)
        self.inner: PrefillKvTransfer = inner
        self._writes: Deque[_Write] = deque()

    def begin(self, kvx_id: str, claim_secret: str, alloc: str, fabric: str, num_blocks: int) -> None:
        self.inner.begin(kvx_id, claim_secret, alloc, fabric, num_blocks)

    def write_layer(self, kvx_id: str, layer_name: str, kv_layer: Any, first_block: int,
                    block_ids: Sequence[int], last: bool) -> None:
        if not self.staged:
            self.inner.write_layer(kvx_id, layer_name, kv_layer, first_block, block_ids, last)
            return
        assert self.copier is not None
        device = self.device.get(layer_name)
        host = self.host.get(layer_name)
        if device is None or host is None:
            raise LayoutError(f"layer {layer_name!r} is not one of the registered KV tensors")
        copy = self.copier.to_host(device, host, self._block_dim, block_ids)
        self._writes.append(_Write(copy, kvx_id, layer_name, first_block, list(block_ids), last))
        self._post(wait=False)

    def _post(self, wait: bool) -> None:
        """Posts the writes whose host copy completed, in the order they were saved (a
        request's layers, and a layer's steps, stay in order); with ``wait``, all of them."""
        while self._writes:
            w = self._writes[0]
            if wait:
                w.copy.wait()
            elif not w.copy.ready():
                return
            self._writes.popleft()
            self.inner.write_layer(w.kvx_id, w.layer_name, self.host[w.layer_name], w.first_block,
                                   w.block_ids, w.last)

    def finish(self, kvx_id: str) -> None:
        self._post(wait=True)
        self.inner.finish(kvx_id)

    def cancel(self, kvx_id: str) -> None:
        # Writes not yet posted never will be: nothing of them reads the engine's blocks.
        self._writes = deque(w for w in self._writes if w.kvx_id != kvx_id)
        self.inner.cancel(kvx_id)

    def poll(self) -> TransferEvents:
        if self.staged:
            self._post(wait=False)
        return self.inner.poll()

    def close(self) -> None:
        self._writes.clear()
        self.inner.close()


def host_buffered(side: str, inner: Any, host_buffer: bool = False, kv_buffer_device: Optional[str] = None,
                  copier: Callable[[Any], Copier] = Copier) -> Union[HostBufferedDecode, HostBufferedPrefill]:
    """``inner`` (the transfer of ``side``) behind a host buffer where the KV needs one."""
    cls = HostBufferedDecode if side == "decode" else HostBufferedPrefill
    return cls(inner, host_buffer, kv_buffer_device, copier)


__all__ = [
    "Copier", "HostBufferedDecode", "HostBufferedPrefill", "PendingCopy", "asks_for_host_buffer", "block_runs",
    "host_buffered", "needs_host_buffer",
]
