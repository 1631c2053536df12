"""CURVE from Python: ``kvx.Receiver``, ``kvx.Sender`` and ``kvx.Proxy`` given certificates
(pyzmq's ``zmq.auth`` writes them here; ``kvx keygen`` writes the same files) deliver a request
with its notice; a sender without keys, or with a key off the allow-list, is refused with the
reason (``kvx.RefusedError``, not an identity refusal); a half-given pair or a public
certificate where the secret one belongs is a ``ValueError`` naming it; and kvx.lmcache's
``kvx_curve_*`` keys reach the objects."""

import importlib.util
import sys
from pathlib import Path

import pytest

import kvx

zmq_auth = pytest.importorskip("zmq.auth", reason="pyzmq writes the certificates")

SLOT = 1024
WAIT = 10.0


@pytest.fixture
def certs(tmp_path):
    """server.key(_secret); allowed/prefill.key(_secret); others/stranger.key(_secret)."""
    for sub in ("allowed", "others"):
        (tmp_path / sub).mkdir()
    zmq_auth.create_certificates(str(tmp_path), "server")
    zmq_auth.create_certificates(str(tmp_path / "allowed"), "prefill")
    zmq_auth.create_certificates(str(tmp_path / "others"), "stranger")
    return tmp_path


def test_a_curve_sender_delivers_to_a_curve_receiver_and_proxy(certs):
    server = {"curve_secret_key": certs / "server.key_secret", "curve_allow": certs / "allowed"}
    rx = kvx.Receiver(slots=2, slot_bytes=SLOT, **server)
    proxy = kvx.Proxy(**server)
    tx = kvx.Sender(
        slots=2,
        slot_bytes=SLOT,
        proxy=proxy.endpoint,
        curve_secret_key=str(certs / "allowed" / "prefill.key_secret"),
        curve_server_key=str(certs / "server.key"),
    )
    waiting = proxy.expect("c")
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    tx.begin("c", receiver=peer, total_chunks=1)
    assert tx.wait_admitted("c", timeout=WAIT)
    slot = tx.allocate("c", timeout=WAIT)
    slot.write(b"\x07" * SLOT)
    tx.add(slot, "c@0", tokens=256)
    tx.submit("c", last=True)
    tx.wait_outcome("c", timeout=WAIT)
    waiting.wait(timeout=WAIT)
    leases = rx.next_ready(max=1, timeout=WAIT)
    assert [lease.req_id for lease in leases] == ["c"]
    with leases[0] as lease:
        assert bytes(lease.views()[0]) == b"\x07" * SLOT
    rx.close()


@pytest.mark.parametrize("keys", ["none", "stranger"])
def test_a_sender_without_an_allowed_key_is_refused_with_the_reason(certs, keys):
    rx = kvx.Receiver(
        slots=2,
        slot_bytes=SLOT,
        curve_secret_key=certs / "server.key_secret",
        curve_allow=certs / "allowed",
    )
    given = {} if keys == "none" else {
        "curve_secret_key": certs / "others" / "stranger.key_secret",
        "curve_server_key": certs / "server.key",
    }
    tx = kvx.Sender(slots=2, slot_bytes=SLOT, **given)
    with pytest.raises(kvx.RefusedError, match="CURVE") as refused:
        tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint, timeout=5.0)
    assert not isinstance(refused.value, kvx.IdentityRefusedError)
    assert ("NULL" if keys == "none" else "allow-list") in str(refused.value)
    rx.close()


def test_bad_curve_settings_are_value_errors_naming_them(certs):
    with pytest.raises(ValueError, match="curve_allow"):
        kvx.Receiver(slots=2, slot_bytes=SLOT, curve_secret_key=certs / "server.key_secret")
    with pytest.raises(ValueError, match="no secret-key"):
        kvx.Receiver(
            slots=2, slot_bytes=SLOT, curve_secret_key=certs / "server.key", curve_allow=certs
        )
    with pytest.raises(ValueError, match="curve_server_key"):
        kvx.Sender(slots=2, slot_bytes=SLOT, curve_secret_key=certs / "server.key_secret")
    with pytest.raises(ValueError, match="zmq"):
        kvx.Sender(
            slots=2,
            slot_bytes=SLOT,
            transport="mem",
            fabric="mem",
            curve_secret_key=certs / "server.key_secret",
            curve_server_key=certs / "server.key",
        )


def test_the_lmcache_curve_keys_are_optional_paths():
    # kvx/lmcache/settings.py on its own: the kvx.lmcache package needs LMCache and torch.
    path = Path(kvx.__file__).parent / "lmcache" / "settings.py"
    spec = importlib.util.spec_from_file_location("kvx_lmcache_settings_curve", path)
    assert spec is not None and spec.loader is not None
    settings = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = settings
    spec.loader.exec_module(settings)
    for name in ("kvx_curve_secret_key", "kvx_curve_allow", "kvx_curve_server_key"):
        assert settings.KVX_EXTRA_KEYS[name][1] is None, f"{name}: unset by default (NULL)"

    class Config:
        extra_config = {"kvx_curve_secret_key": "/etc/kvx/r.key_secret"}

    extra = settings._extra(Config())
    assert extra["kvx_curve_secret_key"] == "/etc/kvx/r.key_secret"
    assert extra["kvx_curve_allow"] is None


@pytest.mark.parametrize("order", ["reserved first", "claimed first"])
def test_under_curve_an_allowed_principal_without_the_secret_claims_nothing(certs, order):
    """Caller placement under CURVE: another allowed principal (its own key, on the
    allow-list) that knows a reservation's id claims nothing without the secret the
    application handed to the prefill it chose; that prefill's claim then succeeds."""
    zmq_auth.create_certificates(str(certs / "allowed"), "other")
    server = {"curve_secret_key": certs / "server.key_secret", "curve_allow": certs / "allowed"}
    rx = kvx.Receiver(slots=4, slot_bytes=SLOT, placement="caller", **server)

    def sender(name):
        tx = kvx.Sender(
            slots=2,
            slot_bytes=SLOT,
            curve_secret_key=str(certs / "allowed" / f"{name}.key_secret"),
            curve_server_key=str(certs / "server.key"),
        )
        return tx, tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)

    secret = kvx.new_claim_secret()
    other, other_peer = sender("other")
    if order == "reserved first":
        rx.reserve("c", [3], claim_secret=secret)
    other.begin("c", receiver=other_peer, total_chunks=1, claim_secret=kvx.new_claim_secret())
    if order == "claimed first":
        assert not other.wait_admitted("c", timeout=0.2), "a forged claim waits: it proves nothing yet"
        rx.reserve("c", [3], claim_secret=secret)
    with pytest.raises(kvx.RefusedError, match="not its reservation's"):
        other.wait_admitted("c", timeout=WAIT)
    tx, peer = sender("prefill")
    tx.begin("c", receiver=peer, total_chunks=1, claim_secret=secret)
    assert tx.wait_admitted("c", timeout=WAIT)
    slot = tx.allocate("c", timeout=WAIT)
    slot.write(b"\x05" * SLOT)
    tx.add(slot, "c@0", tokens=1)
    tx.submit("c", last=True)
    [lease] = rx.next_ready(max=1, timeout=WAIT)
    assert lease.slots == [3] and bytes(lease.views()[0]) == b"\x05" * SLOT
    lease.consume()
    tx.wait_outcome("c", timeout=WAIT)
    rx.close()
