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
