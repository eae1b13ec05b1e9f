#!/usr/bin/env bash
# Builds, here, everything tests/gpu/run.sh needs on a GPU machine that has CUDA, PyTorch,
# a C++ compiler and pybind11 but none of Debian's gRPC, protobuf or spdlog (the lent H200
# machines are such: an image with no package registry). Writes .gpu-bundle/ (git-ignored):
#   bin/  ckptd ckptctl ckpt-gpu-trainer and the cuda_ tests, stripped
#   lib/  libckpt.so and every library they load that is not glibc's or the compiler's
#         (gRPC, protobuf, abseil, spdlog, fmt, xxhash, c-ares, re2, OpenSSL, zlib)
#   py/   the Python package: the module prebuilt for Python 3.12, and what builds it
#         there for another interpreter (see below)
# Then, on the GPU machine:  bash tests/gpu/run.sh --prebuilt .gpu-bundle
# (device tool: carry [".gpu-bundle"]). The bundle is about 40 MB.
#
# Usage: tests/gpu/bundle.sh [--build DIR] [--out DIR] [--python PY]
#   --python  the interpreter to prebuild the Python module for (default: a Python 3.12
#             found here; the GPU machines run 3.12)
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
build="$here/build"
out="$here/.gpu-bundle"
python=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_WITH_CUDA=ON >/dev/null
ninja -C "$build" -t targets all | grep '^ckpt-gpu-trainer:' >/dev/null ||
  { echo "bundle.sh: $build has no CUDA backend (the CUDA toolkit was not found)" >&2; exit 1; }
cuda_tests=()
for src in "$here"/cuda/tests/*_test.cc; do cuda_tests+=("$(basename "$src" .cc)"); done
ninja -C "$build" ckptd ckptd-test-device ckptctl ckpt ckpt-gpu-trainer cuda_ipc_exporter _ckpt ckpt_format ckpt_common \
  "${cuda_tests[@]}"

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/py/ckpt"
bins=(ckptd ckptd-test-device ckptctl ckpt-gpu-trainer)
for b in "${bins[@]}"; do strip -o "$out/bin/$b" "$build/$b"; done
for t in "${cuda_tests[@]}" cuda_ipc_exporter; do
  f="$(find "$build" -name "$t" -type f -perm -u+x | head -1)"
  [ -n "$f" ] || { echo "bundle.sh: $t was not built" >&2; exit 1; }
  strip -o "$out/bin/$t" "$f"
done
strip -o "$out/lib/libckpt.so.0" "$(readlink -f "$build/libckpt.so")"
ln -s libckpt.so.0 "$out/lib/libckpt.so"
# Every shared library the programs load, except the C library's and the compiler
# runtime's (the GPU machine has its own, newer) and the CUDA driver's.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+\.|libgcc_s\.|libcuda\.|libckpt\.)'
for f in "$out"/bin/* "$out/lib/libckpt.so.0"; do
  LD_LIBRARY_PATH="$out/lib" ldd "$f" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ "$name" =~ $skip ]]; then continue; fi
  [ -e "$out/lib/$name" ] || cp -L "$path" "$out/lib/$name"
done
# The Python module: prebuilt for --python (the GPU machines' interpreter is 3.12), and
# everything needed to build it there for another one: the static libraries, pybind11's
# and xxhash's headers, and that interpreter's headers. Both builds run the same command
# (tests/gpu/build_module.sh); the module finds the bundle's libraries through an
# $ORIGIN-relative RPATH, so nothing else on that machine loads them.
for a in libckpt_format.a libckpt_common.a; do strip --strip-debug -o "$out/py/$a" "$build/$a"; done
mkdir -p "$out/py/include"
cp /usr/include/xxhash.h "$out/py/include/"
cp "$here"/python/ckpt/*.py "$out/py/ckpt/"
if [ -z "$python" ]; then
  for p in /root/.pyenv/versions/3.12*/bin/python3 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$p" ]; then python="$p"; break; fi
  done
fi
pybind_inc=""
if "$python" -m pybind11 --includes >/dev/null 2>&1; then
  pybind_inc="$("$python" -c 'import pybind11; print(pybind11.get_include())')"
else
  # pybind11 from PyPI (its headers only), unpacked beside the build, never installed.
  wheels="$build/pybind11-wheel"
  if [ ! -d "$wheels/pybind11/include" ]; then
    rm -rf "$wheels" && mkdir -p "$wheels"
    "${python:-python3}" -m pip download -q --no-deps --disable-pip-version-check pybind11 -d "$wheels" &&
      (cd "$wheels" && python3 -m zipfile -e pybind11-*.whl .) ||
      echo "bundle.sh: pybind11 could not be fetched from PyPI: no prebuilt module" >&2
  fi
  [ -d "$wheels/pybind11/include" ] && pybind_inc="$wheels/pybind11/include"
fi
if [ -n "$pybind_inc" ]; then cp -r "$pybind_inc/pybind11" "$out/py/include/"; fi
if [ -n "$python" ] && [ -n "$pybind_inc" ]; then
  pyinc="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  pyver="$("$python" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')"
  cp -r "$pyinc" "$out/py/include/$pyver"
  bash "$here/tests/gpu/build_module.sh" "$out" "$python" "$out/py/include/$pyver"
  echo "bundle.sh: the Python module for $("$python" --version) is prebuilt"
else
  echo "bundle.sh: no Python 3.12 with pybind11 here: the module is built on the GPU machine"
fi
printf '%s\n' "$(git -C "$here" rev-parse HEAD 2>/dev/null || echo unknown)" >"$out/COMMIT"
echo "bundle.sh: $out ($(du -sh "$out" | cut -f1)) from $(cat "$out/COMMIT")"
