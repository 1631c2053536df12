"""A 1P1D LMCache PD setup in one process, for the tests of ``kvx.lmcache``: LMCache's own
``StorageManager`` on each side, built by LMCache's own ``CreateStorageBackends`` from an
``LMCacheEngineConfig`` (so the backend is kvx's after ``kvx.lmcache.install()``, LMCache's
``PDBackendAsync`` after ``uninstall()``), and a proxy's notice socket. The transfer spec is
a namespace with the fields of LMCache's ``DisaggSpec``, which lives in its vLLM adapter and
cannot be imported without vLLM."""

from __future__ import annotations

import random
import socket
import threading
import time
import types
from typing import Dict, List, Optional

import msgspec
import torch
import zmq
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

CHUNK_TOKENS = 16
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 32)  # layers, k/v, tokens, heads, head size
DTYPE = torch.bfloat16
CHUNK_BYTES = 2 * 2 * CHUNK_TOKENS * 2 * 32 * 2


_HANDED_OUT: set = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port for a server that must be told its port in advance (LMCache's config
    names fixed ports). Not bind(0)'s: the kernel takes those from the ephemeral range, the one
    it also gives outgoing connections, so any connection on the host could take the port
    before the server binds it. These come from below that range, each once per process."""
    top = _ephemeral_low() - 1
    for _ in range(1000):
        port = random.randint(20000, top) if top > 20000 else 0
        if port in _HANDED_OUT:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
                port = s.getsockname()[1]
        except OSError:
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range in 1000 tries")


def metadata(rank: int = 0, world: int = 1, kv_shape: tuple = KV_SHAPE) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="kvx-test", world_size=world, local_world_size=world, worker_id=rank,
        local_worker_id=rank, kv_dtype=DTYPE, kv_shape=kv_shape, chunk_size=kv_shape[2],
        role="worker",
    )


def config(role: str, buffer_chunks: int, init: List[int], alloc: List[int], proxy_port: int,
           timeout: float, kv_shape: tuple = KV_SHAPE, **extra) -> LMCacheEngineConfig:
    chunk = metadata(kv_shape=kv_shape)
    chunk_bytes = chunk.get_shapes()[0].numel() * DTYPE.itemsize
    return LMCacheEngineConfig.from_dict(dict(
        chunk_size=kv_shape[2], local_cpu=False, max_local_cpu_size=1, enable_pd=True,
        save_unfull_chunk=True,  # What LMCache's PD mode needs (its config check says so).
        pd_role=role, pd_buffer_size=buffer_chunks * chunk_bytes, pd_buffer_device="cpu",
        transfer_channel="mock_memory", pd_peer_host="127.0.0.1", pd_peer_init_port=init,
        pd_peer_alloc_port=alloc, pd_proxy_host="127.0.0.1", pd_proxy_port=proxy_port,
        pd_backend_mode="async", pd_allocation_timeout_sec=timeout,
        extra_config=extra or None,
    ))


def chunk_key(req_id: str, chunk: int, rank: int = 0, world: int = 1) -> CacheEngineKey:
    return CacheEngineKey(model_name="kvx-test", world_size=world, worker_id=rank,
                          chunk_hash=hash((req_id, chunk)) & 0xFFFFFFFF, dtype=DTYPE)


def chunk_bytes(req_id: str, chunk: int, nbytes: int) -> torch.Tensor:
    seed = (sum(req_id.encode()) * 31 + chunk * 7) % 251
    return ((torch.arange(nbytes, dtype=torch.int64) + seed) % 251).to(torch.uint8)


class Cluster:
    """A receiver and a sender StorageManager for TP ``ranks`` (one pair per rank), and the
    proxy's PULL socket."""

    def __init__(self, buffer_chunks: int, staging_chunks: Optional[int] = None, timeout: float = 10.0,
                 ranks: int = 1, **extra) -> None:
        self.proxy_port = free_port()
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(f"tcp://127.0.0.1:{self.proxy_port}")
        staging_chunks = staging_chunks or buffer_chunks  # As LMCache configs usually have it.
        self.rx_init = [free_port() for _ in range(ranks)]
        self.rx_alloc = [free_port() for _ in range(ranks)]
        tx_init = [free_port() for _ in range(ranks)]
        tx_alloc = [free_port() for _ in range(ranks)]
        self.receivers = [
            StorageManager(config("receiver", buffer_chunks, self.rx_init, self.rx_alloc,
                                  self.proxy_port, timeout, **extra), metadata(r, ranks),
                           EventManager())
            for r in range(ranks)
        ]
        self.senders = [
            StorageManager(config("sender", staging_chunks, tx_init, tx_alloc, self.proxy_port,
                                  timeout, **extra), metadata(r, ranks), EventManager())
            for r in range(ranks)
        ]
        self.notices: List[dict] = []

    def spec(self, req_id: str, total_chunks: int, last: bool = False) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            req_id=req_id, receiver_id=f"127.0.0.1{self.rx_init[0]}", receiver_host="127.0.0.1",
            receiver_init_port=list(self.rx_init), receiver_alloc_port=list(self.rx_alloc),
            is_last_prefill=last, num_transferred_tokens=0, total_chunks=total_chunks,
            receiver_query_port=None,
        )

    def store(self, req_id: str, total: int, chunks: range, last: bool, rank: int = 0,
              tokens_of_last: int = CHUNK_TOKENS) -> int:
        """What one ``LMCacheEngine.store`` does for these chunks of a request: allocate each
        (inside the request's transfer context), write it, ``batched_put`` them. Returns how
        many were allocated (LMCache stops at the first ``None``)."""
        import kvx.lmcache

        sm = self.senders[rank]
        meta = metadata(rank, len(self.senders))
        spec = self.spec(req_id, total, last)
        keys, objs = [], []
        with kvx.lmcache.transfer(spec):
            for c in chunks:
                toks = tokens_of_last if (last and c == total - 1) else CHUNK_TOKENS
                obj = sm.allocate(meta.get_shapes(toks), meta.get_dtypes(), fmt=MemoryFormat.KV_2LTD)
                if obj is None:
                    break
                raw = obj.tensor.reshape(-1).view(torch.uint8)
                raw.copy_(chunk_bytes(req_id, c, raw.numel()))
                keys.append(chunk_key(req_id, c, rank, len(self.senders)))
                objs.append(obj)
        if objs:
            sm.batched_put(keys, objs, transfer_spec=spec)
        return len(objs)

    def next_notice(self, timeout: float) -> Optional[dict]:
        if self.pull.poll(int(timeout * 1000)):
            msg = msgspec.msgpack.decode(self.pull.recv())
            self.notices.append(msg)
            return msg
        return None

    def retrieve(self, req_id: str, total: int, rank: int = 0,
                 tokens_of_last: int = CHUNK_TOKENS) -> bool:
        """The decode side's retrieve of every chunk (get, compare, remove); True when each
        one holds exactly the bytes the sender wrote."""
        return self.retrieve_status(req_id, total, rank, tokens_of_last)[1]

    def retrieve_status(self, req_id: str, total: int, rank: int = 0,
                        tokens_of_last: int = CHUNK_TOKENS) -> "tuple[bool, bool]":
        """``retrieve``, telling apart (every chunk is there with its token count, each holds
        exactly the sender's bytes). LMCache's own ``mock_memory`` channel moves no bytes
        (its decode side reads zeros), so only the first can hold for it."""
        sm = self.receivers[rank]
        present, exact = True, True
        for c in range(total):
            key = chunk_key(req_id, c, rank, len(self.receivers))
            try:
                obj = sm.get(key)
            except AssertionError:  # LMCache's own backend asserts on a missing key.
                return False, False
            if obj is None:
                return False, False
            raw = obj.tensor.reshape(-1).view(torch.uint8)
            want_tokens = tokens_of_last if c == total - 1 else CHUNK_TOKENS
            present &= obj.get_num_tokens() == want_tokens
            exact &= bool(torch.equal(raw, chunk_bytes(req_id, c, raw.numel())))
            sm.remove(key)
        return present, present and exact

    def close(self, timeout: float = 10.0) -> int:
        """Closes every StorageManager, each within ``timeout`` (on a thread of its own: a
        close that hangs is abandoned); returns how many did not close in time."""
        hung = 0
        for sm in self.senders + self.receivers:
            t = threading.Thread(target=sm.close, daemon=True)
            t.start()
            t.join(timeout)
            hung += t.is_alive()
        self.pull.close()
        if not hung:
            self.ctx.term()
        return hung


