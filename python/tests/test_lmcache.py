"""kvx as LMCache's PD backend, through LMCache's own code (``lmcache==0.5.6`` from PyPI):
``StorageManager``s that LMCache's ``CreateStorageBackends`` builds from an
``LMCacheEngineConfig``, and ``LMCacheEngine.store``. The scenarios that LMCache's own
``PDBackendAsync`` deadlocks or wedges on run against it too, in this file, as the
contrast. Skipped with a message when ``lmcache`` or ``torch`` is missing."""

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

lmcache = pytest.importorskip("lmcache", reason="lmcache (0.5.6) is needed for the LMCache backend tests")
torch = pytest.importorskip("torch", reason="torch is needed for the LMCache backend tests")

import kvx  # noqa: E402
import kvx.lmcache  # noqa: E402
from lmcache_cluster import CHUNK_BYTES, CHUNK_TOKENS, Cluster, Decoder, four_concurrent, run_interleaved_on_one_thread  # noqa: E402


@pytest.fixture
def kvx_backend():
    kvx.lmcache.install()
    yield
    kvx.lmcache.uninstall()


def test_two_requests_interleaved_on_one_thread_complete_through_kvx(kvx_backend):
    cluster, decoder, took, stuck = run_interleaved_on_one_thread(timeout=10.0)
    try:
        assert not stuck
        assert decoder.delivered == {"a": True, "b": True}, (decoder.delivered, decoder.failed)
        tx, rx = cluster.senders[0].allocator_backend, cluster.receivers[0].allocator_backend
        assert type(tx).__name__ == "KvxPDBackend" and str(tx) == "PDBackend"
        # Nothing held anywhere once both are consumed.
        deadline = time.monotonic() + 5
        while rx.receiver.leased_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        snap = rx.receiver.receiver.snapshot()
        assert snap["free"] == 10 and snap["tracked_requests"] == 0, snap
        assert rx.receiver.buffered_keys() == 0
        assert tx.sender.sender.staging_free == 10 and tx.sender.room.free_slots() == tx.sender.room.capacity
        assert took < 10, f"took {took:.1f} s: a wait ran to its timeout"
    finally:
        assert cluster.close() == 0


def test_the_last_remove_hands_the_slots_back_at_once(kvx_backend):
    # The next request's admission may be waiting for exactly these slots: they go back to
    # kvx on the thread of LMCache's last remove, not at the receiver's next delivery.
    cluster = Cluster(buffer_chunks=8, timeout=10.0)
    try:
        assert cluster.store("r", 4, range(4), last=True) == 4
        notice = cluster.next_notice(10.0)
        assert notice is not None and notice["type"] == "ProxyNotif", notice
        rx = cluster.receivers[0].allocator_backend.receiver
        assert rx.receiver.snapshot()["free"] == 4
        assert cluster.retrieve("r", 4)
        snap = rx.receiver.snapshot()
        assert snap["free"] == 8 and snap["tracked_requests"] == 0, snap
        assert rx.leased_requests() == 0
    finally:
        assert cluster.close() == 0


def test_four_concurrent_requests_per_sender_complete_through_kvx(kvx_backend):
    cluster = Cluster(buffer_chunks=12, staging_chunks=6, timeout=10.0)
    try:
        plans, decoder, stuck = four_concurrent(cluster)
        assert not stuck
        assert decoder.delivered == {r: True for r in plans}, (decoder.delivered, decoder.failed)
    finally:
        assert cluster.close() == 0


@pytest.fixture(scope="module")
def lmcaches_own():
    """The same scenarios against LMCache's own PDBackendAsync, in a process of their own
    (its wedged threads and sockets, and a close that can hang, stay out of this one)."""
    script = Path(__file__).with_name("lmcache_contrast.py")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    assert lines, f"the contrast run printed no result: {out.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("fabric", ["mem", "shm"])
