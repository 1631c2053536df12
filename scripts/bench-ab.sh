#!/usr/bin/env bash
# `kvx bench --fabric F --json` of this tree's kvx and of a baseline kvx binary, in turn, for
# ROUNDS rounds (so the two share the machine's conditions), then the medians and the
# per-round ratios. The figures of docs/PERFORMANCE.md "Integrity: what the checks cost".
#   bash scripts/bench-ab.sh BASELINE_KVX ROUNDS [FABRIC...]     (fabrics: tcp shm, default both)
#   KVX_AB_COMMAND=demo: `kvx demo` instead (the whole path: ZeroMQ, the drivers, the fabric;
#   rates and request latency), e.g. to weigh a change above the fabrics.
#   e.g. git worktree add --detach /tmp/base f310fba && (cd /tmp/base && cargo build --release -p kvx)
#        bash scripts/bench-ab.sh /tmp/base/target/release/kvx 10
set -euo pipefail
cd "$(dirname "$0")/.."
command=${KVX_AB_COMMAND:-bench}
[[ $command == bench || $command == demo ]] || { echo "KVX_AB_COMMAND: bench or demo" >&2; exit 2; }
base=$1
rounds=$2
shift 2
fabrics=("$@")
[[ ${#fabrics[@]} -gt 0 ]] || fabrics=(tcp shm)
cargo build --release -q -p kvx
ours=./target/release/kvx
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  for f in "${fabrics[@]}"; do
    # Which binary goes first alternates, so neither always follows the other.
    if ((r % 2)); then order=("$base" "$ours"); else order=("$ours" "$base"); fi
    for bin in "${order[@]}"; do
      side=ours
      [[ $bin == "$base" ]] && side=base
      echo "$r $f $side $("$bin" "$command" --fabric "$f" --json 2>/dev/null)" >>"$out"
    done
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    r, f, side, j = line.split(" ", 3)
    d = json.loads(j)
    rows.setdefault((f, int(r)), {})[side] = d
for f in sorted({f for f, _ in rows}):
    rounds = sorted(r for g, r in rows if g == f)
    ours = [rows[f, r]["ours"] for r in rounds]
    base = [rows[f, r]["base"] for r in rounds]
    gb = lambda ds: [d["bytes_per_sec"] / 1e9 for d in ds]
    vs_build = [o["bytes_per_sec"] / b["bytes_per_sec"] for o, b in zip(ours, base)]
    med = statistics.median
    print(f"{f}: ours {med(gb(ours)):.2f} GB/s ({min(gb(ours)):.2f}-{max(gb(ours)):.2f}), "
          f"baseline build {med(gb(base)):.2f} ({min(gb(base)):.2f}-{max(gb(base)):.2f}); "
          f"ours/baseline build per round: median {med(vs_build):.2f} "
          f"({min(vs_build):.2f}-{max(vs_build):.2f}), ratio of medians {med(gb(ours)) / med(gb(base)):.2f}")
    if "ratio" not in ours[0]:
        p50 = lambda ds: [d["request_latency_ms_p50"] for d in ds]
        lat = [o / b for o, b in zip(p50(ours), p50(base))]
        print(f"{f}: request p50 ours {med(p50(ours)):.1f} ms, baseline build {med(p50(base)):.1f} ms; "
              f"ours/baseline build per round: median {med(lat):.2f} ({min(lat):.2f}-{max(lat):.2f})")
        continue
    vs_own = [o["ratio"] for o in ours]
    base_own = [b["ratio"] for b in base]
    print(f"{f}: against the bench's own baseline ({ours[0]['baseline']}): ours median "
          f"{med(vs_own):.2f} ({min(vs_own):.2f}-{max(vs_own):.2f}), baseline build median "
          f"{med(base_own):.2f} ({min(base_own):.2f}-{max(base_own):.2f})")
PY
