#!/usr/bin/env bash
# kvx.vllm's host-buffer path with KV in CUDA memory (python/bench/gpu_check.py; docs/vllm.md
# "GPU engines"), on a machine with a CUDA GPU and PyTorch: needs no vLLM and no network.
# Installs the kvx wheel (KVX_WHEEL, default the one in target/wheel/, which
# scripts/build-wheel.sh makes) into a virtual environment that sees the system's torch, names
# the GPU and any RDMA device, and runs the check: every byte of every layer of every layout
# compared on the device, and the copies' and the pipeline's GB/s. Arguments go to
# gpu_check.py (--help). Exits 1 when a byte differs.
#
#   KVX_GPU_VENV   the virtual environment (default target/gpu-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=${KVX_WHEEL:-$(ls target/wheel/kvx-*.whl 2>/dev/null | head -1)}
[[ -n $wheel && -f $wheel ]] || { echo "gpu-check: no kvx wheel (bash scripts/build-wheel.sh makes one)" >&2; exit 2; }
venv=${KVX_GPU_VENV:-target/gpu-venv}
python3 -c 'import torch' || { echo "gpu-check: python3 has no torch" >&2; exit 2; }
[[ -x $venv/bin/python ]] || python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-index --force-reinstall "$wheel"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu-check: GPU /'
fi
if command -v ibv_devices >/dev/null; then
  ibv_devices | sed 's/^/gpu-check: ibv_devices: /'
else
  echo "gpu-check: no ibv_devices here (no RDMA tooling)"
fi
lscpu | grep -E '^(Model name|CPU\(s\)):' | sed 's/^/gpu-check: /'
"$venv/bin/python" python/bench/gpu_check.py "$@"
