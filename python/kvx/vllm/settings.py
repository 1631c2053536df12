"""What ``KvxConnector`` takes from vLLM's ``--kv-transfer-config``: the role (``kv_role``)
and kvx's settings under ``kv_connector_extra_config``, read and checked as ``kvx.lmcache``
reads its keys (one reader, ``python/kvx/_settings.py``). Every refusal names the key and says what
to set instead; an unknown key is refused with the list of known ones.

A key that is a protocol setting defaults to kvx's own default, read from the native module
(``kvx.defaults()``, the core's), as ``kvx receiver`` and ``kvx sender`` run; the keys only the
connector has (where the decode engine listens, the fabric's name) are defined here.

This module does not import vLLM: the router and the tests read settings without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from kvx._kvx import defaults as _native_defaults
from kvx._settings import KeySpec, Words, describe, protocol_keys, read_keys

_DEFAULTS = _native_defaults()

#: How kvx's protocol settings read here (``kvx._settings.protocol_keys``).
WORDS = Words(sender="prefill", receiver="decode", a_sender="a prefill engine", a_receiver="a decode engine",
              senders="prefill engines", receivers="decode engines", unit="write", worker="engine")

#: vLLM's ``kv_role`` → kvx's side. ``kv_both`` is not yet supported.
ROLES: Dict[str, str] = {"kv_producer": "prefill", "kv_consumer": "decode"}

#: The fabrics the connector can run on: TCP, and RDMA from a host buffer (one registered
#: range: ``kvx.vllm.host_buffer``).
FABRICS: Tuple[str, ...] = ("tcp", "rdma")

#: kvx's settings in ``kv_connector_extra_config``: name → (type, default, meaning).
EXTRA_KEYS: Dict[str, KeySpec] = {
    "fabric": (
        str,
        "tcp",
        "how KV bytes move: tcp (between processes and hosts), or rdma (one-sided writes from "
        "and into the connector's host buffer, which rdma always uses: one registered range; "
        "a GPU engine also needs kv_buffer_device cpu; a kvx wheel built with the rdma "
        "feature)",
    ),
    "host": (
        str,
        "127.0.0.1",
        "decode: the address its receivers listen on and the router hands to prefill engines",
    ),
    "alloc_port": (
        int,
        8400,
        "decode: the first alloc (admission) port; TP rank r listens on alloc_port + r",
    ),
    "fabric_port": (
        int,
        8300,
        "decode: the first fabric port; TP rank r listens on fabric_port + r",
    ),
    "host_buffer": (
        bool,
        False,
        "move the KV through a host copy of the engine's blocks even when the KV is in host "
        "memory (the GPU engines' path, run on a CPU engine; KV on a GPU always takes it, "
        "with vLLM's kv_buffer_device: cpu)",
    ),
    **protocol_keys(
        ["checksums", "connect_timeout_sec", "grant_timeout_sec", "reply_timeout_sec", "write_timeout_sec",
         "claim_timeout_sec", "idle_timeout_sec", "heartbeat_interval_sec", "heartbeat_timeout_sec"],
        WORDS,
        {
            "connect_timeout_sec": " (decode, under llm-d: the prefill engine's bootstrap server)",
            "grant_timeout_sec": "; past it, the request runs without a push (the decode side then "
                                 "reports a load error)",
            "claim_timeout_sec": "; past it, the load fails",
            "idle_timeout_sec": "; past it, the load fails",
        },
    ),
    # llm-d's P/D protocol (docs/vllm.md, "Under llm-d"; kvx.vllm.bootstrap).
    "bootstrap_port": (
        int,
        None,
        "prefill, under llm-d: serve the bootstrap server on this port (the routing "
        "sidecar's --mooncake-bootstrap-port, 8998 by default); unset: none",
    ),
    "bootstrap_host": (
        str,
        "0.0.0.0",
        "prefill, under llm-d: the address the bootstrap server listens on",
    ),
    "bootstrap_engine_id": (
        str,
        None,
        "prefill, under llm-d: the engine id /query states (the sidecar caches it for good); "
        "unset: kvx-<host name>-<bootstrap_port>, the same after a restart",
    ),
    "bootstrap_allow": (
        str,
        None,
        "prefill, under llm-d: the networks decode engines register from, comma-separated "
        "(10.0.0.0/8,fd00::/8); unset: any",
    ),
    **protocol_keys(["curve_secret_key", "curve_allow", "curve_server_key"], WORDS),
}


class ConfigError(ValueError):
    """A ``--kv-transfer-config`` that ``KvxConnector`` cannot run with; the message names the
    key."""


@dataclass(frozen=True)
class KvxVllmSettings:
    """One engine's connector settings. ``side`` is ``"prefill"`` or ``"decode"``; the rest
    are ``EXTRA_KEYS``, checked."""

    side: str
    engine_id: str
    fabric: str
    host: str
    alloc_port: int
    fabric_port: int
    checksums: bool
    connect_timeout_sec: float
    grant_timeout_sec: float
    reply_timeout_sec: float
    write_timeout_sec: float
    claim_timeout_sec: float
    idle_timeout_sec: float
    heartbeat_interval_sec: float = _DEFAULTS["node"]["heartbeat_interval"]
    heartbeat_timeout_sec: float = _DEFAULTS["node"]["heartbeat_timeout"]
    bootstrap_port: Optional[int] = None
    bootstrap_host: str = "0.0.0.0"
    bootstrap_engine_id: Optional[str] = None
    bootstrap_allow: Optional[str] = None
    curve_secret_key: Optional[str] = None
    curve_allow: Optional[str] = None
    curve_server_key: Optional[str] = None
    host_buffer: bool = False
    #: vLLM's own ``kv_buffer_device`` (``KVTransferConfig``): ``cpu`` lets KV on a GPU go
    #: through a host buffer (``kvx.vllm.host_buffer``).
    kv_buffer_device: Optional[str] = None

    def alloc_endpoint(self, tp_rank: int) -> str:
        """The decode receiver's alloc endpoint of ``tp_rank``."""
        return f"tcp://{self.host}:{self.alloc_port + tp_rank}"

    def fabric_endpoint(self, tp_rank: int) -> str:
        """The decode receiver's fabric endpoint of ``tp_rank``."""
        return f"tcp://{self.host}:{self.fabric_port + tp_rank}"


