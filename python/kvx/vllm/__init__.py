"""kvx as a vLLM KV connector (vLLM 0.32 and 0.33): ``KvxConnector``, loaded by vLLM from
``--kv-transfer-config '{"kv_connector": "KvxConnector", "kv_connector_module_path":
"kvx.vllm", "kv_role": "kv_producer" | "kv_consumer", "kv_connector_extra_config": {...}}'``.
``docs/vllm.md`` describes the design and the setup.

``KvxConnector`` is imported on first use, so ``import kvx`` and ``import kvx.vllm`` (its
settings and parameters) work without vLLM; using it with an unsupported or missing vLLM
raises ``UnsupportedVllmError``, naming the supported range.
"""

from typing import Any

from kvx.vllm.settings import ConfigError, KvxVllmSettings, settings_from
from kvx.vllm.version import SUPPORTED_RANGE, UnsupportedVllmError

__all__ = [
    "ConfigError",
    "KvxConnector",
    "KvxVllmSettings",
    "SUPPORTED_RANGE",
    "UnsupportedVllmError",
    "settings_from",
]


def __getattr__(name: str) -> Any:
    if name == "KvxConnector":
        from kvx.vllm.connector import KvxConnector

        return KvxConnector
    raise AttributeError(f"module 'kvx.vllm' has no attribute {name!r}")
