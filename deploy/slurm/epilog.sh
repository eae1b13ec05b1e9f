#!/usr/bin/env bash
# Slurm epilog: stops the job user's ckptd; SIGTERM lets in-flight shards finish.
set -uo pipefail
uid="$(id -u "${SLURM_JOB_USER:?}")"
pidfile="/tmp/ckptd-$uid/ckptd.pid"
[ -f "$pidfile" ] || exit 0
pid="$(cat "$pidfile")"
kill -TERM "$pid" 2>/dev/null || exit 0
for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
rm -f "$pidfile"
