"""One reader for the kvx settings a serving stack's configuration carries: LMCache's
``extra_config`` (``kvx.lmcache``) and vLLM's ``kv_connector_extra_config`` (``kvx.vllm``).
Each names its keys as ``name → (type, default, meaning)``; this checks what was given against
them, the same way for both:

- an unknown key is refused with the list of known ones;
- a boolean is ``true``/``false`` (a bool, or that string in any case: JSON and YAML files
  give either); anything else, ``1`` or ``"yes"`` included, is refused rather than guessed;
- an integer is an int or its digits (never a bool, which Python counts as an int);
- seconds (``float``) are a positive finite number or its text;
- a key whose default is ``None`` may be left unset (optional files).

Every refusal names the key: ``{where} {name}={value!r}: expected …``.

And one table of the protocol's settings that both carry (``PROTOCOL_KEYS``): each is written
once, its default read from the native module (``kvx.defaults()``, the core's), and each
integration takes the ones it exposes under its own names and words (``protocol_keys``:
``kvx.lmcache`` as ``kvx_*`` keys of a sender and a receiver, ``kvx.vllm`` as bare keys of a
prefill and a decode engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type

from kvx._kvx import defaults as _native_defaults

#: A setting: its type, its default (None: optional), what it means.
KeySpec = Tuple[type, Any, str]


def convert(where: str, name: str, kind: type, value: Any, error: Type[ValueError]) -> Any:
    """``value`` as ``kind``, checked as the module says; ``error`` otherwise."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise error(f"{where} {name}={value!r}: expected true or false")
    if kind is int and (isinstance(value, bool) or not isinstance(value, (int, str))):
        raise error(f"{where} {name}={value!r}: expected an integer")
    if kind is float and isinstance(value, bool):
        raise error(f"{where} {name}={value!r}: expected seconds")
    try:
        converted = kind(value)
    except (TypeError, ValueError) as e:
        raise error(f"{where} {name}={value!r}: expected {kind.__name__}") from e
    if kind is float and not (converted > 0 and math.isfinite(converted)):
        raise error(f"{where} {name}={value!r}: a positive number of seconds")
    return converted


def read_keys(
    given: Optional[Mapping[str, Any]],
    keys: Mapping[str, KeySpec],
    where: str,
    error: Type[ValueError],
    *,
    own_prefix: str = "",
) -> Dict[str, Any]:
    """``given`` checked against ``keys``, every key's default filled in. With ``own_prefix``,
    only keys that start with it are this reader's to refuse (LMCache's ``extra_config`` holds
    other components' keys too)."""
    given = dict(given or {})
    unknown = sorted(k for k in given if k.startswith(own_prefix) and k not in keys)
    if unknown:
        raise error(
            f"unknown key(s) in {where}: {', '.join(unknown)} (known: {', '.join(sorted(keys))})"
        )
    out: Dict[str, Any] = {}
    for name, (kind, default, _) in keys.items():
        value = given.get(name, default)
        out[name] = None if value is None else convert(where, name, kind, value, error)
    return out


def describe(keys: Mapping[str, KeySpec]) -> List[str]:
    """One line per setting: name, default, meaning (for docs and errors)."""
    return [f"{n} (default {d!r}): {m}" for n, (_, d, m) in keys.items()]


@dataclass(frozen=True)
class Words:
    """How an integration names the sides, for the meanings of ``PROTOCOL_KEYS``."""

    #: The side that writes, and the one written to, as a meaning's leading word.
    sender: str
    receiver: str
    #: One peer of each side, and several, in a sentence.
    a_sender: str
    a_receiver: str
    senders: str
    receivers: str
    #: What one write carries, and what a process of either side is called.
    unit: str
    worker: str
    #: The integration's key prefix (``kvx_`` or none), for meanings that name other keys.
    prefix: str = ""


_DEFAULTS = _native_defaults()

