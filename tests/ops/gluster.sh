#!/usr/bin/env bash
# A real GlusterFS volume for the multi-node tests: glusterd on this machine, a replica-2
# volume of two bricks on local directories, FUSE-mounted three times (three mount points
# stand for three nodes). Everything lives under CKPTD_GLUSTER_DIR (default
# /tmp/ckptd-gluster); glusterd keeps its state in /var/lib/glusterd (Debian's path), and
# stop removes the volume again.
#   gluster.sh start    prints "MOUNT0:MOUNT1:MOUNT2" on stdout once all three are mounted
#   gluster.sh stop     unmounts, deletes the volume, stops what start started (idempotent)
# Exit 77 from start: this machine cannot host it (no FUSE, no glusterd), with the reason.
set -euo pipefail
D="${CKPTD_GLUSTER_DIR:-/tmp/ckptd-gluster}"
VOL="${CKPTD_GLUSTER_VOLUME:-ckptdtest}"
host="$(hostname -s)"
log() { echo "gluster: $*" >&2; }

wait_for() {
  local limit=$1
  shift
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
  done
}

g() { gluster --mode=script "$@"; }

mounted() { awk -v m="$1" '$2 == m { found = 1 } END { exit !found }' /proc/mounts; }

start() {
  [ "$(id -u)" -eq 0 ] || { log "needs root"; exit 77; }
  for t in glusterd gluster glusterfs; do
    command -v "$t" >/dev/null || { log "$t is not installed (Debian: glusterfs-server, glusterfs-client)"; exit 77; }
  done
  [ -c /dev/fuse ] || { log "/dev/fuse is missing: no FUSE on this machine"; exit 77; }
  # glusterd places bricks by host name, which must resolve to this machine.
  getent hosts "$host" >/dev/null || { log "host name $host does not resolve (glusterd needs it)"; exit 77; }
  grep -qw fuse /proc/filesystems || { log "the kernel has no fuse file system"; exit 77; }
  stop
  mkdir -p "$D"/bricks "$D"/log
  [ -d /var/lib/glusterd ] || { mkdir -p /var/lib/glusterd && touch "$D/made-var-lib-glusterd"; }
  if ! pgrep -x glusterd >/dev/null; then
    # What glusterd adds to its state directory goes again when stop stops it.
    ls -A /var/lib/glusterd >"$D/var-lib-glusterd-before"
    glusterd -p "$D/glusterd.pid" --log-file="$D/log/glusterd.log"
    touch "$D/started-glusterd"
  fi
  wait_for 30 g volume list || { log "glusterd does not answer"; tail -n 20 "$D/log/glusterd.log" >&2; exit 77; }
  g volume create "$VOL" replica 2 "$host:$D/bricks/b1" "$host:$D/bricks/b2" force >/dev/null
  g volume start "$VOL" >/dev/null
  # Both bricks online, else a mount may see only one replica.
  wait_for 30 bash -c "[ \"\$(gluster --mode=script volume status $VOL detail | grep -c '^Online.*: Y')\" -ge 2 ]" ||
    { log "the bricks of $VOL did not come online"; g volume status "$VOL" >&2; exit 1; }
  local mounts=()
  for i in 0 1 2; do
    mkdir -p "$D/mnt$i"
    if ! mount -t glusterfs -o log-file="$D/log/mnt$i.log" "$host:/$VOL" "$D/mnt$i"; then
      log "FUSE mount of $host:/$VOL failed (no FUSE in this container?)"
      tail -n 20 "$D/log/mnt$i.log" >&2 || true
      stop
      exit 77
    fi
    wait_for 30 mounted "$D/mnt$i" || { log "mount $D/mnt$i did not appear"; exit 1; }
    mounts+=("$D/mnt$i")
  done
  chmod 0755 "$D/mnt0"
  (IFS=:; echo "${mounts[*]}")
}

stop() {
  for i in 0 1 2; do
    if mounted "$D/mnt$i"; then umount "$D/mnt$i" || umount -l "$D/mnt$i"; fi
  done
  if command -v gluster >/dev/null && pgrep -x glusterd >/dev/null; then
    if g volume info "$VOL" >/dev/null 2>&1; then
      g volume stop "$VOL" force >/dev/null 2>&1 || true
      g volume delete "$VOL" >/dev/null 2>&1 || true
    fi
  fi
  # The brick and self-heal processes of our volume only (their command lines name it).
  local pid
  for pid in $(pgrep -f -- "--volfile-id ($VOL\.|shd/$VOL)" 2>/dev/null); do
    kill -TERM "$pid" 2>/dev/null || true
  done
  if [ -f "$D/started-glusterd" ]; then
    # glustershd serves every volume of this glusterd: it goes with it.
    for pid in $(pgrep -f "glustershd" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
    if [ -f "$D/glusterd.pid" ]; then
      pid="$(cat "$D/glusterd.pid")"
      if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = glusterd ]; then
        kill -TERM "$pid"
        wait_for 30 bash -c "! [ -d /proc/$pid ]" || kill -KILL "$pid" 2>/dev/null || true
      fi
    fi
  fi
  if [ -f "$D/made-var-lib-glusterd" ]; then
    rm -rf /var/lib/glusterd
  elif [ -f "$D/var-lib-glusterd-before" ]; then
    local e
    for e in $(ls -A /var/lib/glusterd); do
      grep -qxF "$e" "$D/var-lib-glusterd-before" || rm -rf "/var/lib/glusterd/${e:?}"
    done
  fi
  rm -rf "$D"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start | stop" >&2; exit 2 ;;
esac
