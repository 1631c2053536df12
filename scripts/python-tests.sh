#!/usr/bin/env bash
# The kvx Python package's tests (python/tests, pytest), run against the package as users get
# it: a wheel built with `maturin build --release` (scripts/build-wheel.sh) and installed into
# a virtual environment under target/ (not the source tree). Needs python3 with venv and
# network access to PyPI the first time (pytest, numpy, pyzmq, msgspec, mypy, maturin for the
# wheel, and for the LMCache backend's tests
# lmcache==0.5.6 with torch: about 6.5 GB, once); without them it says so and skips, unless
# KVX_REQUIRE_PYTHON=1 (CI), where that is a failure. KVX_MUTANTS=all|changed also runs
# scripts/lmcache-mutants.py (each deliberately broken variant must be caught);
# KVX_DROP_VENVS=1 deletes the environment afterwards (scripts/python-env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
label="python tests"
source scripts/python-env.sh
venv="$PWD/target/pyenv"
venv_make "$venv"
venv_install "$venv" pytest numpy pyzmq msgspec mypy ||
  skip "cannot install pytest, numpy, pyzmq, msgspec, mypy from PyPI"
# LMCache's own classes, for kvx.lmcache's tests (python/tests/test_lmcache.py skips without).
venv_install "$venv" "lmcache==0.5.6" torch || {
  [[ "${KVX_REQUIRE_PYTHON:-0}" == 1 ]] && { echo "$label: cannot install lmcache==0.5.6 and torch (KVX_REQUIRE_PYTHON=1: failing)" >&2; exit 1; }
  echo "$label: lmcache==0.5.6 and torch could not be installed: the LMCache backend's tests skip"
}
# Release: the package's benchmarks and timing-sensitive tests measure the real thing.
venv_install_kvx "$venv" kvx kvx._kvx
if [[ "${KVX_MUTANTS_ONLY:-0}" != 1 ]]; then
  # The `kvx` binary, for the tests that talk to a kvx process.
  cargo build --release --quiet -p kvx
  start=$SECONDS
  # kvx.vllm's modules run in scripts/vllm-tests.sh (with vLLM) and scripts/evidence.sh.
  KVX_BIN="$PWD/target/release/kvx" "$venv/bin/python" -m pytest -q python/tests \
    --ignore=python/tests/kvx_vllm --ignore=python/tests/kvx_vllm_e2e
  echo "$label: passed in $((SECONDS - start)) s"
fi
run_variants scripts/lmcache-mutants.py KVX_PYTHON="$venv/bin/python"
venv_drop "$venv"