class Decoder(threading.Thread):
    """The decode side of the proxy's loop: on each ProxyNotif (one per TP rank), retrieves
    the request's chunks and checks them; records failures as reported."""

    def __init__(self, cluster: Cluster, totals: Dict[str, int], ranks: int = 1,
                 tokens_of_last: int = CHUNK_TOKENS, deadline_s: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.totals = totals
        self.ranks = ranks
        self.tokens_of_last = tokens_of_last
        self.deadline = time.monotonic() + deadline_s
        self.delivered: Dict[str, bool] = {}
        #: Requests notified ready whose every chunk the decode side found (bytes aside).
        self.present: Dict[str, bool] = {}
        self.failed: Dict[str, str] = {}
        self._ranks_heard: Dict[str, int] = {}

    def run(self) -> None:
        while time.monotonic() < self.deadline and len(self.delivered) + len(self.failed) < len(self.totals):
            msg = self.cluster.next_notice(0.1)
            if msg is None:
                continue
            req_id = msg["req_id"]
            if msg["type"] != "ProxyNotif":
                self.failed[req_id] = msg.get("reason", msg["type"])
                continue
            self._ranks_heard[req_id] = self._ranks_heard.get(req_id, 0) + 1
            if self._ranks_heard[req_id] == self.ranks:
                status = [
                    self.cluster.retrieve_status(req_id, self.totals[req_id], rank, self.tokens_of_last)
                    for rank in range(self.ranks)
                ]
                self.present[req_id] = all(p for p, _ in status)
                self.delivered[req_id] = all(e for _, e in status)


def interleave(cluster, plans, batch, step_timeout=None):
    """One worker thread interleaving requests as a scheduler does: each step stores the next
    ``batch`` chunks of every unfinished request in turn. ``plans``: req_id → total chunks.
    Returns req_id → chunks stored."""
    stored = {r: 0 for r in plans}
    while any(stored[r] < n for r, n in plans.items()):
        for r, n in plans.items():
            if stored[r] >= n:
                continue
            upto = min(stored[r] + batch, n)
            got = cluster.store(r, n, range(stored[r], upto), last=upto == n)
            if got < upto - stored[r]:
                stored[r] = n  # LMCache gives up on the rest (allocate returned None).
            else:
                stored[r] = upto
    return stored


def run_interleaved_on_one_thread(timeout):
    """The interleaved deadlock case: one sender, one thread, two 8-chunk requests interleaved in
    batches of 2 into a receiver buffer of 10 chunks (each fits, both do not)."""
    cluster = Cluster(buffer_chunks=10, timeout=timeout)
    plans = {"a": 8, "b": 8}
    decoder = Decoder(cluster, plans, deadline_s=4 * timeout + 10)
    decoder.start()
    started = time.monotonic()
    worker = threading.Thread(target=interleave, args=(cluster, plans, 2), daemon=True)
    worker.start()
    worker.join(timeout=4 * timeout + 10)
    decoder.join(timeout=4 * timeout + 10)
    return cluster, decoder, time.monotonic() - started, worker.is_alive()


def four_concurrent(cluster, requests_per_thread=2, deadline_s=60.0):
    """Four worker threads, each storing its own requests (4..8 chunks) in batches of 2."""
    plans = {}
    for t in range(4):
        for i in range(requests_per_thread):
            plans[f"t{t}-r{i}"] = 4 + (t + i) % 5
    decoder = Decoder(cluster, plans, deadline_s=deadline_s)
    decoder.start()

    def work(t):
        mine = {r: n for r, n in plans.items() if r.startswith(f"t{t}-")}
        for r, n in mine.items():
            interleave(cluster, {r: n}, 2)

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=deadline_s)
    decoder.join(timeout=deadline_s)
    return plans, decoder, any(th.is_alive() for th in threads)
