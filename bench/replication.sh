#!/usr/bin/env bash
# Peer replication of the memory tier, 1 GiB per rank, one run on this machine.
#
# Usage: bench/replication.sh [--out FILE.json] [--build DIR] [--dir DIR] [--mib N]
#                             [--iters N] [--skip-restore] [--skip-stall]
#   --dir    where the persistent and local tiers go (default /tmp/ckptd-replication: a
#            disk, so that the memory the bench takes stays small on a shared machine)
#
# 1. Node loss. Two daemons stand for two nodes (--replicas 1, loopback TCP), one rank of
#    --mib MiB (16 tensors) on each; they checkpoint --iters iterations, 1.5 s apart (committed and
#    replicated). Then node 1 is lost: kill -9 of its daemon and its local tier deleted. A
#    replacement daemon starts in its place and a fresh trainer process for rank 1 restores
#    the newest version (verifying every byte): from node 0's memory. "loss to restored"
#    runs from the node gone (its daemon reaped, its local tier deleted) to the end of the
#    restore call (daemon start, registration, the transfer and the checks included). The same again with a replacement daemon without
#    replication (--replicas 0): the restore reads the persistent tier (O_DIRECT where the
#    directory takes it, so not from the page cache).
# 2. Trainer stall and overhead under a flush-bound workload. Three daemons; one rank of
#    --mib MiB on daemon 0, a checkpoint every iteration, a compute phase of half the time
#    the persistent tier needs to write one (so flushes are the bottleneck and the trainer
#    stalls); shards go straight to the persistent tier. With --replicas 0, 1 and 2 (fresh
#    daemons each): the trainer's stall p50/p99, iteration time, flush throughput.
# Memory tiers are sized as DESIGN-NOTES says: (--memory-versions + 1) versions of the own
# rank and of each rank it holds replicas of (4 x --mib, + 512 MiB).
# Medians of one run; JSON to --out (default docs/results/replication.json).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=/tmp/ckptd-replication
out="$here/docs/results/replication.json"
build="$here/build"
mib=1024
iters=6
do_restore=1
do_stall=1
args="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --mib) mib="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --skip-restore) do_restore=0; shift ;;
    --skip-stall) do_stall=0; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out="$(realpath -m "$out")"

echo "== machine"
df -h /dev/shm "$(dirname "$dir")" | cat
free -m | cat
echo "== build ($build)"
ninja -C "$build" -j2 ckptd ckptctl ckpt-toy-trainer >/dev/null
# The default directory is removed at the end if this run made it and left it empty.
made_dir=0
[ -d "$dir" ] || made_dir=1
mkdir -p "$dir" "$(dirname "$out")"
. "$here/bench/cleanup.sh"
bench_cleanup_init
[ "$made_dir" = 0 ] || bench_cleanup_hook "rmdir '$dir' 2>/dev/null"
work="$(mktemp -d "$dir/run-XXXXXX")"
bench_cleanup_add "$work"
pids=()
. "$here/bench/limits.sh"