def test_the_mem_and_shm_fabrics_complete_four_concurrent_requests_byte_exact(kvx_backend, fabric):
    # mem: both sides in one process (LMCache's mock_memory counterpart); shm: one host,
    # through the shared memory kvx allocates, which LMCache's memory objects view in place.
    cluster = Cluster(buffer_chunks=12, staging_chunks=6, timeout=10.0, kvx_fabric=fabric)
    try:
        backend = cluster.senders[0].allocator_backend
        assert backend.pd_config.extra["kvx_fabric"] == fabric
        if fabric == "shm":
            np = pytest.importorskip("numpy")
            tx_role = backend.sender
            rx_role = cluster.receivers[0].allocator_backend.receiver
            for tensor, view in ((tx_role.staging, tx_role.sender.staging),
                                 (rx_role.buffer, rx_role.receiver.buffer)):
                assert tensor.data_ptr() == np.frombuffer(view, dtype=np.uint8).ctypes.data
        plans, decoder, stuck = four_concurrent(cluster)
        assert not stuck
        assert decoder.delivered == {r: True for r in plans}, (decoder.delivered, decoder.failed)
    finally:
        assert cluster.close() == 0


def test_lmcaches_own_backend_delivers_a_request_alone(lmcaches_own):
    """The contrasts' positive twin: on the same setup, one request alone goes through
    LMCache's own backend (notified ready, every chunk found by the decode side; its
    ``mock_memory`` channel moves no bytes, so bytes are not compared), so what the contrasts
    below lose, LMCache loses."""
    alone = lmcaches_own["alone"]
    assert alone["present"] == {"solo": True}, alone
    assert not alone["failed"], alone


def test_two_requests_interleaved_on_one_thread_wedge_lmcaches_own_backend(lmcaches_own):
    """LMCache's sender holds the receiver's only channel while the second request waits
    for admission, so the first request's remaining batches cannot go: nothing moves until
    the admission wait times out. The second is never delivered: the decode side does not
    find its chunks, and no failure notice reaches the proxy. Whether the first gets through
    after the timeout depends on LMCache's threads' timing (on a quiet machine it does, on a
    loaded one it can be lost too), so only the second's loss is asserted."""
    case = lmcaches_own["interleaved"]
    assert case["backend"] == "PDBackendAsync"
    assert case["present"].get("b") is not True, case
    assert "b" not in case["failed"], case  # No failure notice.
    assert case["took"] >= case["timeout"], case


def test_four_concurrent_requests_per_sender_wedge_lmcaches_own_backend(lmcaches_own):
    """Four threads of one sender, each storing its own requests: requests are lost without
    a failure notice (kvx's backend delivers the same scenario whole, above)."""
    four = lmcaches_own["four"]
    lost = [r for r in four["plans"] if four["present"].get(r) is not True]
    assert lost, four
    assert not four["failed"], four  # Lost without a notice.


def test_partial_last_chunk_arrives_byte_exact_with_its_token_count(kvx_backend):
    cluster = Cluster(buffer_chunks=8, staging_chunks=4)
    try:
        decoder = Decoder(cluster, {"p": 3}, tokens_of_last=5)
        decoder.start()
        cluster.store("p", 3, range(0, 2), last=False)
        cluster.store("p", 3, range(2, 3), last=True, tokens_of_last=5)
        decoder.join(timeout=20)
        assert decoder.delivered == {"p": True}, decoder.failed
    finally:
        assert cluster.close() == 0


def test_cancel_in_flight_frees_both_sides_and_sends_no_proxy_notif(kvx_backend):
    cluster = Cluster(buffer_chunks=8, staging_chunks=4)
    try:
        tx = cluster.senders[0].allocator_backend
        rx = cluster.receivers[0].allocator_backend
        assert cluster.store("c", 6, range(0, 2), last=False) == 2
        # The engine's own id reaches it too (vLLM cancels by its request_id).
        cluster.senders[0].cancel_request("c")
        notice = cluster.next_notice(5.0)
        assert notice is not None and notice["type"] == "FailNotif" and notice["req_id"] == "c"
        assert "cancel" in notice["reason"]
        assert cluster.next_notice(0.5) is None  # And never a ProxyNotif.
        # A late store for it sends nothing and holds nothing.
        assert cluster.store("c", 6, range(2, 4), last=False) == 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            snap = rx.receiver.receiver.snapshot()
            if snap["free"] == 8 and tx.sender.sender.staging_free == 4:
                break
            time.sleep(0.02)
        assert snap["free"] == 8 and snap["tracked_requests"] == 0, snap
        assert tx.sender.sender.staging_free == 4 and tx.sender.slots.held() == 0
    finally:
        assert cluster.close() == 0