#: kvx's protocol settings as serving stacks' configurations carry them, each once: name →
#: (type, default, meaning with ``{Words}`` fields). The default is the core's (the native
#: module's), or None for an optional file.
PROTOCOL_KEYS: Dict[str, KeySpec] = {
    # One key for both sides: the sender's `checksums` and the receiver's
    # `require_checksums`, whose core defaults agree (a test checks it).
    "checksums": (bool, _DEFAULTS["sender"]["checksums"],
                  "end-to-end checksums of every {unit} ({sender} computes, {receiver} requires and checks)"),
    "failure_notices": (bool, _DEFAULTS["sender"]["notify_proxy_on_failure"],
                        "{sender}: tell the proxy when a request fails (kvx's FailNotif)"),
    "connect_timeout_sec": (float, _DEFAULTS["node"]["connect_timeout"],
                            "{sender}: how long connecting to {a_receiver} may take"),
    "reply_timeout_sec": (float, _DEFAULTS["sender"]["reply_timeout"],
                          "{sender}: how long {a_receiver} may take to answer"),
    "write_timeout_sec": (float, _DEFAULTS["sender"]["write_timeout"],
                          "{sender}: how long one {unit} may take"),
    "grant_timeout_sec": (float, _DEFAULTS["sender"]["admission_reply_timeout"],
                          "{sender}: how long a request waits for its admission (the grant of its "
                          "reservation)"),
    "claim_timeout_sec": (float, _DEFAULTS["receiver"]["admission_timeout"],
                          "{receiver}: how long reserved room waits for {a_sender} to claim it"),
    "idle_timeout_sec": (float, _DEFAULTS["receiver"]["request_idle_timeout"],
                         "{receiver}: how long a claimed request may go without a landed {unit}"),
    "unconsumed_ttl_sec": (float, _DEFAULTS["receiver"]["unconsumed_ttl"],
                           "{receiver}: how long a delivered request may wait for the decoder "
                           "before its slots are reclaimed"),
    "peer_share_percent": (int, _DEFAULTS["receiver"]["peer_share_percent"],
                           "{receiver}: the most of the buffer {a_sender} may hold, in percent "
                           "(xPyD fairness)"),
    # Heartbeats on the control channels (docs/spec/zmq.md §5.1): how a stopped or hung peer,
    # or a link down without a reset, is found while its connection stays open.
    "heartbeat_interval_sec": (float, _DEFAULTS["node"]["heartbeat_interval"],
                               "{sender}: how often its connection to each {a_receiver_word} pings it"),
    "heartbeat_timeout_sec": (float, _DEFAULTS["node"]["heartbeat_timeout"],
                              "the silence after which a peer {worker} is given up and its requests "
                              "fail; at least twice {prefix}heartbeat_interval_sec"),
    # CURVE on the control channels (docs/operations.md, "CURVE"): unset, they speak ZeroMQ's
    # NULL mechanism, and the network is trusted.
    "curve_secret_key": (str, None,
                         "CURVE: this {worker}'s secret certificate (NAME.key_secret, from `kvx keygen` "
                         "or zmq.auth.create_certificates); with {prefix}curve_allow ({receiver}) or "
                         "{prefix}curve_server_key ({sender})"),
    "curve_allow": (str, None,
                    "{receiver}, CURVE: the directory of the public certificates (NAME.key) of the "
                    "{senders} allowed to connect"),
    "curve_server_key": (str, None,
                         "{sender}, CURVE: the public certificate (NAME.key) of the {receivers}"),
}


def protocol_keys(names: Sequence[str], words: Words,
                  notes: Optional[Mapping[str, str]] = None) -> Dict[str, KeySpec]:
    """The ``PROTOCOL_KEYS`` an integration exposes, named ``words.prefix + name``, their
    meanings in its ``words`` (``notes``: a sentence of its own after a key's meaning)."""
    fields = {**vars(words), "a_receiver_word": words.a_receiver.split(" ", 1)[-1]}
    out: Dict[str, KeySpec] = {}
    for name in names:
        kind, default, meaning = PROTOCOL_KEYS[name]
        text = meaning.format(**fields)
        if notes and name in notes:
            text += notes[name]
        out[words.prefix + name] = (kind, default, text)
    return out
