#!/usr/bin/env bash
# kvx.vllm's tests against vLLM itself (python/tests/kvx_vllm): vLLM's real v1 Scheduler on CPU
# drives KvxConnector (level (a), docs/vllm.md "Tests"). Installs vllm==0.33.0 (with torch:
# about 9.5 GB, 3-4 minutes from PyPI, once) into a virtual environment, builds the kvx wheel
# as scripts/python-tests.sh does (`maturin build --release`) and installs it there, then runs
# the tests against the installed wheel. KVX_VLLM_MUTANTS=1 also runs scripts/vllm-mutants.py
# (each deliberately broken variant must be caught).
#
#   KVX_VLLM_VENV   the virtual environment (default target/vllm-venv; any path, e.g. one
#                   kept outside the checkout between runs)
#
# Without python3 or PyPI it says so and skips, unless KVX_REQUIRE_PYTHON=1 (CI), where that is
# a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVX_VLLM_VENV:-target/vllm-venv}
wheels=target/vllm-wheel
vllm_req="vllm==0.33.0"
skip() {
  if [[ "${KVX_REQUIRE_PYTHON:-0}" == 1 ]]; then
    echo "vllm tests: $1 (KVX_REQUIRE_PYTHON=1: failing)" >&2
    exit 1
  fi
  echo "vllm tests: skipped: $1"
  exit 0
}
command -v python3 >/dev/null || skip "no python3"
if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv" 2>/dev/null || skip "python3 cannot make a virtual environment (apt install python3-venv)"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }
start=$SECONDS
# vLLM only when the environment lacks this exact version (a reinstall resolves torch anew).
if [[ $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("vllm"))' 2>/dev/null) != "${vllm_req#vllm==}" ]]; then
  pip install --quiet "$vllm_req" || skip "cannot install $vllm_req from PyPI"
fi
maturin_req=$(sed -n 's/^requires = \["\(maturin[^"]*\)"\]$/\1/p' pyproject.toml)
[[ -n $maturin_req ]] || { echo "vllm tests: no maturin requirement in pyproject.toml" >&2; exit 1; }
pip install --quiet "$maturin_req" pytest || skip "cannot install maturin and pytest from PyPI"
echo "vllm tests: environment ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"
# The wheel directory holds this build's wheel only, so the glob names exactly one file.
start=$SECONDS
rm -rf "$wheels"
"$venv/bin/maturin" build --release --quiet --interpreter "$venv/bin/python" --out "$wheels"
wheel=("$wheels"/kvx-*.whl)
[[ ${#wheel[@]} == 1 && -f ${wheel[0]} ]] || { echo "vllm tests: expected one wheel in $wheels, found: ${wheel[*]}" >&2; exit 1; }
pip install --quiet --force-reinstall --no-deps "${wheel[0]}"
echo "vllm tests: kvx wheel built and installed in $((SECONDS - start)) s"
# The tests must import the installed wheel, never python/kvx from the checkout.
"$venv/bin/python" - <<'PY' || { echo "vllm tests: kvx is not imported from the installed wheel" >&2; exit 1; }
import pathlib, sysconfig, kvx, kvx.vllm
sites = {pathlib.Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
for module in (kvx, kvx.vllm):
    path = pathlib.Path(module.__file__).resolve()
    assert any(path.is_relative_to(s) for s in sites), f"{module.__name__} from {path}, not from {sites}"
print(f"vllm tests: kvx from {pathlib.Path(kvx.__file__).parent}")
PY
start=$SECONDS
"$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests/kvx_vllm
echo "vllm tests: passed in $((SECONDS - start)) s"
if [[ "${KVX_VLLM_MUTANTS:-0}" == 1 ]]; then
  KVX_VLLM_VENV="$venv" python3 scripts/vllm-mutants.py
fi
