#!/usr/bin/env bash
# Per-call latency against the gRPC floor, measured in the same run: starts a ckptd of its
# own, runs `ckpt-rpc-latency --floor --json` with 1, 1,000 and 10,000 items, writes
# {"runs": [{items, floor_p50_us, snapshot_p50_us, snapshot_p99_us, wait_p50_us,
# snapshot_ratio, wait_ratio, ...}]} and prints a table. The target: snapshot
# and wait_snapshot (for a version already captured) p50 at most 2x the floor.
#
# Usage: bench/rpc_latency.sh [--out FILE.json] [--build DIR] [--iters I] [--dir DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="$here/bench/out/rpc_latency.json"
build="$here/build-bench"
iters=1000
dir=/tmp/ckptd-bench
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_BUILD_TESTS=OFF >/dev/null
ninja -C "$build" -j2 ckptd ckpt-rpc-latency >/dev/null
# The default directory is removed at the end if this run made it and left it empty.
made_dir=0
[ -d "$dir" ] || made_dir=1
mkdir -p "$dir" "$(dirname "$out")"
. "$here/bench/cleanup.sh"
bench_cleanup_init
[ "$made_dir" = 0 ] || bench_cleanup_hook "rmdir '$dir' 2>/dev/null"
work="$(mktemp -d "$dir/rpc-XXXXXX")"
bench_cleanup_add "$work"
daemon=""
. "$here/bench/limits.sh"

# The memory tier off and no local tier: each version goes to the persistent directory,
# the default path of a node without NVMe.
start_ckptd "$build/ckptd" "$work/ckptd.log" --socket "$work/ckptd.sock" --create-root --root "$work/root" \
  --pool-mib 64 --memory-mib 0 --keep-last 2 --log-level warn
for items in 1 1000 10000; do
  echo "== $items item(s), $iters iterations" >&2
  bench_run "$build/ckpt-rpc-latency" --socket "$work/ckptd.sock" --items "$items" --iters "$iters" --floor --json \
    >"$work/run-$items.json"
done
stop_ckptd

python3 - "$out" "$work"/run-1.json "$work"/run-1000.json "$work"/run-10000.json <<'PY'
import json, sys
runs = []
for path in sys.argv[2:]:
    r = json.load(open(path))
    r["snapshot_ratio"] = round(r["snapshot_p50_us"] / r["floor_p50_us"], 2)
    r["wait_ratio"] = round(r["wait_p50_us"] / r["floor_p50_us"], 2)
    runs.append(r)
json.dump({"target_ratio": 2.0, "runs": runs}, open(sys.argv[1], "w"), indent=1)
print("| items | floor p50 | snapshot p50 | snapshot p99 | wait p50 | snapshot / floor | wait / floor | first wait p50 |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for r in runs:
    print(f"| {r['items']} | {r['floor_p50_us']:.0f} us | {r['snapshot_p50_us']:.0f} us | {r['snapshot_p99_us']:.0f} us "
          f"| {r['wait_p50_us']:.0f} us | {r['snapshot_ratio']:.2f} | {r['wait_ratio']:.2f} | {r['first_wait_p50_us']:.0f} us |")
print(f"(target: both ratios at most 2.0; written to {sys.argv[1]})")
PY
