#!/usr/bin/env bash
# Commit latency and throughput of ckptd on a GlusterFS volume (replica 2, FUSE) next to a
# local directory of the same disk. For each target and state size, RUNS fresh jobs each
# take one snapshot of one rank and wait until it is committed; the latency of a commit is
# the snapshot call plus the wait (from the trainer's --summary), throughput is the state
# size over it. Prints the medians and writes them as JSON.
# Usage: bench/gluster.sh [BUILD_DIR] [OUT_JSON]   (root; starts and stops the volume itself)
# Env: RUNS (default 5), SIZES_MIB (default "4 64 256").
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "${1:-$here/build}" && pwd)"
out="${2:-$here/docs/results/gluster.json}"
runs="${RUNS:-5}"
sizes="${SIZES_MIB:-4 64 256}"
. "$here/bench/cleanup.sh"
bench_cleanup_init
work="$(mktemp -d "${TMPDIR:-/tmp}/ckptd-gluster-bench-XXXXXX")"
bench_cleanup_add "$work"
daemon_pid=""
bench_cleanup_hook 'bash "$here/tests/ops/gluster.sh" stop || true'

mounts="$(bash "$here/tests/ops/gluster.sh" start)"  # stopped by the cleanup hook
gluster_root="${mounts%%:*}/bench"
local_root="$work/local"
mkdir -p "$gluster_root" "$local_root"

# Starts ckptd on root $1 and waits for its ready line (the daemon holds the FIFO's only
# write end, so its death ends the read at once).
start_daemon() {
  mkfifo "$work/ready"
  "$build/ckptd" --socket "$work/sock/ckptd.sock" --root "$1" --pool-mib 512 --chunk-mib 16 \
    --memory-mib 0 --ready-fd 3 3>"$work/ready" >"$work/ckptd-$2.log" 2>&1 &
  daemon_pid=$!
  bench_track_daemon "$daemon_pid"
  local line=""
  read -r -t 60 line <"$work/ready" || true
  rm -f "$work/ready"
  [ "$line" = ready ] || { echo "ckptd did not start on $1:" >&2; cat "$work/ckptd-$2.log" >&2; exit 1; }
}

stop_daemon() {
  kill -TERM "$daemon_pid"
  wait "$daemon_pid" || true
  daemon_pid=""
}

results="$work/results.jsonl"
for target in local gluster; do
  root="$local_root"
  [ "$target" = gluster ] && root="$gluster_root"
  start_daemon "$root" "$target"
  for mib in $sizes; do
    for i in $(seq "$runs"); do
      bench_run "$build/ckpt-toy-trainer" --socket "$work/sock/ckptd.sock" --job "b-$mib-$i" --state-mib "$mib" \
        --tensors 4 --iters 1 --compute-ms 0 --quiet --summary "$work/s.json" >/dev/null
      python3 - "$work/s.json" "$target" "$mib" >>"$results" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
ms = s["snapshot_call_us_p50"] / 1000 + s["final_durable_ms"]
print(json.dumps({"target": sys.argv[2], "mib": int(sys.argv[3]), "commit_ms": ms,
                  "MBps": s["state_bytes"] / 1e6 / (ms / 1000)}))
EOF
    done
  done
  grep -h "O_DIRECT\|buffered\|root " "$work/ckptd-$target.log" | head -n 1 | sed "s/^/$target: /"
  stop_daemon
done

python3 - "$results" "$out" "$runs" <<'EOF'
import json, statistics, sys, platform, datetime
rows = [json.loads(l) for l in open(sys.argv[1])]
table = {}
for r in rows:
    table.setdefault((r["target"], r["mib"]), []).append(r)
summary = []
print(f"{'target':8} {'state MiB':>9} {'commit ms (median)':>19} {'MB/s (median)':>14}  runs")
for (target, mib), rs in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    ms = statistics.median(r["commit_ms"] for r in rs)
    mbps = statistics.median(r["MBps"] for r in rs)
    summary.append({"target": target, "state_mib": mib, "commit_ms_median": round(ms, 2),
                    "MBps_median": round(mbps, 1), "runs": len(rs),
                    "commit_ms_all": [round(r["commit_ms"], 2) for r in rs]})
    print(f"{target:8} {mib:9d} {ms:19.2f} {mbps:14.1f}  {len(rs)}")
json.dump({"what": "ckptd commit latency and throughput: one rank, one daemon, one snapshot per job; "
                   "GlusterFS replica-2 volume (two bricks on the local disk, FUSE mount) vs a local directory",
           "host": platform.node(), "date": datetime.datetime.utcnow().isoformat() + "Z",
           "results": summary}, open(sys.argv[2], "w"), indent=1)
print(f"written to {sys.argv[2]}")
EOF