head -c 48 /dev/urandom | base64 >"$work/secret"
chmod 600 "$work/secret"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start NAME ARGS...: a daemon on $work/NAME.sock, ready when it returns; its pid in pid_NAME.
start() {
  local name=$1
  shift
  rm -f "$work/ready-$name"
  mkfifo "$work/ready-$name"
  "$build/ckptd" --socket "$work/$name.sock" --create-root --root "$work/persistent" --pool-mib 512 \
    --chunk-mib 16 "$@" --ready-fd 3 3>"$work/ready-$name" >>"$work/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  bench_track_daemon "$pid"
  eval "pid_$name=$pid"
  read -r _ <"$work/ready-$name"
}
stop() {  # NAME [signal]
  local pid
  eval "pid=\$pid_$1"
  kill "-${2:-TERM}" "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
status_json() { "$build/ckptctl" --socket "$work/$1.sock" status --json; }
json_field() { python3 -c "import json,sys; print(json.load(sys.stdin).get('$1', 0))"; }
trainer() {  # SOCKET JOB RANK WORLD TAG [flags]
  local sock=$1 job=$2 rank=$3 world=$4 tag=$5
  shift 5
  bench_run "$build/ckpt-toy-trainer" --socket "$work/$sock.sock" --job "$job" --rank "$rank" --world-size "$world" \
    --state-mib "$mib" --tensors 16 --quiet --summary "$work/$tag.json" "$@" >>"$work/trainers.log" 2>&1
}

echo "== limits: fio O_DIRECT write of $dir"
write_mbps=$(fio_mbps "$work" write)
rm -f "$work/fio.dat"
echo "   $write_mbps MB/s"

declare -A loss_ms=()
if [ "$do_restore" = 1 ]; then
  p0=$(free_port)
  p1=$(free_port)
  peers="127.0.0.1:$p0,127.0.0.1:$p1"
  node() {  # INDEX REPLICAS
    local i=$1 r=$2 port
    port=$([ "$i" = 0 ] && echo "$p0" || echo "$p1")
    start "n$i" --local "$work/local$i" --memory-mib $((mib * 4 + 512)) --replicas "$r" \
      --peer-listen "127.0.0.1:$port" --peers "$peers" --peer-secret "$work/secret"
  }
  node 0 1
  node 1 1
  echo "== node loss: $iters checkpoints of $mib MiB per rank on 2 nodes, R=1"
  # The trainers die with their last snapshot (SIGKILL, as when the job goes down with a
  # node).
  { trainer n0 loss 0 2 loss-r0 --iters "$iters" --compute-ms 1500 --crash-at "$iters" || true; } 2>/dev/null &
  t0=$!
  { trainer n1 loss 1 2 loss-r1 --iters "$iters" --compute-ms 1500 --crash-at "$iters" || true; } 2>/dev/null
  wait "$t0" || true
  # The last version committed and held by the other node (the commit waits for its
  # replicas; older versions still queued were superseded by newer ones, as designed).
  held_by() {  # NODE RANK: whether NODE's memory holds RANK's shard of the last version (own image or replica)
    "$build/ckptctl" --socket "$work/$1.sock" ls --job loss --json | python3 -c "
import json, sys
vs = [v for v in json.load(sys.stdin).get('versions', []) if int(v['version']) == $iters]
held = vs[0].get('memory_ranks', []) + [h['rank'] for h in vs[0].get('replicas_held', [])] if vs else []
print(1 if $2 in [int(r) for r in held] else 0)"
  }
  for _ in $(seq 1 300); do
    [ "$(cat "$work/persistent/loss/latest" 2>/dev/null || echo 0)" -ge "$iters" ] &&
      [ "$(held_by n0 1)" = 1 ] && [ "$(held_by n1 0)" = 1 ] && break
    sleep 0.5
  done
  echo "   latest $(cat "$work/persistent/loss/latest"); replicated shards: $(status_json n0 | json_field replicated_shards) + $(status_json n1 | json_field replicated_shards)"
  for source in peer persistent; do
    echo "== node 1 lost; a replacement daemon ($([ $source = peer ] && echo "--replicas 1" || echo "--replicas 0")); rank 1 restores"
    stop n1 KILL
    rm -rf "$work/local1"
    # The clock starts once the node is gone: the kill's exit and the removal of its local
    # tier (GiBs of files in the peer run, none in the second) simulate the loss, they are
    # not part of the recovery.
    killed=$(date +%s%3N)
    if [ "$source" = peer ]; then node 1 1; else start n1 --local "$work/local1" --memory-mib $((mib * 4 + 512)); fi
    trainer n1 loss 1 2 "restored-$source" --iters "$iters" --resume
    end=$(python3 -c "import json; print(json.load(open('$work/restored-$source.json'))['restore_end_unix_ms'])")
    loss_ms[$source]=$(python3 -c "print(round($end - $killed, 1))")
    status_json n1 >"$work/status-restored-$source.json"
    echo "   loss to restored: ${loss_ms[$source]} ms"
  done
  stop n0
  stop n1
fi

stall_runs=""
if [ "$do_stall" = 1 ]; then
  compute_ms=$(python3 -c "print(int($mib * 1.048576 / $write_mbps * 1000 * 0.5) + 1)")
  echo "== flush-bound workload: compute $compute_ms ms per iteration (half the write of one checkpoint)"
  for r in 0 1 2; do
    q0=$(free_port)
    q1=$(free_port)
    q2=$(free_port)
    peers="127.0.0.1:$q0,127.0.0.1:$q1,127.0.0.1:$q2"
    for i in 0 1 2; do
      port=$(eval echo "\$q$i")
      if [ "$r" = 0 ]; then
        start "s${r}x$i" --memory-mib $((mib * 4 + 512))
      else
        start "s${r}x$i" --memory-mib $((mib * 4 + 512)) --replicas "$r" --peer-listen "127.0.0.1:$port" \
          --peers "$peers" --peer-secret "$work/secret"
      fi
    done
    echo "   --replicas $r"
    trainer "s${r}x0" "stall-r$r" 0 1 "stall-r$r" --iters $((iters + 4)) --compute-ms "$compute_ms"
    # Replication trails the trainer: wait (at most 60 s) until the R holders keep the last
    # version (older ones still queued were superseded, as designed).
    for _ in $(seq 1 120); do
      [ "$r" = 0 ] && break
      [ "$(status_json "s${r}x0" | json_field replicated_shards)" -ge 1 ] &&
        "$build/ckptctl" --socket "$work/s${r}x1.sock" ls --job "stall-r$r" --json | python3 -c "
import json, sys
vs = [v for v in json.load(sys.stdin).get('versions', []) if int(v['version']) == $((iters + 4))]
sys.exit(0 if vs and 0 in [int(x) for x in vs[0].get('memory_ranks', [])] else 1)" && break
      sleep 0.5
    done
    status_json "s${r}x0" >"$work/status-stall-r$r.json"
    for i in 0 1 2; do stop "s${r}x$i"; done
    rm -rf "$work/persistent/stall-r$r"
    stall_runs="$stall_runs $r"
  done
fi

python3 - "$work" "$out" "$mib" "$iters" "$write_mbps" "bench/replication.sh $args" \
  "${loss_ms[peer]:-}" "${loss_ms[persistent]:-}" "$stall_runs" <<'PY'
import datetime, json, os, platform, sys
work, out, mib, iters, write_mbps, command, loss_peer, loss_persistent, stall_runs = sys.argv[1:]
def load(name):
    p = os.path.join(work, name)
    return json.load(open(p)) if os.path.exists(p) else None
result = {
    "command": command,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}",
    "state_bytes_per_rank": int(mib) * 2**20,
    "persistent_write_MBps": float(write_mbps),
}
if loss_peer:
    node_loss = {}
    for source, ms in (("peer", loss_peer), ("persistent", loss_persistent)):
        r = load(f"restored-{source}.json")
        st = load(f"status-restored-{source}.json")
        node_loss[source] = {
            "loss_to_restored_ms": float(ms),
            "restore_call_ms": r["restore_ms"],
            "restored_version": r["restored_version"],
            "restore_tier": r["restore_tier"],
            "daemon_restored_bytes_peer": int(st.get("restored_bytes_peer", 0)),
            "daemon_restored_bytes_persistent": int(st.get("restored_bytes_persistent", 0)),
            "daemon_bytes_read_total": int(st.get("bytes_read_total", 0)),
        }
    node_loss["ratio_persistent_over_peer"] = round(float(loss_persistent) / float(loss_peer), 2)
    result["node_loss"] = node_loss
