"""The router's configuration (``python -m kvx.vllm.router --config router.yaml``): where it
listens, the prefill engines, and the decode engines with their kvx receivers' endpoints.
Read from YAML (or JSON) and checked key by key: every refusal names the key and says what
to write instead, and an unknown key is refused with the list of known ones.

.. code-block:: yaml

    listen: 0.0.0.0:8000
    prefill:
      - url: http://10.0.0.1:8100
    decode:
      - url: http://10.0.0.2:8200
        kvx_alloc: [tcp://10.0.0.2:8400]      # one per decode TP rank
        kvx_fabric: [tcp://10.0.0.2:8300]
    request_timeout_sec: 600                  # optional: one request, end to end
    health_interval_sec: 1                    # optional: how often each engine's /health is asked
    engine_liveness_sec: 4                    # optional: an engine silent this long is down
    # Optional, what lets it face a network (router_guard.py), with their defaults:
    max_body_bytes: 4194304                   # a request body, at most (413 past it)
    header_timeout_sec: 10                    # to send a request's headers
    body_timeout_sec: 30                      # to send a request's body (408 past it)
    max_connections: 1000                     # open at once, all clients together
    max_connections_per_client: 64            # open at once from one client address
    api_key: null                             # /v1/ paths need "Authorization: Bearer KEY"
    tls_cert: null                            # PEM files: serve https
    tls_key: null

The API key may come from the environment instead (``KVX_ROUTER_API_KEY``), which keeps it
out of the file. This module does not import vLLM or aiohttp.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple
from urllib.parse import urlsplit

TOP_KEYS = (
    "listen", "prefill", "decode", "request_timeout_sec", "health_interval_sec", "engine_liveness_sec", "max_body_bytes", "header_timeout_sec",
    "body_timeout_sec", "max_connections", "max_connections_per_client", "api_key", "tls_cert", "tls_key",
)
PREFILL_KEYS = ("url",)
DECODE_KEYS = ("url", "kvx_alloc", "kvx_fabric")

#: How long one request may take end to end when the configuration does not say.
DEFAULT_REQUEST_TIMEOUT_SEC = 600.0
#: How often the router asks a down engine's ``/health`` (``router_pool``).
DEFAULT_HEALTH_INTERVAL_SEC = 1.0
#: An engine whose ``/health`` has not answered for this long (a stopped or hung process, a
#: link that went down) is down, and its requests in flight end with a typed error: the
#: bound of ``docs/reliability.md`` is 5 s from the fault to the client's answer.
DEFAULT_ENGINE_LIVENESS_SEC = 4.0
#: A request body's bound: the 4 MiB that vLLM's own server buffers for one incomplete HTTP
#: event by default (``--h11-max-incomplete-event-size``); a 128k-token prompt is about 1 MB.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_HEADER_TIMEOUT_SEC = 10.0
DEFAULT_BODY_TIMEOUT_SEC = 30.0
DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
#: The environment variable an API key may come from instead of the file.
API_KEY_ENV = "KVX_ROUTER_API_KEY"


class RouterConfigError(ValueError):
    """A router configuration that cannot work; the message names the key."""


@dataclass(frozen=True)
class PrefillEngine:
    """A prefill engine: vLLM's OpenAI server with ``KvxConnector`` as ``kv_producer``."""

    url: str


