#!/usr/bin/env bash
# The long evidence, beside CI's gate (.ci/run): what takes too long to run on every
# commit but must hold before an issue is called resolved.
#
#   rust-variants     every broken variant of scripts/mutants.py caught
#   curve-variants    every broken variant of the CURVE mechanism caught (mutants.py --curve)
#   lmcache-variants  every broken variant of kvx.lmcache caught, against LMCache's classes
#   vllm-variants     every broken variant of kvx.vllm caught, against vLLM's scheduler
#   vllm-e2e          kvx.vllm end to end on real CPU vLLM engines (scripts/vllm-e2e.sh)
#   fault-matrix      every fault at every state of a request on real engines, each in a
#                     network namespace, kvx's connector and NIXL's (scripts/fault-matrix.sh;
#                     no kvx cell hangs or answers wrong tokens), then kvx's kill and
#                     preemption rows with 4 requests in flight; its tables go to
#                     target/evidence/fault-matrix*.json
#   fault-pairs       kvx's kill rows with two prefill and two decode engines under llm-d's
#                     sidecar (scripts/fault-matrix.sh --pairs): the faulted requests
#                     recomputed or typed, the other pairs' all correct; its table goes to
#                     target/evidence/fault-pairs.json
#   sim-sweeps        the simulation's long sweeps, determinism, its --break variants
#   fuzz              a fuzz run of every cargo-fuzz target (scripts/fuzz-smoke.sh)
#
# Usage: bash scripts/evidence.sh [PART ...]   (default: every part, in this order)
# Each part's output goes to target/evidence/PART.log; each prints one summary line, and a
# table of them closes the run. Exit status 1 if any part failed. When every part ran and
# passed on a tree without uncommitted changes, the commit is written to
# .ci/evidence-commit: CI's gate then runs only the broken variants whose files changed
# since (scripts/mutant_selection.py). Commit that file.
set -uo pipefail
cd "$(dirname "$0")/.."
# Evidence that cannot run is no evidence: a skip for want of Python, or of root for the
# cross-user tests (which a broken variant may otherwise turn into a silent skip), fails.
# Run it as CI runs, as root.
export KVX_REQUIRE_PYTHON=1 KVX_REQUIRE_CROSS_USER=1
all=(rust-variants curve-variants lmcache-variants vllm-variants vllm-e2e fault-matrix fault-pairs sim-sweeps fuzz)
parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=("${all[@]}")

run_part() {
  case "$1" in
    rust-variants) python3 scripts/mutants.py ;;
    curve-variants) python3 scripts/mutants.py --curve ;;
    lmcache-variants) KVX_MUTANTS=all KVX_MUTANTS_ONLY=1 bash scripts/python-tests.sh ;;
    vllm-variants) KVX_MUTANTS=all KVX_MUTANTS_ONLY=1 bash scripts/vllm-tests.sh ;;
    vllm-e2e) bash scripts/vllm-e2e.sh ;;
    fault-matrix) bash scripts/fault-matrix.sh --out target/evidence/fault-matrix.json &&
      bash scripts/fault-matrix.sh --connectors kvx --faults prefill-killed,decode-killed,prefill-preempted \
        --states mid-push --in-flight 4 --out target/evidence/fault-matrix-in-flight.json ;;
    fault-pairs) bash scripts/fault-matrix.sh --pairs --states computing,mid-push,pushed \
        --out target/evidence/fault-pairs.json ;;
    sim-sweeps) sim/sweeps.sh ;;
    fuzz) SECONDS_PER_TARGET="${SECONDS_PER_TARGET:-45}" bash scripts/fuzz-smoke.sh ;;
    *) echo "no such part: $1 (the parts: ${all[*]})"; return 2 ;;
  esac
}

# A part's one-line result: the count of caught variants or passed tests where its log says.
summary_of() {
  local log=$1
  local caught missed
  # A variant's verdict line begins with its name (what it breaks follows, indented).
  caught=$(grep -cE '^[a-z0-9-]+ +caught' "$log")
  missed=$(grep -cE '^[a-z0-9-]+:? +(MISSED|STALE|ERROR)' "$log")
  if ((caught + missed > 0)); then
    echo "$caught caught, $missed not"
  else
    grep -E '[0-9]+ passed|^fuzz: |Done [0-9]+ runs|cells in [0-9]+ s' "$log" | tail -1 | cut -c1-100
  fi
}

mkdir -p target/evidence
commit=$(git rev-parse HEAD)
clean=$([[ -z $(git status --porcelain) ]] && echo yes || echo no)
failed=0
lines=()
for part in "${parts[@]}"; do
  log="target/evidence/$part.log"
  start=$SECONDS
  echo "== evidence: $part (log: $log)"
  if run_part "$part" >"$log" 2>&1; then status=passed; else status=FAILED; failed=1; fi
  line=$(printf 'evidence: %-17s %-6s in %5d s  %s' "$part" "$status" $((SECONDS - start)) "$(summary_of "$log")")
  echo "$line"
  [[ $status == passed ]] || tail -20 "$log"
  lines+=("$line")
done
echo
echo "== evidence summary (${commit:0:12}, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores)"
printf '%s\n' "${lines[@]}"
if ((failed == 0)) && [[ ${#parts[@]} -eq ${#all[@]} && $clean == yes ]]; then
  echo "$commit" > .ci/evidence-commit
  echo "every part passed on ${commit:0:12}: .ci/evidence-commit records it (commit it)"
fi
exit $failed
