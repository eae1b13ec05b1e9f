#!/usr/bin/env bash
# Creates the torch 2.x environment the Python tests run in besides Debian's torch 1.13: a venv
# made from /usr/bin/python3 (so the ckpt module built for that interpreter loads in it, same
# ABI) holding the pinned packages of scripts/torch2-requirements.txt from PyPI.
#
#   scripts/setup_torch2_venv.sh [VENV]     # default: <repo>/.venv-torch2 (git-ignored)
#
# Idempotent: a venv that holds exactly those pins (a stamp written after a complete install)
# and imports them is reused in a few seconds; anything else is rebuilt from scratch, so an
# interrupted install is never mistaken for a good one. Exits non-zero, saying why, when the
# venv cannot be made (no python3-venv, no disk, no PyPI); scripts/test.sh decides whether
# that fails the run (it does under CI=true).
#
# Why the full CUDA wheel on a CPU-only machine: PyPI's Linux torch 2.x wheels are CUDA
# builds, and libtorch links the CUDA libraries at load time, so without the nvidia-*
# packages `import torch` fails ("libcufile.so.0: cannot open shared object file"). With them
# torch runs on the CPU (torch.cuda.is_available() is False). PyTorch's CPU-only index is not
# reachable from this project's machines. The venv is about 5.4 GB.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$here/.venv-torch2}"
base_python=/usr/bin/python3
requirements="$here/scripts/torch2-requirements.txt"
stamp="$venv/.ckpt-requirements"
# The CUDA wheels unpack to about 5.4 GB; pip needs room for the download beside them.
need_gib=8

say() { echo "setup_torch2_venv: $*"; }
fail() { echo "setup_torch2_venv: ERROR: $*" >&2; exit 1; }

# What the stamp must say for the venv to be reused: the base interpreter and the pins.
want="$("$base_python" -c 'import sys; print(sys.executable, sys.version.split()[0])')
$(grep -v '^#' "$requirements")"

imports_ok() {
  "$venv/bin/python" - "$requirements" <<'PY' 2>/dev/null
import sys, importlib.metadata as md
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        if md.version(name) != version:
            sys.exit(1)
# Each must import, not just be listed (deepspeed is slow to import; its own test imports it).
import torch, pytest, numpy, safetensors  # noqa: E401, F401
print("torch", torch.__version__)
PY
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && found="$(imports_ok)"; then
  say "reusing $venv ($found)"
  exit 0
fi

"$base_python" -c "import ensurepip" 2>/dev/null \
  || fail "$base_python cannot make a venv with pip (Debian: apt-get install python3-venv)"
mkdir -p "$(dirname "$venv")"
avail_kib="$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 { print $4 }')"
[ "$avail_kib" -ge $((need_gib * 1024 * 1024)) ] \
  || fail "$(dirname "$venv") has $((avail_kib / 1024 / 1024)) GiB free; the torch 2 venv needs $need_gib"

say "creating $venv from $base_python and installing $(grep -v '^#' "$requirements" | tr '\n' ' ')(about 5.4 GB from PyPI)"
rm -rf "$venv"
"$base_python" -m venv "$venv"
# No pip cache: a second copy of the wheels would double the disk used, and a venv that is
# kept (the usual case) is not downloaded again anyway.
if ! "$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check \
       --root-user-action=ignore -r "$requirements"; then
  rm -rf "$venv"
  fail "pip could not install $requirements from PyPI (network? disk?); $venv removed"
fi
"$venv/bin/python" - <<'PY' || fail "torch in $venv does not run"
import torch, torch.distributed as dist
x = torch.randn(64, 64)
assert torch.allclose(x @ torch.eye(64), x, atol=1e-6)
assert dist.is_available() and dist.is_gloo_available(), "no torch.distributed with gloo"
PY
found="$(imports_ok)" || fail "$venv does not hold the pins of $requirements after installing them"
echo "$want" > "$stamp"
say "ready: $venv ($(du -sh "$venv" | cut -f1), $found)"
