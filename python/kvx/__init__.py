"""kvx: deadlock-free KV-cache transfer from prefill to decode workers.

The native module (``kvx._kvx``, built from ``crates/kvx-py``) does the work; this package
re-exports it. Every blocking call releases the GIL, can be interrupted with Ctrl-C, and is
bounded by a ``timeout`` in seconds (``None``: as long as it takes). Errors are the
exceptions below, all subclasses of ``KvxError``.
"""

from kvx._kvx import (
    CancelledError,
    KvxError,
    MisuseError,
    Proxy,
    ProxyWait,
    ReceiverLostError,
    RefusedError,
    StartError,
    TimedOutError,
    __version__,
    configure,
)

__all__ = [
    "CancelledError",
    "KvxError",
    "MisuseError",
    "Proxy",
    "ProxyWait",
    "ReceiverLostError",
    "RefusedError",
    "StartError",
    "TimedOutError",
    "__version__",
    "configure",
]
