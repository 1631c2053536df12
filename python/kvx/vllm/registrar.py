"""llm-d's P/D protocol, the decode side (``kvx.vllm.bootstrap`` has the protocol and the
prefill side): ``Registrar`` registers each reservation with its prefill engine's bootstrap
server, and cancels it when the decode request ends first, in the background (a request
never waits on HTTP in vLLM's scheduler); a registration refused or unanswered is reported
back (``Registrar.failures``)."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvx.vllm.bootstrap import RESERVATIONS, SECRET_HEADER
from kvx.vllm.params import Bootstrap

logger = logging.getLogger("kvx.vllm")


def _http(method: str, url: str, body: Optional[Dict[str, Any]], headers: Dict[str, str],
          timeout: float) -> Tuple[int, str]:
    """One HTTP request: (status, the body's text); status 0 when no answer came."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(4096).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(4096).decode(errors="replace")
    except (OSError, ValueError) as e:
        return 0, str(e)


Http = Callable[[str, str, Optional[Dict[str, Any]], Dict[str, str], float], Tuple[int, str]]


class Registrar:
    """The decode engine's side: registrations and cancels sent in the background, at most
    ``workers`` at once; each bounded by ``timeout_sec``."""

    def __init__(self, timeout_sec: float, workers: int = 4, http: Http = _http) -> None:
        self.timeout_sec, self._http = timeout_sec, http
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvx-register")
        self._lock = threading.Lock()
        self._failed: List[Tuple[str, str]] = []
        #: Each request's registration under way, so that its cancel follows it.
        self._pending: Dict[str, "concurrent.futures.Future[bool]"] = {}

    def register(self, rid: str, bootstrap: Bootstrap, transfer_id: str, claim_secret: str,
                 decode_alloc: Sequence[str], decode_fabric: Sequence[str]) -> None:
        body = {"transfer_id": transfer_id, "engine_id": bootstrap.engine_id, "claim_secret": claim_secret,
                "decode_alloc": list(decode_alloc), "decode_fabric": list(decode_fabric)}

        def run() -> bool:
            status, text = self._http("POST", bootstrap.addr + RESERVATIONS, body, {}, self.timeout_sec)
            if status in (200, 201):
                return True
            why = f"the prefill engine's bootstrap server at {bootstrap.addr} " + (
                f"refused the registration ({status}: {text[:200]})" if status else f"did not answer: {text[:200]}")
            with self._lock:
                self._failed.append((rid, why))
            return False

        with self._lock:
            self._pending[rid] = self._pool.submit(run)

    def cancel(self, rid: str, bootstrap: Bootstrap, transfer_id: str, claim_secret: str) -> None:
        """Cancels ``rid``'s registration once it is through (a cancel that overtook it
        would find nothing to cancel)."""
        with self._lock:
            pending = self._pending.pop(rid, None)

        def run() -> None:
            if pending is not None and not pending.result():
                return  # never registered
            url = f"{bootstrap.addr}{RESERVATIONS}/{urllib.parse.quote(transfer_id, safe='')}"
            status, text = self._http("DELETE", url, None, {SECRET_HEADER: claim_secret}, self.timeout_sec)
            if status not in (200, 404):  # 404: taken by the prefill engine already
                logger.info("kvx: cancel of transfer %s at %s: %s %s", transfer_id, bootstrap.addr, status, text[:200])

        self._pool.submit(run)

    def forget(self, rid: str) -> None:
        """``rid`` needs no cancel (its KV arrived or its load failed)."""
        with self._lock:
            self._pending.pop(rid, None)

    def failures(self) -> List[Tuple[str, str]]:
        """The registrations that failed since the last call: (request id, why)."""
        with self._lock:
            out, self._failed = self._failed, []
            return out

    def close(self, wait: bool = False) -> None:
        """Stops; ``wait``: after what was handed in is sent (else it is dropped)."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
