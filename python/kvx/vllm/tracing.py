"""Each request's transfer as OpenTelemetry spans, one per engine and TP rank
(``docs/vllm.md``, "Signals"): ``kvx.receive`` on the decode engine (its blocks reserved →
its KV received, failed or withdrawn) and ``kvx.push`` on the prefill engine (its claim →
delivered, refused or failed, with the grant and the first and last write posted as events).

The two engines never exchange a trace context, yet their spans join: both are children of
one span context drawn from the transfer's kvx id (``transfer_context``), which both engines
know (the router's id, or llm-d's ``transfer_id``), so a trace viewer shows the pair as one
trace whatever the client sent. A request that came with a W3C trace context (vLLM keeps its
``traceparent`` when ``--otlp-traces-endpoint`` is set) is linked to from both spans.

Spans are made only where vLLM's ``--otlp-traces-endpoint`` is set (``tracer_for``), through
the tracer provider vLLM set up in the process (its own exporter); OpenTelemetry is not
imported otherwise. This module does not import vLLM at import time."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

logger = logging.getLogger("kvx.vllm")

#: The instrumentation scope of kvx's spans.
SCOPE = "kvx.vllm"


def transfer_ids(kvx_id: str) -> Tuple[int, int]:
    """(trace id, span id) of the transfer ``kvx_id``: the same on every engine, never 0
    (W3C's invalid value)."""
    digest = hashlib.sha256(b"kvx transfer " + kvx_id.encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id


def transfer_context(kvx_id: str) -> Any:
    """The OpenTelemetry context whose span is the transfer ``kvx_id`` (remote, sampled): the
    parent of both engines' spans."""
    from opentelemetry import trace

    trace_id, span_id = transfer_ids(kvx_id)
    parent = trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def tracer_for(otlp_traces_endpoint: Optional[str]) -> Any:
    """The tracer for kvx's spans, or None (no endpoint, or OpenTelemetry missing). vLLM's
    engine processes set their tracer provider up when the endpoint is set; where none is
    (a process vLLM did not set up), one is made as vLLM makes its own."""
    if not otlp_traces_endpoint:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError:
        logger.warning("kvx: --otlp-traces-endpoint is set but OpenTelemetry is not installed: no kvx spans")
        return None
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        from vllm.tracing import init_tracer

        return init_tracer(SCOPE, otlp_traces_endpoint)
    return trace.get_tracer(SCOPE)


@dataclass
class _Open:
    """A span not yet ended: what it will be made of."""

    name: str
    start_ns: int
    attributes: Dict[str, Any]
    events: List[Tuple[str, int]] = field(default_factory=list)
    links: Optional[Mapping[str, str]] = None


class Spans:
    """One worker's open transfer spans, by kvx id. Each is made whole when it ends (the
    times kept until then), so an engine that never ends a transfer exports nothing half
    made. With no tracer every call does nothing."""

    def __init__(self, tracer: Any, attributes: Optional[Mapping[str, Any]] = None) -> None:
        self.tracer = tracer
        self.attributes = dict(attributes or {})
        self._open: Dict[str, _Open] = {}

    def __bool__(self) -> bool:
        return self.tracer is not None

    def open(self, kvx_id: str, name: str, attributes: Mapping[str, Any],
             trace_headers: Optional[Mapping[str, str]] = None) -> None:
        if self.tracer is None or kvx_id in self._open:
            return
        self._open[kvx_id] = _Open(name, time.time_ns(), {**self.attributes, "kvx.id": kvx_id, **attributes},
                                   links=trace_headers)

    def event(self, kvx_id: str, name: str) -> None:
        """Marks ``name`` now on ``kvx_id``'s span (once: the first time counts)."""
        span = self._open.get(kvx_id)
        if span is not None and all(n != name for n, _ in span.events):
            span.events.append((name, time.time_ns()))

    def close(self, kvx_id: str, outcome: str, error: Optional[str] = None) -> None:
        """Ends ``kvx_id``'s span with ``outcome`` (an attribute), in error with ``error``."""
        span = self._open.pop(kvx_id, None)
        if span is None:
            return
        try:
            self._export(kvx_id, span, outcome, error)
        except Exception as e:  # a tracing failure never fails a transfer
            logger.warning("kvx: span of %s not exported: %s", kvx_id, e)

    def _export(self, kvx_id: str, span: _Open, outcome: str, error: Optional[str]) -> None:
        from opentelemetry import trace

        links = []
        if span.links:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            client = trace.get_current_span(TraceContextTextMapPropagator().extract(dict(span.links))).get_span_context()
            if client.is_valid:
                links.append(trace.Link(client, {"kvx.link": "request"}))
        made = self.tracer.start_span(span.name, context=transfer_context(kvx_id), kind=trace.SpanKind.INTERNAL,
                                      attributes={**span.attributes, "kvx.outcome": outcome},
                                      links=links, start_time=span.start_ns)
        for name, at in span.events:
            made.add_event(name, timestamp=at)
        if error is not None:
            made.set_status(trace.Status(trace.StatusCode.ERROR, error))
        made.end(end_time=time.time_ns())

    def close_all(self, outcome: str) -> None:
        """The worker stops: every open span ends with ``outcome``, in error."""
        for kvx_id in list(self._open):
            self.close(kvx_id, outcome, outcome)


__all__ = ["SCOPE", "Spans", "tracer_for", "transfer_context", "transfer_ids"]
