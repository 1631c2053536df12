"""What kvx's connector adds to vLLM's own metrics, for a gateway or an operator to act on
(``docs/vllm.md``, "Signals"). vLLM carries it: the workers' and the scheduler-side
connector's ``KvxConnectorStats`` are summed each step and handed to ``KvxPromMetrics``
(``kvx.vllm.connector``), which exports them on the engine's ``/metrics`` beside vLLM's own.
vLLM's own metrics stay true: a decode engine's reservations are blocks vLLM allocated, so
``vllm:kv_cache_usage_perc`` counts them, filled or not.

Stats data is one dict: a key ending ``_s`` holds samples in seconds (a histogram's), one
starting ``now_`` a gauge's value at this step, ``refused:<class>`` a count of claims refused
for that class of reason, any other a count. This module does not import vLLM."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Tuple

#: Seconds: from a loopback handover (milliseconds) to a claim that waits out its timeout.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: Histograms: data key → (metric, help). The handover's phases as each engine sees them.
HISTOGRAMS: Dict[str, Tuple[str, str]] = {
    "reserve_to_received_s": (
        "vllm:kvx_reserve_to_received_seconds",
        "decode: from a request's blocks reserved to its KV received, complete and verified",
    ),
    "claim_to_grant_s": (
        "vllm:kvx_claim_to_grant_seconds",
        "prefill: from a request's claim to the decode engine's grant on every TP rank",
    ),
    "push_s": (
        "vllm:kvx_push_seconds",
        "prefill: from a push's first write posted to its delivery (the forward pass included: "
        "writes go as layers are computed)",
    ),
    "delivery_s": (
        "vllm:kvx_delivery_seconds",
        "prefill: from a push's last write posted to its delivery (what the forward pass does "
        "not hide)",
    ),
}

#: Counters: data key → (metric, help).
COUNTERS: Dict[str, Tuple[str, str]] = {
    "received": ("vllm:kvx_loads_received_total", "decode: requests whose KV arrived complete and verified"),
    "load_failures": ("vllm:kvx_loads_failed_total",
                      "decode: requests whose KV did not arrive (recomputed or failed, as "
                      "kv_load_failure_policy says; withdrawals of aborted requests among them)"),
    "pushed": ("vllm:kvx_pushes_delivered_total", "prefill: pushes delivered"),
    "push_failures": ("vllm:kvx_pushes_failed_total", "prefill: pushes that failed after their claim"),
    "registrations_failed": ("vllm:kvx_registrations_failed_total",
                             "decode, under llm-d: reservations the prefill engine's bootstrap "
                             "server refused or did not answer"),
}

#: Claims refused, by class of reason (the ``reason`` label).
REFUSED = ("vllm:kvx_claims_refused_total",
           "prefill: requests that ran without a push, by reason: grant_timeout, "
           "no_registration, decode_ended, refused (by the decode engine)")
REFUSED_PREFIX = "refused:"

#: Gauges: data key → (metric, help).
GAUGES: Dict[str, Tuple[str, str]] = {
    "now_reserved_blocks": ("vllm:kvx_reserved_blocks",
                            "decode: blocks reserved for KV that has not arrived yet"),
    "now_waiting_claims": ("vllm:kvx_waiting_claims",
                           "prefill: requests held until their decode engine grants (or, under "
                           "llm-d, registers) their reservation"),
}


def refusal_class(reason: str) -> str:
    """The ``reason`` label of a refused claim (a few values, never the text itself)."""
    if "granted no blocks within" in reason:
        return "grant_timeout"
    if "registered" in reason or "bootstrap" in reason:
        return "no_registration"
    if "ended before" in reason:
        return "decode_ended"
    return "refused"


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> Dict[str, Any]:
    """Two steps' or two workers' data as one: samples joined, counts summed, a gauge's
    latest value kept."""
    out = dict(a)
    for key, value in b.items():
        if key.endswith("_s"):
            out[key] = list(out.get(key, ())) + list(value)
        elif key.startswith("now_"):
            out[key] = value
        else:
            out[key] = out.get(key, 0) + value
    return out


class Signals:
    """One scheduler side's part: phase timings by request, refusals, a gauge that is
    reported when it changes. ``take`` hands over what gathered since the last call."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._started: Dict[Tuple[str, str], float] = {}
        self._data: Dict[str, Any] = {}
        self._gauges: Dict[str, float] = {}

    def start(self, phase: str, rid: str) -> None:
        self._started.setdefault((phase, rid), self.clock())

    def end(self, phase: str, rid: str) -> None:
        """Records the phase's duration for ``rid``, if it was started."""
        began = self._started.pop((phase, rid), None)
        if began is not None:
            self._data.setdefault(phase, []).append(max(0.0, self.clock() - began))

    def drop(self, rid: str) -> None:
        """``rid`` ended: its phases still open are not measured."""
        for key in [k for k in self._started if k[1] == rid]:
            del self._started[key]

    def count(self, key: str, n: int = 1) -> None:
        self._data[key] = self._data.get(key, 0) + n

    def refused(self, reason: str) -> None:
        self.count(REFUSED_PREFIX + refusal_class(reason))

    def gauge(self, key: str, value: float) -> None:
        if self._gauges.get(key) != value:
            self._gauges[key] = value
            self._data[key] = value

    def take(self) -> Dict[str, Any]:
        data, self._data = self._data, {}
        return data


def samples(data: Mapping[str, Any]) -> List[Tuple[str, List[float]]]:
    """The histogram samples in ``data``: (data key, seconds)."""
    return [(k, list(v)) for k, v in data.items() if k in HISTOGRAMS and v]
