"""kvx.vllm.router facing a hostile network (router_guard.py): bodies bounded before they are
parsed, header and body deadlines, connection caps that make room for a newcomer, an API key
and https. Raw sockets and aiohttp clients on loopback against the router, in this process
(the caps, the deadlines) or as ``python -m kvx.vllm.router`` (its memory). No vLLM needed."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import socket
import ssl
import subprocess
import sys
import time
from typing import Any, Dict, List

import pytest

aiohttp = pytest.importorskip("aiohttp")

from kvx.vllm.router import Router  # noqa: E402
from kvx.vllm.router_config import RouterConfigError, config_from  # noqa: E402
from kvx.vllm.router_guard import MAX_JSON_CONTAINERS, json_containers  # noqa: E402
from test_router import BOUND, DECODE_ALLOC, DECODE_FABRIC, FakeEngine, good_config, run, until  # noqa: E402

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 4}


def config(decode: FakeEngine, prefill: FakeEngine, **extra: Any):
    return config_from(
        {
            "listen": "127.0.0.1:1",
            "prefill": [{"url": prefill.url}],
            "decode": [{"url": decode.url, "kvx_alloc": DECODE_ALLOC, "kvx_fabric": DECODE_FABRIC}],
            **extra,
        }
    )


class Guarded:
    """A router, started as ``serve`` starts it (behind its guard), in front of two fake
    engines; ``port`` is where it listens."""

    def __init__(self, **extra: Any) -> None:
        self.extra = extra

    async def __aenter__(self) -> "Guarded":
        self.decode, self.prefill = await FakeEngine("decode").start(), await FakeEngine("prefill").start()
        self.router = Router(config(self.decode, self.prefill, **self.extra))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.runner = await self.router.start(sock=sock)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *_exc: Any) -> None:
        await self.runner.cleanup()
        await self.decode.stop()
        await self.prefill.stop()

    async def stats(self) -> Dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND)) as c:
            async with c.get(self.url + "/kvx/stats") as r:
                return await r.json()


async def raw_exchange(port: int, data: bytes, source: str = "127.0.0.1") -> bytes:
    """Sends ``data`` on a new connection from ``source`` and reads until the router closes
    it (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), BOUND)
    finally:
        writer.close()


def test_json_containers_are_counted_outside_strings():
    assert json_containers(b'{"prompt": "[[[{{{ \\" [{", "n": [1, 2, [3]]}') == 3
    assert json_containers(b"[" + b"{}," * 10 + b"{}]") == 12


def test_a_body_over_the_limit_is_refused_declared_or_streamed():
    async def body() -> None:
        async with Guarded(max_body_bytes=1024) as g:
            big = json.dumps(dict(COMPLETION, prompt="x" * 4096)).encode()
            async with aiohttp.ClientSession() as c:
                async with c.post(g.url + "/v1/completions", data=big,
                                  headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 413
                    err = (await r.json())["error"]
                    assert "1024" in err["message"] and err["type"] == "invalid_request_error"

                async def chunks():
                    for i in range(0, len(big), 256):
                        yield big[i : i + 256]

                async with c.post(g.url + "/v1/completions", data=chunks()) as r:
                    assert r.status == 413
            assert not g.decode.bodies and not g.prefill.bodies
            assert (await g.stats())["bodies_refused"] == 2

    run(body())


def test_a_body_that_would_expand_is_refused_before_it_is_parsed():
    async def body() -> None:
        async with Guarded() as g:
            bomb = b'{"model": "m", "prompt": [' + b"[]," * MAX_JSON_CONTAINERS + b"[]]}"
            async with aiohttp.ClientSession() as c:
                async with c.post(g.url + "/v1/completions", data=bomb) as r:
                    assert r.status == 413
                    assert "JSON objects and arrays" in (await r.json())["error"]["message"]
                async with c.post(g.url + "/v1/completions", json=COMPLETION) as r:
                    assert r.status == 200
            assert len(g.decode.bodies) == 1

    run(body())


def test_a_trickled_body_is_cut_at_its_deadline():
    async def body() -> None:
        async with Guarded(body_timeout_sec=0.5) as g:
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"model\"")
            answer = await raw_exchange(g.port, head)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]

    run(body())


