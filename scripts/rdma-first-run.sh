#!/usr/bin/env bash
# The first run of kvx's RDMA fabric on a machine with an RDMA device (docs/operations.md §7):
#   bash scripts/rdma-first-run.sh [OUT_DIR]
# Checks the locked-memory limit first (registered memory is pinned), saves what the run is
# about beside the results (the device, GID table, rdma-core version, memlock limit, network
# interfaces with their MTUs and addresses, the git revision), then runs, each as a step that
# must pass, stopping at a failed build:
#   1. the hardware conformance tests with the defaults (KVX_REQUIRE_RDMA=1: no skipping), one
#      at a time, among them an MTU cap on the receiver only, a staging pool at the most slots
#      the device takes, and a fence after an idle receiver counting Landed notices against Ok
#      completions, and a fence with writes outstanding;
#   2. `kvx bench --fabric rdma` against `kvx bench --fabric tcp` on the same host, and
#      `kvx bench --fabric rdma --checksums off` (the receiver's check is the difference:
#      docs/PERFORMANCE.md, "Over RDMA"; one round each: alternate several for a ratio).
# kvx's own lines about the device (GID chosen, limits, fork safety) are logged at info and
# kept in the step logs and in kvx-device.txt.
# Exits 0 only when every step passed, 1 when one failed (or the memlock limit is too low to
# run), 2 when there is no RDMA device (saying so). KVX_RDMA_DEVICE / KVX_RDMA_GID_INDEX pick
# the device and GID for every step (default: the first device, kvx's GID choice).
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

# Registered memory is pinned: below 64 MiB of locked memory the tests and the bench cannot
# register their buffers (root usually holds CAP_IPC_LOCK, which lifts the limit).
memlock=$(ulimit -l)
echo "locked-memory limit (ulimit -l, KiB): $memlock" >"$out/memlock.txt"
if [[ $memlock != unlimited && $(id -u) -ne 0 && $memlock -lt 65536 ]]; then
  echo "the locked-memory limit is $memlock KiB: registering kvx's buffers pins them and needs" >&2
  echo "more. Raise it for this user (ulimit -l unlimited; /etc/security/limits.conf memlock;" >&2
  echo "LimitMEMLOCK=infinity in a systemd unit; --ulimit memlock=-1 for a container)" >&2
  exit 1
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
{
  uname -a
  echo "git revision: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  git status --short 2>/dev/null | head -20
  echo "rdma-core:"
  if command -v dpkg-query >/dev/null 2>&1; then
    dpkg-query -W rdma-core libibverbs1 ibverbs-providers 2>/dev/null
  elif command -v rpm >/dev/null 2>&1; then
    rpm -q rdma-core libibverbs 2>/dev/null
  fi
  echo "interfaces (MTU, addresses):"
  ip -o link 2>/dev/null | awk '{print $2, $4, $5}'
  ip -br addr 2>/dev/null
} >"$out/host.txt" 2>&1

# The device and GID every step uses, and kvx's own device lines at info.
rdma_flags=()
[[ -n ${KVX_RDMA_DEVICE:-} ]] && rdma_flags+=(--rdma-device "$KVX_RDMA_DEVICE")
[[ -n ${KVX_RDMA_GID_INDEX:-} ]] && rdma_flags+=(--rdma-gid-index "$KVX_RDMA_GID_INDEX")
export RUST_LOG=${RUST_LOG:-kvx_rdma=info,warn}

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
if [[ $failed -ne 0 ]]; then
  echo "the build failed: nothing else runs ($out/build.log)"
  exit 1
fi
# One test at a time: they share the device's completion queue budget and its ports.
step conformance env KVX_REQUIRE_RDMA=1 cargo test --release -p kvx-rdma --features rdma \
  --test conformance_hw -- --nocapture --test-threads=1
step bench-rdma ./target/release/kvx bench --fabric rdma "${rdma_flags[@]}"
step bench-rdma-checksums-off ./target/release/kvx bench --fabric rdma --checksums off "${rdma_flags[@]}"
step bench-tcp ./target/release/kvx bench --fabric tcp
grep -h -e "rdma device opened" -e "rdma GID chosen" -e "fork" "$out"/*.log >"$out/kvx-device.txt" 2>/dev/null || true

echo
grep -h -i -e "GB/s" -e "ratio" "$out"/bench-*.log 2>/dev/null || true
if [[ $failed -ne 0 ]]; then
  echo "a step failed: $out"
  exit 1
fi
echo "every step passed: $out"
exit 0
