#!/usr/bin/env bash
# Nothing left behind: a real bench (bench/restore_mem.sh, small: a ckptd, a trainer with its
# shm regions, a socket and a directory under $TMPDIR) ended while its trainer runs, by
#   term     SIGTERM to the script alone (kill): it must end its children itself;
#   int      SIGINT to the script alone (its background children ignore SIGINT);
#   timeout  `timeout` expiring (SIGALRM to timeout, which then sends SIGTERM to the whole
#            process group, the bench's daemon and trainer included);
#   kill9    SIGKILL to the script alone (no cleanup can run), then a second run of the bench,
#            itself ended by SIGTERM: its start ends the first run's daemon and trainer and
#            removes their files;
# leaves nothing: its $TMPDIR is as empty as before, no process of it runs, no shm object
# named after one of its processes (libckpt's /dev/shm/ckpt-UID-PID-*) remains, and /tmp
# holds no directory of the bench. Each case runs with a private TMPDIR and looks only at
# names that carry the pids of the bench's own processes, so tests running beside it (which
# create and remove their own entries) neither disturb it nor are disturbed.
#
# Usage: leftovers_test.sh BUILD_DIR [CASE ...]   (default: term int timeout kill9)
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
build="$(cd "${1:?usage: leftovers_test.sh BUILD_DIR [CASE ...]}" && pwd)"
shift
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(term int timeout kill9)
for b in ckptd ckptctl ckpt-toy-trainer ckpt-memcpy-bw; do
  [ -x "$build/$b" ] || { echo "FAIL: $build/$b is not built"; exit 1; }
done
uid="$(id -u)"
work="$(mktemp -d "${TMPDIR:-/tmp}/leftovers-test.XXXXXX")"
seen_pids=()
# Whatever the bench failed to remove goes here, so that a failing run leaves nothing either.
cleanup() {
  local p
  for p in "${seen_pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for p in "${seen_pids[@]}"; do rm -f "/dev/shm/ckpt-$uid-$p-"* "/dev/shm/ckpt-release-$p-"*; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' TERM INT HUP

fail() {
  echo "FAIL ($1): $2"
  echo "--- the bench's output:"
  cat "$work/$1.log" 2>/dev/null || true
  exit 1
}

descendants() {  # PID: its descendants' pids
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do
    echo "$c"
    descendants "$c"
  done
}

# Bounded polls (the bench's start and its cleanup take what the machine gives them).
within() {  # SECONDS COMMAND...: true once COMMAND succeeds, false after SECONDS
  local deadline=$(($(date +%s) + $1))
  shift
  until "$@"; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.05
  done
}

# The bench's processes, and the shm objects named after them, found while it runs.
pids=()
shm=()
snapshot() {  # ROOT_PID: true once the trainer has registered (a region and the socket exist)
  mapfile -t pids < <(descendants "$1")
  shm=()
  local p f
  for p in "${pids[@]}"; do
    for f in /dev/shm/ckpt-"$uid-$p"-*; do [ -e "$f" ] && shm+=("$f"); done
  done
  [ ${#shm[@]} -gt 0 ] && compgen -G "$tmp/ckpt-restore-mem-*/ckptd.sock" >/dev/null
}

ended() {  # PID...: true once none of them runs (a zombie has ended)
  local p
  for p in "$@"; do
    if kill -0 "$p" 2>/dev/null && [ "$(ps -o stat= -p "$p" 2>/dev/null)" != Z ]; then return 1; fi
  done
}

for c in "${cases[@]}"; do
  tmp="$work/tmp-$c"
  mkdir -p "$tmp"
  tmp_before="$(ls -A /tmp | grep -c 'ckpt-restore-mem-' || true)"
  # A long compute phase: the first trainer stays registered (its regions mapped) until the
  # signal comes.
  bench=(bash "$here/bench/restore_mem.sh" --build "$build" --no-build --mib 4 --restores 3 --compute-ms 600000
    --pool-mib 64 --out "$work/$c.json")
  # env --default-signal: a command this script starts with & would otherwise ignore SIGINT
  # (as every background command of a non-interactive shell does), and bash cannot trap a
  # signal ignored at its start.
  start_bench() {
    case "$c" in
      term | int | kill9) TMPDIR="$tmp" env --default-signal=INT "${bench[@]}" >>"$work/$c.log" 2>&1 & ;;
      timeout) TMPDIR="$tmp" env --default-signal=INT timeout -s TERM 600 "${bench[@]}" >"$work/$c.log" 2>&1 & ;;
      *) echo "unknown case $c" >&2; exit 2 ;;
    esac
    root=$!
    seen_pids+=("$root")
    within 60 snapshot "$root" || fail "$c" "the bench did not start its daemon and trainer within 60 s"
    seen_pids+=("${pids[@]}")
  }
  start_bench
  if [ "$c" = kill9 ]; then
    kill -KILL "$root"
    wait "$root" || true
    killed_pids=("${pids[@]}")
    killed_shm=("${shm[@]}")
    ended "${killed_pids[@]}" && fail "$c" "SIGKILL of the script alone should have left its daemon and trainer"
    start_bench
    pids+=("${killed_pids[@]}")
    shm+=("${killed_shm[@]}")
  fi
  case "$c" in
    term | kill9) kill -TERM "$root" ;;
    int) kill -INT "$root" ;;
    timeout) kill -ALRM "$root" ;;  # what timeout's own timer sends it
  esac
  within 60 ended "$root" || fail "$c" "the bench still runs 60 s after the signal"
  rc=0
  wait "$root" || rc=$?
  want=$(case "$c" in term | kill9) echo 143 ;; int) echo 130 ;; *) echo 124 ;; esac)
  [ "$rc" = "$want" ] || fail "$c" "the bench exited with $rc, not $want"
  within 30 ended "${pids[@]}" || fail "$c" "processes of the bench still run: $(ps -o pid=,args= -p "$(IFS=,; echo "${pids[*]}")")"
  for f in "${shm[@]}"; do [ ! -e "$f" ] || fail "$c" "shm object $f is left"; done
  for p in "${pids[@]}"; do
    left=(/dev/shm/ckpt-"$uid-$p"-*)
    [ ! -e "${left[0]}" ] || fail "$c" "shm objects of pid $p are left: ${left[*]}"
  done
  [ -z "$(ls -A "$tmp")" ] || fail "$c" "left under TMPDIR: $(ls -A "$tmp")"
  tmp_after="$(ls -A /tmp | grep -c 'ckpt-restore-mem-' || true)"
  [ "$tmp_after" -le "$tmp_before" ] || fail "$c" "a ckpt-restore-mem-* directory appeared in /tmp"
  echo "leftovers_test: $c: the bench exited $rc, ${#pids[@]} processes and ${#shm[@]} shm objects gone, TMPDIR empty"
done
echo "leftovers_test: OK"
