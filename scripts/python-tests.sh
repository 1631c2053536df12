#!/usr/bin/env bash
# The kvx Python package's tests (python/tests, pytest): builds the package into a virtual
# environment under target/ (maturin develop) and runs them. Needs python3 with venv and
# network access to PyPI the first time (maturin, pytest, numpy, pyzmq, msgspec, mypy, and for
# the LMCache backend's tests lmcache==0.5.6 with torch: several GB, once); without them it
# says so and skips, unless KVX_REQUIRE_PYTHON=1 (CI), where that is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyenv
skip() {
  if [[ "${KVX_REQUIRE_PYTHON:-0}" == 1 ]]; then
    echo "python tests: $1 (KVX_REQUIRE_PYTHON=1: failing)" >&2
    exit 1
  fi
  echo "python tests: skipped: $1"
  exit 0
}
command -v python3 >/dev/null || skip "no python3"
if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv" 2>/dev/null || skip "python3 cannot make a virtual environment (apt install python3-venv)"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "maturin>=1.7,<2" pytest numpy pyzmq msgspec mypy ||
  skip "cannot install maturin, pytest, numpy, pyzmq, msgspec, mypy from PyPI"
# LMCache's own classes, for kvx.lmcache's tests (python/tests/test_lmcache.py skips without).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "lmcache==0.5.6" torch || {
  [[ "${KVX_REQUIRE_PYTHON:-0}" == 1 ]] && { echo "python tests: cannot install lmcache==0.5.6 and torch (KVX_REQUIRE_PYTHON=1: failing)" >&2; exit 1; }
  echo "python tests: lmcache==0.5.6 and torch could not be installed: the LMCache backend's tests skip"
}
# Release: the package's benchmarks and timing-sensitive tests measure the real thing.
VIRTUAL_ENV="$PWD/$venv" "$venv/bin/maturin" develop --release --quiet
# The `kvx` binary, for the tests that talk to a kvx process.
cargo build --release --quiet -p kvx
KVX_BIN="$PWD/target/release/kvx" "$venv/bin/python" -m pytest -q python/tests
