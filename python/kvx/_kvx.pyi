"""Type stubs of kvx's native module (crates/kvx-py)."""

from asyncio import Future
from os import PathLike
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union, final

from typing_extensions import Self

# Anything with the writable buffer protocol: bytearray, a NumPy array, mmap; or a CPU
# torch.Tensor (through .numpy()).
_Buffer = Any

# A certificate file or directory (CURVE): `kvx keygen`'s or pyzmq's zmq.auth's.
_Path = Union[str, PathLike[str]]

__all__ = [
    "CancelledError",
    "IdentityRefusedError",
    "KvxError",
    "MisuseError",
    "Proxy",
    "ProxyWait",
    "ReadLease",
    "Receiver",
    "ReceiverLostError",
    "RefusedError",
    "Returned",
    "Sender",
    "StagingSlot",
    "StartError",
    "StoppedError",
    "TimedOutError",
    "__version__",
    "configure",
    "defaults",
    "lmcache_pd_buffer_slots",
    "may_stage_in_place",
    "synthetic_check",
    "synthetic_fill",
]

__version__: str

class KvxError(Exception):
    """Base class of every error kvx raises."""

class RefusedError(KvxError):
    """The receiver or the proxy refused the request (its reason is the message)."""

class IdentityRefusedError(RefusedError):
    """The receiver refused this sender's identity: another of its connections holds it (two senders given the same local_id), or it breaks ZeroMQ's rules (1 to 255 bytes, no leading zero byte). Give each sender its own local_id, or leave it to kvx."""

class TimedOutError(KvxError):
    """A bounded wait ran out (staging, admission, an outcome)."""

class CancelledError(KvxError):
    """The request was cancelled."""

class ReceiverLostError(KvxError):
    """The connection to the receiver (or the proxy) was lost, or it has stopped."""

class StoppedError(KvxError):
    """This sender or receiver has stopped: its driver ended (shutdown, close, or the process's kvx runtime went away), so no call on it can succeed. Make a new one."""

class MisuseError(KvxError):
    """A call broke the API's contract (an unknown request, more chunks than declared, ...)."""

class StartError(KvxError):
    """A kvx object could not start (a port in use, an invalid setting, no device)."""

def defaults() -> Dict[str, Dict[str, Any]]:
    """The default of every setting, from kvx's core: ``{"receiver": ..., "sender": ...,
    "proxy": ..., "node": ...}``, each keyed by the core's field name (durations in seconds);
    ``node`` also lists the names ``transport=`` and ``fabric=`` take in this build
    (``"transports"``, ``"fabrics"``), and the ZeroMQ transport's heartbeats
    (``"heartbeat_interval"``, ``"heartbeat_timeout"``)."""

def may_stage_in_place(checksums: bool) -> bool:
    """Whether memory its owner may reuse while a write still reads it (a vLLM engine's KV
    blocks) may be staged in place (``placement="caller"``) by a sender with ``checksums``:
    kvx's rule, so that no integration decides it for itself. ``False``: copy such memory into
    kvx's own staging."""

def configure(*, workers: int) -> None:
    """Sets the number of threads kvx's runtime uses (default 2), before any kvx object."""

def synthetic_fill(slot: StagingSlot, req_id: str, chunk: int, nbytes: Optional[int] = None) -> None:
    """Writes kvx's synthetic bytes of chunk ``chunk`` of ``req_id`` into the slot, in place."""

def synthetic_check(lease: ReadLease, chunk: int, nbytes: Optional[int] = None) -> bool:
    """True when the leased chunk holds exactly its request's synthetic bytes."""

def lmcache_pd_buffer_slots(pd_buffer_size: int, chunk_bytes: int) -> int:
    """LMCache's ``pd_buffer_size`` (bytes) as kvx's count of whole slots of ``chunk_bytes``
    (the mapping the ``kvx`` binary uses too); ``ValueError`` saying what to set when no
    chunk fits or more than a buffer may hold."""

