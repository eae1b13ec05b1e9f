#!/usr/bin/env bash
# Fetches the CUDA 12 runtime (headers, libcudart_static.a) from PyPI's
# nvidia-cuda-runtime-cu12 wheel into DIR, for a build whose binaries run on NVIDIA drivers
# R525 and newer instead of R580 and newer (see README, GPU requirements):
#   bash scripts/fetch_cuda12_runtime.sh /opt/cuda12-runtime
#   cmake -S . -B build -G Ninja -DCKPT_CUDA_RUNTIME_ROOT=/opt/cuda12-runtime/nvidia/cuda_runtime
set -euo pipefail
dir=${1:?usage: fetch_cuda12_runtime.sh DIR}
version=${CKPT_CUDA12_RUNTIME_VERSION:-12.9.79}
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
  -d "$tmp" "nvidia-cuda-runtime-cu12==$version"
python3 -m zipfile -e "$tmp"/nvidia_cuda_runtime_cu12-*.whl "$dir"
test -f "$dir/nvidia/cuda_runtime/lib/libcudart_static.a"
test -f "$dir/nvidia/cuda_runtime/include/cudaTypedefs.h"
echo "CUDA runtime $version in $dir/nvidia/cuda_runtime"
