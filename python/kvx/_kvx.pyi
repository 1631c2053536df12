"""Type stubs of kvx's native module (crates/kvx-py)."""

from typing import Optional, Tuple

__version__: str

class KvxError(Exception):
    """Base class of every error kvx raises."""

class RefusedError(KvxError):
    """The receiver or the proxy refused the request (its reason is the message)."""

class TimedOutError(KvxError):
    """A bounded wait ran out (staging, admission, an outcome)."""

class CancelledError(KvxError):
    """The request was cancelled."""

class ReceiverLostError(KvxError):
    """The connection to the receiver (or the proxy) was lost, or it has stopped."""

class MisuseError(KvxError):
    """A call broke the API's contract (an unknown request, more chunks than declared, ...)."""

class StartError(KvxError):
    """A kvx object could not start (a port in use, an invalid setting, no device)."""

def configure(*, workers: int) -> None:
    """Sets the number of threads kvx's runtime uses (default 2), before any kvx object."""

class ProxyWait:
    """One awaited request's outcome, to come (from ``Proxy.expect``)."""

    @property
    def req_id(self) -> str: ...
    def wait(self, timeout: Optional[float] = None) -> None:
        """Returns when every TP rank reported; raises ``RefusedError``, ``TimedOutError``
        or ``ReceiverLostError``."""

class Proxy:
    """The notice channel of a proxy (a ZeroMQ PULL socket)."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        *,
        kv_ready_timeout: float = 120.0,
        standalone_tp_ranks: Optional[int] = None,
    ) -> None: ...
    @property
    def endpoint(self) -> str: ...
    def expect(self, req_id: str, tp_ranks: int = 1) -> ProxyWait: ...
    def next_event(self, timeout: Optional[float] = None) -> Optional[Tuple[str, Optional[str]]]: ...
