#!/usr/bin/env bash
# Builds the whole tree with clang and -Wthread-safety -Werror (CKPT_THREAD_SAFETY), into
# build-clang: a field read or written without the lock that guards it (GUARDED_BY), or a
# function called without the lock it requires (REQUIRES) or with one it takes itself
# (EXCLUDES), fails the build. No test runs here; scripts/test.sh runs them (GCC build).
# Usage: scripts/check_thread_safety.sh
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="$here/build-clang"
bash "$here/scripts/install-deps.sh"
CC=clang CXX=clang++ cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCKPT_THREAD_SAFETY=ON >/dev/null
ninja -C "$build"
echo "check_thread_safety: the clang -Wthread-safety -Werror build is clean"
