#!/usr/bin/env bash
# scripts/check_layers.py fails on an include that goes up a layer or sideways, naming the
# file, the line and the layers, and passes once the include goes down.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/check-layers.XXXXXX")"
trap 'rm -rf "$work"' EXIT INT TERM
git -C "$work" init -q
mkdir -p "$work/common" "$work/daemon/base" "$work/daemon/rpc" "$work/tools"
printf '#pragma once\n' >"$work/daemon/base/log.h"
printf '#pragma once\n' >"$work/daemon/rpc/service.h"
printf '#pragma once\n#include "daemon/base/log.h"\n' >"$work/common/status.h"
printf '#include "daemon/rpc/service.h"\n' >"$work/tools/ckptctl.cc"
git -C "$work" add -A
if out="$(python3 "$here/scripts/check_layers.py" --root "$work" 2>&1)"; then
  echo "FAIL: check_layers passed an upward include:"; echo "$out"; exit 1
fi
echo "$out" | grep -q 'common/status.h:2: includes daemon/base/log.h (daemon/base) from common: up a layer' ||
  { echo "FAIL: no message for the upward include:"; echo "$out"; exit 1; }
echo "$out" | grep -q 'tools/ckptctl.cc:1: includes daemon/rpc/service.h (daemon/rpc) from tools: sideways' ||
  { echo "FAIL: no message for the sideways include:"; echo "$out"; exit 1; }
printf '#pragma once\n' >"$work/common/status.h"
printf '#include "common/status.h"\n' >"$work/tools/ckptctl.cc"
printf '#pragma once\n#include "common/status.h"\n' >"$work/daemon/base/log.h"
python3 "$here/scripts/check_layers.py" --root "$work" ||
  { echo "FAIL: check_layers refused includes that go down"; exit 1; }
echo "check_layers_test: OK"
