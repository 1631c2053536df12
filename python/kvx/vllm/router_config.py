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

This module does not import vLLM or aiohttp.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Mapping, Tuple
from urllib.parse import urlsplit

TOP_KEYS = ("listen", "prefill", "decode", "request_timeout_sec")
PREFILL_KEYS = ("url",)
DECODE_KEYS = ("url", "kvx_alloc", "kvx_fabric")

#: How long one request may take end to end when the configuration does not say.
DEFAULT_REQUEST_TIMEOUT_SEC = 600.0


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
    timeout = raw.get("request_timeout_sec", DEFAULT_REQUEST_TIMEOUT_SEC)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise RouterConfigError(f"request_timeout_sec={timeout!r}: positive finite seconds")
    return RouterConfig(host, port, tuple(prefill), tuple(decode), float(timeout))


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
