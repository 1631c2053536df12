"""kvx.vllm.router against stand-ins for vLLM's OpenAI server (aiohttp servers on loopback that
record what they get, answer as vLLM does, streamed or not, and notice a client that goes
away, as vLLM does to abort a request). No vLLM needed: aiohttp only."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from kvx.vllm import params  # noqa: E402
from kvx.vllm.router import Router  # noqa: E402
from kvx.vllm.router_config import RouterConfigError, config_from, load  # noqa: E402

DECODE_ALLOC = ["tcp://127.0.0.1:8400", "tcp://127.0.0.1:8401"]
DECODE_FABRIC = ["tcp://127.0.0.1:8300", "tcp://127.0.0.1:8301"]
#: Every wait in these tests is bounded by this.
BOUND = 10.0


async def serve(app: web.Application, port: int = 0) -> Tuple[web.AppRunner, str]:
    """Serves ``app`` on a loopback port of its own (``port``, or one the OS picks); its URL."""
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    site = web.SockSite(runner, sock)
    await site.start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


class FakeEngine:
    """What the router sees of vLLM's OpenAI server: each completion's body is recorded; the
    answer comes after ``delay`` seconds, as server-sent events when the request streams;
    a request whose client went away is recorded in ``aborted`` (vLLM aborts it then)."""

    def __init__(self, name: str, delay: float = 0.0, status: int = 200) -> None:
        self.name, self.delay, self.status = name, delay, status
        self.bodies: List[Dict[str, Any]] = []
        self.aborted: List[Dict[str, Any]] = []
        self.runner: Optional[web.AppRunner] = None
        self.url = ""

    def events(self) -> List[bytes]:
        return [
            b"data: " + json.dumps({"choices": [{"text": f"{self.name}-{i}"}]}).encode() + b"\n\n"
            for i in range(3)
        ] + [b"data: [DONE]\n\n"]

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        try:
            await asyncio.sleep(self.delay)
            if self.status != 200:
                return web.json_response({"error": {"message": "no"}}, status=self.status)
            if not body.get("stream"):
                return web.json_response({"choices": [{"text": f"{self.name}-answer"}]})
            response = web.StreamResponse()
            response.content_type = "text/event-stream"
            await response.prepare(request)
            for event in self.events():
                await response.write(event)
                await asyncio.sleep(0.01)
            await response.write_eof()
            return response
        except asyncio.CancelledError:
            self.aborted.append(body)
            raise

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": f"{self.name}-model"}]})

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def start(self) -> "FakeEngine":
        """Serves on a port of its own; again on the same one after ``stop`` (a restart)."""
        app = web.Application()
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        port = int(self.url.rsplit(":", 1)[1]) if self.url else 0
        self.runner, self.url = await serve(app, port)
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def router_config(prefill: List[FakeEngine], decode: List[FakeEngine], **extra: Any):
    return config_from(
        {
            "listen": "127.0.0.1:1",
            "prefill": [{"url": e.url} for e in prefill],
            "decode": [{"url": e.url, "kvx_alloc": DECODE_ALLOC, "kvx_fabric": DECODE_FABRIC} for e in decode],
            **extra,
        }
    )


class Rig:
    """A router in front of fake engines, all on this event loop."""

    def __init__(self, prefill: List[FakeEngine], decode: List[FakeEngine], **config: Any) -> None:
        self.prefill, self.decode, self.config = prefill, decode, config

    async def __aenter__(self) -> "Rig":
        for e in self.prefill + self.decode:
            await e.start()
        self.router = Router(router_config(self.prefill, self.decode, **self.config))
        if self.config.get("health_interval_sec"):
            # What Router.start runs beside the server: the engines' health probes.
            self.probes = asyncio.create_task(self.router._watch_engines())
        self.runner, self.url = await serve(self.router.app())
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND))
        return self

    async def __aexit__(self, *_exc: Any) -> None:
        if hasattr(self, "probes"):
            self.probes.cancel()
        await self.client.close()
        await self.runner.cleanup()
        for e in self.prefill + self.decode:
            await e.stop()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 3 * BOUND))


async def until(check: Any, what: str) -> None:
    """Waits (bounded) until ``check()`` holds."""
    deadline = time.monotonic() + BOUND
    while not check():
        assert time.monotonic() < deadline, f"not within {BOUND} s: {what}"
        await asyncio.sleep(0.02)


def test_a_completion_goes_to_the_decode_engine_unchanged_and_to_prefill_for_one_token():
    async def go():
        async with Rig([FakeEngine("p")], [FakeEngine("d")]) as rig:
            request = {"model": "m", "prompt": "hello", "max_tokens": 5, "min_tokens": 2, "n": 2, "seed": 7}
            async with rig.client.post(rig.url + "/v1/completions", json=request) as r:
                assert r.status == 200
                assert await r.json() == {"choices": [{"text": "d-answer"}]}
            await until(lambda: rig.prefill[0].bodies, "the prefill engine got its request")
            (d,), (p,) = rig.decode[0].bodies, rig.prefill[0].bodies
            decode_wants = params.parse(d["kv_transfer_params"])
            prefill_wants = params.parse(p["kv_transfer_params"])
            assert isinstance(decode_wants, params.RemotePrefill)
            assert isinstance(prefill_wants, params.RemoteDecode)
            assert decode_wants.kvx_id == prefill_wants.kvx_id, "one kvx id names the request on both sides"
            assert decode_wants.claim_secret == prefill_wants.claim_secret, \
                "the prefill engine proves the secret the decode engine reserves with"
            assert prefill_wants.decode_alloc == tuple(DECODE_ALLOC)
            assert prefill_wants.decode_fabric == tuple(DECODE_FABRIC)
            assert {k: v for k, v in d.items() if k != "kv_transfer_params"} == request
            assert p["max_tokens"] == 1 and p["stream"] is False
            assert "min_tokens" not in p and "n" not in p, "one token, one sequence"
            assert p["prompt"] == "hello" and p["seed"] == 7

    run(go())


def test_each_request_gets_a_kvx_id_and_a_claim_secret_of_its_own():
    async def go():
        async with Rig([FakeEngine("p")], [FakeEngine("d")]) as rig:
            for _ in range(3):
                async with rig.client.post(rig.url + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 200
            ids = {b["kv_transfer_params"][params.REQUEST_ID] for b in rig.decode[0].bodies}
            assert len(ids) == 3
            secrets = {b["kv_transfer_params"][params.CLAIM_SECRET] for b in rig.decode[0].bodies}
            assert len(secrets) == 3, "a fresh claim secret per request"

    run(go())


def test_a_streamed_chat_is_relayed_event_by_event():
    async def go():
        async with Rig([FakeEngine("p")], [FakeEngine("d")]) as rig:
            request = {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_completion_tokens": 9,
            }
            async with rig.client.post(rig.url + "/v1/chat/completions", json=request) as r:
                assert r.status == 200
                assert r.content_type == "text/event-stream"
                got = await r.read()
            assert got == b"".join(rig.decode[0].events())
            await until(lambda: rig.prefill[0].bodies, "the prefill engine got its request")
            p = rig.prefill[0].bodies[0]
            assert p["max_completion_tokens"] == 1 and p["max_tokens"] == 1
            assert p["stream"] is False and "stream_options" not in p
            assert rig.decode[0].bodies[0]["stream"] is True

    run(go())


def test_a_client_that_goes_away_aborts_both_engines_requests():
    async def go():
        async with Rig([FakeEngine("p", delay=BOUND)], [FakeEngine("d", delay=BOUND)]) as rig:
            with pytest.raises(asyncio.TimeoutError):
                async with rig.client.post(
                    rig.url + "/v1/completions",
                    json={"prompt": "x"},
                    timeout=aiohttp.ClientTimeout(total=0.5),
                ):
                    pass
            await until(lambda: rig.decode[0].aborted, "the decode engine saw its request go")
            await until(lambda: rig.prefill[0].aborted, "the prefill engine saw its request go")
            await until(lambda: rig.router.stats["client_gone"] == 1, "the router counted it")
            assert rig.router.prefill.in_flight() == [0] and rig.router.decode.in_flight() == [0]

    run(go())


def test_kv_transfer_params_from_the_client_are_refused():
    async def go():
        async with Rig([FakeEngine("p")], [FakeEngine("d")]) as rig:
            request = {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}
            async with rig.client.post(rig.url + "/v1/completions", json=request) as r:
                assert r.status == 400
                assert "kv_transfer_params" in (await r.json())["error"]["message"]
            async with rig.client.post(rig.url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400
            assert not rig.decode[0].bodies and not rig.prefill[0].bodies

    run(go())


def test_an_unreachable_decode_engine_is_a_503_and_its_prefill_is_withdrawn():
    async def go():
        gone = FakeEngine("d")
        async with Rig([FakeEngine("p", delay=BOUND)], [gone]) as rig:
            await gone.stop()
            async with rig.client.post(rig.url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503, "retryable"
                err = (await r.json())["error"]
                assert err["type"] == "upstream_unreachable" and gone.url in err["message"]
            # Withdrawn before it was sent, or aborted once there: never left running.
            await until(lambda: rig.router.prefill.in_flight() == [0], "the prefill request ended")
            await asyncio.sleep(0.2)
            assert len(rig.prefill[0].bodies) == len(rig.prefill[0].aborted)
            assert rig.router.stats["decode_unreachable"] == 1

    run(go())


def test_a_failed_prefill_is_counted_and_the_decode_answer_still_comes():
    async def go():
        async with Rig([FakeEngine("p", status=500)], [FakeEngine("d", delay=0.2)]) as rig:
            async with rig.client.post(rig.url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200 and (await r.json())["choices"][0]["text"] == "d-answer"
            await until(lambda: rig.router.stats["prefill_failed"] == 1, "the failure was counted")

    run(go())


def test_requests_spread_over_the_engines_with_the_fewest_in_flight():
    async def go():
        prefill = [FakeEngine("p0", delay=0.3), FakeEngine("p1", delay=0.3)]
        decode = [FakeEngine("d0", delay=0.3), FakeEngine("d1", delay=0.3)]
        async with Rig(prefill, decode) as rig:

            async def one() -> None:
                async with rig.client.post(rig.url + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 200

            await asyncio.gather(*(one() for _ in range(4)))
            assert [len(e.bodies) for e in decode] == [2, 2]
            await until(lambda: sum(len(e.bodies) for e in prefill) == 4, "every prefill request")
            assert [len(e.bodies) for e in prefill] == [2, 2]

    run(go())


def test_models_and_health():
    async def go():
        async with Rig([FakeEngine("p")], [FakeEngine("d")]) as rig:
            async with rig.client.get(rig.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "d-model"
            async with rig.client.get(rig.url + "/health") as r:
                assert r.status == 200
            async with rig.client.get(rig.url + "/kvx/stats") as r:
                assert (await r.json())["requests"] == 0

    run(go())


def good_config() -> Dict[str, Any]:
    return {
        "listen": "0.0.0.0:8000",
        "prefill": [{"url": "http://10.0.0.1:8100"}],
        "decode": [{"url": "http://10.0.0.2:8200", "kvx_alloc": ["tcp://10.0.0.2:8400"], "kvx_fabric": ["tcp://10.0.0.2:8300"]}],
    }


def test_a_configuration_is_read_from_yaml_or_json(tmp_path):
    yaml = pytest.importorskip("yaml")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(good_config()))
    (tmp_path / "r.json").write_text(json.dumps(good_config()))
    for name in ("r.yaml", "r.json"):
        c = load(str(tmp_path / name))
        assert (c.host, c.port) == ("0.0.0.0", 8000)
        assert c.decode[0].kvx_alloc == ("tcp://10.0.0.2:8400",)
        assert c.prefill[0].url == "http://10.0.0.1:8100"


@pytest.mark.parametrize(
    "change, names",
    [
        (lambda c: c.update(listen="8000"), "listen"),
        (lambda c: c.update(extra=1), "unknown key 'extra'"),
        (lambda c: c.update(prefill=[]), "prefill"),
        (lambda c: c["prefill"][0].update(url="10.0.0.1:8100"), "prefill[0].url"),
        (lambda c: c["decode"][0].update(kvx_alloc=["http://10.0.0.2:8400"]), "decode[0].kvx_alloc"),
        (lambda c: c["decode"][0].update(kvx_fabric=["tcp://a:1", "tcp://a:2"]), "one of each per decode TP rank"),
        (
            lambda c: c["decode"].append(
                {"url": "http://d:1", "kvx_alloc": ["tcp://d:1", "tcp://d:2"], "kvx_fabric": ["tcp://d:3", "tcp://d:4"]}
            ),
            "decode[1]: 2 TP ranks",
        ),
        (lambda c: c.update(request_timeout_sec=0), "request_timeout_sec"),
    ],
)
def test_a_configuration_that_cannot_work_is_refused_naming_the_key(change, names):
    c = good_config()
    change(c)
    with pytest.raises(RouterConfigError, match=__import__("re").escape(names)):
        config_from(c)


def test_the_command_reports_a_bad_configuration_and_has_help(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prefill": []}))
    out = subprocess.run(
        [sys.executable, "-m", "kvx.vllm.router", "--config", str(bad)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and "prefill" in out.stderr
    helped = subprocess.run(
        [sys.executable, "-m", "kvx.vllm.router", "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0 and "--config" in helped.stdout


class BrokenEngine(FakeEngine):
    """A decode engine whose streamed answer breaks off before its first event."""

    async def completion(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        await response.write(b"data: {\"choi")
        request.transport.close()
        return response


def test_a_decode_answer_that_breaks_off_before_any_output_is_a_retryable_503_at_once():
    async def go():
        # The prefill engine takes long to answer: the router does not wait for its reason
        # when the decode engine died.
        async with Rig([FakeEngine("p", delay=5.0)], [BrokenEngine("d")]) as rig:
            request = {"prompt": "x", "stream": True}
            started = time.monotonic()
            async with rig.client.post(rig.url + "/v1/completions", json=request) as r:
                assert r.status == 503
                err = (await r.json())["error"]
                assert err["type"] == "upstream_broke_off" and "broke off" in err["message"], err
                assert "kvx request kvx-" in err["message"]
            assert time.monotonic() - started < 1.0
            assert rig.router.stats["decode_failed"] == 1
            assert [s.engine.url for s in rig.router.decode.down()] == [rig.decode[0].url]

    run(go())


async def post_status(rig: Rig, request: Optional[Dict[str, Any]] = None) -> Tuple[int, bytes]:
    async with rig.client.post(rig.url + "/v1/completions", json=request or {"prompt": "x"}) as r:
        return r.status, await r.read()


def test_a_dead_decode_engine_gets_no_new_requests_until_its_health_answers_again():
    async def go():
        dead, live = FakeEngine("d0"), FakeEngine("d1")
        async with Rig([FakeEngine("p")], [dead, live], health_interval_sec=0.1) as rig:
            await dead.stop()
            statuses = [(await post_status(rig))[0] for _ in range(6)]
            # At most the first request met the dead engine (a retryable 503); it is down
            # from then on, and every later request goes to the live one.
            assert statuses.count(503) <= 1 and statuses[1:] == [200] * 5, statuses
            assert len(live.bodies) >= 5
            async with rig.client.get(rig.url + "/kvx/stats") as r:
                stats = await r.json()
            assert list(stats["decode_down"]) == [dead.url], stats
            # Restarted on the same port: its /health answers, and it takes requests again.
            await dead.start()
            await until(lambda: not rig.router.decode.down(), "the restarted engine is up again")
            before = len(dead.bodies)
            for _ in range(4):
                assert (await post_status(rig))[0] == 200
            assert len(dead.bodies) > before, "the restarted engine takes requests"

    run(go())


def test_a_dead_prefill_engine_is_passed_over_for_a_live_one_within_the_request():
    async def go():
        dead, live = FakeEngine("p0"), FakeEngine("p1")
        async with Rig([dead, live], [FakeEngine("d")], health_interval_sec=0.1) as rig:
            await dead.stop()
            for _ in range(4):
                status, body = await post_status(rig)
                assert status == 200, body
            await until(lambda: len(live.bodies) == 4, "every push went through the live prefill engine")
            assert [s.engine.url for s in rig.router.prefill.down()] == [dead.url]

    run(go())


def test_with_no_prefill_engine_up_a_request_is_a_503_at_once_and_the_decode_engine_is_spared():
    async def go():
        dead = FakeEngine("p")
        decode = FakeEngine("d", delay=BOUND)
        async with Rig([dead], [decode], health_interval_sec=0.1) as rig:
            await dead.stop()
            started = time.monotonic()
            status, body = await post_status(rig)
            assert status == 503, body
            err = json.loads(body)["error"]
            assert err["type"] == "kv_transfer_failed" and "no prefill engine could be reached" in err["message"], err
            # The next one is refused before any engine is asked.
            status, body = await post_status(rig)
            assert status == 503 and json.loads(body)["error"]["type"] == "no_engine_up", body
            assert time.monotonic() - started < BOUND / 2, "at once, not after the decode engine's answer"
            await until(lambda: rig.router.decode.in_flight() == [0], "the decode request ended")
            await asyncio.sleep(0.2)
            assert len(decode.bodies) == len(decode.aborted) <= 1, "never left running"

    run(go())


class DyingEngine(FakeEngine):
    """A decode engine that streams one event, then dies (its connection cut mid-answer)."""

    async def completion(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        await response.write(self.events()[0])
        await asyncio.sleep(0.05)
        request.transport.abort()
        return response


def test_a_decode_engine_that_dies_mid_stream_ends_the_stream_with_an_error_event_and_done():
    async def go():
        dying = DyingEngine("d")
        async with Rig([FakeEngine("p")], [dying]) as rig:
            status, got = await post_status(rig, {"prompt": "x", "stream": True})
            assert status == 200
            assert got.startswith(dying.events()[0]), got
            events = [e for e in got.split(b"\n\n") if e.startswith(b"data: ")]
            assert events[-1] == b"data: [DONE]", got
            error = json.loads(events[-2][len(b"data: "):])["error"]
            assert error["type"] == "upstream_broke_off" and dying.url in error["message"], error
            assert rig.router.stats["decode_broke_off"] == 1
            assert [s.engine.url for s in rig.router.decode.down()] == [dying.url]

    run(go())


class FreezingEngine(FakeEngine):
    """An engine that freezes (as a stopped process looks from outside: connections stay
    open, nothing answers) once it has streamed ``before`` events of a request; its
    ``/health`` stops answering then too."""

    def __init__(self, name: str, before: int) -> None:
        super().__init__(name)
        self.before, self.frozen = before, False

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        try:
            if self.before == 0:
                self.frozen = True
                await asyncio.sleep(3 * BOUND)
            response = web.StreamResponse()
            response.content_type = "text/event-stream"
            await response.prepare(request)
            for event in self.events()[: self.before]:
                await response.write(event)
            self.frozen = True
            await asyncio.sleep(3 * BOUND)
            return response
        except asyncio.CancelledError:
            self.aborted.append(body)
            raise

    async def health(self, request: web.Request) -> web.Response:
        if self.frozen:
            await asyncio.sleep(3 * BOUND)
        return await super().health(request)


LIVENESS = {"health_interval_sec": 0.1, "engine_liveness_sec": 0.5}


def test_a_decode_engine_that_freezes_mid_stream_ends_the_stream_typed_within_the_liveness_bound():
    async def go():
        freezing = FreezingEngine("d", before=1)
        async with Rig([FakeEngine("p")], [freezing], **LIVENESS) as rig:
            started = time.monotonic()
            status, got = await post_status(rig, {"prompt": "x", "stream": True})
            took = time.monotonic() - started
            assert status == 200
            assert got.startswith(freezing.events()[0]), got
            events = [e for e in got.split(b"\n\n") if e.startswith(b"data: ")]
            assert events[-1] == b"data: [DONE]", got
            error = json.loads(events[-2][len(b"data: "):])["error"]
            assert error["type"] == "engine_unresponsive" and freezing.url in error["message"], error
            assert took < 0.5 + 1.0, took
            assert rig.router.stats["engines_unresponsive"] == 1
            assert [s.engine.url for s in rig.router.decode.down()] == [freezing.url]
            await until(lambda: freezing.aborted, "the frozen engine's request closed")

    run(go())


def test_a_decode_engine_that_freezes_before_any_output_is_a_503_and_gets_no_new_request():
    async def go():
        freezing, live = FreezingEngine("d0", before=0), FakeEngine("d1")
        async with Rig([FakeEngine("p")], [freezing, live], **LIVENESS) as rig:
            started = time.monotonic()
            status, got = await post_status(rig, {"prompt": "x"})
            took = time.monotonic() - started
            assert status == 503, got
            error = json.loads(got)["error"]
            assert error["type"] == "engine_unresponsive", error
            assert took < 0.5 + 1.0, took
            # The next request goes to the engine that answers.
            status, got = await post_status(rig, {"prompt": "y"})
            assert status == 200 and b"d1-answer" in got, got
            assert len(freezing.bodies) == 1

    run(go())


def test_a_frozen_prefill_engine_is_dropped_and_passed_over():
    async def go():
        frozen, live = FreezingEngine("p0", before=0), FakeEngine("p1")
        async with Rig([frozen, live], [FakeEngine("d")], **LIVENESS) as rig:
            status, _ = await post_status(rig, {"prompt": "x"})
            assert status == 200  # the fake decode engine answers whatever the prefill does
            await until(lambda: rig.router.prefill.down(), "the frozen prefill engine marked down")
            await until(lambda: frozen.aborted, "its request dropped by the router")
            for _ in range(2):
                status, _ = await post_status(rig, {"prompt": "y"})
                assert status == 200
            assert len(frozen.bodies) == 1 and len(live.bodies) >= 2

    run(go())


def test_engine_liveness_must_leave_room_for_a_late_health_answer():
    with pytest.raises(RouterConfigError, match="engine_liveness_sec"):
        config_from({**good_config(), "health_interval_sec": 2, "engine_liveness_sec": 3})


def test_with_every_engine_of_a_kind_down_one_back_up_takes_the_request_before_its_probe():
    async def go():
        prefill = FakeEngine("p")
        # Probes far apart: only the request's own asking can find the engine back.
        async with Rig([prefill], [FakeEngine("d")], health_interval_sec=30, engine_liveness_sec=60) as rig:
            await prefill.stop()
            status, _ = await post_status(rig)
            assert status == 503  # no prefill engine could be reached
            assert rig.router.prefill.down()
            await prefill.start()  # back on its port
            status, got = await post_status(rig)
            assert status == 200, got
            assert not rig.router.prefill.down()
            assert len(prefill.bodies) == 1

    run(go())
