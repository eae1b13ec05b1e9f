#!/usr/bin/env bash
# Builds the Python module `ckpt._ckpt` of a bundle (tests/gpu/bundle.sh) for one
# interpreter, from the sources of this checkout and the bundle's libraries and headers:
#   tests/gpu/build_module.sh BUNDLE PYTHON [PYTHON_INCLUDE_DIR]
# Writes BUNDLE/py/ckpt/_ckpt<the interpreter's EXT_SUFFIX>. The module's RPATH
# ($ORIGIN/../../lib, DT_RPATH so that it also serves libckpt's own dependencies) finds the
# bundle's libraries without LD_LIBRARY_PATH, so the interpreter and torch keep their own.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
bundle="$(cd "$1" && pwd)"
python="$2"
pyinc="${3:-$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')}"
[ -f "$pyinc/Python.h" ] || { echo "build_module.sh: no Python.h in $pyinc" >&2; exit 1; }
ext="$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
c++ -O2 -std=c++20 -shared -fPIC -fvisibility=hidden -I"$pyinc" -I"$bundle/py/include" \
  -I"$here" -I"$here/client/include" -I"$here/python/src" \
  "$here/python/src/bindings.cc" "$here/python/src/shard_reader.cc" \
  "$bundle/py/libckpt_format.a" "$bundle/py/libckpt_common.a" -L"$bundle/lib" -lckpt -l:libxxhash.so.0 \
  -Wl,--disable-new-dtags,-rpath,'$ORIGIN/../../lib' -o "$bundle/py/ckpt/_ckpt$ext"
