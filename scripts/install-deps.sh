#!/usr/bin/env bash
# Installs the Debian 12 packages ckptd needs to build, test and benchmark.
# Idempotent: packages already present are left alone. Needs root (or sudo).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  # The lock-annotation check (scripts/check_thread_safety.sh) builds with clang, and so do
  # the libFuzzer targets (tests/fuzz/run.sh), whose runtimes Debian's clang only recommends.
  clang libclang-rt-14-dev libfuzzer-14-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  # HMAC-SHA256 of the peer secret (tokens, proofs, image MACs): OpenSSL's libcrypto.
  libssl-dev
  # ISA-L's Reed-Solomon kernels: the erasure code of peer redundancy.
  libisal-dev
  libspdlog-dev libfmt-dev catch2
  libxxhash-dev libcli11-dev nlohmann-json3-dev
  # Boost.Interprocess (header-only): the client's shared-memory regions.
  libboost-dev
  python3 fio procps
  # scripts/setup_torch2_venv.sh: the venv (with pip) that holds torch 2.x for the Python tests.
  python3-venv
  # bench/run.sh plots its results with matplotlib.
  python3-matplotlib
  # The Python module (pybind11) and its tests, for Debian's /usr/bin/python3.
  pybind11-dev python3-dev python3-torch python3-pytest python3-numpy python3-pip
  # tests/ops/: a real one-node Slurm (with munge) runs deploy/slurm/, and a GlusterFS
  # volume holds the multi-daemon tests' root (util-linux: setpriv).
  slurm-wlm munge glusterfs-server glusterfs-client util-linux
  # systemd-analyze verify/security on deploy/ckptd.service (tests/systemd_unit_test.sh);
  # systemd-sysusers and systemd-tmpfiles run by the ckptd package's postinst.
  systemd
  # The Debian packages (cpack -G DEB; tests/scripts/deb_package_test.sh): dpkg-shlibdeps
  # finds their Depends, `file` tells CPack which files are binaries.
  dpkg-dev file
  # The wheel built from the build tree (pip wheel --no-build-isolation ./python;
  # tests/scripts/wheel_test.sh).
  python3-setuptools python3-wheel
  # promtool checks the metrics text, and the scrape test runs a real Prometheus server.
  prometheus
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
