#!/usr/bin/env bash
# The kvx Python package's tests (python/tests, pytest), run against the package as users get
# it: a wheel built with `maturin build --release` and pip-installed into a virtual environment
# under target/ (not the source tree). Needs python3 with venv and network access to PyPI the
# first time (maturin, pytest, numpy, pyzmq, msgspec, mypy, and for the LMCache backend's tests
# lmcache==0.5.6 with torch: several GB, once); without them it says so and skips, unless
# KVX_REQUIRE_PYTHON=1 (CI), where that is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyenv
wheels=target/pyenv-wheel
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
# The maturin that pyproject.toml's build-system asks for (one place for its version).
maturin_req=$(sed -n 's/^requires = \["\(maturin[^"]*\)"\]$/\1/p' pyproject.toml)
[[ -n $maturin_req ]] || { echo "python tests: no maturin requirement in pyproject.toml" >&2; exit 1; }
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "$maturin_req" pytest numpy pyzmq msgspec mypy ||
  skip "cannot install maturin, pytest, numpy, pyzmq, msgspec, mypy from PyPI"
# LMCache's own classes, for kvx.lmcache's tests (python/tests/test_lmcache.py skips without).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "lmcache==0.5.6" torch || {
  [[ "${KVX_REQUIRE_PYTHON:-0}" == 1 ]] && { echo "python tests: cannot install lmcache==0.5.6 and torch (KVX_REQUIRE_PYTHON=1: failing)" >&2; exit 1; }
  echo "python tests: lmcache==0.5.6 and torch could not be installed: the LMCache backend's tests skip"
}
# Release: the package's benchmarks and timing-sensitive tests measure the real thing. The
# wheel directory holds this build's wheel only, so the glob below names exactly one file.
rm -rf "$wheels"
"$venv/bin/maturin" build --release --quiet --interpreter "$venv/bin/python" --out "$wheels"
wheel=("$wheels"/kvx-*.whl)
[[ ${#wheel[@]} == 1 && -f ${wheel[0]} ]] || { echo "python tests: expected one wheel in $wheels, found: ${wheel[*]}" >&2; exit 1; }
# --force-reinstall: the version stays the same from build to build; --no-deps: the package
# has none, and the test tools are installed above.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "${wheel[0]}"
# The tests must import the installed wheel, never python/kvx from the checkout (an editable
# install left over from `maturin develop`, or the source directory on sys.path, would hide
# a file missing from the wheel). Checked from the directory pytest runs in.
"$venv/bin/python" - <<'PY' || { echo "python tests: kvx is not imported from the installed wheel" >&2; exit 1; }
import pathlib, sysconfig, kvx, kvx._kvx
sites = {pathlib.Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
for module in (kvx, kvx._kvx):
    path = pathlib.Path(module.__file__).resolve()
    assert any(path.is_relative_to(s) for s in sites), f"{module.__name__} from {path}, not from {sites}"
print(f"python tests: kvx from {pathlib.Path(kvx.__file__).parent}")
PY
# The `kvx` binary, for the tests that talk to a kvx process.
cargo build --release --quiet -p kvx
KVX_BIN="$PWD/target/release/kvx" "$venv/bin/python" -m pytest -q python/tests
