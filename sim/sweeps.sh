#!/usr/bin/env bash
# The simulation's long evidence (scripts/evidence.sh runs it; see docs/sim.md): a seed sweep
# with faults, one without, determinism, and every deliberately broken `--break` variant
# caught. Builds with --cfg madsim into its own target dir. The short sweep, the scenario
# tests, formatting and clippy of sim/ are CI's gate (.ci/run, scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")"
SEEDS="${KVX_SIM_SEEDS:-2000}"

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
