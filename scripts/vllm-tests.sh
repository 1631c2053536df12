#!/usr/bin/env bash
# kvx.vllm's tests against vLLM itself (python/tests/kvx_vllm): vLLM's real v1 Scheduler on CPU
# drives KvxConnector (level (a), docs/vllm.md "Tests"). Installs vllm==0.33.0 (with torch:
# about 9 GB, once) into a virtual environment, builds the kvx wheel as
# scripts/python-tests.sh does (scripts/build-wheel.sh) and installs it there, then runs
# the tests against the installed wheel. KVX_MUTANTS=all|changed also runs scripts/vllm-mutants.py
# (each deliberately broken variant must be caught); KVX_DROP_VENVS=1 deletes the environment
# afterwards (scripts/python-env.sh).
#
#   KVX_VLLM_VENV   the virtual environment (default target/vllm-venv; any path, e.g. one
#                   kept outside the checkout between runs)
#
# Without python3 or PyPI it says so and skips, unless KVX_REQUIRE_PYTHON=1 (CI), where that is
# a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
label="vllm tests"
source scripts/python-env.sh
# Absolute: the broken-variant runner starts its Python from another directory.
venv=$(realpath -m "${KVX_VLLM_VENV:-target/vllm-venv}")
vllm_req="vllm==0.33.0"
venv_make "$venv"
start=$SECONDS
# vLLM only when the environment lacks this exact version (a reinstall resolves torch anew).
if [[ $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("vllm"))' 2>/dev/null) != "${vllm_req#vllm==}" ]]; then
  venv_install "$venv" "$vllm_req" || skip "cannot install $vllm_req from PyPI"
fi
venv_install "$venv" pytest || skip "cannot install pytest from PyPI"
echo "$label: environment ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"
start=$SECONDS
venv_install_kvx "$venv" kvx kvx.vllm
echo "$label: kvx wheel installed in $((SECONDS - start)) s"
if [[ "${KVX_MUTANTS_ONLY:-0}" != 1 ]]; then
  start=$SECONDS
  "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests/kvx_vllm
  echo "$label: passed in $((SECONDS - start)) s"
fi
run_variants scripts/vllm-mutants.py KVX_VLLM_VENV="$venv"
venv_drop "$venv"
