# Sourced (never run) by scripts/build-wheel.sh, python-tests.sh, vllm-tests.sh and
# vllm-e2e.sh: a virtual environment with the kvx wheel installed as users get it. The
# sourcing script sets `label` (how its messages begin) first.
#
#   KVX_REQUIRE_PYTHON=1  a missing python3 or PyPI is a failure, not a skip (CI)
#   KVX_DROP_VENVS=1      each script deletes its environment (and uv's cache) when its last
#                         user is done: CI's disk holds one torch environment at a time
#   KVX_WHEEL=PATH        the kvx wheel to install, built already (scripts/test.sh)
#   KVX_MUTANTS=all|changed  also run the script's broken variants (run_variants)
#   KVX_MUTANTS_ONLY=1    make the environment and run the variants, not the tests
#                         (scripts/evidence.sh)
#
# Packages are installed with uv when `python3 -m uv` answers (CI installs it): it unpacks
# each wheel once into its cache and hard-links it into the environment, so an install needs
# no room for the downloaded archives beside the installed copy (GBs with torch), and it is
# several times faster than pip. Without uv, pip.

skip() {
  if [[ "${KVX_REQUIRE_PYTHON:-0}" == 1 ]]; then
    echo "$label: $1 (KVX_REQUIRE_PYTHON=1: failing)" >&2
    exit 1
  fi
  echo "$label: skipped: $1"
  [[ -n "${KVX_SKIP_LOG:-}" ]] && echo "$label (all of it): $1" >>"$KVX_SKIP_LOG"
  exit 0
}

# venv_make VENV: makes VENV unless it is there, or skips.
venv_make() {
  command -v python3 >/dev/null || skip "no python3"
  if [[ ! -x $1/bin/python ]]; then
    python3 -m venv "$1" 2>/dev/null || skip "python3 cannot make a virtual environment (apt install python3-venv)"
  fi
  df -h "$1" | awk -v label="$label" 'NR == 2 { print label ": " $4 " of disk free" }'
}

# venv_install VENV [INSTALLER OPTIONS] PACKAGE...: installs into VENV; fails as the installer does.
venv_install() {
  local venv=$1
  shift
  if python3 -m uv --version >/dev/null 2>&1; then
    python3 -m uv pip install --quiet --python "$venv/bin/python" "$@"
  else
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
  fi
}

# maturin_requirement: the maturin that pyproject.toml's build-system asks for (one place for
# its version; scripts/build-wheel.sh installs it).
maturin_requirement() {
  local req
  req=$(sed -n 's/^requires = \["\(maturin[^"]*\)"\]$/\1/p' pyproject.toml)
  [[ -n $req ]] || { echo "$label: no maturin requirement in pyproject.toml" >&2; exit 1; }
  echo "$req"
}

# kvx_wheel: the path of the kvx wheel, as users get it (`maturin build --release`, one abi3
# wheel for every CPython >= 3.10): $KVX_WHEEL when set (scripts/test.sh builds it once for
# all its Python steps), else built now by scripts/build-wheel.sh. Empty when it skipped.
kvx_wheel() {
  if [[ -n ${KVX_WHEEL:-} ]]; then
    [[ -f $KVX_WHEEL ]] || { echo "$label: KVX_WHEEL=$KVX_WHEEL is not a file" >&2; exit 1; }
    echo "$KVX_WHEEL"
  else
    bash scripts/build-wheel.sh
  fi
}

# venv_install_kvx VENV MODULE...: installs the kvx wheel (kvx_wheel) into VENV, and checks
# that each MODULE is imported from the installed wheel, never from python/ in the checkout
# (an editable install left over from `maturin develop`, or the source directory on sys.path,
# would hide a file missing from the wheel).
venv_install_kvx() {
  local venv=$1 wheel
  shift
  wheel=$(kvx_wheel)
  [[ -n $wheel ]] || skip "no kvx wheel (scripts/build-wheel.sh said why)"
  # Reinstalled: the version stays the same from build to build; no dependencies: the package
  # has none, and the test tools are installed by the caller.
  if python3 -m uv --version >/dev/null 2>&1; then
    venv_install "$venv" --reinstall --no-deps "$wheel"
  else
    venv_install "$venv" --force-reinstall --no-deps "$wheel"
  fi
  "$venv/bin/python" - "$label" "$@" <<'PY' || { echo "$label: kvx is not imported from the installed wheel" >&2; exit 1; }
import importlib, pathlib, sys, sysconfig
label, modules = sys.argv[1], sys.argv[2:]
sites = {pathlib.Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
for name in modules:
    path = pathlib.Path(importlib.import_module(name).__file__).resolve()
    assert any(path.is_relative_to(s) for s in sites), f"{name} from {path}, not from {sites}"
print(f"{label}: kvx from {pathlib.Path(importlib.import_module('kvx').__file__).parent}")
PY
}

# venv_drop VENV: with KVX_DROP_VENVS=1, deletes VENV and uv's cache (its files are VENV's,
# hard-linked).
venv_drop() {
  [[ "${KVX_DROP_VENVS:-0}" == 1 ]] || return 0
  rm -rf "$1"
  if python3 -m uv --version >/dev/null 2>&1; then
    python3 -m uv cache clean --quiet >/dev/null 2>&1 || true
  fi
  df -h . | awk -v label="$label" 'NR == 2 { print label ": environment deleted, " $4 " of disk free" }'
}

# run_variants SCRIPT [ENV=VALUE ...]: runs the broken-variant table SCRIPT (scripts/*-mutants.py)
# as KVX_MUTANTS asks: `all` every variant, `changed` every pattern checked and the variants
# whose file changed since the last full evidence run (scripts/mutant_selection.py); unset,
# none.
run_variants() {
  local script=$1
  shift
  case "${KVX_MUTANTS:-}" in
    "") return 0 ;;
    all) env "$@" python3 "$script" ;;
    changed) env "$@" python3 "$script" --changed ;;
    *) echo "$label: KVX_MUTANTS=$KVX_MUTANTS: expected all or changed" >&2; exit 1 ;;
  esac
}
