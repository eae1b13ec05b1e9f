# Sourced by every benchmark script: nothing a bench created outlives it, however it ends
# (normal exit, a failed command under set -e, SIGTERM from kill or timeout, SIGINT, SIGHUP).
#
#   bench_cleanup_init          traps EXIT, and INT/TERM/HUP as exit 130/143/129 (which runs
#                               the EXIT trap). Call it once, before creating anything.
#   bench_cleanup_add PATH...   removed (rm -rf) at the end, once every child is gone.
#   bench_cleanup_hook CMD      run (eval) at the end, after the children and the removal
#                               (stopping a GlusterFS volume, removing a parent directory if
#                               empty); hooks run in order.
#   bench_run CMD...            runs the external command CMD as a child and waits for it,
#                               returning its status. Use it for anything that runs long:
#                               bash defers a trap until a foreground child ends, and a
#                               child started so is known to the cleanup.
#   bench_track PID             a child started with & by the script itself (a daemon, a
#                               trainer), so that the cleanup ends it.
#   bench_wait PID              waits for it and returns its status.
#
# At the end, in this order: every child still running and its descendants get SIGTERM
# (trainers and drivers before daemons: a daemon reaps a dead trainer's shared memory only
# while it runs), then SIGKILL after CKPT_BENCH_GRACE_S (default 20) seconds; then the
# shared memory a child trainer left (libckpt names it /dev/shm/ckpt-UID-PID-* and
# /dev/shm/ckpt-release-PID-*, after its creator's pid, so no other process's regions match)
# is removed; then the paths go; then the hooks run. CKPT_BENCH_KEEP=1 keeps the paths (the
# children are still ended). The exit status is the script's own (128 + N for signal N).
#
# SIGKILL leaves no time for any of that, so each run also keeps a manifest of its paths and
# processes (pid and start time) in $TMPDIR/ckpt-bench-runs-UID/PID-START, removed at its
# end; bench_cleanup_init first sweeps the manifests of runs that are gone: their processes
# that still run (the same pid and start time: never a reused pid) get SIGTERM, then SIGKILL,
# their children's shared memory and their paths are removed.
_bench_paths=()
_bench_hooks=()
_bench_children=()
_bench_daemons=()
# The start time of each tracked pid, taken while it is our unreaped child: a pid whose
# process now has another start time was reused by someone else's and is never signalled,
# nor its shared memory removed.
declare -A _bench_started=()
_bench_runs="${TMPDIR:-/tmp}/ckpt-bench-runs-$(id -u)"
_bench_manifest=""

# The start time of process PID (field 22 of /proc/PID/stat), empty if it is gone.
_bench_start_time() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 0
  stat="${stat##*) }"
  echo "$stat" | cut -d' ' -f20
}
_bench_note() {  # KIND VALUE: a line of this run's manifest
  if [ -n "$_bench_manifest" ]; then echo "$1 $2" >>"$_bench_manifest"; fi
}
_bench_note_pid() {
  _bench_started[$1]="$(_bench_start_time "$1")"
  _bench_note pid "$1 ${_bench_started[$1]}"
}
# Whether PID is gone or still the process that was tracked under it (not reused).
_bench_ours() {
  local now
  now="$(_bench_start_time "$1")"
  [ -z "$now" ] || [ -z "${_bench_started[$1]:-}" ] || [ "$now" = "${_bench_started[$1]}" ]
}

bench_cleanup_init() {
  trap _bench_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  trap 'exit 129' HUP
  _bench_sweep_stale
  mkdir -p "$_bench_runs"
  _bench_manifest="$_bench_runs/$$-$(_bench_start_time $$)"
  : >"$_bench_manifest"
}
bench_cleanup_add() {
  _bench_paths+=("$@")
  local p
  for p in "$@"; do _bench_note path "$(realpath -m "$p")"; done
}
bench_cleanup_hook() { _bench_hooks+=("$1"); }
bench_track() {
  _bench_children+=("$1")
  _bench_note_pid "$1"
}
bench_track_daemon() {
  _bench_daemons+=("$1")
  _bench_note_pid "$1"
}
bench_wait() {
  local rc=0
  wait "$1" || rc=$?
  return $rc
}
bench_run() {
  "$@" &
  local pid=$!
  bench_track "$pid"
  bench_wait "$pid"
}

