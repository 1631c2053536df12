"""The switch that puts kvx in LMCache: ``install`` makes LMCache build ``KvxPDBackend``
where it would build its own ``PDBackendAsync``, and wraps ``LMCacheEngine.store`` so that
each store says which request its allocations are for (``context.transfer``);
``uninstall`` undoes both. LMCache itself is not modified on disk.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from .backend import KvxPDBackend
from .context import transfer

_INSTALL_LOCK = threading.Lock()


def install() -> None:
    """Makes LMCache build kvx's PD backend where it would build its own ``PDBackendAsync``
    (``enable_pd: true``, ``pd_backend_mode: async``), and makes ``LMCacheEngine.store``
    tell the backend which request it stores for. Call it once per process, before LMCache
    creates its storage backends; calling it again does nothing. LMCache itself is not
    modified on disk: ``uninstall()`` undoes both."""
    from lmcache.v1 import cache_engine
    from lmcache.v1.storage_backend import pd_backend_async

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
