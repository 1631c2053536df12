"""What a kvx PD backend takes from an LMCache configuration: LMCache's own ``pd_*`` keys
(read as LMCache reads them, per TP rank) and kvx's settings under ``extra_config``
(``kvx_*`` keys). Every refusal names the key and says what to set instead.

A ``kvx_*`` key that is a protocol setting defaults to kvx's own default, read from the native
module (``kvx.defaults()``, the core's), exactly as ``kvx receiver`` and ``kvx sender`` run;
the keys that only this backend has (the fabric's name, the waiting room, the waits around
LMCache's calls) are defined here. Where an LMCache key's meaning forces a value of its own
(``pd_buffer_size`` in bytes, ``pd_allocation_timeout_sec`` unbounded), the mapping is beside
the key in ``settings_from``."""

from __future__ import annotations

import logging
import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kvx._kvx import defaults as _native_defaults
from kvx._kvx import lmcache_pd_buffer_slots
from kvx._settings import KeySpec, Words, describe, protocol_keys, read_keys

logger = logging.getLogger("kvx.lmcache")

_DEFAULTS = _native_defaults()

#: How kvx's protocol settings read here (``kvx._settings.protocol_keys``).
WORDS = Words(sender="sender", receiver="receiver", a_sender="a sender", a_receiver="a receiver",
              senders="senders", receivers="receivers", unit="chunk", worker="worker", prefix="kvx_")

#: kvx's own settings, read from LMCache's ``extra_config``: name → (type, default, meaning).
KVX_EXTRA_KEYS: Dict[str, KeySpec] = {
    "kvx_fabric": (
        str,
        "tcp",
        "how chunk bytes move: tcp (between processes and hosts), shm (between processes on "
        "one host, through shared memory kvx allocates; pd_buffer_device cpu), or mem "
        "(in-process copies: prefill and decode StorageManagers in one process, as LMCache's "
        "mock_memory channel, for tests and benchmarks)",
    ),
    **protocol_keys(
        ["checksums", "failure_notices", "reply_timeout_sec", "write_timeout_sec", "connect_timeout_sec"],
        WORDS,
        {"failure_notices": "; set false for a proxy that knows only LMCache's messages (its example "
                            "proxy decodes every frame as one)"},
    ),
    "kvx_admission_grace_sec": (
        float,
        0.02,
        "sender: how long a request's first allocation waits for its admission before its "
        "chunks go to the waiting room (one round trip to the receiver, with room to spare)",
    ),
    "kvx_waiting_room_chunks": (
        int,
        0,
        "sender: chunks of requests the receiver has not admitted yet that can wait in host "
        "memory (0: as many as pd_buffer_size holds)",
    ),
    **protocol_keys(["unconsumed_ttl_sec", "peer_share_percent"], WORDS),
    "kvx_get_wait_sec": (
        float,
        5.0,
        "receiver: how long get_blocking waits for a key whose request is still arriving",
    ),
    **protocol_keys(
        ["curve_secret_key", "curve_allow", "curve_server_key"], WORDS,
        {"curve_server_key": ", and of the proxy, which shares that key pair"},
    ),
}


class ConfigError(ValueError):
    """An LMCache configuration that kvx's PD backend cannot run with; the message names the
    key."""


@dataclass
class KvxPDSettings:
    """The settings of one TP rank's backend. ``role`` is what LMCache's ``StorageManager``
    reads (as ``backend.pd_config.role``)."""

    role: str
    tp_rank: int
    chunk_bytes: int
    slots: int
    allocation_timeout_sec: float
    # Receiver: where it listens.
    peer_host: Optional[str] = None
    peer_init_port: Optional[int] = None
    peer_alloc_port: Optional[int] = None
    # Sender: where ProxyNotif goes, and its identity.
    proxy_host: Optional[str] = None
    proxy_port: Optional[int] = None
    local_id: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def alloc_endpoint(self) -> str:
        return f"tcp://{self.peer_host}:{self.peer_alloc_port}"

    @property
    def fabric_endpoint(self) -> str:
        return f"tcp://{self.peer_host}:{self.peer_init_port}"

    @property
    def proxy_endpoint(self) -> Optional[str]:
        if self.proxy_host is None or self.proxy_port is None:
            return None
        return f"tcp://{self.proxy_host}:{self.proxy_port}"


def _port_for_rank(config: Any, key: str, tp_rank: int, required: bool) -> Optional[int]:
    ports = getattr(config, key, None)
    if ports is None:
        if required:
            raise ConfigError(f"{key} is required (a list with one port per TP rank)")
        return None
    if isinstance(ports, int):
        ports = [ports]
    if tp_rank >= len(ports):
        raise ConfigError(
            f"{key} has {len(ports)} port(s) but this worker is TP rank {tp_rank}: give one "
            "port per TP rank"
        )
    return int(ports[tp_rank])


def _extra(config: Any) -> Dict[str, Any]:
    # LMCache's extra_config holds other components' keys too: only kvx_ ones are ours.
    out = read_keys(
        getattr(config, "extra_config", None), KVX_EXTRA_KEYS, "extra_config", ConfigError,
        own_prefix="kvx_",
    )
    # The fabrics this build of the native module has (kvx_embed::named, the one mapping).
    if out["kvx_fabric"] not in _DEFAULTS["node"]["fabrics"]:
        raise ConfigError(f"extra_config kvx_fabric={out['kvx_fabric']!r}: use tcp (or shm, "
                          "with both sides on one host; or mem, with both in one process)")
    if out["kvx_waiting_room_chunks"] < 0:
        raise ConfigError("extra_config kvx_waiting_room_chunks: 0 or more")
    if not 1 <= out["kvx_peer_share_percent"] <= 100:
        raise ConfigError("extra_config kvx_peer_share_percent: 1..100")
    return out


