"""What lets ``kvx.vllm.router`` face a network: every connection and every request body has
a bound, checked before anything is parsed or kept.

- **Connections** (``ConnectionGuard``): at most ``max_connections`` open, and at most
  ``max_connections_per_client`` from one client address. A connection that is not in a
  request (it has not sent a request's headers yet, or is idle between requests) must send
  its next request's headers within ``header_timeout_sec`` or is closed: a client that
  trickles its headers, or opens connections and sends nothing, holds each one that long at
  most. At a cap, a newcomer takes the place of the oldest such waiting connection, its own
  address's first, so a flood of waiting connections never locks a client out; a newcomer
  that finds only connections in requests is refused (closed at once).
- **Bodies** (``read_json``): refused (413) past ``max_body_bytes``, from the declared
  ``Content-Length`` before one byte is read, else while reading; given
  ``body_timeout_sec`` to arrive (408); and refused (413) with more than
  ``MAX_JSON_CONTAINERS`` objects and arrays, counted outside strings before parsing, so a
  small body cannot expand into gigabytes of Python objects.
- **Who may ask** (``authorized``): with an API key configured, the ``/v1/`` paths need
  ``Authorization: Bearer <key>`` (as vLLM's own ``--api-key``), compared in constant time;
  ``/health`` stays open.

Every refusal answers in OpenAI's error shape and is counted (``/kvx/stats``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

#: A request body with more objects and arrays than this is refused before it is parsed. A
#: completion or chat request has a handful (a batch of token-id prompts one per prompt);
#: parsed, each costs about 100 bytes or more, so the bound keeps one body's objects to a few MB.
MAX_JSON_CONTAINERS = 65536

# A JSON string (the unrolled form: runs of plain characters matched in one go).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


class Refused(Exception):
    """A request refused before it reached an engine: its HTTP status, message and OpenAI
    error type."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def json_containers(raw: bytes) -> int:
    """How many objects and arrays ``raw`` (JSON text) holds, counting no bracket inside a
    string."""
    stripped = _JSON_STRING.sub(b'""', raw)
    return stripped.count(b"{") + stripped.count(b"[")


async def read_json(request: Any, max_body_bytes: int, body_timeout_sec: float) -> Any:
    """The request's body, parsed, within the bounds above; ``Refused`` otherwise."""
    from aiohttp import web

    declared = request.content_length
    if declared is not None and declared > max_body_bytes:
        raise Refused(413, f"the request body is {declared} bytes; the router takes {max_body_bytes} at most", "invalid_request_error")
    try:
        raw = await asyncio.wait_for(request.read(), body_timeout_sec)
    except asyncio.TimeoutError:
        raise Refused(408, f"the request body did not arrive within {body_timeout_sec:g} s", "invalid_request_error") from None
    except web.HTTPRequestEntityTooLarge:
        raise Refused(413, f"the request body is over the {max_body_bytes} bytes the router takes", "invalid_request_error") from None
    containers = json_containers(raw)
    if containers > MAX_JSON_CONTAINERS:
        raise Refused(
            413, f"the request body holds {containers} JSON objects and arrays; the router takes {MAX_JSON_CONTAINERS} at most",
            "invalid_request_error",
        )
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Refused(400, "the request body is not JSON", "invalid_request_error") from None


def authorized(headers: Any, api_key: Optional[str]) -> bool:
    """Whether a request with ``headers`` may use the ``/v1/`` paths: always without a key;
    with one, when it carries ``Authorization: Bearer <key>`` (compared in constant time)."""
    if api_key is None:
        return True
    given = headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


@dataclass
class _Conn:
    transport: Any
    source: str
    #: When it began to wait for a request's headers (monotonic); None while in a request.
    waiting_since: Optional[float]


