#!/usr/bin/env bash
# A short fuzz run of every cargo-fuzz target (CI calls this; SECONDS_PER_TARGET overrides).
# Installs cargo-fuzz when missing. Stable toolchain: `--sanitizer none`.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
per_target=${SECONDS_PER_TARGET:-45}
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
# Seed the wire decoder with LMCache's own payloads.
mkdir -p corpus/wire_decode
for f in ../../shared/golden/*.hex; do
  case "$f" in *zmtp_*) continue ;; esac
  xxd -r -p "$f" > "corpus/wire_decode/$(basename "$f" .hex)" 2>/dev/null || python3 -c "import sys; sys.stdout.buffer.write(bytes.fromhex(open('$f').read().strip()))" > "corpus/wire_decode/$(basename "$f" .hex)"
done
for target in wire_decode core_events; do
  echo "fuzz: $target for ${per_target}s"
  cargo fuzz run --sanitizer none "$target" -- -max_total_time="$per_target" -rss_limit_mb=2048
done
