"""kvx.SenderConfig and kvx.ReceiverConfig stay in step with the native constructors: every
field is a keyword parameter of the same name and default, and a config's kwargs build the
object."""

import dataclasses
import inspect

import pytest

import kvx


@pytest.mark.parametrize(
    "config, native", [(kvx.SenderConfig, kvx.Sender), (kvx.ReceiverConfig, kvx.Receiver)]
)
def test_each_field_is_a_keyword_with_the_same_default(config, native):
    params = inspect.signature(native).parameters
    for field in dataclasses.fields(config):
        assert field.name in params, f"{native.__name__} has no parameter {field.name}"
        assert params[field.name].default == field.default, field.name


def test_a_config_builds_the_objects():
    rx = kvx.Receiver(slots=2, slot_bytes=4096, **kvx.ReceiverConfig(peer_share_percent=100).kwargs())
    tx = kvx.Sender(slots=2, slot_bytes=4096, **kvx.SenderConfig(staging_timeout=1.0).kwargs())
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    tx.begin("c", receiver=peer, total_chunks=2)
    assert tx.wait_admitted("c", timeout=10.0), "a 100 % share admits two of two slots"
    with pytest.raises(ValueError, match="staging_timeout"):
        kvx.Sender(slots=2, slot_bytes=4096, **kvx.SenderConfig(staging_timeout=0.0).kwargs())
    rx.close()
