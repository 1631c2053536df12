"""kvx: deadlock-free KV-cache transfer from prefill to decode workers.

The native module (``kvx._kvx``, built from ``crates/kvx-py``) does the work; this package
re-exports it. A prefill worker runs a ``Sender``, a decode worker a ``Receiver``, the router
a ``Proxy``; staging and receive buffers may be the caller's own memory (a ``bytearray``, a
NumPy array, a CPU ``torch.Tensor``), and slots are reached through zero-copy
``memoryview``s of it. Every blocking call releases the GIL, can be interrupted with Ctrl-C, and is
bounded by a ``timeout`` in seconds (``None``: as long as it takes). Errors are the
exceptions below, all subclasses of ``KvxError``.
"""

from kvx._kvx import (
    CancelledError,
    IdentityRefusedError,
    KvxError,
    MisuseError,
    Proxy,
    ProxyWait,
    ReadLease,
    Receiver,
    ReceiverLostError,
    RefusedError,
    Returned,
    Sender,
    StagingSlot,
    StartError,
    StoppedError,
    TimedOutError,
    __version__,
    configure,
    defaults,
)
from kvx.config import ReceiverConfig, SenderConfig

__all__ = [
    "CancelledError",
    "IdentityRefusedError",
    "KvxError",
    "MisuseError",
    "Proxy",
    "ProxyWait",
    "ReadLease",
    "Receiver",
    "ReceiverConfig",
    "ReceiverLostError",
    "RefusedError",
    "Returned",
    "Sender",
    "SenderConfig",
    "StagingSlot",
    "StartError",
    "StoppedError",
    "TimedOutError",
    "__version__",
    "configure",
    "defaults",
]