@final
class ProxyWait:
    """One awaited request's outcome, to come (from ``Proxy.expect``)."""

    @property
    def req_id(self) -> str: ...
    def wait(self, timeout: Optional[float] = None) -> None:
        """Returns when every TP rank reported; raises ``RefusedError``, ``TimedOutError``,
        or ``StoppedError`` once the proxy has stopped."""

@final
class Proxy:
    """The notice channel of a proxy (a ZeroMQ PULL socket)."""

    def __new__(
        cls,
        endpoint: str = "tcp://127.0.0.1:0",
        *,
        kv_ready_timeout: Optional[float] = None,
        standalone_tp_ranks: Optional[int] = None,
        ranks_per_connection: Optional[int] = None,
        curve_secret_key: Optional[_Path] = None,
        curve_allow: Optional[_Path] = None,
    ) -> Self:
        """``ranks_per_connection`` (``None``: 1): the TP ranks of one request one sender's
        connection may speak for; its further notices for the request are refused, not
        counted. ``curve_secret_key`` and ``curve_allow`` (both or neither): CURVE on the
        notice channel, as for ``Receiver``; a request then counts notices only from the key
        of its first notice."""
    @property
    def endpoint(self) -> str: ...
    def expect(self, req_id: str, tp_ranks: int = 1) -> ProxyWait: ...
    def next_event(self, timeout: Optional[float] = None) -> Optional[Tuple[str, Optional[str]]]: ...


@final
class StagingSlot:
    """A staging slot held for one request (``Sender.allocate``): write the chunk into
    ``view`` (or with ``write``), then ``Sender.add`` it. Dropped or released before that,
    the slot goes back to the pool."""

    @property
    def index(self) -> int:
        """The slot's index: bytes ``index * slot_bytes`` on of the staging."""
    @property
    def req_id(self) -> str: ...
    @property
    def view(self) -> memoryview:
        """The slot as a writable byte memoryview into the staging itself (zero-copy)."""
    def write(self, data: _Buffer, offset: int = 0) -> None:
        """Copies ``data`` (any bytes-like object) into the slot at ``offset``."""
    def release(self) -> None:
        """Hands the slot back unused."""

