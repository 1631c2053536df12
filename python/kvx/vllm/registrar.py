"""llm-d's P/D protocol, the decode side (``kvx.vllm.bootstrap`` has the protocol and the
prefill side): ``Registrar`` registers each reservation with its prefill engine's bootstrap
server, and cancels it when the decode request ends first, in the background (a request
never waits on HTTP in vLLM's scheduler); a registration refused or unanswered is reported
back (``Registrar.failures``).

A registration lives in the prefill engine's memory until that engine claims it. If the
engine dies or restarts in between, nothing else would tell the decode engine: its
reservation would wait out ``claim_timeout_sec`` (30 s) before the load fails. So while it
has registrations there, the registrar asks the bootstrap server's ``/query`` every
``probe_interval_sec`` (the heartbeat interval): a refused connection (nothing listens any
more), another instance (the engine restarted, its registrations gone) or no answer for
``dead_after_sec`` (the heartbeat timeout) fails those loads at once, recomputed under
``kv_load_failure_policy: recompute``. A load the prefill engine already claimed may fail
this way too, as its push would: kvx's connection to that engine is gone as well."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
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


def _instance(text: str) -> Optional[str]:
    """The bootstrap server's instance in an answer of ``/query`` or of a registration."""
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("instance"), str):
        return body["instance"]
    rank = body.get("0") if isinstance(body, dict) else None
    kvx = rank.get("kvx") if isinstance(rank, dict) else None
    return kvx.get("instance") if isinstance(kvx, dict) and isinstance(kvx.get("instance"), str) else None


class Registrar:
    """The decode engine's side: registrations and cancels sent in the background, at most
    ``workers`` at once; each bounded by ``timeout_sec``. The prefill engines that hold
    registrations are watched (``probe_interval_sec``, ``dead_after_sec``; module
    docstring)."""

    def __init__(self, timeout_sec: float, workers: int = 4, http: Http = _http,
                 probe_interval_sec: float = 1.0, dead_after_sec: float = 4.0) -> None:
        self.timeout_sec, self._http = timeout_sec, http
        self.probe_interval_sec, self.dead_after_sec = probe_interval_sec, dead_after_sec
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvx-register")
        self._lock = threading.Lock()
        self._failed: List[Tuple[str, str]] = []
        #: Each request's registration under way, so that its cancel follows it.
        self._pending: Dict[str, "concurrent.futures.Future[bool]"] = {}
        #: Registrations held by a prefill engine: its bootstrap address → request id → the
        #: server's instance that took it; and when each address last answered.
        self._held: Dict[str, Dict[str, Optional[str]]] = {}
        self._answered: Dict[str, float] = {}
        self._closed = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    def register(self, rid: str, bootstrap: Bootstrap, transfer_id: str, claim_secret: str,
                 decode_alloc: Sequence[str], decode_fabric: Sequence[str]) -> None:
        body = {"transfer_id": transfer_id, "engine_id": bootstrap.engine_id, "claim_secret": claim_secret,
                "decode_alloc": list(decode_alloc), "decode_fabric": list(decode_fabric)}

        def run() -> bool:
            status, text = self._http("POST", bootstrap.addr + RESERVATIONS, body, {}, self.timeout_sec)
            if status in (200, 201):
                self._hold(bootstrap.addr, rid, _instance(text))
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
            self._release(rid)

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
            self._release(rid)

    def _release(self, rid: str) -> None:
        """``rid``'s registration is held nowhere any more (under the lock)."""
        for addr in [a for a, held in self._held.items() if held.pop(rid, 0) != 0 and not held]:
            del self._held[addr]

    def _hold(self, addr: str, rid: str, instance: Optional[str]) -> None:
        """``rid`` is registered at ``addr``, under ``instance``: watch that engine."""
        with self._lock:
            if rid not in self._pending:
                return  # ended meanwhile: its cancel follows
            self._held.setdefault(addr, {})[rid] = instance
            self._answered.setdefault(addr, time.monotonic())
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="kvx-bootstrap-watch", daemon=True)
                self._watcher.start()

    def _watch(self) -> None:
        """Asks each prefill engine holding registrations whether it is still the one that
        took them, every ``probe_interval_sec``, until closed."""
        while not self._closed.wait(self.probe_interval_sec):
            with self._lock:
                addrs = list(self._held)
            for addr in addrs:
                status, text = self._http("GET", addr + "/query", None, {},
                                          min(self.timeout_sec, max(self.probe_interval_sec, 0.5)))
                now = time.monotonic()
                with self._lock:
                    held = self._held.get(addr, {})
                    if status == 200:
                        self._answered[addr] = now
                        current = _instance(text)
                        gone = [rid for rid, inst in held.items() if inst is not None and inst != current]
                        why = f"the prefill engine at {addr} restarted: its registrations are gone"
                    elif status == 0 and "refused" in text.lower():
                        gone, why = list(held), f"the prefill engine's bootstrap server at {addr} is gone ({text[:120]})"
                    elif now - self._answered.get(addr, now) >= self.dead_after_sec:
                        gone = list(held)
                        why = (f"the prefill engine's bootstrap server at {addr} did not answer for "
                               f"{now - self._answered[addr]:.1f} s")
                    else:
                        gone = []
                    for rid in gone:
                        self._failed.append((rid, why))
                        self._pending.pop(rid, None)
                        self._release(rid)
                    if not self._held.get(addr):
                        self._answered.pop(addr, None)

    def failures(self) -> List[Tuple[str, str]]:
        """The registrations that failed since the last call: (request id, why)."""
        with self._lock:
            out, self._failed = self._failed, []
            return out

    def close(self, wait: bool = False) -> None:
        """Stops; ``wait``: after what was handed in is sent (else it is dropped)."""
        self._closed.set()
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
