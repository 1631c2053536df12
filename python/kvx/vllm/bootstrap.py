"""llm-d's P/D protocol, engine to engine, and its prefill side: a decode engine registers each reservation with
the prefill engine's bootstrap server, because llm-d's routing sidecar carries neither
endpoints nor secrets (``docs/vllm.md``, "Under llm-d"; the shape is its ``mooncake``
connector's, llm-d-router ``pkg/sidecar/proxy/connector_mooncake.go`` @ ``ebab687``).

Prefill side (``BootstrapServer``, with ``Registrations``), on ``bootstrap_port`` (8998, the
sidecar's ``--mooncake-bootstrap-port`` default):

- ``GET /query``: ``{"0": {"engine_id": <id>, "kvx": {..., "instance": <this process's>}}}``,
  what the sidecar reads once per prefill engine and caches for good (so the id is stable
  across restarts: the host's name and the port, unless ``bootstrap_engine_id`` is set), and
  what a decode engine asks while it has registrations here (``kvx.vllm.registrar``: no
  answer, or another instance, and they are gone). One data-parallel rank.
- ``POST /kvx/v1/reservations``: ``{"transfer_id", "engine_id", "claim_secret",
  "decode_alloc": [...], "decode_fabric": [...]}``. 201 registered (with the instance); 400 malformed; 403 from
  an address outside ``bootstrap_allow``; 404 another engine id; 409 the transfer is
  registered already with another secret; 413 too large; 503 the table is full.
- ``DELETE /kvx/v1/reservations/<transfer_id>`` with the registration's secret in
  ``X-Kvx-Claim-Secret``: the decode request ended before the prefill engine claimed.

The prefill scheduler takes a request's registration when it is there (``Registrations.take``)
and claims as it does for kvx's router. Registrations nobody takes expire after
``REGISTRATION_TTL_SEC``.

Decode side: ``kvx.vllm.registrar`` (``Registrar``) registers and cancels in the background (a
request never waits on HTTP in vLLM's scheduler); a registration that fails is reported back,
and the request's load fails at once (recomputed under ``kv_load_failure_policy: recompute``)
instead of waiting out ``claim_timeout_sec``.

Trust: the secret travels decode → prefill in the registration, never through the sidecar.
Whoever can reach the bootstrap port and knows a transfer id first could register its own
receiver for that transfer; keep the port on the pods' network, or name the decode engines'
networks in ``bootstrap_allow``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import time
import urllib.parse
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from kvx.vllm.params import REQUEST_ID_BYTES_MAX, ParamsError, check_claim_secret

logger = logging.getLogger("kvx.vllm")

#: The path decode engines register at.
RESERVATIONS = "/kvx/v1/reservations"
#: The header a cancel proves its registration with.
SECRET_HEADER = "X-Kvx-Claim-Secret"
#: How long a registration waits for its prefill request before it is dropped.
REGISTRATION_TTL_SEC = 60.0
#: The most registrations held at once (a registration is a few hundred bytes).
REGISTRATIONS_MAX = 4096
#: The largest request body the server reads.
BODY_BYTES_MAX = 16 * 1024
#: Connections served at once (a thread each), and how long one may stay idle.
CONNECTIONS_MAX = 64
CONNECTION_IDLE_SEC = 10.0
#: The protocol version ``/query`` states, for decode engines to check.
PROTOCOL = 1


@dataclass(frozen=True)
class Registration:
    """A decode engine's reservation of one transfer: what the prefill engine claims it
    with, and where."""

    claim_secret: str = field(repr=False)
    decode_alloc: Tuple[str, ...]
    decode_fabric: Tuple[str, ...]


class Cancelled:
    """``Registrations.take``'s answer for a transfer whose decode request ended first."""


CANCELLED = Cancelled()


