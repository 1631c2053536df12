"""Why a KV transfer failed, in vLLM's terms: kvx's reasons speak of chunks, slots, bytes and
kvx's own setting names; a vLLM user set ``--block-size`` and the connector's
``kv_connector_extra_config`` keys. ``explain`` turns the one into the other, so that both
engines log, and the router's client reads, the same sentence for one failure (both engines
compute it from kvx's words, which name the same numbers on both sides).

A prefill engine that cannot begin a request's push puts the reason in the ``kv_transfer_params``
of its answer (``ERROR``), which the router reads. ``connection_refused`` tells a closed port
from a silent one at once, where kvx's connect would only time out.

Pure Python, no vLLM and no kvx import: the router uses it too.
"""

from __future__ import annotations

import re
import socket
from typing import Callable, List, Optional, Tuple

#: The key of a prefill engine's answer (its ``kv_transfer_params``) that carries why the
#: request's push never began, in vLLM's terms.
ERROR = "kvx_error"

#: kvx's setting names → the connector's ``kv_connector_extra_config`` keys (and the side that
#: sets each), in kvx's messages.
SETTING_NAMES: Tuple[Tuple[str, str], ...] = (
    ("admission_reply_timeout", "grant_timeout_sec (prefill)"),
    ("admission_timeout", "claim_timeout_sec (decode)"),
    ("request_idle_timeout", "idle_timeout_sec (decode)"),
    ("write_timeout", "write_timeout_sec (prefill)"),
    ("reply_timeout", "reply_timeout_sec (prefill)"),
    ("connect_timeout", "connect_timeout_sec (prefill)"),
)

_SIZES = re.compile(r"the sender's chunks are (\d+) bytes but the receiver's slots are (\d+) bytes")
_COUNTS = re.compile(r"request needs (\d+) chunks but its reservation lends (\d+) slots")


def block_size_mismatch(prefill_page: int, decode_page: int, side: str, block_size: Optional[int],
                        page_bytes: Optional[int]) -> str:
    """Pages of different sizes: with this engine's block size, the other engine's follows
    (a page is one block of one layer, so its bytes are the block size times the bytes of one
    token's KV of one layer, which the same model gives both engines)."""
    own, other = (prefill_page, decode_page) if side == "prefill" else (decode_page, prefill_page)
    if block_size and page_bytes == own and (block_size * other) % own == 0:
        theirs = block_size * other // own
        prefill_bs, decode_bs = (block_size, theirs) if side == "prefill" else (theirs, block_size)
        return (
            f"block size {prefill_bs} on the prefill engine, {decode_bs} on the decode engine: "
            f"start both with the same --block-size (KV pages of {prefill_page} and {decode_page} "
            "bytes: with equal block sizes, the model, --dtype, --kv-cache-dtype or TP size "
            "would differ)"
        )
    return (
        f"KV pages of {prefill_page} bytes on the prefill engine but {decode_page} on the decode "
        "engine (a page is one block of one layer): the engines' --block-size, model, --dtype, "
        "--kv-cache-dtype or TP size differ"
    )


def block_count_mismatch(need: int, reserved: int, pages_per_block: int) -> str:
    """A claim for more pages than the reservation lends: the prompt is more blocks on the
    prefill engine than on the decode engine, whose block size is then the larger (kvx says
    no more; each engine adds its own block size, ``own_block_size``)."""
    ppb = max(pages_per_block, 1)
    sent, kept = need // ppb, reserved // ppb
    return (
        f"block sizes differ: the prefill engine has {sent} of the prompt's blocks to send "
        f"where the decode engine reserved {kept}, so the decode engine's --block-size is the "
        "larger; start both with the same --block-size"
    )


def own_block_size(side: str, block_size: Optional[int]) -> str:
    """What an engine adds to ``block_count_mismatch``: its own block size."""
    return f" (the {side} engine's is {block_size})" if block_size else ""


#: kvx's whole reasons, recognized by a phrase of theirs → the sentence in vLLM's terms.
_PHRASES: List[Tuple[str, Callable[[str], str]]] = [
    ("cancelled by the sender", lambda side: (
        "the prefill engine cancelled its push: the request was aborted there, or its push "
        "failed (the prefill engine's log says why under this kvx id)")),
    ("no sender claimed the reservation", lambda side: (
        "no prefill engine claimed the reserved blocks within claim_timeout_sec (decode): its "
        "request failed before its push began (the router's answer and log say why), or it "
        "cannot reach this engine's alloc port")),
    ("withdrew the request's reservation", lambda side: (
        "the decode engine withdrew its reservation: the request ended there (aborted, or its "
        "client went away)")),
    ("no batch or write arrived for request_idle_timeout", lambda side: (
        "no write came from the prefill engine for idle_timeout_sec (decode): it stopped, or "
        "lost its connection")),
]


def kvx_setting_names(text: str) -> str:
    """``text`` with kvx's setting names replaced by the connector's keys."""
    for kvx_name, key in SETTING_NAMES:
        text = re.sub(rf"\b{kvx_name}\b(?!_sec)", key, text)
    return text


def explain(reason: str, side: str, block_size: Optional[int] = None,
            page_bytes: Optional[int] = None, pages_per_block: int = 1) -> str:
    """kvx's ``reason`` for a failed transfer, as seen by the ``side`` engine (``"prefill"``
    or ``"decode"``, whose vLLM ``--block-size`` is ``block_size`` and whose KV pages are
    ``page_bytes``), in vLLM's terms: chunk and slot sizes become the two engines' block
    sizes, chunk counts become blocks, kvx's setting names the connector's keys. A reason it
    does not recognize comes back with the setting names replaced only."""
    sizes = _SIZES.search(reason)
    if sizes:
        return block_size_mismatch(int(sizes[1]), int(sizes[2]), side, block_size, page_bytes)
    counts = _COUNTS.search(reason)
    if counts:
        return block_count_mismatch(int(counts[1]), int(counts[2]), pages_per_block) + own_block_size(
            side, block_size
        )
    for phrase, sentence in _PHRASES:
        if phrase in reason:
            return sentence(side)
    return kvx_setting_names(reason)


def _host_port(endpoint: str) -> Optional[Tuple[str, int]]:
    """``tcp://host:port`` (``[v6]`` hosts too) → (host, port), or None."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def connection_refused(endpoint: str, timeout: float) -> Optional[str]:
    """Why nothing can be reached at the ``tcp://`` ``endpoint``, known at once: the host
    refused the connection (no process listens on that port), or the address cannot be
    resolved or routed. None when something answered, or nothing did within ``timeout``
    (then only kvx's own connect can tell). One TCP connection, closed at once."""
    where = _host_port(endpoint)
    if where is None:
        return None
    try:
        with socket.create_connection(where, timeout=timeout):
            return None
    except ConnectionRefusedError:
        return (
            f"connection refused at {endpoint}: no kvx receiver listens there (the router's "
            "kvx_alloc for this decode engine must be its host and alloc_port, plus the TP "
            "rank)"
        )
    except socket.timeout:
        return None
    except OSError as e:
        return f"{endpoint} cannot be reached: {e.strerror or e}"


__all__ = ["ERROR", "connection_refused", "explain", "kvx_setting_names"]
