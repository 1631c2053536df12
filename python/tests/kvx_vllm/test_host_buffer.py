"""KV moved through a host buffer (``kvx.vllm.host_buffer``), the path of GPU engines, run on
CPU tensors: a prefill transfer and a decode transfer, kvx's real ones over loopback TCP, each
wrapped in ``HostBufferedDecode`` and ``HostBufferedPrefill`` with ``host_buffer`` on, in every attention layout vLLM
0.33's backends use (logical shapes; HND and NHD differ in strides, which a permuted view
stands for). Every byte of every layer of the request's blocks arrives in the decode engine's
own tensors, nothing outside its blocks changes, copies that complete late are waited for,
and a GPU KV cache without ``kv_buffer_device: cpu`` is refused saying what to set."""

from __future__ import annotations

import time
import types
from typing import Any, Callable, Dict, List, Sequence

import pytest

torch = pytest.importorskip("torch")

import kvx  # noqa: E402
from kvx.testing import free_port  # noqa: E402
from kvx.vllm.host_buffer import Copier, HostBufferedDecode, HostBufferedPrefill, PendingCopy, block_runs  # noqa: E402
from kvx.vllm.kvx_transfer import DecodeTransfer, PrefillTransfer  # noqa: E402
from kvx.vllm.settings import ConfigError, settings_from  # noqa: E402

LAYERS = 3
BLOCKS = 10
SECRET = "secret-0123456789abcdef"

#: name → a layer's KV tensor of ``BLOCKS`` blocks (block size 4, 2 KV heads, head size 8).
LAYOUTS: Dict[str, Callable[[], Any]] = {
    # vLLM's CPU backend: [num_blocks, heads, block_size, 2 * head_size].
    "cpu": lambda: torch.zeros(BLOCKS, 2, 4, 16),
    # FlashAttention: K and V apart, [2, num_blocks, block_size, heads, head_size].
    "flash-attn": lambda: torch.zeros(2, BLOCKS, 4, 2, 8),
    # FlashInfer: [num_blocks, 2, block_size, heads, head_size].
    "flashinfer": lambda: torch.zeros(BLOCKS, 2, 4, 2, 8),
    # MLA: one latent cache per layer, [num_blocks, block_size, latent size].
    "mla": lambda: torch.zeros(BLOCKS, 4, 24),
    # HND: FlashAttention's logical shape over memory ordered [2, num_blocks, heads, block_size,
    # head_size] (strides only differ), not contiguous.
    "flash-attn-hnd": lambda: torch.zeros(2, BLOCKS, 2, 4, 8).permute(0, 1, 3, 2, 4),
}


def settings(role: str, alloc: int, fabric: int, **extra: Any):
    return settings_from(types.SimpleNamespace(
        kv_role=role, engine_id=role, kv_connector_extra_config={
            "host": "127.0.0.1", "alloc_port": alloc, "fabric_port": fabric, "host_buffer": True, **extra}))


def layer_names() -> List[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class LateCopier(Copier):
    """Device → host copies that complete only when waited for, or at the third look: what
    a copy on a CUDA stream may do. Until then the host blocks hold a marker."""

    def to_host(self, src: Any, dst: Any, block_dim: int, block_ids: Sequence[int]) -> PendingCopy:
        for first, n in block_runs(block_ids):
            dst.narrow(block_dim, first, n).fill_(-7.0)
        done = super().to_host
        looks = [0]

        class Late(PendingCopy):
            finished = False

            def ready(self) -> bool:
                looks[0] += 1
                if looks[0] >= 3:
                    self.wait()
                return self.finished

            def wait(self) -> None:
                if not self.finished:
                    done(src, dst, block_dim, block_ids)
                    self.finished = True

        return Late()


def pair(layout: str, copier: Callable[[Any], Copier] = Copier, **extra: Any):
    alloc, fabric = free_port(), free_port()
    decode = HostBufferedDecode(DecodeTransfer(settings("kv_consumer", alloc, fabric, **extra), 0, BLOCKS),
                                  host_buffer=True)
    prefill = HostBufferedPrefill(PrefillTransfer(settings("kv_producer", alloc, fabric, **extra), 0, BLOCKS),
                                   host_buffer=True, copier=copier)
    gen = torch.Generator().manual_seed(11)
    p_kv = {n: LAYOUTS[layout]() for n in layer_names()}
    for t in p_kv.values():
        t.copy_(torch.rand(t.shape, generator=gen))
    d_kv = {n: LAYOUTS[layout]() for n in layer_names()}
    decode.register_kv_caches(d_kv)
    prefill.register_kv_caches(p_kv)
    return decode, prefill, d_kv, p_kv, alloc, fabric


def until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout} s: {what}")


