"""Each transfer as an OpenTelemetry span pair across both engines (``kvx.vllm.tracing``):
a decode engine and a prefill engine, each vLLM's real ``Scheduler`` with the connector,
joined by the in-process stand-in for kvx (``loopback``), with vLLM's
``otlp_traces_endpoint`` set and an in-process exporter as the process's tracer provider
(where vLLM's own would export to the endpoint)."""

from __future__ import annotations

import logging

import pytest

from kvx.vllm.version import SUPPORTED, installed_version, parse_release

VERSION = installed_version()
if VERSION is None or parse_release(VERSION) not in SUPPORTED:
    pytest.skip("vLLM 0.32 or 0.33 is not installed (scripts/vllm-tests.sh installs vllm==0.33.0)",
                allow_module_level=True)

from loopback import DecodeEnd, Hub, PrefillEnd  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import BLOCK_SIZE, Engine  # noqa: E402

from kvx.vllm import params  # noqa: E402
from kvx.vllm.tracing import Spans, transfer_ids  # noqa: E402

PROMPT = 3 * BLOCK_SIZE + 5
SECRET = "secret-0123456789abcdef"
ENDPOINT = "http://127.0.0.1:4317"  # never reached: the test's provider exports in process
#: A client's W3C trace context, as a gateway sends it on both legs.
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}

