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
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

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
