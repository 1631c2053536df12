"""The tunables of a ``kvx.Sender`` and a ``kvx.Receiver`` as values, for code that keeps its
configuration apart from where it builds the objects (a serving stack's config file, a test's
fixture)::

    cfg = kvx.SenderConfig(staging_timeout=5.0)
    tx = kvx.Sender(slots=8, slot_bytes=1 << 20, **cfg.kwargs())

Each field is the keyword argument of the same name, with the same default (a test keeps them
in step with the native signatures). Sizes and memory (``slots``, ``slot_bytes``, ``staging``,
``buffer``) and where to connect stay arguments of the objects themselves.
"""

from dataclasses import asdict, dataclass
from typing import Any, Dict


@dataclass(frozen=True)
class SenderConfig:
    """A sender's timers and checks (seconds)."""

    #: The longest ``allocate`` waits for a staging slot when given no timeout.
    staging_timeout: float = 30.0
    #: The longest a receiver may take to answer a batch before the request fails.
    reply_timeout: float = 10.0
    #: The longest a posted write may take before the request fails.
    write_timeout: float = 10.0
    #: Compute a checksum of every chunk, which the receiver checks before it is ready.
    checksums: bool = True
    #: Tell the proxy when a request fails (kvx's FailNotif); off for a proxy that knows only
    #: LMCache's messages.
    failure_notices: bool = True

    def kwargs(self) -> Dict[str, Any]:
        """The fields as keyword arguments of ``kvx.Sender``."""
        return asdict(self)


@dataclass(frozen=True)
class ReceiverConfig:
    """A receiver's admission policy and timers (seconds)."""

    #: The most of the buffer one sender may hold, in percent (100 with a single sender).
    peer_share_percent: int = 50
    #: The longest a request waits for admission before it is refused.
    admission_timeout: float = 30.0
    #: How long a ready request may stay unconsumed before its slots are reclaimed.
    unconsumed_ttl: float = 300.0
    #: Refuse chunks that carry no checksum.
    require_checksums: bool = False

    def kwargs(self) -> Dict[str, Any]:
        """The fields as keyword arguments of ``kvx.Receiver``."""
        return asdict(self)


__all__ = ["ReceiverConfig", "SenderConfig"]
