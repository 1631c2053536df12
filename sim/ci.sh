#!/usr/bin/env bash
# The simulation's CI step (called by .ci/run; see docs/sim.md): formatting and clippy of
# sim/, its test binary, a seed sweep with faults, one without, determinism, and every
# deliberately broken variant caught. Builds with --cfg madsim into its own target dir.
set -euo pipefail
cd "$(dirname "$0")"
export RUSTFLAGS="--cfg madsim --cfg tokio_unstable"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-../target/sim}"
SEEDS="${KVX_SIM_SEEDS:-2000}"

cargo fmt --check
cargo clippy --release --all-targets --quiet -- -D warnings
cargo test --release --quiet
./run.sh --seeds "$SEEDS" --faults
./run.sh --seeds 1000 --start 100000
./run.sh --seeds 50 --start 200000 --faults --determinism

# Each broken variant must fail the sweep (exit 1 with a FAIL line naming the rule).
for variant in no-reservation release-before-complete stage-before-admit \
    lock-across-admission no-cancel-release reuse-slot-early no-pending-flush \
    released-while-writes-read; do
    if out=$(./run.sh --seeds 200 --faults --break "$variant" 2>/dev/null); then
        echo "broken variant $variant was NOT caught in 200 seeds"
        exit 1
    fi
    caught=$(grep -m1 '^FAIL seed' <<<"$out" || true)
    if [ -z "$caught" ]; then
        echo "broken variant $variant: the runner failed without a FAIL line:"
        echo "$out"
        exit 1
    fi
    echo "$variant: caught — ${caught:0:160}"
done