def test_a_connection_that_trickles_its_headers_is_closed_at_the_deadline():
    async def body() -> None:
        async with Guarded(header_timeout_sec=0.5) as g:
            started = time.monotonic()
            answer = await raw_exchange(g.port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")
            assert answer == b"" and time.monotonic() - started < BOUND
            stats = await g.stats()
            assert stats["header_timeouts"] == 1 and stats["connections"] == 1  # the stats request's own

    run(body())


def test_waiting_connections_make_room_and_health_answers_under_a_flood():
    """1,100 connections that trickle their headers, from 20 client addresses (55 each: under
    the per-client cap of 64, over the total of 1,000 together): the router keeps at most
    its caps, a newcomer takes a waiting connection's place, and /health answers."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(hard, 8192) < 4096:
        pytest.skip(f"the open-files hard limit ({hard}) is too low for 1,100 connections on both sides")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))

    async def body() -> None:
        async with Guarded() as g:
            writers: List[asyncio.StreamWriter] = []
            for host in range(2, 22):
                for _ in range(55):
                    _, w = await asyncio.open_connection("127.0.0.1", g.port, local_addr=(f"127.0.0.{host}", 0))
                    w.write(b"GET /health HTTP/1.1\r\nHo")
                    writers.append(w)
            await until(lambda: g.router.guard.open_connections() >= 1000, "the flood reaches the total cap")
            latencies = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND)) as c:
                for _ in range(5):
                    started = time.monotonic()
                    async with c.get(g.url + "/health", headers={"Connection": "close"}) as r:
                        assert r.status == 200
                    latencies.append(time.monotonic() - started)
            stats = await g.stats()
            assert stats["connections"] <= 1000
            # The flood past 1,000 took 100 waiting places, and the first probe one more.
            assert stats["evicted"] >= 101, stats
            print(f"/health under 1,100 trickling connections: {max(latencies) * 1000:.1f} ms at most")
            for w in writers:
                w.close()

    run(body())


def test_one_client_keeps_at_most_its_share_of_connections():
    async def body() -> None:
        async with Guarded(max_connections_per_client=8) as g:
            writers = []
            for _ in range(20):
                _, w = await asyncio.open_connection("127.0.0.1", g.port, local_addr=("127.0.0.2", 0))
                w.write(b"GET /he")
                writers.append(w)
            await until(lambda: g.router.guard.counts["evicted"] == 12, "each newcomer past 8 took a waiting one's place")
            assert g.router.guard.open_connections() == 8
            for w in writers:
                w.close()

    run(body())


def test_an_api_key_guards_the_v1_paths_and_not_health():
    async def body() -> None:
        async with Guarded(api_key="s3cret-key") as g:
            async with aiohttp.ClientSession() as c:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"}):
                    async with c.post(g.url + "/v1/completions", json=COMPLETION, headers=headers) as r:
                        assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
                    async with c.get(g.url + "/v1/models", headers=headers) as r:
                        assert r.status == 401
                async with c.post(g.url + "/v1/completions", json=COMPLETION,
                                  headers={"Authorization": "Bearer s3cret-key"}) as r:
                    assert r.status == 200
                async with c.get(g.url + "/health") as r:
                    assert r.status == 200
            assert len(g.decode.bodies) == 1
            assert "s3cret" not in repr(g.router.config)

    run(body())


def test_the_api_key_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVX_ROUTER_API_KEY", "from-env")
    assert config_from(good_config()).api_key == "from-env"
    assert config_from(dict(good_config(), api_key="from-file")).api_key == "from-file"


def test_https_with_a_certificate(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )

    async def body() -> None:
        async with Guarded(tls_cert=str(cert), tls_key=str(key)) as g:
            trust = ssl.create_default_context(cafile=str(cert))
            async with aiohttp.ClientSession() as c:
                async with c.post(f"https://127.0.0.1:{g.port}/v1/completions", json=COMPLETION, ssl=trust) as r:
                    assert r.status == 200
                with pytest.raises(aiohttp.ClientError):
                    async with c.get(g.url + "/health") as r:  # plain http to a TLS port
                        await r.read()

    run(body())


@pytest.mark.parametrize(
    "change, names",
    [
        ({"max_connections": 8, "max_connections_per_client": 9}, "at most max_connections"),
        ({"tls_cert": "/etc/hostname"}, "tls_cert and tls_key"),
        ({"tls_cert": "/nonexistent.pem", "tls_key": "/nonexistent.pem"}, "tls_cert"),
        ({"api_key": ""}, "api_key"),
        ({"header_timeout_sec": 0}, "header_timeout_sec"),
        ({"max_body_bytes": -1}, "max_body_bytes"),
    ],
)
def test_guard_settings_that_cannot_work_are_refused_naming_the_key(change, names):
    with pytest.raises(RouterConfigError, match=names):
        config_from(dict(good_config(), **change))


def _kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_three_60_mib_bodies_leave_the_router_process_small(tmp_path):
    """The router as users run it: three 60 MiB bodies at once (one declared, two streamed)
    are refused, and its peak resident memory grows by less than 100 MiB."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "router.json"
    path.write_text(json.dumps(dict(good_config(), listen=f"127.0.0.1:{port}")))
    proc = subprocess.Popen([sys.executable, "-m", "kvx.vllm.router", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 3 * BOUND
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the router did not start"
                time.sleep(0.1)
        before = _kib(proc.pid, "VmRSS")

        async def send(declared: bool) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            size = 60 << 20
            length = f"Content-Length: {size}" if declared else "Transfer-Encoding: chunked"
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: r\r\n{length}\r\n\r\n".encode())
            piece = b"[{}," * (1 << 14)
            try:
                for _ in range(size // len(piece)):
                    writer.write(piece if declared else b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
            except (ConnectionError, OSError):
                pass  # the router answered and closed: the rest need not go
            try:
                return await asyncio.wait_for(reader.read(), BOUND)
            except (ConnectionError, OSError):
                return b""
            finally:
                writer.close()

        async def attack() -> List[bytes]:
            return await asyncio.gather(send(True), send(False), send(False))

        answers = asyncio.run(asyncio.wait_for(attack(), 6 * BOUND))
        peak = _kib(proc.pid, "VmHWM")
        grew = (peak - before) / 1024
        print(f"router RSS {before / 1024:.0f} MiB before, peak {peak / 1024:.0f} MiB: grew {grew:.1f} MiB")
        assert grew < 100, f"the router's peak memory grew by {grew:.0f} MiB"
        assert any(a.startswith(b"HTTP/1.1 413") for a in answers), [a[:100] for a in answers]
        assert proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(BOUND)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
