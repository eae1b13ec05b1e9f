#!/usr/bin/env bash
# libckpt and ckptd installed, and used the way a trainer outside this project uses them:
#  1. `cmake --install` into a temporary prefix: the files of the three components are there,
#     the unit's ExecStart names the installed ckptd, and the tree is then moved elsewhere
#     (the CMake package and ckpt.pc must not depend on where it was installed);
#  2. every installed header compiles alone with only `pkg-config --cflags ckpt`, and
#     include/ckpt/ holds the public headers only;
#  3. find_package(ckpt) takes 0.1 and refuses 0.2 and 1.0 (SameMajorVersion), finds the
#     component cuda exactly when libckpt was built with CUDA (so does the target property
#     CKPT_CUDA and `pkg-config --variable=cuda ckpt`), and never an unknown component;
#  4. examples/installed_trainer builds with find_package(ckpt) and, separately, with
#     `pkg-config --cflags --libs ckpt` alone; both load libckpt from the moved prefix;
#  5. both run against a real daemon, the installed ckptd: register a buffer, snapshot it,
#     wait until it is committed, restore it and check every byte.
# Everything lives in one temporary directory, removed on exit; the daemon and trainers are
# ended first.
#
# Usage: install_prefix_test.sh BUILD_DIR HAVE_CUDA(ON|OFF)
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
build="$(cd "${1:?usage: install_prefix_test.sh BUILD_DIR HAVE_CUDA}" && pwd)"
have_cuda="${2:?usage: install_prefix_test.sh BUILD_DIR HAVE_CUDA}"
# shellcheck source-path=SCRIPTDIR source=packaging_lib.sh
. "$src/tests/scripts/packaging_lib.sh"
packaging_setup install-test

step "1. install into a temporary prefix, then move it"
stage="$work/stage"
cmake --install "$build" --prefix "$stage" >"$work/install.log" 2>&1 || fail "cmake --install"
libdir="$(sed -n 's/^libdir=\${prefix}\///p' "$build/ckpt.pc")"
for f in bin/ckptd bin/ckptctl "$libdir/libckpt.so" "$libdir/libckpt.so.0" "$libdir/cmake/ckpt/ckptConfig.cmake" \
         "$libdir/cmake/ckpt/ckptConfigVersion.cmake" "$libdir/cmake/ckpt/ckptTargets.cmake" \
         "$libdir/pkgconfig/ckpt.pc" lib/systemd/system/ckptd.service lib/sysusers.d/ckptd.conf \
         lib/tmpfiles.d/ckptd.conf libexec/ckptd/prolog.sh libexec/ckptd/epilog.sh libexec/ckptd/task_prolog.sh \
         libexec/ckptd/common.sh etc/ckptd/ckptd.conf etc/default/ckptd; do
  [ -e "$stage/$f" ] || fail "$f is not installed"
done
grep -qx "ExecStart=$stage/bin/ckptd --config $stage/etc/ckptd/ckptd.conf" "$stage/lib/systemd/system/ckptd.service" ||
  fail "the installed unit's ExecStart does not name the installed ckptd: $(grep ExecStart= "$stage/lib/systemd/system/ckptd.service")"
grep -q "CKPTD_BIN=\"\${CKPTD_BIN:-$stage/bin/ckptd}\"" "$stage/libexec/ckptd/common.sh" ||
  fail "the installed Slurm scripts do not default to the installed ckptd"
prefix="$work/moved"
mv "$stage" "$prefix"
export PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig"

step "2. installed headers are self-contained"
# shellcheck disable=SC2207
installed=($(cd "$prefix/include/ckpt" && ls))
[ "${installed[*]}" = "client.h dtype.h export.h level.h" ] || fail "include/ckpt holds ${installed[*]}"
for h in "${installed[@]}"; do
  # shellcheck disable=SC2046
  printf '#include <ckpt/%s>\n' "$h" | c++ -std=c++17 -fsyntax-only -Wall -Wextra -Werror \
      $(pkg-config --cflags ckpt) -x c++ - || fail "<ckpt/$h> does not compile alone with the package's flags"
done

