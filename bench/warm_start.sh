#!/usr/bin/env bash
# Warm start from peers: a replacement node's trainer restored three ways, one run on this
# machine (docs/DESIGN-NOTES.md, "Warm start from peers").
#
# Usage: bench/warm_start.sh [--out FILE.json] [--build DIR] [--dir DIR] [--mib N]
#                            [--rounds N] [--cap MIBPS]
#   --dir     where the persistent and local tiers go (default /tmp/ckptd-warm-start: a disk)
#   --mib     state of the rank restored, in MiB (default 1024, 16 tensors)
#   --rounds  node losses per way (default 3); medians are reported
#   --cap     the replacement's --warm-start-mib-per-s (default 0: no cap, the fastest)
#
# Two daemons stand for two nodes (--replicas 1, loopback TCP), one rank of --mib MiB on each;
# they checkpoint 2 iterations (committed and replicated), and the trainers die with the
# last one (SIGKILL: they do not unregister). Then, each round and each way, node 1 is lost
# (kill -9 of its daemon, its local tier deleted) and a replacement daemon starts in its
# place; a fresh trainer process for rank 1 restores the newest version, verifying every byte:
#   warm        the replacement starts with --warm-start; the trainer registers once the
#               warm start is done (its progress in `ckptctl status`), and restores from the
#               daemon's own memory
#   peer        today's cold path: the restore fetches the shard from node 0's memory
#   persistent  a replacement with --replicas 0: the restore reads the persistent tier
#               (O_DIRECT where the directory takes it, so not from the page cache)
# "restore call" is what the trainer (its GPUs) waits for; "loss to restored" runs from the
# node gone to the end of the restore call (daemon start, the warm start, registration and
# the restore included).
# JSON to --out (default bench/out/warm_start.json; the figures of docs/BENCHMARKS.md are in
# docs/results/warm_start.json). Every daemon it started is killed,
# and everything it made is removed, whether it ends, fails or is interrupted.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=/tmp/ckptd-warm-start
out="$here/bench/out/warm_start.json"
build="$here/build"
mib=1024
rounds=3
cap=0
args="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --mib) mib="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --cap) cap="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out="$(realpath -m "$out")"

echo "== machine"
free -m | cat
echo "== build ($build)"
ninja -C "$build" -j2 ckptd ckptctl ckpt-toy-trainer >/dev/null
made_dir=0
[ -d "$dir" ] || made_dir=1
mkdir -p "$dir" "$(dirname "$out")"
work="$(mktemp -d "$dir/run-XXXXXX")"
pids=()
cleanup() {
  trap - EXIT INT TERM HUP
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  [ -z "${CKPT_BENCH_KEEP:-}" ] || { echo "kept $work"; return; }
  rm -rf "$work"
  [ "$made_dir" = 0 ] || rmdir "$dir" 2>/dev/null || true
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap 'cleanup; exit 129' HUP

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
trainer() {  # SOCKET JOB RANK WORLD TAG [flags]
  local sock=$1 job=$2 rank=$3 world=$4 tag=$5
  shift 5
  "$build/ckpt-toy-trainer" --socket "$work/$sock.sock" --job "$job" --rank "$rank" --world-size "$world" \
    --state-mib "$mib" --tensors 16 --quiet --summary "$work/$tag.json" "$@" >>"$work/trainers.log" 2>&1
}

iters=2
p0=$(free_port)
p1=$(free_port)
peers="127.0.0.1:$p0,127.0.0.1:$p1"
memory=$((mib * 4 + 512))
node() {  # INDEX [flags]
  local i=$1 port
  shift
  port=$([ "$i" = 0 ] && echo "$p0" || echo "$p1")
  start "n$i" --local "$work/local$i" --memory-mib "$memory" --replicas 1 \
    --peer-listen "127.0.0.1:$port" --peers "$peers" --peer-secret "$work/secret" "$@"
}
node 0
node 1
echo "== $iters checkpoints of $mib MiB per rank on 2 nodes, R=1"
{ trainer n0 loss 0 2 loss-r0 --iters "$iters" --compute-ms 1500 --crash-at "$iters" || true; } 2>/dev/null &
t0=$!
{ trainer n1 loss 1 2 loss-r1 --iters "$iters" --compute-ms 1500 --crash-at "$iters" || true; } 2>/dev/null
wait "$t0" || true
held_by() {  # NODE RANK: whether NODE's memory holds RANK's shard of the last version (own image or replica)
  "$build/ckptctl" --socket "$work/$1.sock" ls --job loss --json | python3 -c "
import json, sys
vs = [v for v in json.load(sys.stdin).get('versions', []) if int(v['version']) == $iters]
held = vs[0].get('memory_ranks', []) + [h['rank'] for h in vs[0].get('replicas_held', [])] if vs else []
print(1 if $2 in [int(r) for r in held] else 0)"
}
for _ in $(seq 1 300); do
  [ "$(cat "$work/persistent/loss/latest" 2>/dev/null || echo 0)" -ge "$iters" ] && [ "$(held_by n0 1)" = 1 ] && break
  sleep 0.5
done
[ "$(held_by n0 1)" = 1 ] || { echo "node 0 does not hold rank 1's shard of version $iters" >&2; exit 1; }

warm_done() {  # whether node 1's warm start of `loss` finished: prints its state
  status_json n1 | python3 -c "
import json, sys
ws = [w for w in json.load(sys.stdin).get('warm_starts', []) if w['job'] == 'loss']
print(ws[-1]['state'] if ws else 'none')"
}
: >"$work/rounds.txt"
for round in $(seq 1 "$rounds"); do
  for way in warm peer persistent; do
    stop n1 KILL
    rm -rf "$work/local1"
    killed=$(date +%s%3N)
    case "$way" in
      warm) node 1 --warm-start --warm-start-mib-per-s "$cap" ;;
      peer) node 1 ;;
      persistent) start n1 --local "$work/local1" --memory-mib "$memory" ;;
    esac
    warm_ms=0
    if [ "$way" = warm ]; then
      state=none
      for _ in $(seq 1 6000); do
        state=$(warm_done)
        [ "$state" = done ] || [ "$state" = failed ] && break
        sleep 0.01
      done
      warm_ms=$(($(date +%s%3N) - killed))
      [ "$state" = done ] || echo "   round $round: warm start $state" >&2
    fi
    tag="restored-$way-$round"
    trainer n1 loss 1 2 "$tag" --iters "$iters" --resume
    status_json n1 >"$work/status-$tag.json"
    echo "$way $round $killed $warm_ms" >>"$work/rounds.txt"
    echo "   round $round $way: $(python3 -c "import json; r=json.load(open('$work/$tag.json')); print(f\"restore call {r['restore_ms']:.0f} ms from {r['restore_tier']}\")")"
  done
