#!/usr/bin/env bash
# Slurm prolog (runs as root on each node before the job): starts one ckptd for the job's
# user, with its socket in the user's runtime area, and waits until it serves.
# Configure in slurm.conf:  Prolog=/usr/local/libexec/ckptd/prolog.sh
# Trainers then find the daemon through CKPTD_SOCKET=/tmp/ckptd-$UID/ckptd.sock (the default).
set -euo pipefail
user="${SLURM_JOB_USER:?}"
uid="$(id -u "$user")"
# CKPTD_ROOT: the persistent tier, the same (shared) directory on every node;
# CKPTD_LOCAL: this node's local tier (empty: none).
root="${CKPTD_ROOT:-/local/ckptd/$user}"
local_tier="${CKPTD_LOCAL:-}"
sockdir="/tmp/ckptd-$uid"
install -d -m 0700 -o "$user" "$sockdir"
install -d -m 0700 -o "$user" "$root"
local_args=()
if [ -n "$local_tier" ]; then
  install -d -m 0700 -o "$user" "$local_tier"
  local_args=(--local "$local_tier")
fi
ready="$(mktemp -u /tmp/ckptd-ready-XXXXXX)"
mkfifo -m 0600 "$ready"
chown "$user" "$ready"
# Run as the job's user so only that user's trainers are served.
setsid runuser -u "$user" -- /usr/local/bin/ckptd --config /etc/ckptd/ckptd.conf \
  --socket "$sockdir/ckptd.sock" --root "$root" "${local_args[@]}" --ready-fd 3 3>"$ready" \
  >>"$sockdir/ckptd.log" 2>&1 < /dev/null &
echo $! > "$sockdir/ckptd.pid"
timeout 60 head -n1 "$ready" >/dev/null
rm -f "$ready"
