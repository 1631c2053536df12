"""``CorruptingKvxConnector``: ``KvxConnector`` whose prefill side flips a byte of every page
between its checksum and its write (``kvx.testing.corrupting_sender``), loaded by a real
prefill engine (``kv_connector_module_path``) in the end-to-end tests to show that a decode
engine never answers from KV that failed its checksum."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvx.testing import corrupting_sender
from kvx.vllm.connector import KvxConnector
from kvx.vllm.kvx_transfer import PrefillTransfer
from kvx.vllm.settings import settings_from


class CorruptingKvxConnector(KvxConnector):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        transfer = None
        if role == KVConnectorRole.WORKER:
            settings = settings_from(vllm_config.kv_transfer_config)
            blocks = getattr(kv_cache_config, "num_blocks", None)
            transfer = PrefillTransfer(
                settings, 0, blocks, sender_factory=corrupting_sender, copy_staging=True
            )
        super().__init__(vllm_config, role, kv_cache_config, transfer=transfer)
