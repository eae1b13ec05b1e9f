#!/usr/bin/env bash
# A real one-node Slurm cluster for the ckptd tests: munged, slurmctld and slurmd, all
# configured and kept under one directory (CKPTD_SLURM_DIR, default /tmp/ckptd-slurm), with
# Prolog/Epilog/TaskProlog set to the worktree's deploy/slurm scripts. Nothing is written
# under /etc: every command gets SLURM_CONF=DIR/etc/slurm.conf (source DIR/env).
#   slurm_cluster.sh start BUILD_DIR   writes the config, starts the daemons, waits for idle
#   slurm_cluster.sh stop              stops what start started (safe to run twice)
# Needs root, slurm-wlm (22.05) and munge.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
D="${CKPTD_SLURM_DIR:-/tmp/ckptd-slurm}"
host="$(hostname -s)"
log() { echo "slurm_cluster: $*" >&2; }

# Waits up to $1 s for the command after it to succeed.
wait_for() {
  local limit=$1
  shift
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
  done
}

stop_pidfile() {
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid="$(cat "$f" 2>/dev/null)"
  # Only a process whose executable is the expected daemon is signalled.
  if [ -n "$pid" ] && [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$2" ]; then
    kill -TERM "$pid" 2>/dev/null || true
    wait_for 30 bash -c "! [ -d /proc/$pid ]" || kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

start() {
  local build="${1:?usage: slurm_cluster.sh start BUILD_DIR}"
  build="$(cd "$build" && pwd)"
  stop
  rm -rf "$D"
  mkdir -p "$D"/{etc,state,spool,log,munge,run,ckpt,jobs}
  # Users traverse DIR (job scripts, the env file, the munge socket); root owns all of it.
  chmod 0755 "$D" "$D"/etc "$D"/log "$D"/munge "$D"/run
  chmod 0700 "$D"/state "$D"/spool
  chmod 1777 "$D"/jobs
  chmod 0755 "$D"/ckpt
  mkdir -p "$D"/log/ckptd

  mungekey --create --keyfile "$D/munge/munge.key" --force >/dev/null
  chmod 0400 "$D/munge/munge.key"
  munged --force --key-file "$D/munge/munge.key" --socket "$D/munge/munge.socket.2" \
    --pid-file "$D/munge/munged.pid" --log-file "$D/log/munged.log" --seed-file "$D/munge/munged.seed"
  wait_for 20 test -S "$D/munge/munge.socket.2" || { log "munged did not start"; cat "$D/log/munged.log" >&2; return 1; }

  # Installed as on a node (the job's user must reach them, and a checkout or build under
  # a 0700 home would not let it): the binaries in DIR/bin, libckpt in DIR/lib, the
  # scripts in DIR/libexec/ckptd.
  mkdir -p "$D"/bin "$D"/lib "$D"/libexec/ckptd
  cp "$build"/ckptd "$build"/ckptctl "$build"/ckpt-toy-trainer "$D"/bin/
  cp -a "$build"/libckpt.so* "$D"/lib/
  cp "$here"/deploy/slurm/*.sh "$D"/libexec/ckptd/
  chmod -R a+rX "$D"/bin "$D"/lib "$D"/libexec
  # The wrappers only name the env file for the real scripts (slurmd gives the prolog a
  # minimal environment, and the TaskProlog the task's).
  for s in prolog epilog task_prolog; do
    printf '#!/bin/sh\nCKPTD_ENV_FILE=%s/etc/ckptd.env exec %s/libexec/ckptd/%s.sh "$@"\n' \
      "$D" "$D" "$s" >"$D/etc/$s"
    chmod 0755 "$D/etc/$s"
  done
  cat >"$D/etc/ckptd.env" <<ENV
CKPTD_BIN=$D/bin/ckptd
CKPTD_CONFIG=$D/etc/ckptd.conf
CKPTD_ROOT=$D/ckpt/%u
CKPTD_RUN_BASE=$D/run/ckptd-jobs
CKPTD_LOG_DIR=$D/log/ckptd
CKPTD_READY_TIMEOUT_S=30
CKPTD_STOP_TIMEOUT_S=30
ENV
  # Small pools: two daemons (two jobs) share this node with the rest of the tests.
  cat >"$D/etc/ckptd.conf" <<CONF
pool-mib = 64
chunk-mib = 4
memory-mib = 64
memory-versions = 1
writers = 2
copiers = 1
CONF
  chmod 0644 "$D/etc/ckptd.env" "$D/etc/ckptd.conf"

  # More CPUs than the machine has (config_overrides), so two 2-rank jobs run at once.
  # Addresses are given: a container's host name may not resolve.
  cat >"$D/etc/slurm.conf" <<CONF
ClusterName=ckptdtest
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket.2
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=debug
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=600
PrologFlags=Alloc
PrologEpilogTimeout=120
Prolog=$D/etc/prolog
Epilog=$D/etc/epilog
TaskProlog=$D/etc/task_prolog
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 RealMemory=2000 State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  cat >"$D/etc/cgroup.conf" <<CONF
CgroupPlugin=cgroup/v1
CgroupAutomount=no
CgroupMountpoint=/sys/fs/cgroup
CONF
  echo "export SLURM_CONF=$D/etc/slurm.conf" >"$D/env"
  export SLURM_CONF="$D/etc/slurm.conf"
  # The daemons' working directory must outlive them (slurmstepd inherits it).
  cd /
  slurmctld -i
  slurmd
  if ! wait_for 60 bash -c "sinfo -h -n $host -o %T | grep -qx idle"; then
    log "the node did not become idle: $(sinfo -h -N -o '%N %T %E' 2>&1)"
    tail -n 20 "$D/log/slurmctld.log" "$D/log/slurmd.log" >&2
    return 1
  fi
  log "up: node $host idle; SLURM_CONF=$SLURM_CONF"
}

stop() {
  # Debian installs the daemons through alternatives (slurmd -> slurmd-wlm).
  local b
  for b in slurmd slurmctld munged; do
    local exe
    exe="$(readlink -f "$(command -v "$b" || echo "/usr/sbin/$b")")"
    case $b in
      munged) stop_pidfile "$D/munge/munged.pid" "$exe" ;;
      *) stop_pidfile "$D/run/$b.pid" "$exe" ;;
    esac
  done
}

case "${1:-}" in
  start) start "${2:-}" ;;
  stop) stop ;;
  *) echo "usage: $0 start BUILD_DIR | stop" >&2; exit 2 ;;
esac