def settings_from(config: Any, metadata: Any, chunk_bytes: int, chunk_tokens: int) -> KvxPDSettings:
    """Reads and checks the configuration of the backend of TP rank ``metadata.worker_id``.
    ``chunk_bytes`` is the size of one full chunk and ``chunk_tokens`` its token count."""
    role = getattr(config, "pd_role", None)
    if role not in ("sender", "receiver"):
        raise ConfigError(f"pd_role={role!r}: kvx's PD backend is a sender or a receiver")
    mode = getattr(config, "pd_backend_mode", "async")
    if mode != "async":
        raise ConfigError(f"pd_backend_mode={mode!r}: kvx replaces the async backend; set async")
    for unsupported in ("pd_bidirectional", "pd_skip_proxy_notification"):
        if getattr(config, unsupported, False):
            raise ConfigError(f"{unsupported}: not supported by kvx's PD backend; remove it")
    device = str(getattr(config, "pd_buffer_device", None) or "cpu")
    if device != "cpu":
        raise ConfigError(
            f"pd_buffer_device={device!r}: kvx's Python backend moves chunks through host "
            "memory (TCP or shared-memory fabric), which cannot reach GPU memory. Set "
            "pd_buffer_device: cpu (LMCache then copies KV between the GPU and the buffer), "
            "or run kvx's RDMA fabric on a NIC with GPUDirect (docs/operations.md)"
        )
    # pd_buffer_size is LMCache's buffer (receiver) or staging (sender) in bytes; kvx's
    # buffer_slots and staging_slots count whole chunks, so it becomes size // chunk_bytes
    # instead of kvx's default slot counts.
    size = getattr(config, "pd_buffer_size", None)
    if size is None or int(size) <= 0:
        raise ConfigError("pd_buffer_size is required: the buffer's size in bytes")
    try:
        slots = lmcache_pd_buffer_slots(int(size), chunk_bytes)
    except (ValueError, OverflowError) as e:
        raise ConfigError(str(e)) from None
    max_prefill = int(getattr(config, "pd_max_prefill_len", 0) or 0)
    if max_prefill > 0 and slots * chunk_tokens < max_prefill:
        raise ConfigError(
            f"pd_buffer_size={size} holds {slots} chunks of {chunk_tokens} tokens "
            f"({slots * chunk_tokens} tokens), fewer than pd_max_prefill_len={max_prefill}: "
            f"give pd_buffer_size at least {math.ceil(max_prefill / chunk_tokens) * chunk_bytes}"
        )
    # pd_allocation_timeout_sec bounds the receiver's admission wait and the sender's staging
    # wait. LMCache's default is no bound, which kvx does not allow (a wait that never ends is a
    # hang): unbounded, each side takes kvx's own default for that wait (the receiver's
    # admission_timeout, the sender's staging_timeout), as `kvx receiver|sender
    # --lmcache-config` do.
    timeout = float(getattr(config, "pd_allocation_timeout_sec", math.inf) or math.inf)
    if timeout <= 0:
        raise ConfigError(f"pd_allocation_timeout_sec={timeout}: a positive number of seconds")
    if not math.isfinite(timeout):
        timeout = default_allocation_timeout(role)
        logger.info(
            "kvx: pd_allocation_timeout_sec is unbounded; the %s's waits end after %.0f s "
            "instead (kvx's default)", role, timeout,
        )
    tp_rank = int(getattr(metadata, "worker_id", 0))
    settings = KvxPDSettings(
        role=role,
        tp_rank=tp_rank,
        chunk_bytes=chunk_bytes,
        slots=slots,
        allocation_timeout_sec=timeout,
        extra=_extra(config),
    )
    if role == "receiver":
        settings.peer_host = getattr(config, "pd_peer_host", None)
        if not settings.peer_host:
            raise ConfigError("pd_peer_host is required on the receiver: the address it listens on")
        settings.peer_init_port = _port_for_rank(config, "pd_peer_init_port", tp_rank, True)
        settings.peer_alloc_port = _port_for_rank(config, "pd_peer_alloc_port", tp_rank, True)
    else:
        settings.proxy_host = getattr(config, "pd_proxy_host", None)
        settings.proxy_port = getattr(config, "pd_proxy_port", None)
        if settings.proxy_host is None or settings.proxy_port is None:
            raise ConfigError("pd_proxy_host and pd_proxy_port are required on the sender")
        host = getattr(config, "pd_peer_host", None)
        init = _port_for_rank(config, "pd_peer_init_port", tp_rank, False)
        # LMCache's identity rule: host+port when the sender has one, else unique per process.
        settings.local_id = (
            f"{host}{init}" if host and init is not None
            else f"sender-pid{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
    return settings


def default_allocation_timeout(role: str) -> float:
    """kvx's bound on the waits ``pd_allocation_timeout_sec`` bounds, for a configuration that
    leaves it unbounded: the receiver's admission timeout or the sender's staging timeout."""
    if role == "receiver":
        return float(_DEFAULTS["receiver"]["admission_timeout"])
    return float(_DEFAULTS["sender"]["staging_timeout"])


def describe_extra_keys() -> List[str]:
    """One line per kvx setting: name, default, meaning (for docs and errors)."""
    return describe(KVX_EXTRA_KEYS)
