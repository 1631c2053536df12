#!/usr/bin/env bash
# The first run of kvx's RDMA fabric on a machine with an RDMA device (docs/operations.md §7):
#   bash scripts/rdma-first-run.sh [OUT_DIR]
# Saves the device's description beside the results, then runs, each as a step that must pass:
#   1. the hardware conformance tests with the defaults (KVX_REQUIRE_RDMA=1: no skipping),
#      among them an MTU cap on the receiver only, a staging pool at the device's max_qp_wr,
#      and a fence after an idle receiver counting Landed notices against Ok completions;
#   2. `kvx bench --fabric rdma` against `kvx bench --fabric tcp` on the same host.
# Exits 0 only when every step passed, 1 when one failed, 2 when there is no RDMA device
# (saying so). KVX_RDMA_DEVICE / KVX_RDMA_GID_INDEX pick the device and GID (default: the
# first device, kvx's GID choice).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/rdma-first-run/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
echo "results in $out"

if ! command -v ibv_devinfo >/dev/null 2>&1; then
  echo "no RDMA device: ibv_devinfo is not installed (apt install ibverbs-utils rdma-core)" >&2
  exit 2
fi
if ! ibv_devinfo -l 2>/dev/null | grep -qv -e '^[0-9]* HCAs\? found' -e '^$'; then
  echo "no RDMA device: ibv_devinfo lists none (no NIC, or its driver is not loaded)" >&2
  exit 2
fi

# What the run is about, kept with its results.
ibv_devinfo -v >"$out/ibv_devinfo.txt" 2>&1
{
  if command -v show_gids >/dev/null 2>&1; then
    show_gids
  else
    for gid in /sys/class/infiniband/*/ports/*/gids/*; do
      value=$(cat "$gid" 2>/dev/null) || continue
      [[ $value == 0000:0000:0000:0000:0000:0000:0000:0000 ]] && continue
      type=${gid/\/gids\//\/gid_attrs\/types\/}
      ndev=${gid/\/gids\//\/gid_attrs\/ndevs\/}
      echo "$gid $value $(cat "$type" 2>/dev/null) $(cat "$ndev" 2>/dev/null)"
    done
  fi
} >"$out/gids.txt" 2>&1
uname -a >"$out/host.txt"

failed=0
step() {
  local name=$1
  shift
  echo "== $name"
  if "$@" >"$out/$name.log" 2>&1; then
    echo "   passed"
  else
    echo "   FAILED (see $out/$name.log)"
    failed=1
  fi
}

step build cargo build --release --features rdma -p kvx
step conformance env KVX_REQUIRE_RDMA=1 cargo test --release -p kvx-rdma --features rdma \
  --test conformance_hw -- --nocapture
step bench-rdma ./target/release/kvx bench --fabric rdma
step bench-tcp ./target/release/kvx bench --fabric tcp

echo
grep -h -i -e "GB/s" -e "ratio" "$out"/bench-*.log 2>/dev/null || true
if [[ $failed -ne 0 ]]; then
  echo "a step failed: $out"
  exit 1
fi
echo "every step passed: $out"
exit 0
