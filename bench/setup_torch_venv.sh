#!/usr/bin/env bash
# Creates the benchmark's Python environment: a venv at .venv-bench (git-ignored through
# .git/info/exclude) with torch from PyPI, for bench/torch_compare.py and the ckpt module.
#
#   bench/setup_torch_venv.sh [PYTHON]      # PYTHON: interpreter to base it on (default python3)
#
# Why the full torch install: PyPI's Linux torch 2.x wheels are CUDA builds. Installed with
# --no-deps (to skip the ~3 GB of nvidia-* packages), `import torch` fails on this CPU-only
# machine with "libcufile.so.0: cannot open shared object file" (torch 2.15.0), because
# libtorch links the CUDA libraries at load time. So the CUDA packages come along; torch then
# runs on the CPU (torch.cuda.is_available() is False). The venv is ~5.4 GB.
# PyTorch's CPU-only wheels live on PyTorch's own index, which this project's machines do
# not reach.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${1:-python3}"
torch_version="${TORCH_VERSION:-2.15.0}"
venv="$here/.venv-bench"

"$python" -m venv "$venv"
exclude="$here/.git/info/exclude"
if [ -d "$here/.git" ] && ! grep -qx '/.venv-bench/' "$exclude" 2>/dev/null; then
  mkdir -p "$(dirname "$exclude")"
  echo '/.venv-bench/' >> "$exclude"
fi
# pytest and safetensors: the torch-2 tests (DCP, DTensor, FSDP2) and the export test run here.
"$venv/bin/pip" install "torch==$torch_version" numpy pytest safetensors
"$venv/bin/python" - <<'PY'
import torch, torch.distributed as dist
x = torch.randn(64, 64)
assert torch.allclose(x @ torch.eye(64), x)
print(f"torch {torch.__version__} imports and runs on CPU; gloo: {dist.is_gloo_available()}")
PY
echo "venv ready: $venv ($(du -sh "$venv" | cut -f1)); build the ckpt module with"
echo "  cmake -S $here -B $here/build -G Ninja -DCKPT_BUILD_PYTHON=ON -DPython3_EXECUTABLE=$venv/bin/python"
echo "  ninja -C $here/build ckptd _ckpt"
echo "and run the tests that need torch 2.x with"
echo "  PYTHONPATH=$here/build/python CKPTD_BINARY=$here/build/ckptd CKPTCTL_BINARY=$here/build/ckptctl \\"
echo "    $venv/bin/python -m pytest -q python/tests/test_dcp.py python/tests/test_torch_layouts.py"
