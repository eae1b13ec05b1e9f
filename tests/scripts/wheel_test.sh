#!/usr/bin/env bash
# The Python package as a wheel, installed the way a user installs it:
#  1. `pip wheel ./python` from this build tree (CKPT_BUILD_DIR: python/setup.py takes the
#     extension and libckpt built here) gives ckptd-VERSION-*.whl, VERSION the C++ project's;
#  2. it installs, with no index and no dependencies, into a fresh venv; there `import ckpt`
#     loads the installed package, whose extension finds the libckpt.so.0 of the wheel (not
#     the build tree's); its metadata version is the C++ project's;
#  3. in that venv a save and restore runs through a real ckptd: torch tensors over a
#     SharedRegion when torch imports there, which it does with TORCH2_PYTHON (a venv with
#     torch 2.x from PyPI, scripts/setup_torch2_venv.sh: its packages are made visible to the
#     fresh venv by a .pth file instead of a download of 5 GB), else a memoryview.
# PYTHON, the interpreter the extension is built for, builds the wheel and makes the venv;
# when it lacks venv, setuptools or wheel (a pyenv or conda interpreter), /usr/bin/python3
# does, if its extension suffix is the same (the extension loads in it). Exits 77 (skipped)
# only when neither can (Debian: python3-venv, python3-setuptools, python3-wheel).
#
# Usage: wheel_test.sh BUILD_DIR PYTHON CKPTD [TORCH2_PYTHON]   (ckptctl beside CKPTD)
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
build="$(cd "${1:?usage: wheel_test.sh BUILD_DIR PYTHON CKPTD [TORCH2_PYTHON]}" && pwd)"
python="${2:?usage: wheel_test.sh BUILD_DIR PYTHON CKPTD [TORCH2_PYTHON]}"
ckptd="$(readlink -f "${3:?usage: wheel_test.sh BUILD_DIR PYTHON CKPTD [TORCH2_PYTHON]}")"
torch2_python="${4:-}"
ckptctl="$(dirname "$ckptd")/ckptctl"
can_build() { "$1" -c "import venv, ensurepip, setuptools, wheel" 2>/dev/null; }
suffix() { "$1" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"; }
if ! can_build "$python"; then
  if [ -x /usr/bin/python3 ] && can_build /usr/bin/python3 && [ "$(suffix /usr/bin/python3)" = "$(suffix "$python")" ]; then
    echo "$python lacks venv, setuptools or wheel: using /usr/bin/python3, of the same ABI"
    python=/usr/bin/python3
  else
    echo "SKIP: $python lacks venv, ensurepip, setuptools or wheel (python3-venv python3-setuptools python3-wheel)"
    exit 77
  fi
fi
# shellcheck source-path=SCRIPTDIR source=packaging_lib.sh
. "$src/tests/scripts/packaging_lib.sh"
packaging_setup wheel-test
version="$(sed -n 's/^Version: //p' "$build/ckpt.pc")"

step "1. pip wheel ./python from the build tree"
# A copy of python/ (pip and setuptools write build/ and egg-info beside setup.py).
cp -r "$src/python" "$work/python-src"
ln -s "$src/CMakeLists.txt" "$work/CMakeLists.txt"
(cd "$work" && CKPT_BUILD_DIR="$build" PYTHONDONTWRITEBYTECODE=1 "$python" -m pip wheel -q --no-deps \
   --no-build-isolation --disable-pip-version-check -w "$work/dist" ./python-src) >"$work/pip-wheel.log" 2>&1 ||
  fail "pip wheel"
wheels=("$work"/dist/ckptd-"$version"-*.whl)
[ -f "${wheels[0]}" ] || fail "no ckptd-$version wheel: $(ls "$work/dist")"
echo "   $(basename "${wheels[0]}")"

step "2. install it into a fresh venv"
"$python" -m venv "$work/venv" >"$work/venv.log" 2>&1 || fail "python -m venv"
venv_python="$work/venv/bin/python"
if [ -n "$torch2_python" ]; then
  purelib="$("$torch2_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' | {
    read -r site
    echo "$purelib" >"$site/torch2-venv.pth"
  }
fi
"$venv_python" -m pip install -q --no-index --no-deps --disable-pip-version-check "${wheels[0]}" \
  >"$work/pip-install.log" 2>&1 || fail "pip install of the wheel"
cd "$work"
env -u PYTHONPATH "$venv_python" - "$work/venv" "$version" >"$work/import.log" 2>&1 <<'PY' || fail "import ckpt in the venv"
import importlib.metadata, pathlib, subprocess, sys
import ckpt
venv, version = pathlib.Path(sys.argv[1]).resolve(), sys.argv[2]
package = pathlib.Path(ckpt.__file__).resolve().parent
assert venv in package.parents, f"ckpt imported from {package}, not the venv"
assert importlib.metadata.version("ckptd") == version, importlib.metadata.version("ckptd")
ext = next(package.glob("_ckpt*.so"))
ldd = subprocess.run(["ldd", str(ext)], capture_output=True, text=True, check=True).stdout
lib = [line.split()[2] for line in ldd.splitlines() if line.split()[:1] == ["libckpt.so.0"]]
assert lib and pathlib.Path(lib[0]).resolve() == package / "libckpt.so.0", f"libckpt from {lib}"
print(f"ckpt {version} from {package}, libckpt from the wheel")
PY
sed 's/^/   /' "$work/import.log"

step "3. save and restore through a real ckptd"
mkdir -m 0700 "$work/run" "$work/root"
sock="$work/run/ckptd.sock"
start_ckptd "$ckptd" "$ckptctl" "$sock" --root "$work/root" --pool-mib 64 --memory-mib 64
env -u PYTHONPATH "$venv_python" - "$sock" "$torch2_python" >"$work/save-restore.log" 2>&1 <<'PY' &
import sys
import ckpt
sock, want_torch2 = sys.argv[1], sys.argv[2]
n = 1 << 18
region = ckpt.SharedRegion.create(n * 4)
try:
    import torch
except ImportError:
    if want_torch2:
        raise
    torch = None
if torch is not None:
    assert not want_torch2 or int(torch.__version__.split(".")[0]) >= 2, torch.__version__
    w = torch.frombuffer(region, dtype=torch.float32, count=n)
    w.copy_(torch.arange(n, dtype=torch.float32))
    expected = w.clone()
    what = f"torch {torch.__version__} tensor"
else:
    w = memoryview(region).cast("B")
    w[:] = bytes(i % 251 for i in range(n * 4))
    expected = bytes(w)
    what = "memoryview (no torch in this venv)"
client = ckpt.Client.connect(sock)
client.register_items("wheel", 0, 1, [("w", "F32", [n], region, 0)])
client.snapshot(1, {"step": b"1"})
client.wait_snapshot(1)
client.wait_durable(1)
if torch is not None:
    w.zero_()
    r = client.restore(result=True)
    assert torch.equal(w, expected)
else:
    w[:] = bytes(n * 4)
    r = client.restore(result=True)
    assert bytes(w) == expected
assert r.version == 1, r.version
client.unregister()
print(f"saved and restored version 1 ({what}) from the {r.tier} tier")
PY
children+=($!)
wait $! || fail "save and restore in the venv"
sed 's/^/   /' "$work/save-restore.log"
stop_ckptd
echo "PASS"
