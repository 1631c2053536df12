"""``python -m kvx.vllm.router --config router.yaml``: an OpenAI-compatible router for vLLM
engines joined by ``KvxConnector``. For each ``/v1/completions`` or ``/v1/chat/completions``
request (streaming or not) it chooses a kvx request id and sends, at once, the client's
request to a decode engine (``kv_transfer_params``: ``do_remote_prefill``) and the same
prompt, for one token, to a prefill engine (``do_remote_decode``, with the decode engine's
kvx endpoints). It streams the decode engine's answer back as it comes and discards the
prefill engine's one token. No proxy hop carries the handover: the decode engine hears from
its own kvx receiver that the KV is complete.

When the client goes away, both upstream requests are closed, which makes vLLM abort them (the
connector then withdraws the decode engine's reservation and cancels the prefill engine's
push). A prefill engine whose push could not begin says why in its answer's
``kv_transfer_params`` (``kvx_error``: a refused connection, a refused claim, no grant): the
decode request is closed at once (its reservation withdrawn) and the client gets 502 in
OpenAI's error shape with that reason. A decode engine that fails a request before any
output (vLLM's bare ``Internal server error`` for a failed KV load) is answered likewise,
with the prefill engine's reason when it gave one, and the kvx id under which both engines
log it. Any other failed prefill request is logged and counted; the decode engine's request
then fails its load after ``claim_timeout_sec`` and vLLM's ``kv_load_failure_policy`` applies
(``fail``, or ``recompute`` on the decode engine itself).

An engine whose connection fails or breaks, or whose ``/health`` has not answered for
``engine_liveness_sec`` (a stopped or hung engine), is down (``router_pool.py``): it gets no
new request until its ``/health`` answers, a prefill engine that cannot be connected to is
passed over for the next one within the request, and with none of a kind up a request is a
503 at once. A decode engine that dies mid-stream ends the client's stream with an error
event and ``[DONE]``; one that falls silent ends its requests in flight the same way (or with
a 503 before any output), and a silent prefill engine's requests are dropped by the router
(the decode engine's receiver fails their loads once the prefill engine's heartbeats stop).

Engines are chosen by fewest requests in flight, in turn among equals. ``GET /v1/models``
is the first decode engine's; ``GET /health`` answers while the router runs; ``GET
/kvx/stats`` counts requests, failures, refusals and open connections. Connections, request
bodies and the ``/v1/`` paths are bounded and guarded as ``router_guard.py`` says (caps per
client and in all, header and body deadlines, a body-size limit checked before parsing, an
optional API key), and it serves https given a certificate. Needs aiohttp (which vLLM
installs) and, for a YAML configuration, PyYAML (``router_config.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set

from kvx.vllm import params
from kvx.vllm.reasons import ERROR
from kvx.vllm.router_config import DecodeEngine, PrefillEngine, RouterConfig, RouterConfigError, load
from kvx.vllm.router_guard import ConnectionGuard, Refused, authorized, raise_open_files_limit, read_json
from kvx.vllm.router_pool import EnginePool, Slot

try:
    import aiohttp
    from aiohttp import web
except ImportError:  # the module's documentation and config stay importable without it
    aiohttp = None  # type: ignore[assignment]
    web = None  # type: ignore[assignment]

logger = logging.getLogger("kvx.vllm.router")

#: The OpenAI paths the router dispatches to a decode and a prefill engine.
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")

#: Request keys that cannot go to a one-token prefill request: ``min_tokens`` would contradict
#: ``max_tokens: 1``, the others ask for more than one sequence or for streaming.
_NOT_FOR_PREFILL = ("min_tokens", "best_of", "stream_options", "n")

#: Once the decode engine answered an error before any output, how long the router waits for
#: the prefill engine's answer, which says why when the push failed on its side.
PREFILL_REASON_WAIT_SEC = 10.0

#: The most the router reads of a decode answer before it relays any of it, to tell an
#: error from an answer: an error's body, or a stream's first event.
FIRST_PART_MAX = 64 * 1024

#: How long one ``/health`` probe of a down engine may take.
PROBE_TIMEOUT_SEC = 1.0

#: Errors that say an engine's connection failed or broke (its process died, restarted, or
#: was never there): the engine is marked down. A timeout is not one (it may only be busy).
ENGINE_LOST = ((aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
               if aiohttp is not None else ())


class EngineSilent(Exception):
    """The decode engine of a request in flight fell silent (``Router._watch_engines``)."""


@dataclass
class PushFailed:
    """Why a request's push never began (the prefill engine said, or no prefill engine could
    be reached); ``retryable``: the same request may succeed when sent again (503)."""

    reason: str
    retryable: bool = False


def new_kvx_id() -> str:
    """A kvx request id no other request has (well under ``params.REQUEST_ID_BYTES_MAX``)."""
    return f"kvx-{uuid.uuid4().hex}"


def decode_body(body: Dict[str, Any], kvx_id: str, claim_secret: str) -> Dict[str, Any]:
    """The client's request as the decode engine gets it: unchanged but for its
    ``kv_transfer_params``."""
    out = dict(body)
    out["kv_transfer_params"] = params.for_decode(kvx_id, claim_secret)
    return out


def prefill_body(
    body: Dict[str, Any], path: str, kvx_id: str, claim_secret: str, decode: DecodeEngine
) -> Dict[str, Any]:
    """The same prompt for the prefill engine: one token, not streamed, one sequence, with
    the decode engine's kvx endpoints to push to."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["max_tokens"] = 1
    if path == "/v1/chat/completions":
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = params.for_prefill(
        kvx_id, claim_secret, list(decode.kvx_alloc), list(decode.kvx_fabric)
    )
    return out


