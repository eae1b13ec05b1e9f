#!/usr/bin/env bash
# Slurm Prolog (slurm.conf: Prolog=/usr/local/libexec/ckptd/prolog.sh): runs as root on
# each node of a job before it starts. In job mode (the default) it starts one ckptd for the
# job, as the job's user, serving CKPTD_RUN_BASE/job-ID/ckptd.sock (TaskProlog exports it to
# the tasks), and waits until it serves. In node mode it only checks that the node daemon
# answers. Settings: /etc/default/ckptd (ckptd-slurm.env). Exits non-zero, saying why, when
# no daemon serves the job: Slurm then drains the node and requeues the job.
set -euo pipefail
ckptd_script=prolog
# shellcheck source=common.sh
. "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/common.sh"

fail() {
  ckptd_log "FAILED: $*"
  exit 1
}

[ -n "$job_id" ] || fail "SLURM_JOB_ID is not set (run by slurmd as Prolog)"
user="${SLURM_JOB_USER:-}"
[ -n "$user" ] || fail "SLURM_JOB_USER is not set"
uid="$(id -u "$user" 2>/dev/null)" || fail "user '$user' is unknown on $(hostname -s)"
gid="$(id -g "$user")"

if [ "$CKPTD_SLURM_MODE" = node ]; then
  # The systemd unit's daemon serves every user; the job only needs it to be up.
  ctl="$(dirname "$CKPTD_BIN")/ckptctl"
  [ -S "$CKPTD_NODE_SOCKET" ] || fail "node mode: no ckptd socket at $CKPTD_NODE_SOCKET (is ckptd.service running?)"
  if [ -x "$ctl" ] && ! timeout 10 setpriv --reuid="$uid" --regid="$gid" --init-groups -- \
      "$ctl" --socket "$CKPTD_NODE_SOCKET" status >/dev/null 2>&1; then
    fail "node mode: ckptd at $CKPTD_NODE_SOCKET does not answer user '$user' (uid $uid)"
  fi
  exit 0
fi
[ "$CKPTD_SLURM_MODE" = job ] || fail "CKPTD_SLURM_MODE is '$CKPTD_SLURM_MODE': expected job or node"

[ -x "$CKPTD_BIN" ] || fail "ckptd binary $CKPTD_BIN is missing or not executable (set CKPTD_BIN in $ckptd_env_file)"
[ -n "${CKPTD_ROOT:-}" ] || fail "CKPTD_ROOT is not set in $ckptd_env_file: it must name the shared checkpoint directory"
root="$(expand_user "$CKPTD_ROOT" "$user")"
# Never created here: a missing root usually means the shared file system is not mounted.
[ -d "$root" ] || fail "checkpoint root $root does not exist on $(hostname -s) (not mounted? it is never created here)"
as_user=(setpriv --reuid="$uid" --regid="$gid" --init-groups --)
"${as_user[@]}" test -w "$root" -a -x "$root" || fail "checkpoint root $root is not writable by user '$user' (uid $uid)"
local_args=()
if [ -n "${CKPTD_LOCAL:-}" ]; then
  local_tier="$(expand_user "$CKPTD_LOCAL" "$user")"
  [ -d "$local_tier" ] || fail "local tier $local_tier does not exist (it is never created here)"
  "${as_user[@]}" test -w "$local_tier" -a -x "$local_tier" || fail "local tier $local_tier is not writable by user '$user' (uid $uid)"
  local_args=(--local "$local_tier")
fi
config_args=()
if [ -n "${CKPTD_CONFIG:-}" ]; then
  [ -r "$CKPTD_CONFIG" ] || fail "config file $CKPTD_CONFIG (CKPTD_CONFIG) is not readable"
  config_args=(--config "$CKPTD_CONFIG")
fi

# The base is ours: root-owned, 0755 (users traverse it to their own 0700 job directory).
if [ ! -d "$CKPTD_RUN_BASE" ]; then
  install -d -m 0755 -o root -g root "$CKPTD_RUN_BASE"