done
stop n0
stop n1

python3 - "$work" "$out" "$mib" "$rounds" "$cap" "bench/warm_start.sh $args" <<'PY'
import datetime, json, os, platform, statistics, sys
work, out, mib, rounds, cap, command = sys.argv[1:]
runs = {"warm": [], "peer": [], "persistent": []}
for line in open(os.path.join(work, "rounds.txt")):
    way, rnd, killed, warm_ms = line.split()
    tag = f"restored-{way}-{rnd}"
    r = json.load(open(os.path.join(work, tag + ".json")))
    st = json.load(open(os.path.join(work, f"status-{tag}.json")))
    ws = [w for w in st.get("warm_starts", []) if w["job"] == "loss"]
    runs[way].append({
        "restore_call_ms": r["restore_ms"],
        "loss_to_restored_ms": round(r["restore_end_unix_ms"] - float(killed), 1),
        "loss_to_warm_ms": float(warm_ms) if way == "warm" else None,
        "restore_tier": r["restore_tier"],
        "restored_version": r["restored_version"],
        "daemon_restored_bytes_memory": int(st.get("restored_bytes_memory", 0)),
        "daemon_restored_bytes_peer": int(st.get("restored_bytes_peer", 0)),
        "daemon_restored_bytes_persistent": int(st.get("restored_bytes_persistent", 0)),
        "daemon_bytes_read_total": int(st.get("bytes_read_total", 0)),
        "warm_start_state": ws[-1]["state"] if ws else None,
    })
def med(way, key):
    xs = [x[key] for x in runs[way] if x[key] is not None]
    return round(statistics.median(xs), 1) if xs else None
summary = {w: {"restore_call_ms_median": med(w, "restore_call_ms"),
               "loss_to_restored_ms_median": med(w, "loss_to_restored_ms")} for w in runs}
summary["warm"]["loss_to_warm_ms_median"] = med("warm", "loss_to_warm_ms")
fs = summary["persistent"]["restore_call_ms_median"]
for w in ("warm", "peer"):
    summary[w]["restore_call_over_persistent"] = round(summary[w]["restore_call_ms_median"] / fs, 3)
result = {
    "command": command,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}",
    "state_bytes_per_rank": int(mib) * 2**20,
    "rounds": int(rounds),
    "warm_start_mib_per_s": int(cap),
    "median": summary,
    "runs": runs,
}
json.dump(result, open(out, "w"), indent=2)
print("== node loss, 1 rank of %d MiB restored on a replacement node, medians of %s rounds" % (int(mib), rounds))
print("| way | restore call | vs persistent | loss to restored | tier | restore bytes from peer / files |")
print("|---|---|---|---|---|---|")
for w in ("warm", "peer", "persistent"):
    s = summary[w]
    x = runs[w][-1]
    ratio = s.get("restore_call_over_persistent", 1.0)
    print(f"| {w} | {s['restore_call_ms_median']:.0f} ms | {ratio:.2f}x | {s['loss_to_restored_ms_median']:.0f} ms | "
          f"{x['restore_tier']} | {x['daemon_restored_bytes_peer']} / {x['daemon_bytes_read_total']} |")
if summary["warm"]["loss_to_warm_ms_median"] is not None:
    print(f"warm start done {summary['warm']['loss_to_warm_ms_median']:.0f} ms after the loss (median)")
print(f"written to {out}")
PY