_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans():
    """The process's tracer provider (set once, as vLLM sets its own), its spans cleared."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def pair(endpoint=ENDPOINT, **prefill_kwargs):
    hub = Hub()
    decode = Engine("kv_consumer", transfer=DecodeEnd(hub), otlp_traces_endpoint=endpoint)
    prefill = Engine("kv_producer", transfer=PrefillEnd(hub), otlp_traces_endpoint=endpoint, **prefill_kwargs)
    return hub, decode, prefill


def run(decode, prefill, until, steps=24):
    for _ in range(steps):
        decode.step()
        prefill.step()
        if until():
            return
    raise AssertionError("not reached")


def by_name(exporter):
    out = {}
    for span in exporter.get_finished_spans():
        out.setdefault(span.name, []).append(span)
    return out


def events(span):
    return [e.name for e in span.events]


def test_a_transfer_is_one_trace_of_two_spans_one_per_engine(spans):
    hub, decode, prefill = pair(max_batched_tokens=2 * BLOCK_SIZE)  # chunked: two steps
    decode.add("d1", PROMPT, params.for_decode("X", SECRET), trace_headers=TRACEPARENT)
    decode.step()
    prefill.add("p1", PROMPT, params.for_prefill("X", SECRET, ["tcp://d:8400"], ["tcp://d:8300"]),
                max_tokens=1, trace_headers=TRACEPARENT)
    run(decode, prefill, lambda: "d1" not in decode.scheduler.requests and "p1" not in prefill.scheduler.requests)
    got = by_name(spans)
    (receive,), (push,) = got["kvx.receive"], got["kvx.push"]
    trace_id, parent_id = transfer_ids("X")
    for span in (receive, push):
        assert span.context.trace_id == trace_id  # joined by the kvx id, no context exchanged
        assert span.parent is not None and span.parent.span_id == parent_id and span.parent.is_remote
        assert span.status.is_ok
        assert span.attributes["kvx.id"] == "X"
        (link,) = span.links  # the client's own trace, linked from both engines
        assert link.context.trace_id == int(CLIENT_TRACE, 16) and link.context.span_id == int(CLIENT_SPAN, 16)
    assert receive.context.span_id != push.context.span_id
    assert receive.attributes["kvx.role"] == "decode" and receive.attributes["kvx.outcome"] == "received"
    assert receive.attributes["vllm.request_id"] == "d1" and receive.attributes["kvx.blocks"] == 4
    assert push.attributes["kvx.role"] == "prefill" and push.attributes["kvx.outcome"] == "delivered"
    assert push.attributes["vllm.request_id"] == "p1" and push.attributes["kvx.decode_alloc"] == "tcp://d:8400"
    assert events(push) == ["granted", "first write posted", "last write posted"]
    stamps = [push.start_time] + [e.timestamp for e in push.events] + [push.end_time]
    assert stamps == sorted(stamps)
    # The decode engine reserved first; its KV is received once the prefill engine's last
    # write is in.
    assert receive.start_time <= push.start_time and push.events[-1].timestamp <= receive.end_time


def test_two_transfers_are_two_traces(spans):
    hub, decode, prefill = pair()
    for n in ("1", "2"):
        decode.add("d" + n, PROMPT, params.for_decode("X" + n, SECRET))
        prefill.add("p" + n, PROMPT, params.for_prefill("X" + n, SECRET, ["tcp://d:8400"], ["tcp://d:8300"]),
                    max_tokens=1)
    run(decode, prefill, lambda: not decode.scheduler.requests and not prefill.scheduler.requests)
    got = by_name(spans)
    assert len(got["kvx.receive"]) == len(got["kvx.push"]) == 2
    traces = {s.attributes["kvx.id"]: set() for s in got["kvx.receive"]}
    for s in got["kvx.receive"] + got["kvx.push"]:
        traces[s.attributes["kvx.id"]].add(s.context.trace_id)
        assert not s.links  # no client trace context: none linked
    assert traces == {k: {transfer_ids(k)[0]} for k in ("X1", "X2")}


def test_a_claim_refused_after_a_decode_abort_ends_both_spans_for_what_they_are(spans):
    hub, decode, prefill = pair()
    decode.add("d1", PROMPT, params.for_decode("X", SECRET))
    decode.step()
    decode.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    prefill.add("p1", PROMPT, params.for_prefill("X", SECRET, ["tcp://d:8400"], ["tcp://d:8300"]), max_tokens=1)
    run(decode, prefill, lambda: "p1" not in prefill.scheduler.requests and not decode.scheduler.requests)
    got = by_name(spans)
    (receive,), (push,) = got["kvx.receive"], got["kvx.push"]
    assert receive.attributes["kvx.outcome"] == "withdrawn" and receive.status.is_ok
    assert push.attributes["kvx.outcome"] == "refused"
    assert push.status.status_code == trace.StatusCode.ERROR and "already ended" in push.status.description
    assert events(push) == []


def test_a_push_cancelled_after_its_grant_fails_both_spans(spans):
    hub, decode, prefill = pair(max_batched_tokens=2 * BLOCK_SIZE)
    decode.add("d1", PROMPT, params.for_decode("X", SECRET))
    decode.step()
    prefill.add("p1", PROMPT, params.for_prefill("X", SECRET, ["tcp://d:8400"], ["tcp://d:8300"]), max_tokens=1)
    run(decode, prefill, lambda: bool(hub.writes))  # the first chunk's writes are in
    prefill.scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    run(decode, prefill, lambda: "p1" not in prefill.scheduler.requests and "kvx.receive" in by_name(spans))
    got = by_name(spans)
    (receive,), (push,) = got["kvx.receive"], got["kvx.push"]
    for span in (receive, push):
        assert span.attributes["kvx.outcome"] == "failed"
        assert span.status.status_code == trace.StatusCode.ERROR
        assert "cancelled by the prefill engine" in span.status.description
    assert events(push)[:2] == ["granted", "first write posted"] and "last write posted" not in events(push)


def test_no_endpoint_no_spans(spans):
    hub, decode, prefill = pair(endpoint=None)
    decode.add("d1", PROMPT, params.for_decode("X", SECRET))
    prefill.add("p1", PROMPT, params.for_prefill("X", SECRET, ["tcp://d:8400"], ["tcp://d:8300"]), max_tokens=1)
    run(decode, prefill, lambda: not decode.scheduler.requests and not prefill.scheduler.requests)
    assert spans.get_finished_spans() == ()
    assert not decode.worker._worker.spans and not prefill.worker._worker.spans


def test_a_span_that_cannot_be_made_fails_nothing(spans, caplog):
    class Broken:
        def start_span(self, *args, **kwargs):
            raise RuntimeError("exporter gone")

    caplog.set_level(logging.WARNING, logger="kvx.vllm")
    s = Spans(Broken())
    s.open("X", "kvx.push", {})
    s.event("X", "granted")
    s.close("X", "delivered")  # logged, not raised
    assert "span of X not exported: exporter gone" in caplog.text
    s.close("X", "delivered")  # closed once


def test_transfer_ids_are_the_same_everywhere_and_differ_by_transfer():
    assert transfer_ids("xfer-1") == transfer_ids("xfer-1")
    assert transfer_ids("xfer-1")[0] != transfer_ids("xfer-2")[0]
    assert all(0 < i for i in transfer_ids("")) and transfer_ids("a")[0] < 2**128 and transfer_ids("a")[1] < 2**64
