#!/usr/bin/env bash
# Slurm Epilog (slurm.conf: Epilog=/usr/local/libexec/ckptd/epilog.sh): runs as root on
# each node after the job's processes are gone. Stops the job's ckptd (SIGTERM, which lets
# the shards in flight finish, then up to CKPTD_STOP_TIMEOUT_S before SIGKILL), signalling
# only the process the prolog recorded (same pid, start time, uid and executable), and
# removes what the job left on the node: its socket directory and the shared memory of its
# trainers. Exits non-zero only when it could not stop the daemon (Slurm drains the node).
set -uo pipefail
ckptd_script=epilog
# shellcheck source=common.sh
. "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/common.sh"
[ -n "$job_id" ] || { ckptd_log "SLURM_JOB_ID is not set"; exit 1; }
user="${SLURM_JOB_USER:-}"
uid="${SLURM_JOB_UID:-$(id -u "$user" 2>/dev/null)}"
rc=0
# Whether the daemon may have left temporary files: it died by itself, or was SIGKILLed.
left_tmp=0

# Node mode: a Slurm job that succeeded finished the checkpoint jobs the operator names; their
# memory images and replicas go. Any other end (failure, cancel, requeue, node failure) keeps
# them for the restart, as a trainer crash does.
if [ "$CKPTD_SLURM_MODE" = node ] && [ -n "${CKPTD_FINISH_JOBS:-}" ]; then
  # The batch script's status and the highest of the job's steps' must both be 0 (a variable
  # an older slurmd does not set counts as a failure: nothing is dropped).
  derived="${SLURM_JOB_DERIVED_EC:-0}"
  if [ "${SLURM_JOB_EXIT_CODE:-1}" = 0 ] && [ "${derived%%:*}" = 0 ]; then
    ctl="$(dirname "$CKPTD_BIN")/ckptctl"
    read -r -a patterns <<<"$CKPTD_FINISH_JOBS"  # split on blanks, no glob expansion
    for pattern in "${patterns[@]}"; do
      if [[ "$pattern" == *%u* && -z "$user" ]]; then
        ckptd_log "CKPTD_FINISH_JOBS entry '$pattern' needs %u and SLURM_JOB_USER is not set; skipped"
        continue
      fi
      ckpt_job="${pattern//%j/$job_id}"
      ckpt_job="${ckpt_job//%u/$user}"
      # A trainer killed without unregistering is let go by the daemon within a second (its
      # reaper): a refusal for a trainer still registered is retried that long.
      for attempt in 1 2 3 4 5 6 7 8 9 10; do
        if out="$(timeout 60 "$ctl" --socket "$CKPTD_NODE_SOCKET" finish --job "$ckpt_job" 2>&1)"; then
          ckptd_log "$out"
          break
        fi
        if [[ "$out" != *"still has a registered trainer"* ]] || [ "$attempt" = 10 ]; then
          ckptd_log "ckptctl finish --job $ckpt_job: $out"
          break
        fi
        sleep 0.2
      done
    done
  else
    ckptd_log "exit code ${SLURM_JOB_EXIT_CODE:-unknown} (steps: ${SLURM_JOB_DERIVED_EC:-unknown}): checkpoint jobs kept in memory for a restart"
  fi
fi

if [ "$CKPTD_SLURM_MODE" = job ] && [ -e "$job_state" ]; then
  recorded="$(cat "$job_state" 2>/dev/null)"
  pid="${recorded%% *}"
  if ! recorded_daemon_alive; then
    # Exited already, or the pid now belongs to another process: nothing is signalled.
    ckptd_log "ckptd pid ${pid:-?} of the job is gone (recorded: '$recorded', now: '$(proc_identity "${pid:-0}" 2>/dev/null)'); not signalling"
    left_tmp=1
  else
    kill -TERM "$pid"
    deadline=$((SECONDS + CKPTD_STOP_TIMEOUT_S))
    while recorded_daemon_alive && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    if recorded_daemon_alive; then
      ckptd_log "ckptd pid $pid did not stop within $CKPTD_STOP_TIMEOUT_S s of SIGTERM; sending SIGKILL (its shards in flight are lost)"
      kill -KILL "$pid"
      left_tmp=1
      deadline=$((SECONDS + 10))
      while recorded_daemon_alive && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
      if recorded_daemon_alive; then
        ckptd_log "ckptd pid $pid survived SIGKILL"
        rc=1
      fi
    else
      ckptd_log "ckptd pid $pid stopped"
    fi
  fi
  [ $rc -ne 0 ] || rm -f "$job_state"
fi

# A daemon that died (an OOM kill, a crash) or was SIGKILLed leaves its temporary files
# (NAME.NODE-ID.tmp) of the shards it was writing, and no later daemon removes them: the node
# id is this job's own, so no other daemon's files match either. A daemon that stopped
# normally left none.
if [ $left_tmp -eq 1 ] && [ -n "$user" ]; then
  node_id="$(hostname -s)-job$job_id"
  for dir in "${CKPTD_ROOT:+$(expand_user "$CKPTD_ROOT" "$user")}" \
             "${CKPTD_LOCAL:+$(expand_user "$CKPTD_LOCAL" "$user")}"; do
    [ -n "$dir" ] && [ -d "$dir" ] || continue
    find "$dir" -maxdepth 3 -type f -name "*.$node_id.tmp" -user "$uid" -print -delete 2>/dev/null |
      while read -r f; do ckptd_log "removed $f"; done
  done
fi

if [ $rc -eq 0 ] && [ -d "$job_dir" ]; then
  rm -rf --one-file-system "$job_dir"
fi

# Shared memory of the job's trainers (libckpt names it exactly /ckpt-UID-PID-N and
# /ckpt-release-PID-N). Slurm has killed every task of the job by now, but a task killed by
# a signal never unlinked its regions. Removed: the job user's objects of exactly those
# names whose creating process is gone and that no process has mapped; those of the user's
# other jobs on this node stay (their creators live, or, for a trainer in another PID
# namespace whose pids mean nothing here, they are mapped), and so does any other file of
# the user's that merely starts with "ckpt-".
shm_mapped() { grep -qsF -- "$1" /proc/[0-9]*/maps; }
if [ -n "$uid" ]; then
  for f in /dev/shm/ckpt-*; do
    [ -f "$f" ] && [ "$(stat -c %u "$f" 2>/dev/null)" = "$uid" ] || continue
    name="${f#/dev/shm/}"
    if [[ "$name" =~ ^ckpt-release-([0-9]+)-[0-9]+$ ]] || [[ "$name" =~ ^ckpt-$uid-([0-9]+)-[0-9]+$ ]]; then
      creator="${BASH_REMATCH[1]}"
    else
      continue
    fi
    if [ -d "/proc/$creator" ] && [ "$(proc_uid "$creator")" = "$uid" ]; then
      continue
    fi
    shm_mapped "$f" && continue
    rm -f "$f" && ckptd_log "removed shared memory $f"
  done
fi
exit $rc
