#!/usr/bin/env bash
# The whole test suite, the README's one command (CI's gate runs it too, inside .ci/run):
#   1. `cargo test --workspace`: unit, golden-wire, scenario, property, conformance,
#      end-to-end (ZeroMQ + TCP / shared memory) and Python-interop tests;
#   2. the kvx wheel, built once (scripts/build-wheel.sh) for every Python step;
#   3. the kvx Python package's tests (scripts/python-tests.sh: the wheel installed into
#      target/pyenv, run with pytest);
#   4. kvx.vllm's tests against vLLM's real scheduler (scripts/vllm-tests.sh: vllm==0.33.0
#      installed into target/vllm-venv, about 9 GB, once);
#   5. the madsim simulation (sim/, its own cargo project and target directory): its
#      scenario test binary, then a 500-seed swarm sweep with faults.
# The long evidence (every broken variant, kvx.vllm end to end on real engines, the long
# sweeps, fuzzing) is scripts/evidence.sh.
# Needs the Rust toolchain; the Python parts are skipped with a message without python3 and
# PyPI (CI sets KVX_REQUIRE_PYTHON=1, which makes that a failure).
#
#   KVX_FEATURES=rdma   the workspace's tests with the RDMA backend built in (needs cmake and
#                       libclang to build; CI sets it)
#   KVX_TEST_SEEDS=N    the sweep's seeds (default 500)
set -euo pipefail
cd "$(dirname "$0")/.."
# Every skip of the Python steps is written here (python/tests/conftest.py, python-env.sh)
# and named at the end, so a run that skipped something never reads as a full pass.
mkdir -p target
export KVX_SKIP_LOG="$PWD/target/test-skips.txt"
: >"$KVX_SKIP_LOG"
cargo test --workspace ${KVX_FEATURES:+--features "$KVX_FEATURES"}
# One wheel for every Python step; empty (and each step says why it skips) without Python.
KVX_WHEEL=$(bash scripts/build-wheel.sh)
export KVX_WHEEL
bash scripts/python-tests.sh
bash scripts/vllm-tests.sh
(
  cd sim
  export RUSTFLAGS="--cfg madsim --cfg tokio_unstable"
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-../target/sim}"
  cargo test --release --quiet
)
sim/run.sh --seeds "${KVX_TEST_SEEDS:-500}" --faults
if [[ -s $KVX_SKIP_LOG ]]; then
  echo "test.sh: passed, with $(wc -l <"$KVX_SKIP_LOG") skipped ($KVX_SKIP_LOG):"
  sed 's/^/  /' "$KVX_SKIP_LOG"
else
  echo "test.sh: passed, nothing skipped"
fi