class ConnectionGuard:
    """The connection caps and the header deadline (module docstring). ``protocol(inner)``
    wraps each of aiohttp's per-connection protocols; ``request_started`` and
    ``request_ended`` (a middleware calls them) say when a connection is in a request;
    ``sweep()`` closes connections that waited past the deadline."""

    def __init__(self, max_connections: int, max_per_client: int, header_timeout_sec: float) -> None:
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.header_timeout_sec = header_timeout_sec
        # Oldest first (dicts keep insertion order).
        self._conns: Dict[Any, _Conn] = {}
        self._per_source: Dict[str, int] = {}
        self.counts: Dict[str, int] = {"refused": 0, "evicted": 0, "header_timeouts": 0}

    def open_connections(self) -> int:
        return len(self._conns)

    def protocol(self, inner_factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server``: ``inner_factory``'s protocols
        (aiohttp's), behind the caps."""
        return lambda: _GuardedProtocol(inner_factory(), self)

    def admit(self, transport: Any) -> bool:
        """Takes a new connection in (making room by closing a waiting one where a cap is
        reached), or says it is refused."""
        peer = transport.get_extra_info("peername")
        source = peer[0] if isinstance(peer, tuple) and peer else "?"
        if self._per_source.get(source, 0) >= self.max_per_client and not self._evict(source, only_source=True):
            self.counts["refused"] += 1
            return False
        if len(self._conns) >= self.max_connections and not self._evict(source, only_source=False):
            self.counts["refused"] += 1
            return False
        self._conns[transport] = _Conn(transport, source, time.monotonic())
        self._per_source[source] = self._per_source.get(source, 0) + 1
        return True

    def _evict(self, source: str, only_source: bool) -> bool:
        """Closes the oldest waiting connection of ``source`` or, unless ``only_source``, of
        the address with the most waiting connections; whether one was closed."""
        waiting = [c for c in self._conns.values() if c.waiting_since is not None]
        own = [c for c in waiting if c.source == source]
        if own:
            victim = own[0]
        elif only_source or not waiting:
            return False
        else:
            by_source: Dict[str, int] = {}
            for c in waiting:
                by_source[c.source] = by_source.get(c.source, 0) + 1
            busiest = max(by_source, key=lambda s: by_source[s])
            victim = next(c for c in waiting if c.source == busiest)
        self.counts["evicted"] += 1
        self._close(victim)
        return True

    def _close(self, conn: _Conn) -> None:
        self.forget(conn.transport)
        conn.transport.abort()

    def forget(self, transport: Any) -> None:
        conn = self._conns.pop(transport, None)
        if conn is not None:
            left = self._per_source[conn.source] - 1
            if left:
                self._per_source[conn.source] = left
            else:
                del self._per_source[conn.source]

    def request_started(self, transport: Any) -> None:
        conn = self._conns.get(transport)
        if conn is not None:
            conn.waiting_since = None

    def request_ended(self, transport: Any) -> None:
        conn = self._conns.get(transport)
        if conn is not None:
            conn.waiting_since = time.monotonic()

    def sweep_once(self, now: Optional[float] = None) -> int:
        """Closes the connections that waited for headers past the deadline; how many."""
        now = time.monotonic() if now is None else now
        late = [
            c for c in self._conns.values()
            if c.waiting_since is not None and now - c.waiting_since > self.header_timeout_sec
        ]
        for c in late:
            self._close(c)
        self.counts["header_timeouts"] += len(late)
        return len(late)

    async def sweep(self) -> None:
        """Runs ``sweep_once`` a few times per deadline, until cancelled."""
        tick = min(1.0, self.header_timeout_sec / 4)
        while True:
            await asyncio.sleep(tick)
            self.sweep_once()


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, which sees the connection only once the guard
    has taken it in."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner, self._guard = inner, guard
        self._transport: Any = None
        self._refused = False

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        if not self._guard.admit(transport):
            self._refused = True
            transport.abort()
            return
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            self._inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return None if self._refused else self._inner.eof_received()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._guard.forget(self._transport)
        if not self._refused:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._refused:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self._inner.resume_writing()


def raise_open_files_limit(wanted: int) -> Tuple[int, int]:
    """Raises this process's soft limit on open files towards ``wanted`` (up to the hard
    limit); the (soft, hard) limits after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft, hard