def test_failure_notices_can_be_turned_off_for_lmcaches_own_proxy(kvx_backend):
    """LMCache's example proxy decodes every notice as one of LMCache's messages: with
    kvx_failure_notices false a failed request sends it nothing at all."""
    cluster = Cluster(buffer_chunks=8, kvx_failure_notices=False)
    try:
        assert cluster.store("quiet", 6, range(0, 2), last=False) == 2
        cluster.senders[0].cancel_request("quiet")
        assert cluster.next_notice(1.0) is None
    finally:
        assert cluster.close() == 0


def test_cancel_by_the_engines_own_request_id(kvx_backend):
    cluster = Cluster(buffer_chunks=8, staging_chunks=4)
    try:
        spec = cluster.spec("proxy-7", 4)
        meta_shapes = lmcache_shapes()
        with kvx.lmcache.transfer(spec, engine_req_id="vllm-abc"):
            obj = cluster.senders[0].allocate(*meta_shapes)
        assert obj is not None
        cluster.senders[0].cancel_request("vllm-abc")
        notice = cluster.next_notice(5.0)
        assert notice is not None and notice["type"] == "FailNotif" and notice["req_id"] == "proxy-7"
        obj.ref_count_down()
        assert cluster.senders[0].allocator_backend.sender.slots.held() == 0
    finally:
        assert cluster.close() == 0


def lmcache_shapes():
    from lmcache_cluster import metadata

    meta = metadata()
    return meta.get_shapes(CHUNK_TOKENS), meta.get_dtypes()


def test_an_oversized_request_fails_fast_once_with_the_reason(kvx_backend, caplog):
    cluster = Cluster(buffer_chunks=4, staging_chunks=4, timeout=30.0)
    try:
        started = time.monotonic()
        # The first store returns before the refusal is back (its chunks wait in the
        # waiting room, then are dropped); the proxy hears at once, with the reason.
        cluster.store("big", 5, range(0, 2), last=False)
        notice = cluster.next_notice(5.0)
        took = time.monotonic() - started
        assert notice is not None and notice["type"] == "FailNotif"
        assert "5" in notice["reason"] and "4" in notice["reason"], notice
        assert took < 5, f"{took:.1f} s: it waited instead of failing fast"
        # Later stores of it allocate nothing, and nothing stays held.
        assert cluster.store("big", 5, range(2, 4), last=False) == 0
        tx = cluster.senders[0].allocator_backend.sender
        deadline = time.monotonic() + 5
        while tx.room.free_slots() < tx.room.capacity and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tx.room.free_slots() == tx.room.capacity and tx.sender.staging_free == 4
        failures = [r for r in caplog.records if "big" in r.getMessage() and r.levelno >= logging.ERROR]
        assert len(failures) == 1, [r.getMessage() for r in failures]
    finally:
        assert cluster.close() == 0


def test_allocate_outside_a_store_is_refused_with_the_reason(kvx_backend, caplog):
    cluster = Cluster(buffer_chunks=4, staging_chunks=4)
    try:
        assert cluster.senders[0].allocate(*lmcache_shapes()) is None
        assert any("outside a store" in r.getMessage() for r in caplog.records)
    finally:
        assert cluster.close() == 0


def test_tp2_each_rank_moves_its_own_chunks_through_its_own_ports(kvx_backend):
    cluster = Cluster(buffer_chunks=6, staging_chunks=3, ranks=2)
    try:
        decoder = Decoder(cluster, {"tp": 4}, ranks=2)
        decoder.start()
        for rank in (0, 1):
            cluster.store("tp", 4, range(0, 2), last=False, rank=rank)
            cluster.store("tp", 4, range(2, 4), last=True, rank=rank)
        decoder.join(timeout=20)
        assert decoder.delivered == {"tp": True}, decoder.failed
        ports = {(b.allocator_backend.pd_config.peer_alloc_port, b.allocator_backend.pd_config.peer_init_port)
                 for b in cluster.receivers}
        assert ports == set(zip(cluster.rx_alloc, cluster.rx_init))
    finally:
        assert cluster.close() == 0