def flush_mbps(st, job):
    rates = sorted(s["total_bytes"] / 1e6 / (s["durable_ms"] / 1000) for s in st.get("shards", [])
                   if s["job"] == job and s.get("durable_ms", 0) > 0)
    return round(rates[len(rates) // 2], 1) if rates else None
stall = {}
for r in stall_runs.split():
    s = load(f"stall-r{r}.json")
    st = load(f"status-stall-r{r}.json")
    stall[f"R={r}"] = {
        "compute_ms": s["compute_ms"],
        "stall_ms_p50": s["stall_ms_p50"], "stall_ms_p99": s["stall_ms_p99"],
        "iter_ms_p50": s["iter_ms_p50"], "iter_ms_mean": s["iter_ms_mean"],
        "overhead_pct_mean": round((s["iter_ms_mean"] / s["compute_ms"] - 1) * 100, 1),
        # From the daemon's own timings: shard bytes / (snapshot call -> durable), median.
        "flush_MBps_p50": flush_mbps(st, f"stall-r{r}"),
        "iters": s["iters"],
        "replicated_shards": int(st.get("replicated_shards", 0)),
        "replication_failures": int(st.get("replication_failures", 0)),
    }
if stall:
    result["flush_bound"] = stall
json.dump(result, open(out, "w"), indent=2)
if loss_peer:
    nl = result["node_loss"]
    print("== node loss, 1 rank of %d MiB restored on a replacement node" % int(mib))
    print("| source | loss to restored | restore call | tier | daemon bytes read from files |")
    print("|---|---|---|---|---|")
    for source in ("peer", "persistent"):
        x = nl[source]
        print(f"| {source} | {x['loss_to_restored_ms']:.0f} ms | {x['restore_call_ms']:.0f} ms | {x['restore_tier']} | {x['daemon_bytes_read_total']} |")
if stall:
    print("== flush-bound workload (compute %s ms, persistent write %s MB/s)" % (next(iter(stall.values()))["compute_ms"], write_mbps))
    print("| R | stall p50 | stall p99 | iteration mean | overhead | flush p50 | replicated |")
    print("|---|---|---|---|---|---|---|")
    for k, x in stall.items():
        print(f"| {k} | {x['stall_ms_p50']:.1f} ms | {x['stall_ms_p99']:.1f} ms | {x['iter_ms_mean']:.0f} ms | {x['overhead_pct_mean']} % | {x['flush_MBps_p50']:.0f} MB/s | {x['replicated_shards']} |")
print(f"written to {out}")
PY
