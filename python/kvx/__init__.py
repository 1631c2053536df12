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
    may_stage_in_place,
)
from kvx.config import ReceiverConfig, SenderConfig


def new_claim_secret() -> str:
    """A fresh claim secret for one caller-placement reservation (``Receiver.reserve``):
    192 random bits as 32 URL-safe characters. Hand it to the one sender meant to claim the
    reservation (``Sender.begin(..., claim_secret=)``), and to nobody else."""
    import secrets

    return secrets.token_urlsafe(24)


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
    "may_stage_in_place",
    "new_claim_secret",
]