@pytest.mark.parametrize(
    "change, names",
    [
        (dict(pd_buffer_device="cuda"), "pd_buffer_device"),
        (dict(pd_buffer_size=100), "pd_buffer_size"),
        (dict(pd_max_prefill_len=10_000), "pd_max_prefill_len"),
        (dict(pd_peer_alloc_port=[]), "pd_peer_alloc_port"),
        (dict(extra_config={"kvx_fabrik": "tcp"}), "kvx_fabrik"),
        (dict(extra_config={"kvx_fabric": "carrier-pigeon"}), "kvx_fabric"),
    ],
)
def test_a_bad_configuration_is_refused_naming_the_key(kvx_backend, change, names):
    import asyncio

    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend import CreateStorageBackends
    from lmcache_cluster import free_port, metadata

    base = dict(
        chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=1, enable_pd=True,
        pd_role="receiver", pd_buffer_size=4 * CHUNK_BYTES, pd_buffer_device="cpu",
        transfer_channel="mock_memory", pd_peer_host="127.0.0.1", pd_peer_init_port=[free_port()],
        pd_peer_alloc_port=[free_port()], pd_proxy_host="127.0.0.1", pd_proxy_port=free_port(),
        pd_backend_mode="async",
    )
    base.update(change)
    # LMCache's own builder (a StorageManager that fails in its constructor leaves its
    # event-loop thread running, and the process could not exit).
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(kvx.lmcache.ConfigError, match=names):
            CreateStorageBackends(LMCacheEngineConfig.from_dict(base), metadata(), loop)
    finally:
        loop.close()


def test_lmcache_engine_store_names_its_request_to_the_backend(kvx_backend):
    """Through LMCacheEngine.store itself (its CPU mock connector, writing known bytes where
    a GPU connector would copy KV): install()'s wrapper gives the backend the transfer spec,
    the request is admitted before its chunks take staging, and the decode side gets every
    byte, the partial last chunk with its token count."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache_cluster import KV_SHAPE, chunk_bytes, metadata

    class WritingConnector(MockGPUConnector):
        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, start, _ in zip(memory_objs, starts, ends):
                raw = obj.tensor.reshape(-1).view(torch.uint8)
                raw.copy_(chunk_bytes("eng", start // CHUNK_TOKENS, raw.numel()))

    cluster = Cluster(buffer_chunks=8)
    engine = LMCacheEngineBuilder.get_or_create(
        "kvx-test-engine", cluster.senders[0].config, metadata(), WritingConnector(KV_SHAPE),
        lambda *a: None, lambda *a: None,
    )
    try:
        engine.post_init()
        assert type(engine.storage_manager.allocator_backend).__name__ == "KvxPDBackend"
        tokens = 2 * CHUNK_TOKENS + 8
        engine.store(tokens=torch.arange(tokens), transfer_spec=cluster.spec("eng", 3, last=True),
                     req_id="vllm-eng")
        assert kvx.lmcache.current_transfer() is None
        notice = cluster.next_notice(10.0)
        assert notice == {"type": "ProxyNotif", "req_id": "eng"}, notice
        rx = cluster.receivers[0].allocator_backend.receiver
        deadline = time.monotonic() + 5
        while rx.buffered_keys() < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        with rx._lock:
            objs = list(rx.data.items())
        seen = {}
        for key, obj in objs:
            raw = obj.tensor.reshape(-1).view(torch.uint8)
            chunk = next(c for c in range(3) if torch.equal(raw, chunk_bytes("eng", c, raw.numel())))
            seen[chunk] = obj.get_num_tokens()
        assert seen == {0: CHUNK_TOKENS, 1: CHUNK_TOKENS, 2: 8}, (seen, len(objs), [o.get_num_tokens() for _, o in objs])
        for key, _ in objs:
            cluster.receivers[0].remove(key)
    finally:
        LMCacheEngineBuilder.destroy("kvx-test-engine")
        assert cluster.close() == 0
