"""The tunables of a ``kvx.Sender`` and a ``kvx.Receiver`` as values, for code that keeps its
configuration apart from where it builds the objects (a serving stack's config file, a test's
fixture)::

    cfg = kvx.SenderConfig(staging_timeout=5.0)
    tx = kvx.Sender(slots=8, slot_bytes=1 << 20, **cfg.kwargs())

Each field is the keyword argument of the same name, and its default is kvx's own, read from
the native module (``kvx.defaults()``, the core's defaults), which is what the object takes for
an argument left ``None``. Sizes and memory (``slots``, ``slot_bytes``, ``staging``,
``buffer``) and where to connect stay arguments of the objects themselves.
"""

from dataclasses import asdict, dataclass
from typing import Any, Dict

from kvx._kvx import defaults as _native_defaults

_SENDER = _native_defaults()["sender"]
_RECEIVER = _native_defaults()["receiver"]


@dataclass(frozen=True)
class SenderConfig:
    """A sender's timers and checks (seconds)."""

    #: The longest ``allocate`` waits for a staging slot when given no timeout.
    staging_timeout: float = _SENDER["staging_timeout"]
    #: The longest a receiver may take to answer a batch before the request fails.
    reply_timeout: float = _SENDER["reply_timeout"]
    #: The longest a posted write may take before the request fails.
    write_timeout: float = _SENDER["write_timeout"]
    #: Compute a checksum of every chunk, which the receiver checks before it is ready.
    checksums: bool = _SENDER["checksums"]
    #: Tell the proxy when a request fails (kvx's FailNotif); off for a proxy that knows only
    #: LMCache's messages.
    failure_notices: bool = _SENDER["notify_proxy_on_failure"]

    def kwargs(self) -> Dict[str, Any]:
        """The fields as keyword arguments of ``kvx.Sender``."""
        return asdict(self)


@dataclass(frozen=True)
class ReceiverConfig:
    """A receiver's admission policy and timers (seconds)."""

    #: The most of the buffer one sender may hold, in percent (1-100).
    peer_share_percent: int = _RECEIVER["peer_share_percent"]
    #: The longest a request waits for admission before it is refused.
    admission_timeout: float = _RECEIVER["admission_timeout"]
    #: How long a ready request may stay unconsumed before its slots are reclaimed.
    unconsumed_ttl: float = _RECEIVER["unconsumed_ttl"]
    #: Fail a kvx sender's chunk that carries no checksum.
    require_checksums: bool = _RECEIVER["require_checksums"]

    def kwargs(self) -> Dict[str, Any]:
        """The fields as keyword arguments of ``kvx.Receiver``."""
        return asdict(self)


__all__ = ["ReceiverConfig", "SenderConfig"]
