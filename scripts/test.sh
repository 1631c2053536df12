#!/usr/bin/env bash
# The whole test suite, the README's one command (CI runs it too, inside .ci/run):
#   1. `cargo test --workspace`: unit, golden-wire, scenario, property, conformance,
#      end-to-end (ZeroMQ + TCP / shared memory) and Python-interop tests;
#   2. the madsim simulation (sim/, its own cargo project and target directory): its
#      scenario test binary, then a 500-seed swarm sweep with faults.
# Needs only the Rust toolchain (Python interop is skipped with a message without pyzmq).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
(
  cd sim
  export RUSTFLAGS="--cfg madsim --cfg tokio_unstable"
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-../target/sim}"
  cargo test --release --quiet
)
sim/run.sh --seeds "${KVX_TEST_SEEDS:-500}" --faults
