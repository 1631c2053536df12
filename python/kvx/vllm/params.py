"""The ``kv_transfer_params`` the router puts on each request, and what the connector reads
from them. vLLM's OpenAI server passes a request body's ``kv_transfer_params`` to the engine
unchanged (``Request.kv_transfer_params``); these keys are the contract between
``kvx.vllm.router`` and ``KvxConnector``.

Decode engine::

    {"do_remote_prefill": true, "kvx_request_id": "<id>", "kvx_claim_secret": "<secret>"}

Prefill engine::

    {"do_remote_decode": true, "kvx_request_id": "<id>", "kvx_claim_secret": "<secret>",
     "kvx_decode_alloc": ["tcp://d:8400", ...], "kvx_decode_fabric": ["tcp://d:8300", ...]}

(one endpoint per decode TP rank; prefill rank r pushes to decode rank r). ``kvx_request_id``
names the request at kvx on both sides: the router chooses it, so the two engines' own
request ids (which vLLM may rewrite) never need to agree. ``kvx_claim_secret`` is what the
prefill engine proves to claim the decode engine's reservation: the id travels in logs and
in clear, so it claims nothing alone. The router draws a fresh secret per request and hands
it to the two engines it chose only; it is never logged.

llm-d's shape (its routing sidecar's ``--kv-connector mooncake``; ``docs/vllm.md``, "Under
llm-d"), which carries no endpoint and no secret::

    decode:  {"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": "xfer-…",
              "remote_bootstrap_addr": "http://<prefill host>:8998", "remote_engine_id": "<id>"}
    prefill: {"do_remote_prefill": false, "do_remote_decode": true, "transfer_id": "xfer-…"}

``transfer_id`` names the request at kvx on both sides. The decode engine draws the claim
secret itself and registers its reservation (the secret and its endpoints) with the prefill
engine's bootstrap server (``kvx.vllm.bootstrap``); the prefill engine claims once it has.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

REQUEST_ID = "kvx_request_id"
CLAIM_SECRET = "kvx_claim_secret"
DECODE_ALLOC = "kvx_decode_alloc"
DECODE_FABRIC = "kvx_decode_fabric"

#: llm-d's keys (llm-d-router's ``pkg/sidecar/proxy/connector_mooncake.go``).
TRANSFER_ID = "transfer_id"
BOOTSTRAP_ADDR = "remote_bootstrap_addr"
ENGINE_ID = "remote_engine_id"

#: The longest kvx request id (kvx's receiver refuses longer ones: req_id_bytes_max).
REQUEST_ID_BYTES_MAX = 512
#: A claim secret's bounds in bytes (kvx's ``ClaimSecret``: printable ASCII).
CLAIM_SECRET_BYTES = (16, 128)


class ParamsError(ValueError):
    """``kv_transfer_params`` that ask for a kvx transfer but cannot be served; the message
    says which key is wrong."""


@dataclass(frozen=True)
class Bootstrap:
    """Decode side, llm-d's shape: where this engine registers its reservation (the prefill
    engine's bootstrap server) and the prefill engine it names."""

    addr: str
    engine_id: str


@dataclass(frozen=True)
class RemotePrefill:
    """Decode side: this request's KV is computed by a prefill engine and pushed here."""

    kvx_id: str
    #: What the prefill engine proves to claim this engine's reservation; None in llm-d's
    #: shape, where this engine draws it and registers it at ``bootstrap``.
    claim_secret: Optional[str] = field(repr=False)
    bootstrap: Optional[Bootstrap] = None


@dataclass(frozen=True)
class AwaitRegistration:
    """Prefill side, llm-d's shape: push this request's KV into the decode engine that
    registers a reservation of ``kvx_id`` (the ``transfer_id``) at this engine's bootstrap
    server; its endpoints and secret come with the registration."""

    kvx_id: str


@dataclass(frozen=True)
class RemoteDecode:
    """Prefill side: push this request's KV into the decode engine at these endpoints."""

    kvx_id: str
    #: Proves to the decode engine that this engine may claim its reservation.
    claim_secret: str = field(repr=False)
    decode_alloc: Tuple[str, ...]
    decode_fabric: Tuple[str, ...]


def _kvx_id(params: Mapping[str, Any]) -> str:
    value = params.get(REQUEST_ID)
    if not isinstance(value, str) or not value:
        raise ParamsError(f"kv_transfer_params {REQUEST_ID}={value!r}: a non-empty string")
    if len(value.encode()) > REQUEST_ID_BYTES_MAX:
        raise ParamsError(f"kv_transfer_params {REQUEST_ID}: at most {REQUEST_ID_BYTES_MAX} bytes")
    return value


