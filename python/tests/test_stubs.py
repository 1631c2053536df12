"""The type stubs (python/kvx/_kvx.pyi) describe the native module as built: every class,
method, parameter and default, checked by mypy's stubtest against the real module."""

import subprocess
import sys

import pytest


def test_the_stubs_match_the_native_module():
    pytest.importorskip("mypy", reason="mypy is needed to check the stubs (pip install mypy)")
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvx._kvx"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_lmcache_backend_type_checks():
    """kvx.lmcache's annotations agree with themselves and with the native module's stubs."""
    pytest.importorskip("lmcache", reason="lmcache is needed for kvx.lmcache")
    type_check("lmcache")


def test_the_vllm_connector_and_router_type_check():
    """kvx.vllm's annotations (the connector, the router) agree with themselves and with the
    native module's stubs; vLLM's own modules are not needed for this."""
    type_check("vllm")


def type_check(subpackage: str) -> None:
    pytest.importorskip("mypy", reason="mypy is needed (pip install mypy)")
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "kvx" / subpackage
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", str(package)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