@final
class Sender:
    """A prefill worker's sender: moves KV chunks from its staging into receivers' buffers.

    A request: ``begin`` -> ``wait_admitted`` -> per chunk ``allocate``, write, ``add`` ->
    ``submit`` batches (the last with ``last=True``) -> ``wait_outcome`` or ``next_ends``.
    Write a staging slot only while you hold it (between ``allocate`` and ``add``).

    ``placement="caller"``: ``staging`` is the program's own memory, where the chunks already
    are (one buffer, or per-layer buffers of the same size, slots numbered part after part);
    nothing is allocated or copied: ``submit_slots`` names each batch's slots, and
    ``wait_released`` says when the program may change them again."""

    def __new__(
        cls,
        *,
        slots: int,
        slot_bytes: int,
        staging: Union[None, _Buffer, Sequence[_Buffer]] = None,
        transport: str = "zmq",
        fabric: str = "tcp",
        proxy: Optional[str] = None,
        local_id: Optional[str] = None,
        staging_timeout: Optional[float] = None,
        reply_timeout: Optional[float] = None,
        write_timeout: Optional[float] = None,
        checksums: Optional[bool] = None,
        failure_notices: Optional[bool] = None,
        curve_secret_key: Optional[_Path] = None,
        curve_server_key: Optional[_Path] = None,
        placement: Literal["pool", "caller"] = "pool",
        heartbeat_interval: Optional[float] = None,
        heartbeat_timeout: Optional[float] = None,
    ) -> Self:
        """A protocol setting given as ``None`` is kvx's default (``defaults()["sender"]``).
        ``curve_secret_key`` (this sender's ``NAME.key_secret``) and ``curve_server_key`` (the
        receivers' and proxy's ``NAME.key``), both or neither: CURVE on the control channels.
        ``heartbeat_interval`` / ``heartbeat_timeout`` (``"zmq"`` only; defaults in
        ``defaults()["node"]``): how often this sender's connections ping each receiver, and
        the silence after which it gives a receiver up (failing its requests); the timeout at
        least twice the interval."""
    def add_receiver(self, alloc: str, fabric: str, *, timeout: float = 10.0) -> int:
        """Connects to a receiver; returns its id for ``begin``. ``IdentityRefusedError`` when
        the receiver refuses this sender's identity (another sender's connection holds it)."""
    def begin(
        self,
        req_id: str,
        *,
        receiver: int,
        total_chunks: int,
        shape: Sequence[int] = ...,
        dtype: str = ...,
        fmt: int = 1,
        claim_secret: Optional[str] = None,
        report_admission: bool = False,
    ) -> None:
        """Begins a request; its admission probe goes out at once. ``claim_secret``: the
        secret of the receiver's reservation for it, which a ``placement="caller"`` receiver
        requires (``Receiver.reserve``); sent with the first message only, never printed.
        ``report_admission``: its admission (or why it never came) is reported once through
        ``next_admitted`` instead of asked for."""
    def next_admitted(self, max: int = 64, timeout: Optional[float] = None) -> List[Tuple[str, Optional[KvxError]]]:
        """Up to ``max`` admissions of requests begun with ``report_admission=True``: ``(req_id,
        None)`` admitted, ``(req_id, error)`` never will be; waits at most ``timeout`` for the
        first, ``[]`` when none came. Each comes once, to one caller."""
    def wait_admitted(self, req_id: str, timeout: Optional[float] = None) -> bool:
        """True once admitted, False when ``timeout`` passed; raises when it failed."""
    def admitted(self, req_id: str) -> Future[None]:
        """Awaitable ``wait_admitted``: done once admitted; raises why it failed. Unbounded
        (bound it with ``asyncio.timeout``/``wait_for``). Needs a running event loop."""
    def allocate(self, req_id: str, timeout: Optional[float] = None) -> StagingSlot:
        """Takes a staging slot (``TimedOutError`` after ``timeout``, default
        ``staging_timeout``). When no slot is free and only added, unsubmitted chunks hold
        staging (this request's or others'), they are submitted first, none as the last
        batch."""
    def allocate_async(self, req_id: str, timeout: Optional[float] = None) -> Future[StagingSlot]:
        """Awaitable ``allocate``, without blocking the event loop: already done when a slot
        is free. Cancelled, it hands back a slot it got."""
    def add(self, slot: StagingSlot, key: str, *, nbytes: Optional[int] = None, tokens: int = 0) -> None:
        """Adds the written slot to its request's next batch (checksummed now)."""
    def submit(self, req_id: str, *, last: bool = False) -> None:
        """Submits the request's added chunks as one batch."""
    def submit_slots(
        self,
        req_id: str,
        slots: Sequence[int],
        keys: Sequence[str],
        *,
        tokens: int = 0,
        last: bool = False,
    ) -> None:
        """``placement="caller"``: one batch of chunks read straight from the program's
        staging, chunk i the whole of slot ``slots[i]``, named ``keys[i]`` (checksummed now).
        Leave those slots unchanged until ``wait_released`` returns for the request."""
    def wait_released(self, req_id: str, timeout: Optional[float] = None) -> None:
        """``placement="caller"``: returns once the request reads none of the program's
        staging (delivered); raises why it failed once its last write has completed, or
        ``TimedOutError``."""
    def released(self, req_id: str) -> Future[None]:
        """Awaitable ``wait_released``. Unbounded (bound it with ``asyncio.timeout``)."""
    def cancel(self, req_id: str) -> None:
        """Cancels the request wherever it is; its end is ``CancelledError``."""
    def wait_outcome(self, req_id: str, timeout: Optional[float] = None) -> None:
        """Returns when delivered; raises why it failed, or ``TimedOutError``."""
    def outcome(self, req_id: str) -> Future[None]:
        """Awaitable ``wait_outcome``: done once delivered; raises why it failed. Unbounded
        (bound it with ``asyncio.timeout``/``wait_for``)."""
    def next_ends(self, max: int = 64, timeout: Optional[float] = None) -> List[Tuple[str, Optional[KvxError]]]:
        """Up to ``max`` request ends as ``(req_id, error or None)``; ``[]`` after ``timeout``."""
    @property
    def staging_free(self) -> int: ...
    def write_counts(self) -> Tuple[int, int]:
        """``(writes, bytes)`` posted so far; a run of consecutive chunks is one write over TCP."""
    @property
    def slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def staging(self) -> Optional[memoryview]:
        """The whole staging as a byte memoryview (with the shm fabric, of kvx's mapping)."""
    def close(self, timeout: float = 5.0) -> bool:
        """Stops the sender; waits on running requests, and later calls, raise
        ``StoppedError``. Waits (at
        most ``timeout`` seconds, GIL released) until the notices already due to the proxy
        are written, so that a process exiting next does not lose them; returns whether
        they were."""
    def __enter__(self) -> "Sender": ...
    def __exit__(self, *exc: object) -> None: ...