step "3. the CMake package: versions, components, CUDA property"
mkdir -p "$work/probe"
cat >"$work/probe/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.16)
project(probe NONE)
function(probe label)
  unset(ckpt_DIR CACHE)
  find_package(ckpt ${ARGN} CONFIG QUIET)
  if(ckpt_FOUND)
    message(STATUS "probe ${label}: 1")
  else()
    message(STATUS "probe ${label}: 0")
  endif()
endfunction()
probe(0.1 0.1)
probe(0.2 0.2)
probe(1.0 1.0)
probe(cuda 0.1 COMPONENTS cuda)
probe(unknown 0.1 COMPONENTS nonesuch)
find_package(ckpt 0.1 CONFIG REQUIRED)
get_target_property(cuda ckpt::ckpt CKPT_CUDA)
get_target_property(type ckpt::ckpt TYPE)
message(STATUS "probe property: ${cuda} ${type} ${ckpt_DIR}")
EOF
cmake -S "$work/probe" -B "$work/probe/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
      >"$work/probe.log" 2>&1 || fail "the probe project does not configure"
if [ "$have_cuda" = ON ]; then cuda_found=1 pc_cuda=yes; else cuda_found=0 pc_cuda=no; fi
for want in "probe 0.1: 1" "probe 0.2: 0" "probe 1.0: 0" "probe cuda: $cuda_found" "probe unknown: 0" \
            "probe property: $have_cuda SHARED_LIBRARY $prefix/$libdir/cmake/ckpt"; do
  grep -q -- "-- $want\$" "$work/probe.log" || fail "find_package: expected '$want'"
done
[ "$(pkg-config --variable=cuda ckpt)" = "$pc_cuda" ] || fail "pkg-config --variable=cuda ckpt is not $pc_cuda"
[ "$(pkg-config --modversion ckpt)" = "$(sed -n 's/^Version: //p' "$build/ckpt.pc")" ] || fail "ckpt.pc version"

step "4. the outside trainer, with find_package and with pkg-config"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$src/examples/installed_trainer" -B "$work/trainer-cmake" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$work/trainer-cmake.log" 2>&1 &&
  cmake --build "$work/trainer-cmake" >>"$work/trainer-cmake.log" 2>&1 || fail "the CMake build of the trainer"
# shellcheck disable=SC2046
c++ -std=c++17 -O1 -o "$work/trainer-pc" "$src/examples/installed_trainer/trainer.cc" $(pkg-config --cflags --libs ckpt) \
    -Wl,-rpath,"$(pkg-config --variable=libdir ckpt)" >"$work/trainer-pc.log" 2>&1 || fail "the pkg-config build"
want_lib="$(readlink -f "$prefix/$libdir/libckpt.so.0")"
for t in "$work/trainer-cmake/installed-trainer" "$work/trainer-pc"; do
  got="$(ldd "$t" | awk '$1 == "libckpt.so.0" { print $3 }')"
  [ -n "$got" ] && [ "$(readlink -f "$got")" = "$want_lib" ] || fail "$t loads libckpt from '$got', not the moved prefix"
done

step "5. save and restore against the installed ckptd"
mkdir -m 0700 "$work/run" "$work/root"
sock="$work/run/ckptd.sock"
start_ckptd "$prefix/bin/ckptd" "$prefix/bin/ckptctl" "$sock" --root "$work/root" --pool-mib 64 --memory-mib 64
for t in cmake pc; do
  bin="$work/trainer-cmake/installed-trainer"
  [ "$t" = pc ] && bin="$work/trainer-pc"
  "$bin" --socket "$sock" --job "trainer-$t" >"$work/run-$t.log" 2>&1 &
  children+=($!)
  wait $! || fail "the $t-built trainer failed (exit $?)"
  grep -q "bytes verified" "$work/run-$t.log" || fail "the $t-built trainer did not verify its restore"
  sed 's/^/   /' "$work/run-$t.log"
done
[ -e "$work/root/trainer-cmake/v0000000001/COMMITTED" ] && [ -e "$work/root/trainer-pc/v0000000001/COMMITTED" ] ||
  fail "the trainers' version 1 is not committed under the daemon's root"
stop_ckptd
echo "PASS"
