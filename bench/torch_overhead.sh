#!/usr/bin/env bash
# What checkpointing every step costs a PyTorch trainer with ~30 ms steps on CPU:
# bench/torch_overhead.py's CNN (batch norm, SGD nesterov) with StepLR and with OneCycleLR,
# ckpt.torch.Checkpointer against a real ckptd vs no checkpointing, in alternating blocks.
#
# Usage: bench/torch_overhead.sh [--out FILE.json] [--build DIR] [-- ARGS of torch_overhead.py]
#   --out    JSON result (default bench/out/torch_overhead.json):
#            {"runs": [{"scheduler", "step_ms_none", "step_ms_ckpt", "overhead_pct",
#                       "save_ms_p50", "wait_ms_p50", ...}], "config": {...}}
#   --build  build directory (default build-bench; RelWithDebInfo, no tests): only ckptd and
#            the Python module _ckpt are built, for Debian's /usr/bin/python3 (python3-torch).
#   after --: e.g. --iters 10 --rounds 12 --threads 1 --batch 12 --profile
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="$here/bench/out/torch_overhead.json"
build="$here/build-bench"
python=/usr/bin/python3
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown argument $1 (torch_overhead.py's options go after --)" >&2; exit 2 ;;
  esac
done
out="$(realpath -m "$out")"
build="$(realpath -m "$build")"
if ! "$python" -c "import torch" 2>/dev/null; then
  echo "torch_overhead: $python cannot import torch (Debian: apt-get install python3-torch)" >&2
  exit 1
fi

echo "== build ($build: ckptd, _ckpt for $python)"
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_BUILD_TESTS=OFF \
  -DPython3_EXECUTABLE="$python" >/dev/null
ninja -C "$build" -j2 ckptd _ckpt >/dev/null
mkdir -p "$(dirname "$out")"

echo "== torch_overhead ($("$python" -c 'import torch; print("torch", torch.__version__)'))"
# The Python bench starts and removes its daemon and files itself; the cleanup ends it (it
# exits cleanly on SIGTERM) when this script is ended.
. "$here/bench/cleanup.sh"
bench_cleanup_init
PYTHONPATH="$build/python" bench_run "$python" "$here/bench/torch_overhead.py" --ckptd "$build/ckptd" --out "$out" "$@"
