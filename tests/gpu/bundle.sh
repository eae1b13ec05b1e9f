#!/usr/bin/env bash
# Builds, here, everything tests/gpu/run.sh needs on a GPU machine that has CUDA, PyTorch,
# a C++ compiler and pybind11 but none of Debian's gRPC, protobuf or spdlog (the lent H200
# machines are such: an image with no package registry). Writes .gpu-bundle/ (git-ignored):
#   bin/  ckptd ckptctl ckpt-gpu-trainer and the cuda_ tests, stripped
#   lib/  libckpt.so and every library they load that is not glibc's or the compiler's
#         (gRPC, protobuf, abseil, spdlog, fmt, xxhash, c-ares, re2, OpenSSL, zlib)
#   py/   what the Python module is linked from there, for that machine's interpreter:
#         the shard reader's object, the static format and common libraries, xxhash.h,
#         and the pure-Python part of the package
# Then, on the GPU machine:  bash tests/gpu/run.sh --prebuilt .gpu-bundle
# (device tool: carry [".gpu-bundle"]). The bundle is about 40 MB.
#
# Usage: tests/gpu/bundle.sh [--build DIR] [--out DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
build="$here/build"
out="$here/.gpu-bundle"
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_WITH_CUDA=ON >/dev/null
ninja -C "$build" -t targets all | grep '^ckpt-gpu-trainer:' >/dev/null ||
  { echo "bundle.sh: $build has no CUDA backend (the CUDA toolkit was not found)" >&2; exit 1; }
cuda_tests=()
for src in "$here"/cuda/tests/*_test.cc; do cuda_tests+=("$(basename "$src" .cc)"); done
ninja -C "$build" ckptd ckptctl ckpt ckpt-gpu-trainer cuda_ipc_exporter _ckpt ckpt_format ckpt_common \
  "${cuda_tests[@]}"

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/py/ckpt"
bins=(ckptd ckptctl ckpt-gpu-trainer)
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
strip --strip-debug -o "$out/py/shard_reader.o" "$build/python/CMakeFiles/_ckpt.dir/src/shard_reader.cc.o"
for a in libckpt_format.a libckpt_common.a; do strip --strip-debug -o "$out/py/$a" "$build/$a"; done
cp /usr/include/xxhash.h "$out/py/"
cp "$here"/python/ckpt/*.py "$out/py/ckpt/"
printf '%s\n' "$(git -C "$here" rev-parse HEAD 2>/dev/null || echo unknown)" >"$out/COMMIT"
echo "bundle.sh: $out ($(du -sh "$out" | cut -f1)) from $(cat "$out/COMMIT")"
