"""``KvxConnectorStats``: kvx's counts in vLLM's "KV Transfer metrics" log line, summed over
workers as vLLM aggregates them, reduced to writes per request and bytes per write."""

from __future__ import annotations

import pytest

from kvx.vllm.version import SUPPORTED, installed_version, parse_release

VERSION = installed_version()
if VERSION is None or parse_release(VERSION) not in SUPPORTED:
    pytest.skip("vLLM 0.32 or 0.33 is not installed (scripts/vllm-tests.sh installs vllm==0.33.0)",
                allow_module_level=True)

from kvx.vllm.connector import KvxConnector, KvxConnectorStats  # noqa: E402


def test_counts_of_two_workers_sum_and_reduce_to_per_request_and_per_write_figures():
    a = KvxConnector.build_kv_connector_stats({"pushed": 1, "writes": 6, "write_bytes": 6 * 512})
    b = KvxConnectorStats(data={"pushed": 1, "push_failures": 1, "writes": 3, "write_bytes": 3 * 512})
    total = a.aggregate(b)
    assert total.data == {"pushed": 2, "push_failures": 1, "writes": 9, "write_bytes": 9 * 512}
    assert total.reduce() == {"pushed": 2, "push_failures": 1, "writes": 9, "bytes_per_write": 512.0,
                              "writes_per_request": 3.0}
    assert not total.is_empty()
    assert KvxConnectorStats(data={"received": 0}).is_empty()
    assert KvxConnectorStats(data={"received": 2, "load_failures": 1}).reduce() == {"received": 2, "load_failures": 1}


def test_delivered_pushes_reduce_to_mean_times_and_bytes_per_second():
    stats = KvxConnectorStats(data={"pushed": 2, "writes": 4, "write_bytes": 4 * 1000, "timed_pushes": 2,
                                    "timed_bytes": 4000, "push_us": 8000, "delivery_us": 1000})
    out = stats.reduce()
    assert (out["push_ms"], out["delivery_ms"], out["push_mb_per_s"]) == (4.0, 0.5, 0.5)