class Registrations:
    """The registrations of one prefill engine, by transfer id: put by the server's threads,
    taken by the scheduler. Bounded in count; each expires after ``ttl_sec``."""

    def __init__(
        self,
        capacity: int = REGISTRATIONS_MAX,
        ttl_sec: float = REGISTRATION_TTL_SEC,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity, self.ttl_sec, self.clock = capacity, ttl_sec, clock
        self._lock = threading.Lock()
        #: transfer id → (registration or CANCELLED, its secret, when it expires); in
        #: expiry order (one TTL for all).
        self._entries: "OrderedDict[str, Tuple[Union[Registration, Cancelled], str, float]]" = OrderedDict()

    def _expire(self, now: float) -> None:
        while self._entries:
            transfer_id, (_, _, expires) = next(iter(self._entries.items()))
            if expires > now:
                return
            del self._entries[transfer_id]

    def put(self, transfer_id: str, registration: Registration) -> Optional[Tuple[int, str]]:
        """Registers; None when done (or done before, with the same secret), else (HTTP
        status, why)."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            held = self._entries.get(transfer_id)
            if held is not None:
                if held[1] == registration.claim_secret:
                    return None  # a retry of the same registration
                return 409, f"transfer {transfer_id!r} is registered already"
            if len(self._entries) >= self.capacity:
                return 503, f"{self.capacity} registrations are waiting already"
            self._entries[transfer_id] = (registration, registration.claim_secret, now + self.ttl_sec)
            return None

    def cancel(self, transfer_id: str, claim_secret: str) -> Optional[Tuple[int, str]]:
        """Cancels a registration not yet taken; None when done, else (HTTP status, why)."""
        with self._lock:
            self._expire(self.clock())
            held = self._entries.get(transfer_id)
            if held is None:
                return 404, f"no registration of transfer {transfer_id!r} is waiting"
            if held[1] != claim_secret:
                return 403, "the claim secret is not the registration's"
            self._entries[transfer_id] = (CANCELLED, held[1], held[2])
            return None

    def take(self, transfer_id: str) -> Union[Registration, Cancelled, None]:
        """The transfer's registration (removed), ``CANCELLED``, or None (not yet)."""
        with self._lock:
            self._expire(self.clock())
            held = self._entries.pop(transfer_id, None)
            return None if held is None else held[0]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


def default_engine_id(port: int) -> str:
    """An engine id stable across restarts (llm-d's sidecar caches ``/query`` for good): the
    host's name and the bootstrap port."""
    return f"kvx-{socket.gethostname()}-{port}"


def _endpoints(value: Any, key: str) -> Tuple[str, ...]:
    if not isinstance(value, list) or not value or len(value) > 64 or not all(
        isinstance(v, str) and v.startswith("tcp://") and len(v) <= 256 for v in value
    ):
        raise ParamsError(f"{key}: a list of tcp:// endpoints, one per decode TP rank")
    return tuple(value)


def parse_registration(body: Any, engine_id: str) -> Tuple[str, Registration]:
    """A registration's transfer id and contents, checked; ``ParamsError`` (the message says
    which field) or ``LookupError`` (another engine's id) otherwise."""
    if not isinstance(body, dict):
        raise ParamsError("the body: a JSON object")
    transfer_id = body.get("transfer_id")
    if not isinstance(transfer_id, str) or not transfer_id or len(transfer_id.encode()) > REQUEST_ID_BYTES_MAX:
        raise ParamsError(f"transfer_id: a non-empty string of at most {REQUEST_ID_BYTES_MAX} bytes")
    if body.get("engine_id") != engine_id:
        raise LookupError(f"engine_id {body.get('engine_id')!r} is not this engine's ({engine_id!r})")
    secret = check_claim_secret(body.get("claim_secret"), "claim_secret")
    alloc = _endpoints(body.get("decode_alloc"), "decode_alloc")
    fabric = _endpoints(body.get("decode_fabric"), "decode_fabric")
    if len(alloc) != len(fabric):
        raise ParamsError("decode_alloc and decode_fabric: one of each per decode TP rank")
    return transfer_id, Registration(secret, alloc, fabric)


class BootstrapServer:
    """The prefill engine's bootstrap server (module docstring), on a thread of its own."""

    def __init__(
        self,
        registrations: Registrations,
        host: str,
        port: int,
        engine_id: str,
        allow: Sequence[str] = (),
    ) -> None:
        self.registrations, self.engine_id = registrations, engine_id
        #: This server's life: a decode engine that registered under one instance and sees
        #: another knows its registrations are gone (the prefill engine restarted).
        self.instance = uuid.uuid4().hex
        try:
            self.allow = [ipaddress.ip_network(a.strip(), strict=False) for a in allow if a.strip()]
        except ValueError as e:
            raise ValueError(f"bootstrap_allow: {e}") from e
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # A connection idle this long is closed (one that trickles its request too).
            timeout = CONNECTION_IDLE_SEC

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                logger.debug("kvx bootstrap: " + format, *args)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.split("?", 1)[0] != "/query":
                    self._answer(404, {"error": f"no route {self.path!r}"})
                    return
                self._answer(200, {"0": {"engine_id": server.engine_id,
                                         "kvx": {"protocol": PROTOCOL, "reservations": RESERVATIONS,
                                                 "instance": server.instance}}})

            def do_POST(self) -> None:  # noqa: N802
                if self.path != RESERVATIONS:
                    self._answer(404, {"error": f"no route {self.path!r}"})
                    return
                if not self._allowed():
                    return
                body = self._body()
                if body is None:
                    return
                try:
                    transfer_id, reg = parse_registration(body, server.engine_id)
                except LookupError as e:
                    self._answer(404, {"error": str(e)})
                    return
                except ParamsError as e:
                    self._answer(400, {"error": str(e)})
                    return
                refused = server.registrations.put(transfer_id, reg)
                if refused is not None:
                    self._answer(refused[0], {"error": refused[1]})
                    return
                self._answer(201, {"status": "registered", "instance": server.instance})

            def do_DELETE(self) -> None:  # noqa: N802
                prefix = RESERVATIONS + "/"
                if not self.path.startswith(prefix) or len(self.path) == len(prefix):
                    self._answer(404, {"error": f"no route {self.path!r}"})
                    return
                if not self._allowed():
                    return
                transfer_id = urllib.parse.unquote(self.path[len(prefix):])
                refused = server.registrations.cancel(transfer_id, self.headers.get(SECRET_HEADER, ""))
                if refused is not None:
                    self._answer(refused[0], {"error": refused[1]})
                    return
                self._answer(200, {"status": "cancelled"})

            def _allowed(self) -> bool:
                if not server.allow:
                    return True
                address = ipaddress.ip_address(self.client_address[0])
                if any(address in net for net in server.allow):
                    return True
                self._answer(403, {"error": "this address is not in bootstrap_allow"})
                return False

            def _body(self) -> Any:
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self._answer(411, {"error": "a Content-Length is needed"})
                    return None
                if not 0 < length <= BODY_BYTES_MAX:
                    self._answer(413, {"error": f"a body of 1..{BODY_BYTES_MAX} bytes"})
                    return None
                try:
                    return json.loads(self.rfile.read(length))
                except ValueError:
                    self._answer(400, {"error": "the body: JSON"})
                    return None

            def _answer(self, status: int, body: Dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status >= 400:
                    # What was not read of a refused request's body must not be taken for
                    # the next request.
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(data)

        slots = threading.BoundedSemaphore(CONNECTIONS_MAX)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request: Any, client_address: Any) -> None:
                # At most CONNECTIONS_MAX at once (a thread each): past it, closed unanswered.
                if not slots.acquire(blocking=False):
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        self._http = Server((host, port), Handler)
        self._http.timeout = 5
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="kvx-bootstrap", daemon=True)
        self._thread.start()
        logger.info("kvx: bootstrap server for llm-d at %s:%d (engine id %s)", host, self.port, engine_id)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


_SERVERS: Dict[Tuple[str, int], BootstrapServer] = {}
_SERVERS_LOCK = threading.Lock()


def bootstrap_server(settings: Any) -> BootstrapServer:
    """The bootstrap server a prefill engine's settings ask for (``bootstrap_port`` set),
    started on first use: one per address in a process, however many times vLLM builds the
    scheduler-side connector."""
    port = int(settings.bootstrap_port)
    key = (settings.bootstrap_host, port)
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None:
            allow = (settings.bootstrap_allow or "").split(",")
            try:
                server = BootstrapServer(Registrations(), key[0], port,
                                         settings.bootstrap_engine_id or default_engine_id(port), allow)
            except OSError as e:
                raise OSError(f"kvx: the bootstrap server cannot listen on {key[0]}:{port}: {e}") from e
            _SERVERS[key] = server
        return server
