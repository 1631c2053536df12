#!/usr/bin/env bash
# The end-to-end figures of docs/PERFORMANCE.md, each run next to its baseline in the same
# invocation (this machine is shared and noisy: compare the ratios). Takes about a minute.
#   bash scripts/perf.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
cargo build --release -q -p kvx
kvx=./target/release/kvx
echo "| round | tcp fabric GB/s | tcp baseline GB/s | ratio | shm fabric GB/s | memcpy GB/s | ratio | demo tcp GB/s | request p50 ms | request p99 ms | transfer p99 ms | demo shm GB/s | request p50 ms | request p99 ms | transfer p99 ms |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
  bt=$($kvx bench --fabric tcp --json)
  bs=$($kvx bench --fabric shm --json)
  dt=$($kvx demo --fabric tcp --json 2>/dev/null)
  ds=$($kvx demo --fabric shm --json 2>/dev/null)
  python3 - "$r" "$bt" "$bs" "$dt" "$ds" <<'PY'
import json, sys
r, bt, bs, dt, ds = sys.argv[1], *map(json.loads, sys.argv[2:])
g = lambda x: f"{x / 1e9:.2f}"
print(f"| {r} | {g(bt['bytes_per_sec'])} | {g(bt['baseline_bytes_per_sec'])} | {bt['ratio']:.2f} "
      f"| {g(bs['bytes_per_sec'])} | {g(bs['baseline_bytes_per_sec'])} | {bs['ratio']:.2f} "
      f"| {g(dt['bytes_per_sec'])} | {dt['request_latency_ms_p50']:.1f} | {dt['request_latency_ms_p99']:.1f} | {dt['transfer_ms_p99']:.1f} "
      f"| {g(ds['bytes_per_sec'])} | {ds['request_latency_ms_p50']:.1f} | {ds['request_latency_ms_p99']:.1f} | {ds['transfer_ms_p99']:.1f} |")
PY
done
