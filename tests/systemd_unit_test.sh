#!/bin/bash
# The systemd unit (deploy/ckptd.service) is valid and stays hardened:
#   systemd_unit_test.sh verify UNIT CKPTD   systemd-analyze verify prints nothing (no warning)
#   systemd_unit_test.sh security UNIT MAX   systemd-analyze security scores it at most MAX
# verify needs the ExecStart binary to exist, so it checks a copy naming the built ckptd.
# Both work offline, without systemd as PID 1. Exit 77 (skipped) without systemd-analyze.
set -euo pipefail
mode=$1 unit=$2 arg=$3
if ! command -v systemd-analyze >/dev/null; then
  echo "systemd-analyze is not installed (Debian: systemd); skipped"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
case $mode in
  verify)
    sed "s|/usr/local/bin/ckptd|$arg|g" "$unit" >"$work/ckptd.service"
    out=$(systemd-analyze verify --man=no "$work/ckptd.service" 2>&1) || {
      echo "systemd-analyze verify failed:"; echo "$out"; exit 1; }
    if [[ -n $out ]]; then
      echo "systemd-analyze verify warns about $unit:"; echo "$out"; exit 1
    fi
    echo "systemd-analyze verify: $unit is clean"
    ;;
  security)
    out=$(systemd-analyze security --offline=yes "$unit" 2>&1)
    score=$(sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p' <<<"$out")
    if [[ -z $score ]]; then
      echo "no score in the output of systemd-analyze security:"; echo "$out"; exit 1
    fi
    echo "systemd-analyze security: $unit scores $score (at most $arg allowed)"
    if ! awk -v s="$score" -v m="$arg" 'BEGIN { exit !(s <= m) }'; then
      echo "$out"
      echo "the unit's exposure $score is above $arg: a hardening setting was lost"; exit 1
    fi
    ;;
  *) echo "usage: $0 verify|security UNIT ARG" >&2; exit 2 ;;
esac
