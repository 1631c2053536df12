"""The one reader of kvx settings in a serving stack's configuration (``kvx._settings``), which
``kvx.lmcache`` and ``kvx.vllm`` both use: every refusal names the key, nothing is guessed."""

from __future__ import annotations

import math

import pytest

from kvx._settings import describe, read_keys

KEYS = {
    "kvx_on": (bool, True, "a switch"),
    "kvx_count": (int, 3, "a count"),
    "kvx_wait": (float, 1.5, "seconds"),
    "kvx_file": (str, None, "an optional file"),
}


class Refused(ValueError):
    pass


def read(**given):
    return read_keys(given, KEYS, "extra", Refused, own_prefix="kvx_")


def test_defaults_fill_in_and_text_from_a_file_is_read():
    assert read() == {"kvx_on": True, "kvx_count": 3, "kvx_wait": 1.5, "kvx_file": None}
    got = read(kvx_on="FALSE", kvx_count="7", kvx_wait="0.25", kvx_file="/k", other_component=1)
    assert got == {"kvx_on": False, "kvx_count": 7, "kvx_wait": 0.25, "kvx_file": "/k"}


@pytest.mark.parametrize(
    "key, value",
    [
        ("kvx_on", "yes"),
        ("kvx_on", 1),
        ("kvx_on", "tru"),
        ("kvx_count", True),
        ("kvx_count", "three"),
        ("kvx_count", 2.5),
        ("kvx_wait", 0),
        ("kvx_wait", -1),
        ("kvx_wait", math.inf),
        ("kvx_wait", math.nan),
        ("kvx_wait", False),
        ("kvx_wait", "soon"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_naming_the_key(key, value):
    with pytest.raises(Refused, match=f"extra {key}="):
        read(**{key: value})


def test_an_unknown_key_of_ours_is_refused_with_the_known_ones():
    with pytest.raises(Refused, match="kvx_cont.*known: kvx_count, kvx_file, kvx_on, kvx_wait"):
        read(kvx_cont=1)


def test_describe_lists_every_key_with_its_default():
    assert describe(KEYS)[0] == "kvx_on (default True): a switch"


def test_the_protocols_settings_are_written_once_for_both_integrations():
    """``kvx.lmcache``'s ``kvx_*`` keys and ``kvx.vllm``'s keys that are protocol settings
    come from one table (``PROTOCOL_KEYS``): the same type and default under either name,
    the default the native module's, and a meaning in each integration's words."""
    import kvx
    from kvx._settings import PROTOCOL_KEYS
    from kvx.lmcache.settings import KVX_EXTRA_KEYS
    from kvx.vllm.settings import EXTRA_KEYS

    native = kvx.defaults()
    assert PROTOCOL_KEYS["checksums"][1] == native["sender"]["checksums"] == native["receiver"]["require_checksums"]
    assert PROTOCOL_KEYS["reply_timeout_sec"][1] == native["sender"]["reply_timeout"]
    shared = 0
    for table, prefix, words in ((KVX_EXTRA_KEYS, "kvx_", ("sender", "receiver")),
                                 (EXTRA_KEYS, "", ("prefill", "decode"))):
        for key, (kind, default, meaning) in table.items():
            name = key[len(prefix):]
            if name in PROTOCOL_KEYS:
                shared += 1
                assert (kind, default) == PROTOCOL_KEYS[name][:2], key
                assert "{" not in meaning, f"{key}: {meaning}"
        sides = " ".join(m for _, _, m in table.values())
        assert all(w in sides for w in words)
    both = {k[4:] for k in KVX_EXTRA_KEYS if k[4:] in PROTOCOL_KEYS} & set(EXTRA_KEYS)
    assert {"checksums", "reply_timeout_sec", "write_timeout_sec", "connect_timeout_sec",
            "curve_secret_key", "curve_allow", "curve_server_key"} <= both
    assert shared >= 2 * len(both)