def _transfer_id(params: Mapping[str, Any]) -> str:
    value = params.get(TRANSFER_ID)
    if not isinstance(value, str) or not value or len(value.encode()) > REQUEST_ID_BYTES_MAX:
        raise ParamsError(
            f"kv_transfer_params {TRANSFER_ID}={value!r}: a non-empty string of at most "
            f"{REQUEST_ID_BYTES_MAX} bytes"
        )
    return value


def _bootstrap(params: Mapping[str, Any]) -> Bootstrap:
    addr, engine_id = params.get(BOOTSTRAP_ADDR), params.get(ENGINE_ID)
    if not isinstance(addr, str) or not addr.startswith(("http://", "https://")):
        raise ParamsError(
            f"kv_transfer_params {BOOTSTRAP_ADDR}={addr!r}: the prefill engine's bootstrap "
            "server, http://host:port"
        )
    if not isinstance(engine_id, str) or not engine_id:
        raise ParamsError(f"kv_transfer_params {ENGINE_ID}={engine_id!r}: a non-empty string")
    return Bootstrap(addr.rstrip("/"), engine_id)


def check_claim_secret(value: Any, where: str) -> str:
    """``value`` if it is a claim secret (kvx's ``ClaimSecret``: 16..128 printable ASCII
    characters); ``ParamsError`` naming ``where`` otherwise, never repeating the value."""
    low, high = CLAIM_SECRET_BYTES
    if not isinstance(value, str) or not low <= len(value) <= high or not all(
        "!" <= c <= "~" for c in value
    ):
        raise ParamsError(f"{where}: {low}..{high} printable ASCII characters")
    return value


def _claim_secret(params: Mapping[str, Any]) -> str:
    return check_claim_secret(
        params.get(CLAIM_SECRET),
        f"kv_transfer_params {CLAIM_SECRET} (the router draws one per request)",
    )


def new_claim_secret() -> str:
    """A fresh claim secret (192 random bits), for one request (``kvx.new_claim_secret``'s,
    without importing kvx's native module into the router)."""
    return secrets.token_urlsafe(24)


def _endpoints(params: Mapping[str, Any], key: str) -> Tuple[str, ...]:
    value = params.get(key)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(
        isinstance(v, str) and v.startswith("tcp://") for v in value
    ):
        raise ParamsError(
            f"kv_transfer_params {key}={value!r}: a list of tcp:// endpoints, one per TP rank"
        )
    return tuple(value)


def parse(
    params: Optional[Mapping[str, Any]],
) -> Union[RemotePrefill, RemoteDecode, AwaitRegistration, None]:
    """What a request's ``kv_transfer_params`` ask of kvx: a remote prefill (decode side), a
    remote decode (prefill side; ``AwaitRegistration`` in llm-d's shape), or nothing (None:
    the request runs locally). Raises ``ParamsError`` when they ask for a transfer with
    missing or malformed keys."""
    if not params:
        return None
    prefill, decode = bool(params.get("do_remote_prefill")), bool(params.get("do_remote_decode"))
    if prefill and decode:
        raise ParamsError("kv_transfer_params: do_remote_prefill and do_remote_decode together")
    llmd = REQUEST_ID not in params and TRANSFER_ID in params
    if prefill and llmd:
        return RemotePrefill(_transfer_id(params), None, _bootstrap(params))
    if decode and llmd:
        return AwaitRegistration(_transfer_id(params))
    if prefill:
        return RemotePrefill(_kvx_id(params), _claim_secret(params))
    if decode:
        alloc, fabric = _endpoints(params, DECODE_ALLOC), _endpoints(params, DECODE_FABRIC)
        if len(alloc) != len(fabric):
            raise ParamsError(
                f"kv_transfer_params: {len(alloc)} {DECODE_ALLOC} but {len(fabric)} "
                f"{DECODE_FABRIC} endpoints (one of each per decode TP rank)"
            )
        return RemoteDecode(_kvx_id(params), _claim_secret(params), alloc, fabric)
    return None


def for_decode(kvx_id: str, claim_secret: str) -> Dict[str, Any]:
    """The ``kv_transfer_params`` the router sends to the decode engine."""
    return {"do_remote_prefill": True, REQUEST_ID: kvx_id, CLAIM_SECRET: claim_secret}


def for_prefill(
    kvx_id: str, claim_secret: str, decode_alloc: List[str], decode_fabric: List[str]
) -> Dict[str, Any]:
    """The ``kv_transfer_params`` the router sends to the prefill engine."""
    return {
        "do_remote_decode": True,
        REQUEST_ID: kvx_id,
        CLAIM_SECRET: claim_secret,
        DECODE_ALLOC: list(decode_alloc),
        DECODE_FABRIC: list(decode_fabric),
    }
