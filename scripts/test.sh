#!/usr/bin/env bash
# Builds ckptd and runs every test (unit tests and end-to-end tests against real ckptd
# processes). Usage: scripts/test.sh [--sanitize address|thread] [ctest args...]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="$here/build"
sanitize=""
if [ "${1:-}" = "--sanitize" ]; then
  sanitize="$2"
  build="$here/build-$sanitize"
  shift 2
fi
if [ "$sanitize" = "thread" ]; then
  # Debian's gRPC and abseil are not built with TSan; their internals are suppressed.
  export TSAN_OPTIONS="suppressions=$here/tests/tsan.supp ${TSAN_OPTIONS:-}"
fi
bash "$here/scripts/install-deps.sh"
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_SANITIZE="$sanitize" >/dev/null
ninja -C "$build"
# The real safetensors package (PyPI; not in Debian 12) for the test that opens every
# shard with it, installed beside the build, never into the system. Without network
# that one test is skipped and says so.
if [ -x /usr/bin/python3 ] && ! PYTHONPATH="$build/pydeps" /usr/bin/python3 -c "import safetensors" 2>/dev/null; then
  /usr/bin/python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
      --target "$build/pydeps" safetensors \
    || echo "test.sh: could not install safetensors from PyPI; its test will be skipped"
fi
cd "$build"
ctest --output-on-failure --timeout 900 "$@"
