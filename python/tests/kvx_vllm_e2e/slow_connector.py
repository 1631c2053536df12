"""Connectors that hold a request at a chosen state, for tests and the fault matrix to act on
an engine while a transfer is under way. Loaded by real engines (``kv_connector_module_path``).

``SlowKvxConnector``: ``KvxConnector`` that, on the prefill engine, takes
``KVX_E2E_SLOW_SAVE_SEC`` (default 1.5) before saving each layer, as a long prompt's forward
pass would, and appends a line to the file ``KVX_E2E_MARK`` (when set) as a layer's save begins
(``saving``) and once its writes are posted (``posted``). On the decode engine
(``KVX_E2E_ROLE=decode``) it saves at full speed and marks nothing, unless the file
``KVX_E2E_CONTROL`` (when set) asks it, at the time, to hold a request:

- ``grant <seconds>``: its reservation is made that much later (marked ``reserving``, then
  ``reserved``): the prefill engine's claim waits for its grant meanwhile;
- ``delivered <seconds>``: a request whose KV has all arrived is reported to vLLM that much
  later (marked ``delivered``): delivered, not yet scheduled.

``SlowNixlConnector``: vLLM's ``NixlConnector`` slowed and marked the same way on the prefill
engine, and holding delivered requests on the decode engine as above, for the fault matrix's
rows of that connector (``python/bench/fault_matrix.py``). NIXL moves no KV while the prefill
engine computes (the decode engine reads it once the prefill engine has answered), so its
``posted`` says only that a layer was computed; it has no grant to hold."""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional, Set, Tuple

from kvx.vllm.connector import KvxConnector


def _decode() -> bool:
    return os.environ.get("KVX_E2E_ROLE") == "decode"


def _control(what: str) -> float:
    """The seconds the control file holds ``what`` for, now (0 when it does not)."""
    path = os.environ.get("KVX_E2E_CONTROL")
    if not path:
        return 0.0
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return 0.0
    return float(words[1]) if len(words) == 2 and words[0] == what else 0.0


class SlowKvxConnector(KvxConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Decode: vLLM ids received, and when each may be reported (``delivered``).
        self._held: Dict[str, float] = {}

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        _slow_save(super().save_kv_layer, layer_name, kv_layer, attn_metadata, **kwargs)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        plan = getattr(connector_metadata, "plan", None)
        hold = _control("grant") if _decode() and plan is not None and plan.reserve else 0.0
        if hold:
            _mark("reserving")
            time.sleep(hold)
        super().bind_connector_metadata(connector_metadata)
        if hold:
            _mark("reserved")

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        sending, recving = super().get_finished(finished_req_ids)
        return sending, _hold_delivered(self._held, recving)


def _slow_save(save: Any, layer_name: str, *args: Any, **kwargs: Any) -> None:
    """Prefill: ``save`` (the connector's own ``save_kv_layer``), after
    ``KVX_E2E_SLOW_SAVE_SEC`` and between the marks; decode: at once, unmarked."""
    if _decode():
        save(layer_name, *args, **kwargs)
        return
    _mark(f"saving {layer_name}")
    time.sleep(float(os.environ.get("KVX_E2E_SLOW_SAVE_SEC", "1.5")))
    save(layer_name, *args, **kwargs)
    _mark(f"posted {layer_name}")


def _hold_delivered(held: Dict[str, float], recving: Optional[Set[str]]) -> Optional[Set[str]]:
    """Decode: the received requests to report now, holding each for what the control file
    says (``delivered``) when it arrived; ``held`` keeps those not yet due."""
    if not _decode():
        return recving
    now = time.monotonic()
    hold = _control("delivered")
    for rid in recving or ():
        if hold:
            _mark("delivered")
        held[rid] = now + hold
    due = {rid for rid, at in held.items() if at <= now}
    for rid in due:
        del held[rid]
    return due or None


def _slow_nixl() -> Any:
    """The class, made on first use: importing vLLM's NIXL connector needs ``nixl``, which
    only the fault matrix's NIXL rows install."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

    class SlowNixlConnector(NixlConnector):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._held: Dict[str, float] = {}

        def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
            sending, recving = super().get_finished(finished_req_ids)
            return sending, _hold_delivered(self._held, recving)

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            _slow_save(super().save_kv_layer, layer_name, kv_layer, attn_metadata, **kwargs)

    return SlowNixlConnector


def __getattr__(name: str) -> Any:
    if name == "SlowNixlConnector":
        return _slow_nixl()
    raise AttributeError(name)


def _mark(line: str) -> None:
    mark = os.environ.get("KVX_E2E_MARK")
    if mark:
        with open(mark, "a") as f:
            f.write(line + "\n")
