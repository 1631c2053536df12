"""Which request a staging allocation is for, and the switch that puts kvx in LMCache.

LMCache's ``allocate()`` carries no request id, yet kvx admits a request before any of its
chunks takes staging: that ordering is what keeps concurrent requests from deadlocking the
two buffers. The request is known earlier, though: ``LMCacheEngine.store(...,
transfer_spec=DisaggSpec(req_id, ..., total_chunks))`` has it before its first
``allocate``, on the same thread. So ``install()`` wraps ``store`` to set the transfer spec
in a context variable for the length of the call (``transfer``), and the backend's
``allocate`` reads it (``current_transfer``). A context variable is per thread and per
asyncio task, so concurrent stores on different threads each see their own request.

``allocate`` outside such a context (a store without a transfer spec, or another caller)
has no request to charge: the backend refuses it (returns ``None``, which LMCache treats as
"no memory", and logs why once). Callers other than ``LMCacheEngine.store`` wrap their
allocations in ``kvx.lmcache.transfer(spec)`` themselves.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from typing import Any, Iterator, Optional, Tuple

_CURRENT: contextvars.ContextVar[Optional[Tuple[Any, Optional[str]]]] = contextvars.ContextVar(
    "kvx_lmcache_transfer", default=None
)

_INSTALL_LOCK = threading.Lock()


@contextlib.contextmanager
def transfer(spec: Any, engine_req_id: Optional[str] = None) -> Iterator[None]:
    """Within the block, the kvx backend's ``allocate`` charges staging to the request that
    ``spec`` (an LMCache ``DisaggSpec``: ``req_id``, ``total_chunks``, ``receiver_host``,
    ``receiver_init_port``, ``receiver_alloc_port``) describes. ``engine_req_id`` is the
    serving engine's own id of the request (vLLM's ``request_id``), so that
    ``cancel_request`` with that id reaches it too."""
    token = _CURRENT.set((spec, engine_req_id))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_transfer() -> Optional[Tuple[Any, Optional[str]]]:
    """The ``(spec, engine_req_id)`` of the enclosing ``transfer`` block, if any."""
    return _CURRENT.get()


def install() -> None:
    """Makes LMCache build kvx's PD backend where it would build its own ``PDBackendAsync``
    (``enable_pd: true``, ``pd_backend_mode: async``), and makes ``LMCacheEngine.store``
    tell the backend which request it stores for. Call it once per process, before LMCache
    creates its storage backends; calling it again does nothing. LMCache itself is not
    modified on disk: ``uninstall()`` undoes both."""
    from lmcache.v1 import cache_engine
    from lmcache.v1.storage_backend import pd_backend_async

    from kvx.lmcache.backend import KvxPDBackend

    with _INSTALL_LOCK:
        if getattr(pd_backend_async, "_kvx_original", None) is None:
            pd_backend_async._kvx_original = pd_backend_async.PDBackendAsync
            # LMCache's CreateStorageBackends imports this name when it runs.
            pd_backend_async.PDBackendAsync = KvxPDBackend
        engine = cache_engine.LMCacheEngine
        if getattr(engine.store, "_kvx_wrapped", None) is None:
            engine.store = _with_transfer(engine.store)


def uninstall() -> None:
    """Undoes ``install()``."""
    from lmcache.v1 import cache_engine
    from lmcache.v1.storage_backend import pd_backend_async

    with _INSTALL_LOCK:
        original = getattr(pd_backend_async, "_kvx_original", None)
        if original is not None:
            pd_backend_async.PDBackendAsync = original
            pd_backend_async._kvx_original = None
        engine = cache_engine.LMCacheEngine
        wrapped = getattr(engine.store, "_kvx_wrapped", None)
        if wrapped is not None:
            engine.store = wrapped


def installed() -> bool:
    """Whether ``install()`` is in effect."""
    from lmcache.v1.storage_backend import pd_backend_async

    return getattr(pd_backend_async, "_kvx_original", None) is not None


def _with_transfer(store: Any) -> Any:
    @functools.wraps(store)
    def store_with_transfer(self: Any, *args: Any, **kwargs: Any) -> Any:
        spec = kwargs.get("transfer_spec")
        if spec is None:
            return store(self, *args, **kwargs)
        with transfer(spec, kwargs.get("req_id")):
            return store(self, *args, **kwargs)

    store_with_transfer._kvx_wrapped = store  # type: ignore[attr-defined]
    return store_with_transfer