def read_extra(extra: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``kv_connector_extra_config`` checked, with every key's default filled in."""
    out = read_keys(extra, EXTRA_KEYS, "kv_connector_extra_config", ConfigError)
    if out["fabric"] not in FABRICS:
        raise ConfigError(
            f"kv_connector_extra_config fabric={out['fabric']!r}: use {' or '.join(FABRICS)}"
        )
    for name in ("alloc_port", "fabric_port"):
        if not 1 <= out[name] <= 65535:
            raise ConfigError(f"kv_connector_extra_config {name}={out[name]}: a port, 1..65535")
    if out["bootstrap_port"] is not None and not 1 <= out["bootstrap_port"] <= 65535:
        raise ConfigError(f"kv_connector_extra_config bootstrap_port={out['bootstrap_port']}: a port, 1..65535")
    if out["heartbeat_timeout_sec"] < 2 * out["heartbeat_interval_sec"]:
        raise ConfigError(
            f"kv_connector_extra_config heartbeat_timeout_sec={out['heartbeat_timeout_sec']}: at "
            f"least twice heartbeat_interval_sec ({out['heartbeat_interval_sec']}), so that one "
            "late heartbeat does not end a connection"
        )
    return out


def settings_from(kv_transfer_config: Any) -> KvxVllmSettings:
    """Reads and checks a vLLM ``KVTransferConfig`` (or any object with its attributes
    ``kv_role``, ``engine_id`` and ``kv_connector_extra_config``)."""
    role = getattr(kv_transfer_config, "kv_role", None)
    if role not in ROLES:
        raise ConfigError(
            f"kv_role={role!r}: KvxConnector runs as kv_producer (a prefill engine) or "
            "kv_consumer (a decode engine); kv_both is not yet supported"
        )
    extra = read_extra(getattr(kv_transfer_config, "kv_connector_extra_config", None))
    side = ROLES[role]
    if side == "prefill" and extra["curve_allow"] is not None:
        raise ConfigError("kv_connector_extra_config curve_allow: a decode (kv_consumer) key")
    if side == "decode":
        for key in ("bootstrap_port", "bootstrap_engine_id", "bootstrap_allow"):
            if extra[key] is not None:
                raise ConfigError(f"kv_connector_extra_config {key}: a prefill (kv_producer) key")
    if side == "decode" and extra["curve_server_key"] is not None:
        raise ConfigError(
            "kv_connector_extra_config curve_server_key: a prefill (kv_producer) key"
        )
    curve = [extra["curve_secret_key"], extra["curve_allow" if side == "decode" else "curve_server_key"]]
    if (curve[0] is None) != (curve[1] is None):
        other = "curve_allow" if side == "decode" else "curve_server_key"
        raise ConfigError(f"kv_connector_extra_config: curve_secret_key and {other} go together")
    engine_id = str(getattr(kv_transfer_config, "engine_id", None) or "")
    buffer_device = getattr(kv_transfer_config, "kv_buffer_device", None)
    if extra["fabric"] == "rdma":
        _check_rdma()
    return KvxVllmSettings(side=side, engine_id=engine_id,
                           kv_buffer_device=None if buffer_device is None else str(buffer_device), **extra)


def _check_rdma() -> None:
    """The wheel must have RDMA (a build feature: it needs cmake and libclang to build)."""
    import kvx

    fabrics = kvx.defaults()["node"].get("fabrics", [])
    if "rdma" not in fabrics:
        raise ConfigError(
            f"kv_connector_extra_config fabric='rdma': this kvx was built without RDMA (its fabrics: "
            f"{', '.join(fabrics)}); build the wheel with `maturin build --release --features rdma` "
            "(docs/operations.md)"
        )


def describe_extra_keys() -> List[str]:
    """One line per setting: name, default, meaning (for docs and errors)."""
    return describe(EXTRA_KEYS)
