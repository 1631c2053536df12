"""Which request a staging allocation is for.

LMCache's ``allocate()`` carries no request id, yet kvx admits a request before any of its
chunks takes staging: that ordering is what keeps concurrent requests from deadlocking the
two buffers. The request is known earlier, though: ``LMCacheEngine.store(...,
transfer_spec=DisaggSpec(req_id, ..., total_chunks))`` has it before its first
``allocate``, on the same thread. So the switch (``switch.py``) wraps ``store`` to set the
transfer spec in a context variable for the length of the call (``transfer``), and the
backend's ``allocate`` reads it (``current_transfer``). A context variable is per thread and
per asyncio task, so concurrent stores on different threads each see their own request.

``allocate`` outside such a context (a store without a transfer spec, or another caller)
has no request to charge: the backend refuses it (returns ``None``, which LMCache treats as
"no memory", and logs why once). Callers other than ``LMCacheEngine.store`` wrap their
allocations in ``kvx.lmcache.transfer(spec)`` themselves.

A leaf: the sender reads the context and the switch sets it, so neither imports the other.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional, Tuple

_CURRENT: contextvars.ContextVar[Optional[Tuple[Any, Optional[str]]]] = contextvars.ContextVar(
    "kvx_lmcache_transfer", default=None
)


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
