#!/usr/bin/env bash
# Runs `kvx demo --json` once per configuration, in turn, for ROUNDS rounds (so the
# configurations share the machine's conditions), printing throughput, latency and CPU per GB.
#   bash scripts/demo-ab.sh ROUNDS "ARGS1" "ARGS2" ...
#   e.g. bash scripts/demo-ab.sh 3 "--staging-chunks 64" "--staging-chunks 8"
# A configuration written "BINARY|ARGS" runs another kvx binary (a baseline build), e.g.
#   bash scripts/demo-ab.sh 3 "/tmp/base/kvx|--fabric shm" "--fabric shm"
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p kvx
rounds=$1
shift
out=$(mktemp)
times=$(mktemp)
trap 'rm -f "$out" "$times"' EXIT
for _ in $(seq 1 "$rounds"); do
  for args in "$@"; do
    bin=./target/release/kvx
    flags=$args
    if [[ $args == *"|"* ]]; then
      bin=${args%%|*}
      flags=${args#*|}
    fi
    # shellcheck disable=SC2086 # FLAGS are meant to split into flags
    /usr/bin/time -f "%U %S" -o "$times" "$bin" demo --json $flags >"$out" 2>/dev/null
    python3 - "$args" "$out" "$times" <<'PY'
import json, sys
args, out, times = sys.argv[1:]
d = json.load(open(out))
# A baseline build may predate a field: it shows as nan.
d.setdefault("request_latency_ms_p50", float("nan"))
d.setdefault("request_latency_ms_p99", float("nan"))
d.setdefault("transfer_ms_p99", d.get("latency_ms_p99", float("nan")))
user, system = map(float, open(times).read().split()[-2:])
print(f"{args:45s} {d['bytes_per_sec'] / 1e9:5.2f} GB/s  p50 {d['request_latency_ms_p50']:6.1f} ms  "
      f"p99 {d['request_latency_ms_p99']:6.1f} ms  transfer p99 {d['transfer_ms_p99']:6.1f} ms  CPU/GB {(user + system) / (d['bytes_verified'] / 1e9):.3f}  "
      f"complete={d['requests_completed'] == d['requests_total']}")
PY
  done
done
