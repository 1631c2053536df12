"""One set of defaults: kvx.Receiver, kvx.Sender and kvx.Proxy take ``None`` for kvx's default
of each protocol setting, and kvx.ReceiverConfig, kvx.SenderConfig and kvx.lmcache's ``kvx_*``
keys state exactly the native module's defaults (``kvx.defaults()``, the core's); a config's
kwargs build the object."""

import dataclasses
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

import kvx

NATIVE = kvx.defaults()

#: A Python name → the core's field, where they differ.
CORE_NAME = {"failure_notices": "notify_proxy_on_failure"}


@pytest.mark.parametrize(
    "config, native, role",
    [(kvx.SenderConfig, kvx.Sender, "sender"), (kvx.ReceiverConfig, kvx.Receiver, "receiver")],
)
def test_each_field_is_a_keyword_and_defaults_to_the_native_default(config, native, role):
    params = inspect.signature(native).parameters
    for field in dataclasses.fields(config):
        assert field.name in params, f"{native.__name__} has no parameter {field.name}"
        assert params[field.name].default is None, f"{native.__name__}({field.name}=None)"
        core = NATIVE[role][CORE_NAME.get(field.name, field.name)]
        assert field.default == core and type(field.default) is type(core), (
            f"{config.__name__}.{field.name} = {field.default!r}, kvx's default is {core!r}"
        )


def test_the_proxy_and_connect_defaults_are_the_native_ones():
    params = inspect.signature(kvx.Proxy).parameters
    assert params["kv_ready_timeout"].default is None
    connect = inspect.signature(kvx.Sender.add_receiver).parameters["timeout"].default
    assert connect == NATIVE["node"]["connect_timeout"]


def _lmcache_settings():
    """kvx/lmcache/settings.py on its own: it needs only the native module, while importing
    the kvx.lmcache package needs LMCache and torch."""
    path = Path(kvx.__file__).parent / "lmcache" / "settings.py"
    spec = importlib.util.spec_from_file_location("kvx_lmcache_settings", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses resolve their annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_lmcache_keys_default_to_the_native_defaults():
    settings = _lmcache_settings()
    keys = {name: default for name, (_, default, _) in settings.KVX_EXTRA_KEYS.items()}
    expected = {
        "kvx_peer_share_percent": NATIVE["receiver"]["peer_share_percent"],
        "kvx_unconsumed_ttl_sec": NATIVE["receiver"]["unconsumed_ttl"],
        "kvx_checksums": NATIVE["sender"]["checksums"],
        "kvx_failure_notices": NATIVE["sender"]["notify_proxy_on_failure"],
        "kvx_reply_timeout_sec": NATIVE["sender"]["reply_timeout"],
        "kvx_write_timeout_sec": NATIVE["sender"]["write_timeout"],
        "kvx_connect_timeout_sec": NATIVE["node"]["connect_timeout"],
    }
    for name, default in expected.items():
        assert keys[name] == default, f"{name} defaults to {keys[name]!r}, kvx's is {default!r}"
    # One key sets both sides' checksums: their native defaults must agree.
    assert NATIVE["sender"]["checksums"] == NATIVE["receiver"]["require_checksums"]
    # LMCache's unbounded pd_allocation_timeout_sec becomes each side's own default wait.
    assert settings.default_allocation_timeout("receiver") == NATIVE["receiver"]["admission_timeout"]
    assert settings.default_allocation_timeout("sender") == NATIVE["sender"]["staging_timeout"]


def test_a_config_builds_the_objects():
    rx = kvx.Receiver(slots=2, slot_bytes=4096, **kvx.ReceiverConfig(peer_share_percent=100).kwargs())
    tx = kvx.Sender(slots=2, slot_bytes=4096, **kvx.SenderConfig(staging_timeout=1.0).kwargs())
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    tx.begin("c", receiver=peer, total_chunks=2)
    assert tx.wait_admitted("c", timeout=10.0), "a 100 % share admits two of two slots"
    with pytest.raises(ValueError, match="staging_timeout"):
        kvx.Sender(slots=2, slot_bytes=4096, **kvx.SenderConfig(staging_timeout=0.0).kwargs())
    rx.close()


def test_transport_and_fabric_names_come_from_the_native_mapping():
    """One mapping from names to transports and fabrics (``kvx_embed::named``): the names
    this build takes are the native module's, and a wrong one is refused saying what to
    write instead."""
    node = NATIVE["node"]
    assert node["transports"] == ["zmq", "mem"]
    assert node["fabrics"][:3] == ["tcp", "shm", "mem"]
    with pytest.raises(ValueError, match='"zmq"'):
        kvx.Receiver(slots=1, slot_bytes=64, transport="zeromq")
    with pytest.raises(ValueError, match='"shm"'):
        kvx.Receiver(slots=1, slot_bytes=64, fabric="infiniband")


def test_pd_buffer_size_becomes_slots_as_the_binary_maps_it():
    """LMCache's ``pd_buffer_size`` → slots exists once, in Rust (``kvx_embed::lmcache``)."""
    from kvx._kvx import lmcache_pd_buffer_slots

    assert lmcache_pd_buffer_slots(64 << 20, 1 << 20) == 64
    assert lmcache_pd_buffer_slots((1 << 20) + 5, 1 << 20) == 1
    with pytest.raises(ValueError, match="pd_buffer_size=100 holds no chunk"):
        lmcache_pd_buffer_slots(100, 4096)
    with pytest.raises(ValueError, match="slots a buffer may have"):
        lmcache_pd_buffer_slots((1 << 20) * 8 + 8, 4)
