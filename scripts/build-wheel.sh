#!/usr/bin/env bash
# Builds the kvx wheel as users get it (`maturin build --release`: one abi3 wheel for every
# CPython >= 3.10) into target/wheel and prints its path, the only line on standard output;
# messages go to standard error. maturin comes from a small environment of its own
# (target/maturin-venv) and builds against that environment's interpreter, whichever test
# environment installs the wheel, so a second build of unchanged sources compiles nothing.
# Without python3 or PyPI it prints no path and says why, unless KVX_REQUIRE_PYTHON=1, where
# that is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 3>&1 1>&2
label="kvx wheel"
source scripts/python-env.sh
venv="$PWD/target/maturin-venv"
venv_make "$venv"
venv_install "$venv" "$(maturin_requirement)" || skip "cannot install $(maturin_requirement) from PyPI"
start=$SECONDS
# The folder holds this build's wheel only, so the glob names exactly one file.
rm -rf target/wheel
"$venv/bin/maturin" build --release --quiet --interpreter "$venv/bin/python" --out target/wheel
wheel=(target/wheel/kvx-*.whl)
[[ ${#wheel[@]} == 1 && -f ${wheel[0]} ]] || { echo "$label: expected one wheel in target/wheel, found: ${wheel[*]}"; exit 1; }
echo "$label: ${wheel[0]} built in $((SECONDS - start)) s"
echo "$PWD/${wheel[0]}" >&3
