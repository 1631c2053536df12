#!/usr/bin/env bash
# Builds and runs the kvx simulation's swarm runner (release, its own target directory).
# Usage: sim/run.sh [kvx-sim arguments]   e.g. sim/run.sh --seeds 1000 --faults
# See docs/sim.md.
set -euo pipefail
cd "$(dirname "$0")"
export RUSTFLAGS="--cfg madsim --cfg tokio_unstable"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-../target/sim}"
cargo build --release --quiet --bin kvx-sim
exec "$CARGO_TARGET_DIR/release/kvx-sim" "$@"
