"""What llm-d's routing sidecar sends for one client request with ``--kv-connector mooncake``,
reproduced field for field from its source (llm-d-router @ ``ebab687``,
``pkg/sidecar/proxy/connector_mooncake.go``, ``proxy_helpers.go``,
``pkg/common/request/tokens.go``; read, not copied), for tests against real engines:

1. ``GET http://<prefill host>:<bootstrap port>/query`` (5 s), once per prefill ``host:port``
   and cached for good; a reply without a string ``engine_id`` is a 502 and neither leg goes.
2. ``transfer_id`` = ``"xfer-"`` + a random UUID; one rank of the reply (Go's map order: any).
3. The prefill leg: the client's body with ``kv_transfer_params`` replaced by
   ``{do_remote_prefill: false, do_remote_decode: true, transfer_id}``, ``max_tokens`` 1
   (``max_completion_tokens`` 1 only if the client sent it), ``stream`` false,
   ``stream_options`` deleted; header ``X-Data-Parallel-Rank: <rank>``; started first, on its
   own, never cancelled; its answer discarded.
4. The decode leg, at once: the client's body with ``kv_transfer_params`` replaced by
   ``{do_remote_prefill: true, do_remote_decode: false, transfer_id, remote_bootstrap_addr:
   "http://<prefill host>:<bootstrap port>", remote_engine_id}``; its answer is the client's.
5. Bodies as Go's ``encoding/json`` writes a ``map[string]any``: keys sorted, ``<``, ``>``,
   ``&`` escaped, no spaces.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import uuid
from typing import Any, Dict, List, Optional, Tuple

BOOTSTRAP_TIMEOUT_S = 5.0  # mooncakeBootstrapTimeout


def go_json(body: Dict[str, Any]) -> bytes:
    """``body`` as Go's ``json.Marshal`` of a ``map[string]any`` writes it."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


class Sidecar:
    """A decode pod's sidecar, for one decode engine at ``decode`` (``host:port``)."""

    def __init__(self, decode: str, bootstrap_port: int = 8998) -> None:
        self.decode, self.bootstrap_port = decode, bootstrap_port
        #: prefill host:port → the /query reply (cached for good, as the sidecar does).
        self._query: Dict[str, Dict[str, Any]] = {}
        #: What each leg was sent, for tests to read: (leg, path, headers, body).
        self.sent: List[Tuple[str, str, Dict[str, str], Dict[str, Any]]] = []
        self.prefill_threads: List[threading.Thread] = []

    def query(self, prefill: str) -> Dict[str, Any]:
        if prefill not in self._query:
            host = prefill.rsplit(":", 1)[0]
            conn = http.client.HTTPConnection(host, self.bootstrap_port, timeout=BOOTSTRAP_TIMEOUT_S)
            conn.request("GET", "/query")
            r = conn.getresponse()
            reply = json.loads(r.read())
            conn.close()
            if r.status // 100 != 2 or not isinstance(reply, dict) or not reply or not all(
                isinstance(v, dict) and isinstance(v.get("engine_id"), str) for v in reply.values()
            ):
                raise RuntimeError(f"502: the bootstrap server of {prefill} answered {r.status} {reply!r}")
            self._query[prefill] = reply
        return self._query[prefill]

    def legs(self, body: Dict[str, Any], prefill: str) -> Tuple[Dict[str, Any], Dict[str, Any], str]:
        """(prefill body, decode body, rank) for a client ``body``."""
        ranks = self.query(prefill)
        rank = random.choice(sorted(ranks))
        host = prefill.rsplit(":", 1)[0]
        transfer_id = f"xfer-{uuid.uuid4()}"
        p = {**body, "kv_transfer_params": {"do_remote_prefill": False, "do_remote_decode": True,
                                            "transfer_id": transfer_id}}
        p["max_tokens"] = 1
        if "max_completion_tokens" in body:
            p["max_completion_tokens"] = 1
        p["stream"] = False
        p.pop("stream_options", None)
        d = {**body, "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
            "remote_bootstrap_addr": f"http://{host}:{self.bootstrap_port}",
            "remote_engine_id": ranks[rank]["engine_id"]}}
        return p, d, rank

    def post(self, body: Dict[str, Any], prefill: str, path: str = "/v1/completions",
             on_decode: Optional[Any] = None, on_prefill: Optional[Any] = None) -> Tuple[int, bytes]:
        """One client request: both legs at once; the decode leg's (status, body).
        ``on_decode(conn)`` / ``on_prefill(conn)`` are called with a leg's connection once
        sent (a test closes it there to abort that leg: a client that goes away makes the
        sidecar abort the decode leg; a prefill pod's network can cut the other)."""
        p, d, rank = self.legs(body, prefill)
        headers = {"Content-Type": "application/json", "X-Data-Parallel-Rank": rank}
        self.sent.append(("prefill", path, headers, p))

        def prefill_leg() -> None:
            host, port = prefill.rsplit(":", 1)
            try:
                conn = http.client.HTTPConnection(host, int(port), timeout=600)
                conn.request("POST", path, body=go_json(p), headers=headers)
                if on_prefill is not None:
                    on_prefill(conn)
                conn.getresponse().read()  # discarded
                conn.close()
            except (OSError, http.client.HTTPException):
                pass  # the sidecar records it on its trace span only

        t = threading.Thread(target=prefill_leg, daemon=True)
        t.start()
        self.prefill_threads.append(t)
        host, port = self.decode.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        d_headers = {"Content-Type": "application/json"}
        self.sent.append(("decode", path, d_headers, d))
        conn.request("POST", path, body=go_json(d), headers=d_headers)
        if on_decode is not None:
            on_decode(conn)
        r = conn.getresponse()
        out = r.status, r.read()
        conn.close()
        return out
