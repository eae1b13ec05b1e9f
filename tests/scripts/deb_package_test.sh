#!/usr/bin/env bash
# The Debian packages (cmake/Packaging.cmake), built, installed, run and removed without a
# container: dpkg --root installs them into a throwaway root, running their maintainer
# scripts outside a chroot (DPKG_ROOT), and the daemon runs from there.
#  1. cpack builds ckptd, libckpt0 and libckpt-dev; their contents and control fields are as
#     packaged (Depends from dpkg-shlibdeps, conffiles), and apt can satisfy every Depends
#     on this Debian (a simulated install);
#  2. dpkg --root installs them: the postinst makes the sysusers.d group and the tmpfiles.d
#     directories inside the root;
#  3. the packaged unit passes systemd-analyze verify; its ExecStart, with every path under
#     the root, checks its packaged configuration
#     and then serves (pool and memory tier made small for the test, the socket and checkpoint
#     root those of the packaged configuration, under the root); ckptctl from the package
#     answers, and the outside trainer (examples/installed_trainer) built with pkg-config
#     against libckpt-dev saves and restores through it;
#  4. dpkg -r removes the packages and leaves the checkpoints (and the conffiles); dpkg
#     --purge removes the conffiles and still leaves the checkpoints.
# Exits 77 (skipped) where there is no dpkg toolchain (not Debian), or when not run as root
# (the packaged files and directories belong to root; CI runs as root).
#
# Usage: deb_package_test.sh BUILD_DIR
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
build="$(cd "${1:?usage: deb_package_test.sh BUILD_DIR}" && pwd)"
[ "$(id -u)" -eq 0 ] || { echo "SKIP: dpkg --root must give the packaged files their owner, root: run as root"; exit 77; }
for tool in cpack dpkg dpkg-deb dpkg-shlibdeps apt-get; do
  command -v "$tool" >/dev/null || { echo "SKIP: no $tool (the Debian packages need dpkg and dpkg-dev)"; exit 77; }
done
# shellcheck source-path=SCRIPTDIR source=packaging_lib.sh
. "$src/tests/scripts/packaging_lib.sh"
packaging_setup deb-test

step "1. build the packages"
cpack -G DEB --config "$build/CPackConfig.cmake" -B "$work/pkg" >"$work/cpack.log" 2>&1 || fail "cpack"
version="$(sed -n 's/^Version: //p' "$build/ckpt.pc")-1"
arch="$(dpkg --print-architecture)"
daemon_deb="$work/pkg/ckptd_${version}_${arch}.deb"
lib_deb="$work/pkg/libckpt0_${version}_${arch}.deb"
dev_deb="$work/pkg/libckpt-dev_${version}_${arch}.deb"
for deb in "$daemon_deb" "$lib_deb" "$dev_deb"; do
  [ -f "$deb" ] || fail "cpack made no $(basename "$deb"): $(ls "$work/pkg")"
  echo "   $(basename "$deb"): $(dpkg-deb -f "$deb" Depends)"
done
contents() { dpkg-deb -c "$1" | awk '{ print $6 }' | sed 's|^\./|/|'; }
expect_files() {  # DEB PATH...
  local deb="$1" listing
  shift
  listing="$(contents "$deb")"
  for f in "$@"; do
    grep -qx -- "$f" <<<"$listing" || fail "$(basename "$deb") lacks $f"
  done
}
expect_files "$daemon_deb" /usr/bin/ckptd /usr/bin/ckptctl /usr/lib/systemd/system/ckptd.service \
  /usr/lib/sysusers.d/ckptd.conf /usr/lib/tmpfiles.d/ckptd.conf /usr/libexec/ckptd/prolog.sh \
  /usr/libexec/ckptd/epilog.sh /usr/libexec/ckptd/task_prolog.sh /usr/libexec/ckptd/common.sh \
  /etc/ckptd/ckptd.conf /etc/default/ckptd
expect_files "$lib_deb" /usr/lib/libckpt.so.0 "/usr/lib/libckpt.so.${version%-1}"
expect_files "$dev_deb" /usr/include/ckpt/client.h /usr/include/ckpt/export.h /usr/lib/libckpt.so \
  /usr/lib/cmake/ckpt/ckptConfig.cmake /usr/lib/cmake/ckpt/ckptConfigVersion.cmake /usr/lib/pkgconfig/ckpt.pc
contents "$daemon_deb" | grep -q '^/var/lib/ckptd' && fail "the ckptd package owns /var/lib/ckptd (dpkg -r would touch checkpoints)"
contents "$lib_deb" | grep -q '\.h$' && fail "libckpt0 holds headers"
for pair in "$daemon_deb:libgrpc++" "$daemon_deb:libprotobuf" "$daemon_deb:libc6" "$lib_deb:libgrpc++" \
            "$dev_deb:libckpt0 (= $version)"; do
  deb="${pair%%:*}" dep="${pair#*:}"
  dpkg-deb -f "$deb" Depends | grep -qF -- "$dep" || fail "$(basename "$deb") does not depend on $dep"
