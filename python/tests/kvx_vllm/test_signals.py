"""What kvx's connector adds to vLLM's metrics (``kvx.vllm.signals``): the data each side
gathers, how it adds up over workers and steps, and its export through vLLM's Prometheus
classes (``KvxPromMetrics``, with prometheus_client's own registry). No engine needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fake_transfer import FakeTransfer

from kvx.vllm import signals
from kvx.vllm.plan import Reserve, StepPlan
from kvx.vllm.worker import DecodeWorker


def test_data_adds_up_over_workers_and_steps():
    a = {"push_s": [0.1], "pushed": 1, "now_reserved_blocks": 4, "refused:grant_timeout": 1}
    b = {"push_s": [0.2, 0.3], "pushed": 2, "now_reserved_blocks": 0}
    assert signals.merge(a, b) == {"push_s": [0.1, 0.2, 0.3], "pushed": 3, "now_reserved_blocks": 0,
                                   "refused:grant_timeout": 1}


@pytest.mark.parametrize("reason,label", [
    ("the decode engine granted no blocks within grant_timeout_sec (prefill) (45 s)", "grant_timeout"),
    ("no decode engine registered a reservation within grant_timeout_sec (prefill) (45 s)", "no_registration"),
    ("llm-d's transfer_id needs the bootstrap server: set bootstrap_port (prefill)", "no_registration"),
    ("the decode engine's request ended before it was claimed", "decode_ended"),
    ("receiver tracks 8192 requests already", "refused"),
])
def test_refusal_reasons_become_a_few_labels(reason, label):
    assert signals.refusal_class(reason) == label


def test_phases_gauges_and_refusals_of_one_side():
    now = [0.0]
    s = signals.Signals(lambda: now[0])
    s.start("claim_to_grant_s", "r1")
    s.start("claim_to_grant_s", "r2")
    now[0] = 0.25
    s.end("claim_to_grant_s", "r1")
    s.drop("r2")  # ended before its grant: not measured
    s.end("claim_to_grant_s", "r2")
    s.refused("the decode engine's request ended before it was claimed")
    s.gauge("now_waiting_claims", 3)
    assert s.take() == {"claim_to_grant_s": [0.25], "refused:decode_ended": 1, "now_waiting_claims": 3}
    s.gauge("now_waiting_claims", 3)  # unchanged: not reported again
    assert s.take() == {}
    s.gauge("now_waiting_claims", 0)
    assert s.take() == {"now_waiting_claims": 0}


def test_the_decode_worker_times_each_received_request_from_its_reservation():
    transfer = FakeTransfer()
    worker = DecodeWorker(transfer)
    worker.bind(StepPlan(reserve=[Reserve("r1", "k1", "secret-of-k1-0123456789", 0, (7,), 10),
                                  Reserve("r2", "k2", "secret-of-k2-0123456789", 0, (8,), 10)]))
    worker.clear()
    transfer.complete("k1")
    transfer.fail("k2")
    worker.bind(StepPlan())
    worker.get_finished(set())
    counts = worker.take_counts()
    assert len(counts["reserve_to_received_s"]) == 1 and counts["reserve_to_received_s"][0] >= 0  # k1 only
    assert "reserve_to_received_s" not in worker.take_counts()


def test_the_prometheus_export():
    prometheus_client = pytest.importorskip("prometheus_client")
    pytest.importorskip("vllm")
    from kvx.vllm.connector import KvxConnectorStats, KvxPromMetrics

    registry = prometheus_client.CollectorRegistry()

    def bound(cls):
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):
                kwargs.pop("multiprocess_mode", None)
                super().__init__(*args, registry=registry, **kwargs)
        return Bound

    types = {prometheus_client.Gauge: bound(prometheus_client.Gauge),
             prometheus_client.Counter: bound(prometheus_client.Counter),
             prometheus_client.Histogram: bound(prometheus_client.Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = KvxPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})
    stats = KvxConnectorStats(data={"reserve_to_received_s": [0.003, 0.2], "received": 2,
                                    "refused:grant_timeout": 1, "now_reserved_blocks": 5})
    assert not stats.is_empty() and not KvxConnectorStats(data={"now_reserved_blocks": 0}).is_empty()
    assert KvxConnectorStats(data={}).is_empty()
    prom.observe(stats.data, 0)
    value = lambda name, **labels: registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})
    assert value("vllm:kvx_reserve_to_received_seconds_count") == 2
    assert value("vllm:kvx_reserve_to_received_seconds_bucket", le="0.005") == 1
    assert value("vllm:kvx_loads_received_total") == 2
    assert value("vllm:kvx_claims_refused_total", reason="grant_timeout") == 1
    assert value("vllm:kvx_reserved_blocks") == 5
    # The periodic log line still reads the counts.
    assert stats.reduce()["received"] == 2


def test_the_schedulers_record_their_phases_and_gauges():
    from kvx.vllm import params
    from kvx.vllm.plan import WorkerReport
    from kvx.vllm.scheduler import DecodeScheduler, PrefillScheduler

    now = [0.0]
    p = PrefillScheduler(16, 1, 5.0, clock=lambda: now[0])
    req = SimpleNamespace(request_id="p1", prompt_token_ids=list(range(40)), num_prompt_tokens=40,
                          kv_transfer_params=params.for_prefill("k1", "s" * 32, ["tcp://d:1"], ["tcp://d:2"]))
    p.on_new_request(req)
    empty = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                            num_scheduled_tokens={})
    p.build_connector_meta(empty)
    now[0] = 0.5
    report = WorkerReport()
    report.granted["p1"] += 1
    p.update_connector_output(report, set())
    assert p.signals.take() == {"now_waiting_claims": 1, "claim_to_grant_s": [0.5]}
    d = DecodeScheduler(16)
    d.update_state_after_alloc(SimpleNamespace(request_id="d1", prompt_token_ids=list(range(40)),
                                               kv_transfer_params=params.for_decode("k1", "s" * 32)),
                               SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 40)
    d.build_connector_meta(None)
    assert d.signals.take() == {"now_reserved_blocks": 3}
