# shellcheck shell=bash
# Shared by the packaging tests (install_prefix_test.sh, deb_package_test.sh, wheel_test.sh).
# Sourced, never run. After `packaging_setup NAME`:
#   $work      a new temporary directory, removed on exit (EXIT, INT, TERM, HUP)
#   children   the processes the test started (add each pid): on exit each is sent SIGTERM
#              and waited for before $work goes, and the shm objects libckpt names after
#              it (/dev/shm/ckpt-UID-PID-*) are removed
#   fail MSG   prints MSG and the tail of every $work/*.log, exits 1
#   step MSG   prints a heading
#   start_ckptd CKPTD CKPTCTL SOCKET ARGS...   starts CKPTD --socket SOCKET ARGS... (log:
#              $work/ckptd.log), sets $daemon, and waits (at most 30 s, polling) until
#              CKPTCTL status answers on SOCKET
#   stop_ckptd  SIGTERM to $daemon; fails unless it exits 0
packaging_setup() {
  uid="$(id -u)"
  work="$(mktemp -d "${TMPDIR:-/tmp}/ckpt-$1.XXXXXX")"
  children=()
  trap packaging_cleanup EXIT
  trap 'exit 143' TERM INT HUP
}

packaging_cleanup() {
  local p
  for p in "${children[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${children[@]}"; do
    wait "$p" 2>/dev/null || true
    rm -f "/dev/shm/ckpt-$uid-$p-"* "/dev/shm/ckpt-release-$p-"*
  done
  rm -rf "$work"
}

fail() {
  echo "FAIL: $*"
  local log
  for log in "$work"/*.log; do
    [ -e "$log" ] && { echo "--- $log:"; tail -n 30 "$log"; }
  done
  exit 1
}

step() { echo "== $*"; }

start_ckptd() {
  local bin="$1" ctl="$2" sock="$3"
  shift 3
  "$bin" --socket "$sock" "$@" >"$work/ckptd.log" 2>&1 &
  daemon=$!
  children+=("$daemon")
  local _
  for _ in $(seq 1 300); do
    [ -S "$sock" ] && "$ctl" --socket "$sock" status >/dev/null 2>&1 && return 0
    kill -0 "$daemon" 2>/dev/null || fail "ckptd ($bin) exited at start"
    sleep 0.1
  done
  fail "ckptd ($bin) does not answer on $sock within 30 s"
}

stop_ckptd() {
  kill -TERM "$daemon"
  wait "$daemon" || fail "ckptd did not stop cleanly on SIGTERM (exit $?)"
}