def _error(status: int, message: str, kind: str) -> "web.Response":
    """An error in OpenAI's shape."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _error_object(data: bytes) -> Optional[Dict[str, Any]]:
    """The error in an OpenAI-shaped body (``{"error": {...}}``, or vLLM's older flat one
    with ``"object": "error"``), or None."""
    try:
        d = json.loads(data)
    except ValueError:
        return None
    if isinstance(d, dict) and isinstance(d.get("error"), dict):
        return d["error"]
    if isinstance(d, dict) and d.get("object") == "error":
        return d
    return None


def _stream_error(first: bytes) -> Optional[Dict[str, Any]]:
    """The error a stream of server-sent events opens with (vLLM's answer to a streamed
    request that failed before any output), or None."""
    for line in first.split(b"\n"):
        if line.startswith(b"data:"):
            return _error_object(line[len(b"data:"):].strip())
    return None


def transfer_error(answer: bytes) -> Optional[str]:
    """Why the prefill engine's push never began, from its answer's ``kv_transfer_params``
    (``kvx_error``, set by the connector), or None."""
    try:
        d = json.loads(answer)
    except ValueError:
        return None
    kv = d.get("kv_transfer_params") if isinstance(d, dict) else None
    reason = kv.get(ERROR) if isinstance(kv, dict) else None
    return reason if isinstance(reason, str) and reason else None


@dataclass
class _Opened:
    """A decode engine's answer, begun: ``first`` is what was read of it ahead of the relay;
    ``error`` its error when it failed before any output; ``lost``: the engine's connection
    broke (it died) rather than the engine answering an error."""

    upstream: "aiohttp.ClientResponse"
    first: bytes
    error: Optional[Dict[str, Any]]
    lost: bool = False


class Router:
    """The router's state: its engines, its HTTP client session and its counters. ``app()``
    is the aiohttp application; ``close()`` ends what is still running."""

    def __init__(self, config: RouterConfig) -> None:
        if aiohttp is None:
            raise RuntimeError("kvx.vllm.router needs aiohttp (pip install aiohttp; vLLM installs it)")
        self.config = config
        self.prefill: EnginePool[PrefillEngine] = EnginePool(config.prefill)
        self.decode: EnginePool[DecodeEngine] = EnginePool(config.decode)
        self.stats: Dict[str, int] = {
            "requests": 0,
            "prefill_failed": 0,
            "transfer_failed": 0,
            "decode_failed": 0,
            "decode_unreachable": 0,
            "decode_broke_off": 0,
            "no_engine_up": 0,
            "engines_marked_down": 0,
            "engines_unresponsive": 0,
            "client_gone": 0,
            "unauthorized": 0,
            "bodies_refused": 0,
        }
        self.guard = ConnectionGuard(
            config.max_connections, config.max_connections_per_client, config.header_timeout_sec
        )
        self._session: Optional[aiohttp.ClientSession] = None
        # Prefill requests still running after their decode answer was sent.
        self._background: set = set()

    async def _client(self) -> "aiohttp.ClientSession":
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_sec)
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session

    def app(self) -> "web.Application":
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._guarded])
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self.completion)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/kvx/stats", self.stats_page)
        app.on_cleanup.append(lambda _app: self.close())
        return app

    @web.middleware if web is not None else (lambda f: f)
    async def _guarded(self, request: "web.Request", handler: Any) -> "web.StreamResponse":
        """Marks the connection as in a request (its header deadline stops), and turns away
        an unauthorized ``/v1/`` request or a body declared too large before the handler."""
        self.guard.request_started(request.transport)
        try:
            if request.path.startswith("/v1/") and not authorized(request.headers, self.config.api_key):
                self.stats["unauthorized"] += 1
                return _error(401, "a valid API key is needed: Authorization: Bearer <key>", "authentication_error")
            return await handler(request)
        finally:
            self.guard.request_ended(request.transport)

    async def start(self, host: Optional[str] = None, port: Optional[int] = None, sock: Any = None) -> "web.AppRunner":
        """Serves the router on ``sock``, or on ``host``:``port`` (the configuration's by
        default), behind its connection guard, with https when the configuration names a
        certificate; the runner, whose ``cleanup()`` stops it."""
        ssl_context = None
        if self.config.tls_cert is not None:
            import ssl

            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        # handler_cancellation: a client that goes away cancels its handler, which closes both
        # upstream requests even while the decode engine has sent nothing yet.
        # lingering_time: after a refused body, what the client still sends is read (so that
        # it gets the answer, not a reset) for a second at most, not aiohttp's ten.
        runner = web.AppRunner(self.app(), handler_cancellation=True, lingering_time=1.0)
        await runner.setup()
        site = _GuardedSite(
            runner, self.guard, self.config.header_timeout_sec, ssl_context,
            host=self.config.host if host is None and sock is None else host,
            port=self.config.port if port is None and sock is None else port,
            sock=sock,
        )
        await site.start()
        for loop in (self.guard.sweep(), self._watch_engines()):
            task = asyncio.create_task(loop)
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return runner

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def health(self, _request: "web.Request") -> "web.Response":
        return web.json_response({"status": "ok"})

    async def stats_page(self, _request: "web.Request") -> "web.Response":
        return web.json_response(
            dict(
                self.stats, **self.guard.counts,
                connections=self.guard.open_connections(),
                prefill_in_flight=self.prefill.in_flight(), decode_in_flight=self.decode.in_flight(),
                prefill_down={s.engine.url: s.why_down for s in self.prefill.down()},
                decode_down={s.engine.url: s.why_down for s in self.decode.down()},
            )
        )

    async def models(self, _request: "web.Request") -> "web.Response":
        url = self.config.decode[0].url + "/v1/models"
        try:
            async with (await self._client()).get(url) as up:
                return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"decode engine {self.config.decode[0].url}: {e!r}", "upstream_unreachable")

    async def completion(self, request: "web.Request") -> "web.StreamResponse":
        try:
            body = await read_json(request, self.config.max_body_bytes, self.config.body_timeout_sec)
        except Refused as r:
            self.stats["bodies_refused"] += 1
            refusal = _error(r.status, r.message, r.kind)
            # What is left of the body is not read: the connection cannot carry another request.
            refusal.force_close()
            return refusal
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params are the router's to set", "invalid_request_error")
        self.stats["requests"] += 1
        kvx_id = new_kvx_id()
        # Handed to the two engines chosen here only: the prefill engine proves it to claim
        # the decode engine's reservation (the id alone claims nothing). Never logged.
        claim_secret = params.new_claim_secret()
        path = request.path
        # With no engine of a kind up, those down are asked at once rather than at the next
        # probe: one restarted a moment ago takes this request instead of a 503.
        for kind, pool in (("decode", self.decode), ("prefill", self.prefill)):
            if pool.up_count() == 0:
                await self._probe(kind, pool)
        decode = self.decode.take()
        if decode is None:
            return self._none_up("decode", self.decode)
        if self.prefill.up_count() == 0:
            self.decode.done(decode)
            return self._none_up("prefill", self.prefill)
        # Set when the decode engine falls silent (``_watch_engines``): nothing else would end
        # a request to a stopped engine.
        silent: "asyncio.Future[str]" = asyncio.get_running_loop().create_future()

        def abort(why: str) -> None:
            if not silent.done():
                silent.set_result(why)

        decode.aborts.add(abort)
        prefill_task = asyncio.create_task(
            self._prefill(path, prefill_body(body, path, kvx_id, claim_secret, decode.engine), kvx_id)
        )
        decode_task = asyncio.create_task(
            self._open_decode(decode, path, decode_body(body, kvx_id, claim_secret), kvx_id)
        )
        try:
            await asyncio.wait(_futures(prefill_task, decode_task, silent), return_when=asyncio.FIRST_COMPLETED)
            failed = _result(prefill_task)
            if failed is not None and not decode_task.done():
                # The push never began: the decode engine's request could only wait for a
                # claim that never comes. Closed, it is aborted and its reservation withdrawn.
                decode_task.cancel()
                await asyncio.gather(decode_task, return_exceptions=True)
                return _error(503 if failed.retryable else 502,
                              f"the KV transfer failed: {failed.reason} (kvx request {kvx_id})", "kv_transfer_failed")
            await asyncio.wait(_futures(decode_task, silent), return_when=asyncio.FIRST_COMPLETED)
            if not decode_task.done():
                decode_task.cancel()
                prefill_task.cancel()
                await asyncio.gather(decode_task, return_exceptions=True)
                return _error(503, f"{silent.result()} (kvx request {kvx_id}); retry", "engine_unresponsive")
            opened = decode_task.result()
            if opened is None:
                # No decode engine holds the request: a push could only wait for a
                # reservation that never comes. Retryable: the engine is down now, and the
                # next request goes elsewhere.
                prefill_task.cancel()
                return _error(503, f"decode engine {decode.engine.url} unreachable (kvx request {kvx_id})",
                              "upstream_unreachable")
            if opened.error is not None:
                return await self._decode_failed(opened, decode.engine, prefill_task, kvx_id)
            return await self._relay(request, opened, decode, silent)
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away (aiohttp cancels the handler, or a write finds the
            # connection closed): vLLM aborts both requests once their connections close.
            self.stats["client_gone"] += 1
            prefill_task.cancel()
            decode_task.cancel()
            raise
        finally:
            decode.aborts.discard(abort)
            self.decode.done(decode)
            if not prefill_task.done():
                # Its decode answer is sent; it ends by itself, bounded by the session's
                # timeout, or with the router.
                self._background.add(prefill_task)
                prefill_task.add_done_callback(self._background.discard)

    def _none_up(self, kind: str, pool: "EnginePool[Any]") -> "web.Response":
        """No engine of ``kind`` is up: 503 at once, saying why each is down (retryable: the
        router probes them, and sends again as soon as one answers)."""
        self.stats["no_engine_up"] += 1
        why = "; ".join(f"{s.engine.url}: {s.why_down}" for s in pool.down())
        return _error(503, f"no {kind} engine is up ({why}); retry shortly", "no_engine_up")

    def _mark_down(self, kind: str, slot: Slot[Any], error: BaseException) -> None:
        """``slot``'s engine failed a connection: no new request goes to it until its
        ``/health`` answers (``_watch_engines``)."""
        pool = self.decode if kind == "decode" else self.prefill
        if pool.mark_down(slot, repr(error)):
            self.stats["engines_marked_down"] += 1
            logger.warning("%s engine %s is down (%r): no new requests until its /health answers",
                           kind, slot.engine.url, error)

    async def _watch_engines(self) -> None:
        """Every ``health_interval_sec``, asks every engine's ``/health`` at once. A down one
        that answers 200 takes requests again; an up one that has not answered for
        ``engine_liveness_sec`` is down, and its requests in flight are ended (its slot's
        aborts): a stopped process keeps its connections open, so nothing else ends them."""
        while True:
            await asyncio.sleep(self.config.health_interval_sec)
            slots = [(kind, pool, slot) for kind, pool in (("prefill", self.prefill), ("decode", self.decode))
                     for slot in pool.slots()]
            answers = await asyncio.gather(*(self._healthy(slot.engine.url) for _, _, slot in slots))
            for (kind, pool, slot), healthy in zip(slots, answers):
                if healthy:
                    self._answered(kind, pool, slot)
                elif slot.down_since is None and pool.silent_for(slot) >= self.config.engine_liveness_sec:
                    self._unresponsive(kind, pool, slot)

    async def _probe(self, kind: str, pool: "EnginePool[Any]") -> None:
        """Asks each down engine of ``pool`` at once; one that answers is up again."""
        down = pool.down()
        answers = await asyncio.gather(*(self._healthy(slot.engine.url) for slot in down))
        for slot, healthy in zip(down, answers):
            if healthy:
                self._answered(kind, pool, slot)

    @staticmethod
    def _answered(kind: str, pool: "EnginePool[Any]", slot: Slot[Any]) -> None:
        pool.answered(slot)
        if slot.down_since is not None:
            pool.mark_up(slot)
            logger.info("%s engine %s answers its /health again: it takes requests", kind, slot.engine.url)

    def _unresponsive(self, kind: str, pool: "EnginePool[Any]", slot: Slot[Any]) -> None:
        silent = pool.silent_for(slot)
        why = (f"{kind} engine {slot.engine.url} stopped answering: no /health answer for {silent:.1f} s "
               f"(engine_liveness_sec {self.config.engine_liveness_sec:g}); hung, stopped, or cut off")
        pool.mark_down(slot, why)
        self.stats["engines_marked_down"] += 1
        self.stats["engines_unresponsive"] += 1
        logger.warning("%s; its %d request(s) in flight end now", why, len(slot.aborts))
        for abort in list(slot.aborts):
            abort(why)

    async def _healthy(self, url: str) -> bool:
        try:
            session = await self._client()
            timeout = aiohttp.ClientTimeout(total=min(PROBE_TIMEOUT_SEC, self.config.health_interval_sec))
            async with session.get(url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _open_decode(
        self, slot: Slot[DecodeEngine], path: str, body: Dict[str, Any], kvx_id: str
    ) -> Optional[_Opened]:
        """Sends the request to the decode engine and reads the start of its answer (enough
        to tell an error before any output from an answer); None when the engine cannot be
        reached (it is marked down)."""
        decode = slot.engine
        session = await self._client()
        try:
            upstream = await session.post(decode.url + path, json=body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.stats["decode_unreachable"] += 1
            logger.warning("kvx %s: decode engine %s unreachable: %r", kvx_id, decode.url, e)
            if isinstance(e, ENGINE_LOST):
                self._mark_down("decode", slot, e)
            return None
        try:
            if upstream.status >= 500:
                first = await upstream.content.read(FIRST_PART_MAX)
                text = first.decode(errors="replace").strip()
                return _Opened(upstream, first, _error_object(first) or {"message": text[:300] or "no message"})
            first = b""
            if upstream.status == 200 and upstream.content_type == "text/event-stream":
                while b"\n\n" not in first and len(first) < FIRST_PART_MAX:
                    chunk = await upstream.content.readany()
                    if not chunk:
                        break
                    first += chunk
            return _Opened(upstream, first, _stream_error(first))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            upstream.close()
            lost = isinstance(e, (aiohttp.ClientPayloadError, *ENGINE_LOST))
            if lost:
                self._mark_down("decode", slot, e)
            return _Opened(upstream, b"", {"message": f"its answer broke off before any output: {e!r}"}, lost)
        except BaseException:
            # Closed, not given back to the pool: vLLM sees the connection go and aborts.
            upstream.close()
            raise

    async def _relay(
        self, request: "web.Request", opened: _Opened, slot: Slot[DecodeEngine], silent: "asyncio.Future[str]"
    ) -> "web.StreamResponse":
        """Streams the decode engine's answer to the client as it comes. When the decode
        engine's connection breaks mid-answer (it died), or the engine falls silent
        (``silent``: its ``/health`` stopped answering), a stream ends with an error event in
        OpenAI's shape and ``[DONE]``, never a bare cut or a wait without end; the engine is
        marked down."""
        upstream = opened.upstream
        streamed = upstream.content_type == "text/event-stream"
        try:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            if opened.first:
                await response.write(opened.first)
            try:
                while True:
                    read = asyncio.ensure_future(upstream.content.readany())
                    await asyncio.wait(_futures(read, silent), return_when=asyncio.FIRST_COMPLETED)
                    if not read.done():
                        read.cancel()
                        raise EngineSilent(silent.result())
                    chunk = read.result()
                    if not chunk:
                        break
                    await response.write(chunk)
            except (aiohttp.ClientPayloadError, EngineSilent, *ENGINE_LOST) as e:
                upstream.close()
                if isinstance(e, EngineSilent):
                    message, kind, code = str(e), "engine_unresponsive", 503
                else:
                    self.stats["decode_broke_off"] += 1
                    self._mark_down("decode", slot, e)
                    message, kind, code = f"decode engine {slot.engine.url} broke off its answer: {e!r}", \
                        "upstream_broke_off", 502
                if not streamed:
                    raise
                error = {"error": {"message": message, "type": kind, "code": code}}
                await response.write(b"\n\ndata: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
            await response.write_eof()
        except BaseException:
            # Closed, not given back to the pool: vLLM sees the connection go and aborts.
            upstream.close()
            raise
        upstream.release()
        return response

    async def _decode_failed(
        self, opened: _Opened, decode: DecodeEngine, prefill_task: "asyncio.Task", kvx_id: str
    ) -> "web.Response":
        """The decode engine failed the request before any output (for a failed KV load
        vLLM says only "Internal server error"): the client gets 502 with the prefill
        engine's reason when it gave one, and the kvx id under which both engines log it."""
        opened.upstream.close()
        self.stats["decode_failed"] += 1
        said = str(opened.error.get("message") or "no message") if opened.error else "no message"
        if opened.lost:
            # The engine died: nothing the prefill engine could add is worth the wait, and the
            # request may succeed elsewhere (or once the engine is back).
            return _error(503, f"decode engine {decode.url} broke off before any output: {said} (kvx request "
                          f"{kvx_id}); retry", "upstream_broke_off")
        if not prefill_task.done():
            await asyncio.wait({prefill_task}, timeout=PREFILL_REASON_WAIT_SEC)
        failed = _result(prefill_task)
        logger.warning("kvx %s: decode engine %s failed the request: %s", kvx_id, decode.url, said)
        if failed is not None:
            return _error(
                503 if failed.retryable else 502,
                f"the KV transfer failed: {failed.reason} (kvx request {kvx_id}; the decode engine answered: {said})",
                "kv_transfer_failed",
            )
        return _error(
            502, f"decode engine {decode.url} failed the request: {said} (kvx request {kvx_id}: both "
            "engines log why a KV transfer failed under this id)", "upstream_error",
        )

    async def _prefill(self, path: str, body: Dict[str, Any], kvx_id: str) -> Optional[PushFailed]:
        """Sends the prefill request to an up prefill engine; why its push never began,
        when its answer says so. An engine that cannot be connected to never got the
        request: it is marked down and the next up one is tried (the decode engine's
        reservation waits for whichever claims it); when none can be reached, that is the
        (retryable) reason. An engine whose connection breaks after it got the request may
        have claimed the reservation: not retried (the decode engine's receiver fails the
        load when the engine's kvx connection closes)."""
        tried: List[Slot[PrefillEngine]] = []
        errors: List[str] = []
        while True:
            slot = self.prefill.take(avoid=tried)
            if slot is None:
                if not errors:
                    return PushFailed("no prefill engine is up", retryable=True)
                return PushFailed("no prefill engine could be reached (" + "; ".join(errors) + ")", retryable=True)
            tried.append(slot)
            url = slot.engine.url
            # A silent prefill engine's request is dropped here (the decode engine's
            # receiver fails the load when the engine's heartbeats stop).
            this = asyncio.current_task()

            def abort(_why: str, task: "Optional[asyncio.Task[Any]]" = this) -> None:
                if task is not None:
                    task.cancel()

            slot.aborts.add(abort)
            try:
                session = await self._client()
                async with session.post(url + path, json=body) as up:
                    text = await up.read()
                    if up.status != 200:
                        self.stats["prefill_failed"] += 1
                        logger.warning(
                            "kvx %s: prefill engine %s answered %d: %s", kvx_id, url, up.status,
                            text[:300].decode(errors="replace"),
                        )
                        return None
                    reason = transfer_error(text)
                    if reason is not None:
                        self.stats["transfer_failed"] += 1
                        logger.warning("kvx %s: prefill engine %s could not push its KV: %s", kvx_id, url, reason)
                        return PushFailed(reason)
                    return None
            except aiohttp.ClientConnectorError as e:
                self.stats["prefill_failed"] += 1
                self._mark_down("prefill", slot, e)
                errors.append(f"{url}: {e!r}")
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.stats["prefill_failed"] += 1
                logger.warning("kvx %s: prefill engine %s: %r", kvx_id, url, e)
                if isinstance(e, ENGINE_LOST):
                    self._mark_down("prefill", slot, e)
                return None
            finally:
                slot.aborts.discard(abort)
                self.prefill.done(slot)