# Removes what the runs that ended without their cleanup (SIGKILL) left.
_bench_sweep_stale() {
  local m name kind rest a b uid
  uid=$(id -u)
  for m in "$_bench_runs"/*-*; do
    [ -f "$m" ] || continue
    name="${m##*/}"
    [ "$(_bench_start_time "${name%%-*}")" != "${name#*-}" ] || continue  # that run still runs
    local live=()
    while read -r kind rest; do
      [ "$kind" = pid ] || continue
      read -r a b <<<"$rest"
      if [ -n "$b" ] && [ "$(_bench_start_time "$a")" = "$b" ]; then live+=("$a"); fi
    done <"$m"
    if [ ${#live[@]} -gt 0 ]; then
      echo "bench: ending processes ${live[*]} of an earlier run that was killed" >&2
      _bench_end "${live[@]}"
    fi
    while read -r kind rest; do
      [ "$kind" = pid ] || continue
      read -r a b <<<"$rest"
      local now
      now="$(_bench_start_time "$a")"
      [ -z "$now" ] || [ "$now" = "$b" ] || continue  # the pid is another process's now
      rm -f "/dev/shm/ckpt-$uid-$a-"* "/dev/shm/ckpt-release-$a-"*
    done <"$m"
    while read -r kind rest; do
      if [ "$kind" = path ] && [ -e "$rest" ]; then
        echo "bench: removing $rest, left by an earlier run that was killed" >&2
        rm -rf "$rest"
      fi
    done <"$m"
    rm -f "$m"
  done
}

# The pids of PID's descendants, children first (read before any is signalled: a child whose
# parent died is re-parented, and then no longer found under it).
_bench_descendants() {
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do
    echo "$c"
    _bench_descendants "$c"
  done
}

# Ends PIDs and all their descendants: SIGTERM, then SIGKILL after the grace period.
_bench_end() {
  local all=() p
  for p in "$@"; do
    kill -0 "$p" 2>/dev/null || continue
    _bench_ours "$p" || continue
    all+=("$p")
    while read -r d; do all+=("$d"); done < <(_bench_descendants "$p")
  done
  [ ${#all[@]} -gt 0 ] || return 0
  _bench_trainer_pids+=("${all[@]}")
  kill -TERM "${all[@]}" 2>/dev/null || true
  local deadline=$(($(date +%s) + ${CKPT_BENCH_GRACE_S:-20}))
  for p in "${all[@]}"; do
    while kill -0 "$p" 2>/dev/null && [ "$(ps -o stat= -p "$p" 2>/dev/null)" != Z ]; do
      if [ "$(date +%s)" -ge "$deadline" ]; then
        kill -KILL "$p" 2>/dev/null || true
        break
      fi
      sleep 0.05
    done
    wait "$p" 2>/dev/null || true
  done
}

_bench_cleanup() {
  local rc=$? p
  trap '' INT TERM HUP  # the cleanup runs to its end
  _bench_trainer_pids=("${_bench_children[@]}")
  local others=()
  for p in "${_bench_children[@]}" $(jobs -p); do
    [[ " ${_bench_daemons[*]} " == *" $p "* ]] || others+=("$p")
  done
  _bench_end "${others[@]}"
  _bench_end "${_bench_daemons[@]}"
  local uid
  uid=$(id -u)
  for p in "${_bench_trainer_pids[@]}"; do
    _bench_ours "$p" || continue
    rm -f "/dev/shm/ckpt-$uid-$p-"* "/dev/shm/ckpt-release-$p-"*
  done
  if [ -n "${CKPT_BENCH_KEEP:-}" ]; then
    [ ${#_bench_paths[@]} -eq 0 ] || echo "kept ${_bench_paths[*]}" >&2
  else
    for p in "${_bench_paths[@]}"; do rm -rf "$p"; done
  fi
  if [ -n "$_bench_manifest" ]; then
    rm -f "$_bench_manifest"
    rmdir "$_bench_runs" 2>/dev/null || true
  fi
  local hook
  for hook in "${_bench_hooks[@]}"; do eval "$hook" || true; done
  exit "$rc"
}