done
dpkg-deb --ctrl-tarfile "$daemon_deb" | tar -xO ./conffiles >"$work/conffiles"
[ "$(sort "$work/conffiles" | tr '\n' ' ')" = "/etc/ckptd/ckptd.conf /etc/default/ckptd " ] ||
  fail "conffiles: $(cat "$work/conffiles")"
apt-get install -s -qq "$daemon_deb" "$lib_deb" "$dev_deb" >"$work/apt.log" 2>&1 ||
  fail "apt cannot satisfy the packages' Depends on this system"

step "2. install into a throwaway root"
root="$work/root"
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates" "$root/var/lib/dpkg/triggers"
touch "$root/var/lib/dpkg/status"
# The Depends are runtime libraries of this system, not of the empty root's database.
dpkg_root=(dpkg --root="$root" --log=/dev/null --force-script-chrootless --force-depends)
"${dpkg_root[@]}" -i "$lib_deb" "$dev_deb" "$daemon_deb" >"$work/dpkg-install.log" 2>&1 || fail "dpkg -i"
grep -q '^ckpt:' "$root/etc/group" || fail "the postinst made no group ckpt (sysusers.d)"
for d in run/ckptd run/ckptd-jobs var/lib/ckptd var/log/ckptd; do
  [ -d "$root/$d" ] || fail "the postinst made no /$d (tmpfiles.d)"
done
[ "$(stat -c %a "$root/var/lib/ckptd")" = 700 ] || fail "/var/lib/ckptd is not 0700"

step "3. run the unit's ExecStart under the packaged paths"
unit="$root/usr/lib/systemd/system/ckptd.service"
read -r -a exec_start <<<"$(sed -n 's/^ExecStart=//p' "$unit")"
[ "${exec_start[0]}" = /usr/bin/ckptd ] || fail "ExecStart runs ${exec_start[0]}, not the packaged /usr/bin/ckptd"
for i in "${!exec_start[@]}"; do
  case "${exec_start[$i]}" in /*) exec_start[$i]="$root${exec_start[$i]}" ;; esac
done
# systemd-analyze verify (offline: no systemd needed) wants the binary at its path.
if command -v systemd-analyze >/dev/null; then
  sed "s|^ExecStart=/usr/bin/ckptd|ExecStart=$root/usr/bin/ckptd|" "$unit" >"$work/ckptd.service"
  out="$(systemd-analyze verify --man=no "$work/ckptd.service" 2>&1)" && [ -z "$out" ] ||
    fail "systemd-analyze verify of the packaged unit: $out"
fi
# The packaged configuration's socket and checkpoint root, under the root.
sock="$root/run/ckptd/ckptd.sock"
under_root=(--socket "$sock" --root "$root/var/lib/ckptd")
"${exec_start[@]}" "${under_root[@]}" --check-config >"$work/check-config.log" 2>&1 ||
  fail "the packaged configuration does not check"
ctl="$root/usr/bin/ckptctl"
start_ckptd "${exec_start[0]}" "$ctl" "$sock" "${exec_start[@]:1}" --root "$root/var/lib/ckptd" --pool-mib 64 --memory-mib 64
# shellcheck disable=SC2046
PKG_CONFIG_PATH="$root/usr/lib/pkgconfig" c++ -std=c++17 -O1 -o "$work/trainer" \
  "$src/examples/installed_trainer/trainer.cc" $(PKG_CONFIG_PATH="$root/usr/lib/pkgconfig" pkg-config --cflags --libs ckpt) \
  -Wl,-rpath,"$root/usr/lib" >"$work/trainer-build.log" 2>&1 || fail "the trainer does not build against libckpt-dev"
"$work/trainer" --socket "$sock" --job deb-trainer >"$work/trainer.log" 2>&1 &
children+=($!)
wait $! || fail "the trainer failed against the packaged daemon (exit $?)"
sed 's/^/   /' "$work/trainer.log"
stop_ckptd
checkpoint="$root/var/lib/ckptd/deb-trainer/v0000000001"
[ -e "$checkpoint/COMMITTED" ] || fail "no committed checkpoint under the packaged root"

step "4. dpkg -r and --purge leave the checkpoints"
find "$checkpoint" -type f | sort >"$work/before"
"${dpkg_root[@]}" -r ckptd libckpt-dev libckpt0 >"$work/dpkg-remove.log" 2>&1 || fail "dpkg -r"
[ ! -e "$root/usr/bin/ckptd" ] && [ ! -e "$root/usr/lib/libckpt.so.0" ] || fail "dpkg -r left the packaged files"
[ -e "$root/etc/ckptd/ckptd.conf" ] || fail "dpkg -r removed a conffile"
find "$checkpoint" -type f | sort | cmp -s - "$work/before" || fail "dpkg -r changed the checkpoints"
"${dpkg_root[@]}" --purge ckptd libckpt-dev libckpt0 >"$work/dpkg-purge.log" 2>&1 || fail "dpkg --purge"
[ ! -e "$root/etc/ckptd/ckptd.conf" ] || fail "dpkg --purge left the conffiles"
find "$checkpoint" -type f | sort | cmp -s - "$work/before" || fail "dpkg --purge changed the checkpoints"
echo "PASS"