def block_dim(t: Any) -> int:
    return 1 if t.shape[0] == 2 and t.shape[1] == BLOCKS else 0


def push(decode, prefill, alloc, fabric, d_blocks, p_blocks, steps=1):
    """Reserves ``d_blocks`` at the decode side, pushes ``p_blocks`` into them (in ``steps``
    chunked-prefill steps), and returns once the decode side reported the request."""
    decode.reserve("X", SECRET, 0, d_blocks, 4 * len(d_blocks))
    prefill.begin("X", SECRET, f"tcp://127.0.0.1:{alloc}", f"tcp://127.0.0.1:{fabric}", len(p_blocks))
    granted = set()
    until(lambda: bool(granted.update(prefill.poll().granted) or "X" in granted), "the grant")
    per = -(-len(p_blocks) // steps)
    for s in range(steps):
        part = p_blocks[s * per:(s + 1) * per]
        last = s == steps - 1
        for name in layer_names():
            prefill.write_layer("X", name, None, s * per, part, last)
    prefill.finish("X")
    got = types.SimpleNamespace(received=set(), failed={}, sent=set())

    def done() -> bool:
        d, p = decode.poll(), prefill.poll()
        got.received |= d.received
        got.failed.update(d.failed)
        got.sent |= p.sent
        return ("X" in got.received or "X" in got.failed) and "X" in got.sent

    until(done, "the decode side's report and the prefill side's sent")
    return got


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_byte_of_every_layer_lands_in_the_decode_engines_blocks(layout):
    decode, prefill, d_kv, p_kv, alloc, fabric = pair(layout)
    try:
        assert decode.staged and prefill.staged
        d_blocks, p_blocks = [5, 2, 7, 8], [1, 3, 4, 9]
        got = push(decode, prefill, alloc, fabric, d_blocks, p_blocks, steps=2)
        assert got.received == {"X"} and not got.failed, got
        for name in layer_names():
            d, p = d_kv[name], p_kv[name]
            dim = block_dim(d)
            for db, pb in zip(d_blocks, p_blocks):
                assert torch.equal(d.select(dim, db), p.select(dim, pb)), (name, db, pb)
            for b in set(range(BLOCKS)) - set(d_blocks):
                assert not d.select(dim, b).any(), f"{name}: block {b} is outside the grant"
    finally:
        decode.close()
        prefill.close()


def test_a_copy_that_completes_late_is_waited_for_before_its_writes_go():
    decode, prefill, d_kv, p_kv, alloc, fabric = pair("flash-attn", copier=LateCopier)
    try:
        got = push(decode, prefill, alloc, fabric, [0, 1, 2], [6, 7, 8])
        assert got.received == {"X"} and not got.failed, got
        for name in layer_names():
            assert torch.equal(d_kv[name][:, 0:3], p_kv[name][:, 6:9]), name
    finally:
        decode.close()
        prefill.close()


def test_kv_in_host_memory_is_moved_in_place_unless_the_setting_asks_for_a_host_buffer():
    class Inner:
        def register_kv_caches(self, kv):
            self.kv = kv

    kv = {n: torch.zeros(BLOCKS, 2, 4, 16) for n in layer_names()}
    plain = HostBufferedDecode(Inner())
    plain.register_kv_caches(kv)
    assert not plain.staged and plain.inner.kv is kv
    staged = HostBufferedDecode(Inner(), host_buffer=True)
    staged.register_kv_caches(kv)
    assert staged.staged
    assert all(staged.inner.kv[n] is not kv[n] and staged.inner.kv[n].shape == kv[n].shape for n in kv)


@pytest.mark.parametrize("shape", [(BLOCKS, 2, 4, 16), (2, BLOCKS, 4, 2, 8)])
def test_the_host_buffer_is_one_allocation_with_the_layers_end_to_end_in_kvxs_order(shape):
    """kvx sees one range (RDMA registers it once): layer i + 1 (in name order, kvx's slot
    order) starts where layer i ends."""

    class Inner:
        def register_kv_caches(self, kv):
            self.kv = kv

    names = layer_names()
    kv = {n: torch.zeros(shape) for n in reversed(names)}  # vLLM's order need not be kvx's
    t = HostBufferedDecode(Inner(), host_buffer=True)
    t.register_kv_caches(kv)
    host = t.inner.kv
    nbytes = host[names[0]].numel() * host[names[0]].element_size()
    starts = [host[n].data_ptr() for n in sorted(names)]
    assert starts == [starts[0] + i * nbytes for i in range(len(names))]
    assert all(host[n].is_contiguous() and host[n].shape == kv[n].shape for n in names)


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_both_sides_run_kvx_on_the_fabric_the_settings_name(monkeypatch, side):
    """``fabric: rdma`` reaches kvx on both sides (a build without RDMA, or a machine without
    a device, then refuses it saying so), never a TCP side facing an RDMA one."""
    defaults = kvx.defaults()
    rdma = {**defaults, "node": {**defaults["node"], "fabrics": [*defaults["node"]["fabrics"], "rdma"]}}
    monkeypatch.setattr(kvx, "defaults", lambda: rdma)
    role = "kv_consumer" if side == "decode" else "kv_producer"
    alloc, fabric = free_port(), free_port()
    s = settings_from(types.SimpleNamespace(kv_role=role, engine_id=role, kv_connector_extra_config={
        "host": "127.0.0.1", "alloc_port": alloc, "fabric_port": fabric, "fabric": "rdma"}))
    inner = (DecodeTransfer if side == "decode" else PrefillTransfer)(s, 0, BLOCKS)
    t = (HostBufferedDecode if side == "decode" else HostBufferedPrefill)(inner, host_buffer=True)
    with pytest.raises(Exception, match="(?i)rdma"):
        t.register_kv_caches({n: torch.zeros(BLOCKS, 2, 4, 16) for n in layer_names()})


@pytest.mark.parametrize("buffer_device", [None, "cuda"])
def test_kv_on_a_device_without_kv_buffer_device_cpu_is_refused_saying_what_to_set(buffer_device):
    kv = {n: torch.empty(2, BLOCKS, 4, 2, 8, device="meta") for n in layer_names()}
    t = HostBufferedDecode(object(), kv_buffer_device=buffer_device)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as e:
        t.register_kv_caches(kv)
    assert "kv_buffer_device" in str(e.value) and '"cpu"' in str(e.value) and "meta" in str(e.value)


def test_the_host_buffer_setting_and_vllms_kv_buffer_device_are_read():
    s = settings_from(types.SimpleNamespace(kv_role="kv_consumer", engine_id="d", kv_buffer_device="cpu",
                                            kv_connector_extra_config={"host_buffer": True}))
    assert s.host_buffer and s.kv_buffer_device == "cpu"
    with pytest.raises(ConfigError, match="host_buffer"):
        settings_from(types.SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={"host_buffer": "yes"}))


def test_block_runs():
    assert block_runs([]) == []
    assert block_runs([3, 4, 5, 9, 1, 2]) == [(3, 3), (9, 1), (1, 2)]
