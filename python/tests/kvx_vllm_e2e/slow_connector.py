"""``SlowKvxConnector``: ``KvxConnector`` whose prefill side takes ``KVX_E2E_SLOW_SAVE_SEC``
(default 1.5) before saving each layer, as a long prompt's forward pass would, and appends a
line to the file ``KVX_E2E_MARK`` (when set) as a layer's save begins (``saving``) and once
its writes are posted (``posted``). Loaded by a
real prefill engine (``kv_connector_module_path``) in the end-to-end fault tests, so that a
test can act on the engine while a push is under way."""

from __future__ import annotations

import os
import time
from typing import Any

from kvx.vllm.connector import KvxConnector


class SlowKvxConnector(KvxConnector):
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        _mark(f"saving {layer_name}")
        time.sleep(float(os.environ.get("KVX_E2E_SLOW_SAVE_SEC", "1.5")))
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        _mark(f"posted {layer_name}")


def _mark(line: str) -> None:
    mark = os.environ.get("KVX_E2E_MARK")
    if mark:
        with open(mark, "a") as f:
            f.write(line + "\n")