@final
class Returned:
    """A reservation back with the program (``Receiver.returned``): its slots are the
    program's again and no write can land in them. ``consumed``: its request was read;
    otherwise ``reason`` says why not, and the slots hold nothing to read."""

    @property
    def req_id(self) -> str: ...
    @property
    def slots(self) -> List[int]: ...
    @property
    def consumed(self) -> bool: ...
    @property
    def reason(self) -> Optional[str]: ...

@final
class ReadLease:
    """A ready request, leased: its slots stay put until ``consume`` (or the lease is
    dropped, or its ``with`` block ends)."""

    @property
    def req_id(self) -> str: ...
    @property
    def slots(self) -> List[int]: ...
    @property
    def keys(self) -> List[str]: ...
    @property
    def shape(self) -> List[int]:
        """The shape of one full chunk, as the sender described it."""
    @property
    def dtype(self) -> str:
        """The chunks' torch dtype name, as the sender described it."""
    @property
    def fmt(self) -> int:
        """The chunks' LMCache MemoryFormat value (KV_2LTD = 1)."""
    @property
    def tokens(self) -> List[Optional[int]]:
        """Each chunk's token count where its batch named it (a batch's last chunk), None
        for a full chunk of ``shape``."""
    def views(self) -> List[memoryview]:
        """Each chunk's slot as a memoryview into the buffer itself, valid until consume."""
    def read(self, chunk: int, nbytes: Optional[int] = None) -> bytes:
        """A copy of a chunk's first ``nbytes`` bytes (None: the whole slot)."""
    def consume(self, timeout: float = 10.0, *, wait: bool = True) -> None:
        """Releases the request's slots (``wait=False``: without waiting for kvx's driver to
        confirm); ``MisuseError`` when consumed already, ``StoppedError`` when the receiver has
        stopped."""
    def __enter__(self) -> "ReadLease": ...
    def __exit__(self, *exc: object) -> None: ...
    def __len__(self) -> int: ...