@dataclass(frozen=True)
class DecodeEngine:
    """A decode engine: vLLM's OpenAI server with ``KvxConnector`` as ``kv_consumer``, and
    its kvx receivers' endpoints, one per TP rank (what prefill engines push to)."""

    url: str
    kvx_alloc: Tuple[str, ...]
    kvx_fabric: Tuple[str, ...]


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens and which engines it dispatches to."""

    host: str
    port: int
    prefill: Tuple[PrefillEngine, ...]
    decode: Tuple[DecodeEngine, ...]
    request_timeout_sec: float = DEFAULT_REQUEST_TIMEOUT_SEC
    health_interval_sec: float = DEFAULT_HEALTH_INTERVAL_SEC
    engine_liveness_sec: float = DEFAULT_ENGINE_LIVENESS_SEC
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_sec: float = DEFAULT_HEADER_TIMEOUT_SEC
    body_timeout_sec: float = DEFAULT_BODY_TIMEOUT_SEC
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT
    #: Never printed: ``repr`` leaves it out.
    api_key: Optional[str] = field(default=None, repr=False)
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None


def _unknown(where: str, got: Mapping[str, Any], known: Tuple[str, ...]) -> None:
    extra = sorted(set(got) - set(known))
    if extra:
        raise RouterConfigError(f"{where}: unknown key {extra[0]!r} (known: {', '.join(known)})")


def _url(where: str, value: Any) -> str:
    if not isinstance(value, str) or urlsplit(value).scheme not in ("http", "https") or not urlsplit(value).netloc:
        raise RouterConfigError(f"{where}={value!r}: an http:// or https:// URL, e.g. http://10.0.0.1:8100")
    return value.rstrip("/")


def _endpoints(where: str, value: Any) -> Tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RouterConfigError(f"{where}={value!r}: a list of tcp://host:port endpoints, one per TP rank")
    for v in value:
        parts = urlsplit(v) if isinstance(v, str) else None
        if parts is None or parts.scheme != "tcp" or not parts.hostname or parts.port is None:
            raise RouterConfigError(f"{where}: {v!r} is not a tcp://host:port endpoint")
    return tuple(value)


def _seconds(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise RouterConfigError(f"{key}={value!r}: positive finite seconds")
    return float(value)


def _count(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RouterConfigError(f"{key}={value!r}: a positive whole number")
    return value


def _api_key(raw: Mapping[str, Any]) -> Optional[str]:
    value = raw.get("api_key")
    if value is None:
        value = os.environ.get(API_KEY_ENV) or None
        where = API_KEY_ENV
    else:
        where = "api_key"
    if value is not None and (not isinstance(value, str) or not value.strip() or value != value.strip()):
        raise RouterConfigError(f"{where}: a non-empty string without surrounding spaces")
    return value


def _tls(raw: Mapping[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    cert, key = raw.get("tls_cert"), raw.get("tls_key")
    if (cert is None) != (key is None):
        raise RouterConfigError("tls_cert and tls_key: both (PEM files) to serve https, or neither")
    for name, value in (("tls_cert", cert), ("tls_key", key)):
        if value is not None and (not isinstance(value, str) or not Path(value).is_file()):
            raise RouterConfigError(f"{name}={value!r}: the path of a PEM file")
    return cert, key


def _listen(value: Any) -> Tuple[str, int]:
    if not isinstance(value, str) or ":" not in value:
        raise RouterConfigError(f"listen={value!r}: host:port, e.g. 0.0.0.0:8000")
    host, _, port = value.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RouterConfigError(f"listen={value!r}: the port must be 1..65535")
    return host.strip("[]") or "0.0.0.0", int(port)


def _list(where: str, value: Any) -> List[Mapping[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RouterConfigError(f"{where}: a non-empty list of engines, each with a url")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise RouterConfigError(f"{where}[{i}]: a mapping with a url, not {item!r}")
    return value


def config_from(raw: Any) -> RouterConfig:
    """Checks a parsed configuration (a mapping) and returns it; ``RouterConfigError``
    otherwise."""
    if not isinstance(raw, dict):
        raise RouterConfigError(f"the configuration must be a mapping of {', '.join(TOP_KEYS)}")
    _unknown("router configuration", raw, TOP_KEYS)
    host, port = _listen(raw.get("listen", "0.0.0.0:8000"))
    prefill = []
    for i, item in enumerate(_list("prefill", raw.get("prefill"))):
        _unknown(f"prefill[{i}]", item, PREFILL_KEYS)
        prefill.append(PrefillEngine(_url(f"prefill[{i}].url", item.get("url"))))
    decode = []
    ranks = None
    for i, item in enumerate(_list("decode", raw.get("decode"))):
        _unknown(f"decode[{i}]", item, DECODE_KEYS)
        alloc = _endpoints(f"decode[{i}].kvx_alloc", item.get("kvx_alloc"))
        fabric = _endpoints(f"decode[{i}].kvx_fabric", item.get("kvx_fabric"))
        if len(alloc) != len(fabric):
            raise RouterConfigError(
                f"decode[{i}]: {len(alloc)} kvx_alloc but {len(fabric)} kvx_fabric endpoints "
                "(one of each per decode TP rank)"
            )
        if ranks is not None and len(alloc) != ranks:
            raise RouterConfigError(
                f"decode[{i}]: {len(alloc)} TP ranks, but decode[0] has {ranks} (every decode "
                "engine has the prefill engines' TP size: prefill rank r pushes to decode rank r)"
            )
        ranks = len(alloc)
        decode.append(DecodeEngine(_url(f"decode[{i}].url", item.get("url")), alloc, fabric))
    max_connections = _count(raw, "max_connections", DEFAULT_MAX_CONNECTIONS)
    per_client = _count(raw, "max_connections_per_client", DEFAULT_MAX_CONNECTIONS_PER_CLIENT)
    if per_client > max_connections:
        raise RouterConfigError(
            f"max_connections_per_client={per_client}: at most max_connections ({max_connections})"
        )
    tls_cert, tls_key = _tls(raw)
    health = _seconds(raw, "health_interval_sec", DEFAULT_HEALTH_INTERVAL_SEC)
    liveness = _seconds(raw, "engine_liveness_sec", DEFAULT_ENGINE_LIVENESS_SEC)
    if liveness < 2 * health:
        raise RouterConfigError(
            f"engine_liveness_sec={liveness:g}: at least twice health_interval_sec ({health:g}), "
            "so that one late answer does not take an engine down"
        )
    return RouterConfig(
        host, port, tuple(prefill), tuple(decode),
        request_timeout_sec=_seconds(raw, "request_timeout_sec", DEFAULT_REQUEST_TIMEOUT_SEC),
        health_interval_sec=health,
        engine_liveness_sec=liveness,
        max_body_bytes=_count(raw, "max_body_bytes", DEFAULT_MAX_BODY_BYTES),
        header_timeout_sec=_seconds(raw, "header_timeout_sec", DEFAULT_HEADER_TIMEOUT_SEC),
        body_timeout_sec=_seconds(raw, "body_timeout_sec", DEFAULT_BODY_TIMEOUT_SEC),
        max_connections=max_connections,
        max_connections_per_client=per_client,
        api_key=_api_key(raw),
        tls_cert=tls_cert,
        tls_key=tls_key,
    )


def load(path: str) -> RouterConfig:
    """Reads and checks the configuration file at ``path``: JSON when it ends in ``.json``,
    YAML otherwise (PyYAML, which vLLM installs)."""
    text = Path(path).read_text()
    if path.endswith(".json"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise RouterConfigError(f"{path}: not JSON: {e}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise RouterConfigError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml), or give a .json file"
            ) from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise RouterConfigError(f"{path}: not YAML: {e}") from None
    return config_from(raw)
