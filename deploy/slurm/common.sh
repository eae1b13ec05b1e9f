# shellcheck shell=bash
# Shared by prolog.sh, epilog.sh and task_prolog.sh: settings and the identity checks of
# the per-job daemon. Sourced, never run.

# The env file: /etc/default/ckptd unless CKPTD_ENV_FILE names another (tests do).
ckptd_env_file="${CKPTD_ENV_FILE:-/etc/default/ckptd}"
if [ -r "$ckptd_env_file" ]; then
  # shellcheck disable=SC1090
  . "$ckptd_env_file"
fi
CKPTD_BIN="${CKPTD_BIN:-/usr/local/bin/ckptd}"
CKPTD_SLURM_MODE="${CKPTD_SLURM_MODE:-job}"
CKPTD_NODE_SOCKET="${CKPTD_NODE_SOCKET:-/run/ckptd/ckptd.sock}"
CKPTD_RUN_BASE="${CKPTD_RUN_BASE:-/run/ckptd-jobs}"
CKPTD_LOG_DIR="${CKPTD_LOG_DIR:-/var/log/ckptd}"
CKPTD_READY_TIMEOUT_S="${CKPTD_READY_TIMEOUT_S:-60}"
CKPTD_STOP_TIMEOUT_S="${CKPTD_STOP_TIMEOUT_S:-120}"

job_id="${SLURM_JOB_ID:-}"
job_dir="$CKPTD_RUN_BASE/job-$job_id"
job_socket="$job_dir/ckptd.sock"
# Root-owned, outside the user's directory: the user cannot forge what the epilog signals.
job_state="$CKPTD_RUN_BASE/job-$job_id.pid"
job_log="$CKPTD_LOG_DIR/job-$job_id.log"

# One line to stderr (Slurm's log of the script) and to the scripts' own log.
ckptd_log() {
  local line
  line="$(date -u +%FT%TZ) ckptd-slurm[$$] ${ckptd_script:-?} job ${job_id:-?}: $*"
  echo "$line" >&2
  if [ -d "$CKPTD_LOG_DIR" ] && [ "$(id -u)" -eq 0 ]; then
    echo "$line" >>"$CKPTD_LOG_DIR/slurm-scripts.log" 2>/dev/null || true
  fi
}

# The start time of process $1 in clock ticks since boot (field 22 of /proc/PID/stat; the
# fields are counted after the command name, which may contain spaces).
proc_start_time() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  # shellcheck disable=SC2086
  set -- $stat
  echo "${20}"
}

# Succeeds while process $1 runs (exists and is not a zombie waiting to be reaped).
proc_running() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  [ "${stat%% *}" != Z ]
}

proc_uid() { awk '/^Uid:/ { print $2; exit }' "/proc/$1/status" 2>/dev/null; }

# Prints "PID START UID EXE" of a running process, or fails.
proc_identity() {
  local start uid exe
  start="$(proc_start_time "$1")" || return 1
  uid="$(proc_uid "$1")" || return 1
  exe="$(readlink "/proc/$1/exe" 2>/dev/null)" || return 1
  [ -n "$start" ] && [ -n "$uid" ] || return 1
  echo "$1 $start $uid $exe"
}

# Succeeds when the process recorded in $job_state is still that very process (same pid,
# start time, real uid and executable); a reused pid fails it. An executable replaced on
# disk since (a package upgrade under a running job) reads "EXE (deleted)" and still counts.
recorded_daemon_alive() {
  local recorded now
  recorded="$(cat "$job_state" 2>/dev/null)" || return 1
  [ -n "$recorded" ] || return 1
  now="$(proc_identity "${recorded%% *}")" || return 1
  [ "$now" = "$recorded" ] || [ "$now" = "$recorded (deleted)" ]
}

# %u in a configured path is the job's user.
expand_user() { echo "${1//%u/$2}"; }