@final
class Receiver:
    """A decode worker's receiver: admits requests into its buffer of ``slots *
    slot_bytes`` and hands each complete one to the decoder (``next_ready``)."""

    def __new__(
        cls,
        *,
        slots: int,
        slot_bytes: int,
        buffer: Union[None, _Buffer, Sequence[_Buffer]] = None,
        transport: str = "zmq",
        fabric: str = "tcp",
        alloc: str = "tcp://127.0.0.1:0",
        fabric_endpoint: str = "tcp://127.0.0.1:0",
        peer_share_percent: Optional[int] = None,
        admission_timeout: Optional[float] = None,
        unconsumed_ttl: Optional[float] = None,
        require_checksums: Optional[bool] = None,
        curve_secret_key: Optional[_Path] = None,
        curve_allow: Optional[_Path] = None,
        placement: Literal["pool", "caller"] = "pool",
        request_idle_timeout: Optional[float] = None,
        heartbeat_interval: Optional[float] = None,
        heartbeat_timeout: Optional[float] = None,
    ) -> Self:
        """A protocol setting given as ``None`` is kvx's default (``defaults()["receiver"]``).
        ``curve_secret_key`` (this receiver's ``NAME.key_secret``) and ``curve_allow`` (the
        directory of allowed senders' ``NAME.key``), both or neither: CURVE on the alloc
        channel. ``placement="caller"``: the program owns the buffer's slots and lends each
        request's (``reserve``); ``"pool"``: kvx's admission places requests. ``buffer`` may be
        a list of buffers of the same size (per-layer tensors), each holding
        ``slots / len(buffer)`` slots, numbered part after part. ``request_idle_timeout``: how
        long an admitted request may go without a landed write before it fails.
        ``heartbeat_interval`` / ``heartbeat_timeout`` (``"zmq"`` only; defaults in
        ``defaults()["node"]``): the pings a sender's connection is expected to send, and the
        silence after which this receiver gives the sender up (failing its requests)."""
    @property
    def alloc_endpoint(self) -> str: ...
    @property
    def fabric_endpoint(self) -> str: ...
    def next_ready(self, max: int = 16, timeout: Optional[float] = None) -> List[ReadLease]:
        """Up to ``max`` ready requests, leased, waiting at most ``timeout`` seconds for the
        first (None: as long as it takes); ``[]`` when none came. Ended requests' notices
        (consumed ones too) do not end the wait. ``StoppedError`` once the receiver has
        stopped."""
    def ready(self, max: int = 16) -> Future[List[ReadLease]]:
        """Awaitable ``next_ready``: up to ``max`` ready requests once the first is ready.
        Unbounded (bound it with ``asyncio.timeout``/``wait_for``); cancelled, it loses
        nothing: leases it had taken go to the next ``ready``/``next_ready``.
        ``StoppedError`` once the receiver has stopped."""
    def reserve(
        self, req_id: str, slots: Sequence[int], timeout: float = 5.0, *, claim_secret: str, held: int = 0
    ) -> None:
        """Caller placement: lends ``slots`` (chunk i to ``slots[i]``) to request ``req_id``,
        which the first sender with that id that carries ``claim_secret`` claims: hand the
        secret (16..128 printable ASCII bytes, fresh per reservation: ``kvx.new_claim_secret()``)
        to the one sender meant to claim it (``Sender.begin(..., claim_secret=)``); the id alone
        claims nothing. ``MisuseError`` (nothing changed) for an
        id reserved and not yet returned, a slot out of range, named twice or reserved for another
        request not yet returned, or a ``placement="pool"`` receiver; ``ValueError`` for a
        malformed secret. ``held``: the request's
        first ``held`` chunks are the program's already (a local prefix hit): the sender, which
        sends every chunk, is told they are sent, and chunk ``held + i`` goes to ``slots[i]``."""
    def withdraw(self, req_id: str, timeout: float = 5.0) -> None:
        """Caller placement: takes reservation ``req_id`` back; its sender's request fails and
        its slots come back through ``returned`` once no write can land in them.
        ``MisuseError`` for an id not reserved or already returned."""
    def returned(self, max: int = 64, timeout: Optional[float] = None) -> List[Returned]:
        """Caller placement: up to ``max`` reservations back with the program, waiting at most
        ``timeout`` seconds for the first (None: as long as it takes); ``[]`` when none came.
        ``StoppedError`` once the receiver has stopped and every return was taken."""
    def returned_async(self, max: int = 64) -> Future[List[Returned]]:
        """Awaitable ``returned``: up to ``max`` reservations back once the first has come.
        Unbounded (bound it with ``asyncio.timeout``/``wait_for``); cancelled, it loses
        nothing: returns it had taken go to the next ``returned``/``returned_async``.
        ``StoppedError`` once the receiver has stopped and every return was taken."""
    def snapshot(self, timeout: float = 5.0) -> Dict[str, int]:
        """The buffer's accounting: capacity, free, held, reserved_unallocated,
        quarantined, tracked_requests, admission_queue_len. ``TimedOutError`` when kvx's
        driver does not answer within ``timeout`` seconds, ``StoppedError`` when the
        receiver has stopped."""
    @property
    def slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def buffer(self) -> Optional[memoryview]:
        """The whole buffer as a byte memoryview (with the shm fabric, of kvx's memory);
        None for a buffer lent in parts."""
    def close(self) -> None:
        """Stops the receiver; its ports close."""
    def __enter__(self) -> "Receiver": ...
    def __exit__(self, *exc: object) -> None: ...