def _futures(*futures: "asyncio.Future[Any]") -> "Set[asyncio.Future[Any]]":
    """``futures`` as the set ``asyncio.wait`` takes (their result types differ)."""
    return set(futures)


def _result(task: "asyncio.Task") -> Optional[PushFailed]:
    """A finished prefill task's failure, else None (running, cancelled or failed)."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return None
    return task.result()


class _GuardedSite(web.BaseSite if web is not None else object):  # type: ignore[misc]
    """A listening socket (``sock``, or ``host``:``port``) whose connections pass the guard
    before aiohttp sees them; a TLS handshake counts against the header deadline."""

    def __init__(self, runner: Any, guard: ConnectionGuard, handshake_sec: float, ssl_context: Any,
                 host: Optional[str], port: Optional[int], sock: Any) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=1024)
        self._guard, self._handshake_sec = guard, handshake_sec
        self._host, self._port, self._sock = host, port, sock

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        where = {"sock": self._sock} if self._sock is not None else {"host": self._host, "port": self._port}
        self._server = await loop.create_server(
            self._guard.protocol(self._runner.server), ssl=self._ssl_context, backlog=self._backlog,
            ssl_handshake_timeout=self._handshake_sec if self._ssl_context else None, **where,
        )


async def serve(config: RouterConfig, stop: asyncio.Event) -> None:
    """Runs the router until ``stop`` is set."""
    # Room for every client connection, two upstream connections per request and the rest.
    soft, _ = raise_open_files_limit(config.max_connections + 256)
    if soft < config.max_connections + 256:
        logger.warning(
            "kvx.vllm.router: the open-files limit is %d, too low for max_connections=%d: raise it "
            "(ulimit -n) or lower max_connections", soft, config.max_connections,
        )
    router = Router(config)
    runner = await router.start()
    logger.info(
        "kvx.vllm.router on %s://%s:%d: %d prefill, %d decode engines%s",
        "https" if config.tls_cert else "http", config.host, config.port, len(config.prefill),
        len(config.decode), ", API key required" if config.api_key else "",
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvx.vllm.router",
        description="OpenAI-compatible router for vLLM engines joined by kvx.vllm.KvxConnector: "
        "each request goes to a decode engine and, for one token, to a prefill engine, which "
        "pushes the prompt's KV into the decode engine's blocks (docs/vllm.md).",
    )
    parser.add_argument("--config", required=True, help="the router's YAML or JSON file (docs/vllm.md, 'The router')")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if aiohttp is None:
        print("kvx.vllm.router needs aiohttp: pip install aiohttp (vLLM installs it)", file=sys.stderr)
        return 2
    try:
        config = load(args.config)
    except (OSError, RouterConfigError) as e:
        print(f"kvx.vllm.router: {e}", file=sys.stderr)
        return 2

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
