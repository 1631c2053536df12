"""kvx.vllm's settings (``kv_connector_extra_config``) and version check: no vLLM needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvx
from kvx.vllm import settings_from
from kvx.vllm.host_buffer import asks_for_host_buffer
from kvx.vllm.settings import EXTRA_KEYS, ConfigError
from kvx.vllm.version import SUPPORTED_RANGE, UnsupportedVllmError, check_version, parse_release


def cfg(role="kv_consumer", **extra):
    return SimpleNamespace(kv_role=role, engine_id="e1", kv_connector_extra_config=extra)


def test_defaults_are_kvxs_own():
    d = kvx.defaults()
    s = settings_from(cfg())
    assert s.side == "decode" and s.engine_id == "e1"
    assert s.checksums == d["sender"]["checksums"] == d["receiver"]["require_checksums"]
    assert s.reply_timeout_sec == d["sender"]["reply_timeout"]
    assert s.write_timeout_sec == d["sender"]["write_timeout"]
    assert s.grant_timeout_sec == d["sender"]["admission_reply_timeout"]
    assert s.connect_timeout_sec == d["node"]["connect_timeout"]
    assert s.claim_timeout_sec == d["receiver"]["admission_timeout"]
    assert s.idle_timeout_sec == d["receiver"]["request_idle_timeout"]
    assert s.heartbeat_interval_sec == d["node"]["heartbeat_interval"]
    assert s.heartbeat_timeout_sec == d["node"]["heartbeat_timeout"]
    assert settings_from(cfg("kv_producer")).side == "prefill"


def test_heartbeats_are_checked_together():
    s = settings_from(cfg(heartbeat_interval_sec=0.5, heartbeat_timeout_sec="1.5"))
    assert (s.heartbeat_interval_sec, s.heartbeat_timeout_sec) == (0.5, 1.5)
    with pytest.raises(ConfigError, match="heartbeat_timeout_sec=1.0: at least twice"):
        settings_from(cfg(heartbeat_timeout_sec=1.0))


def test_endpoints_per_tp_rank():
    s = settings_from(cfg(host="10.0.0.2", alloc_port=9400, fabric_port=9300))
    assert s.alloc_endpoint(1) == "tcp://10.0.0.2:9401"
    assert s.fabric_endpoint(0) == "tcp://10.0.0.2:9300"


def test_unknown_key_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError) as e:
        settings_from(cfg(chekcsums=True))
    assert "chekcsums" in str(e.value)
    for name in EXTRA_KEYS:
        assert name in str(e.value)


@pytest.mark.parametrize(
    "key,value",
    [
        ("checksums", "yes please"),
        ("checksums", 1),
        ("alloc_port", "eighty"),
        ("alloc_port", 70000),
        ("alloc_port", True),
        ("reply_timeout_sec", 0),
        ("reply_timeout_sec", float("inf")),
        ("grant_timeout_sec", "soon"),
        ("fabric", "shm"),
    ],
)
def test_wrong_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        settings_from(cfg(**{key: value}))


@pytest.mark.parametrize("built_with_rdma", [True, False])
def test_rdma_is_taken_where_the_wheel_has_it_and_refused_naming_the_build_where_not(monkeypatch, built_with_rdma):
    fabrics = ["tcp", "shm", "mem"] + (["rdma"] if built_with_rdma else [])
    defaults = kvx.defaults()
    monkeypatch.setattr(kvx, "defaults", lambda: {**defaults, "node": {**defaults["node"], "fabrics": fabrics}})
    if built_with_rdma:
        s = settings_from(cfg(fabric="rdma"))
        assert s.fabric == "rdma" and asks_for_host_buffer(s) and not asks_for_host_buffer(settings_from(cfg()))
    else:
        with pytest.raises(ConfigError, match=r"fabric='rdma': this kvx was built without RDMA .*--features rdma"):
            settings_from(cfg(fabric="rdma"))


def test_strings_from_a_json_config_are_read():
    s = settings_from(cfg(checksums="false", alloc_port="9400", write_timeout_sec="2.5"))
    assert (s.checksums, s.alloc_port, s.write_timeout_sec) == (False, 9400, 2.5)


@pytest.mark.parametrize("role", ["kv_both", None, "producer"])
def test_roles_other_than_producer_and_consumer_are_refused(role):
    with pytest.raises(ConfigError, match="kv_role"):
        settings_from(cfg(role))


def test_curve_keys_go_together_and_with_their_side():
    with pytest.raises(ConfigError, match="go together"):
        settings_from(cfg(curve_secret_key="/k/d.key_secret"))
    with pytest.raises(ConfigError, match="curve_server_key"):
        settings_from(cfg(curve_secret_key="/k/d.key_secret", curve_server_key="/k/p.key"))
    s = settings_from(cfg("kv_producer", curve_secret_key="/k/p.key_secret", curve_server_key="/k/d.key"))
    assert s.curve_server_key == "/k/d.key"


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.32.1rc1", "0.33.0+cpu"])
def test_supported_versions(version):
    check_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0", "nightly", None])
def test_unsupported_versions_name_the_range(version):
    with pytest.raises(UnsupportedVllmError) as e:
        check_version(version)
    assert SUPPORTED_RANGE in str(e.value)


def test_parse_release():
    assert parse_release("0.33.0") == (0, 33)
    assert parse_release("v0.32.2.dev3") == (0, 32)
    assert parse_release("x") is None


def test_every_setting_is_in_the_docs_table():
    doc = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"
    if not doc.exists():
        pytest.skip("docs/vllm.md is not beside these tests (a copy of python/ only)")
    rows = {line.split("|")[1].strip().strip("`") for line in doc.read_text().splitlines() if line.startswith("| `")}
    assert set(EXTRA_KEYS) <= rows, f"missing from docs/vllm.md: {sorted(set(EXTRA_KEYS) - rows)}"


def test_import_kvx_and_kvx_vllm_do_not_import_vllm():
    code = "import sys, kvx, kvx.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