fi
read -r base_uid base_mode < <(stat -c '%u %a' "$CKPTD_RUN_BASE")
if [ "$base_uid" != 0 ] || [ $((8#$base_mode & 8#022)) -ne 0 ]; then
  fail "$CKPTD_RUN_BASE is not root-owned or is group/world-writable (uid $base_uid, mode $base_mode); refusing it"
fi
mkdir -p -m 0755 "$CKPTD_LOG_DIR"

if [ -e "$job_state" ]; then
  if recorded_daemon_alive; then
    fail "a ckptd is already running for job $job_id ($(cat "$job_state"))"
  fi
  ckptd_log "removing the stale state of an earlier run of job $job_id ($(cat "$job_state" 2>/dev/null))"
  rm -f "$job_state"
fi
# A directory left by an earlier run of this job id (requeue after a crash) is replaced:
# it lies under our root-owned base, and rm does not follow links the user planted in it.
rm -rf --one-file-system "$job_dir"
install -d -m 0700 -o "$uid" -g "$gid" "$job_dir"
install -m 0640 -o root -g "$gid" /dev/null "$job_log.new"
mv -f "$job_log.new" "$job_log"

work="$(mktemp -d "$CKPTD_RUN_BASE/.prolog-$job_id-XXXXXX")"
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
mkfifo -m 0600 "$work/ready"

# setsid, setpriv and env all exec, so $! is ckptd's own pid: SIGTERM reaches ckptd, not a
# wrapper that would SIGKILL it. setsid: slurmd's kill of the prolog's process group on a
# timeout must not reach the daemon. The daemon's own name in temporary files is per job,
# so that the daemon of another job (of this user too) never deletes this one's .tmp files.
node_id="$(hostname -s)-job$job_id"
home="$(getent passwd "$user" | cut -d: -f6)"
setsid "${as_user[@]}" env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="${home:-/}" USER="$user" \
  LOGNAME="$user" SLURM_JOB_ID="$job_id" \
  "$CKPTD_BIN" "${config_args[@]}" --socket "$job_socket" --root "$root" "${local_args[@]}" \
  --node-id "$node_id" --ready-fd 3 \
  3>"$work/ready" </dev/null >>"$job_log" 2>&1 &
pid=$!
# Opening the read end waits for the daemon's write end; ckptd holds the only write end, so
# its exit ends the read at once (EOF) and the timeout covers a daemon that hangs.
line=""
read_rc=0
exec {ready_fd}<"$work/ready"
read -r -t "$CKPTD_READY_TIMEOUT_S" -u "$ready_fd" line || read_rc=$?
exec {ready_fd}<&-
if [ "$line" != ready ]; then
  if [ $read_rc -gt 128 ]; then
    status="not ready after ${CKPTD_READY_TIMEOUT_S} s; killed"
  else
    # End of file: the daemon closed its end, which it does by exiting; give the exit a
    # moment to complete (a zombie still answers kill -0), then collect its status.
    deadline=$((SECONDS + 10))
    while proc_running "$pid" && [ $SECONDS -lt $deadline ]; do sleep 0.05; done
    status="closed its ready descriptor without serving; killed"
  fi
  if proc_running "$pid"; then
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  else
    rc=0
    wait "$pid" || rc=$?
    status="exited with status $rc"
  fi
  rm -rf --one-file-system "$job_dir"
  errors="$(tail -n 5 "$job_log" | tr '\n' ' ')"
  fail "ckptd for user '$user' (uid $uid), root $root, did not start: $status; its log $job_log says: ${errors:-nothing}"
fi
identity="$(proc_identity "$pid")" || fail "ckptd pid $pid vanished right after reporting ready"
# The executable is the rest of the line: its path may hold spaces.
read -r _ _ found_uid found_exe <<<"$identity"
if [ "$found_uid" != "$uid" ] || [ "$found_exe" != "$(readlink -f "$CKPTD_BIN")" ]; then
  kill -KILL "$pid" 2>/dev/null || true
  fail "process $pid is not ckptd running as uid $uid (found uid $found_uid, exe $found_exe)"
fi
echo "$identity" >"$job_state.new"
mv -f "$job_state.new" "$job_state"
ckptd_log "ckptd pid $pid serves user '$user' (uid $uid) on $job_socket, root $root"
