#!/usr/bin/env bash
# One run of the example trainer against ckptd, next to the storage limit of the same
# directory: fio sequential O_DIRECT write (and read) bandwidth, measured in the same run.
#
# Usage: bench/core_run.sh [--dir DIR] [--state-mib S] [--iters I] [--compute-ms C] [--out FILE]
# Prints a summary and writes JSON (default bench/out/core_run.json). The compute phase
# defaults to the time the storage needs to absorb one checkpoint (state / fio write
# bandwidth) plus 20 %, so a checkpoint every iteration is sustainable.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=/tmp/ckptd-bench
state_mib=1024
iters=20
compute_ms=""
out="$here/bench/out/core_run.json"
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir="$2"; shift 2 ;;
    --state-mib) state_mib="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --compute-ms) compute_ms="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
build="$here/build"
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C "$build" ckptd ckptctl ckpt-toy-trainer >/dev/null
# The default directory is removed at the end if this run made it and left it empty.
made_dir=0
[ -d "$dir" ] || made_dir=1
mkdir -p "$dir" "$(dirname "$out")"
. "$here/bench/cleanup.sh"
bench_cleanup_init
[ "$made_dir" = 0 ] || bench_cleanup_hook "rmdir '$dir' 2>/dev/null"
work="$(mktemp -d "$dir/run-XXXXXX")"
bench_cleanup_add "$work"
. "$here/bench/limits.sh"

echo "== storage limit of $dir (fio, O_DIRECT, 16 MiB blocks, iodepth 4)"
write_mbps=$(fio_mbps "$work" write)
read_mbps=$(fio_mbps "$work" read)
rm -f "$work/fio.dat"
echo "   write $write_mbps MB/s, read $read_mbps MB/s"
if [ -z "$compute_ms" ]; then
  compute_ms=$(compute_ms_for "$state_mib" "$write_mbps")
fi

# No memory tier: the restore reads the disk, to be set against fio's read figure.
start_ckptd "$build/ckptd" "$work/ckptd.log" --socket "$work/ckptd.sock" --create-root --root "$work/root" --pool-mib 1024 \
  --keep-last 2 --memory-mib 0
echo "== trainer: $state_mib MiB in 16 tensors, checkpoint every iteration, $iters iterations, compute $compute_ms ms"
bench_run "$build/ckpt-toy-trainer" --socket "$work/ckptd.sock" --job bench --state-mib "$state_mib" --tensors 16 \
  --iters "$iters" --every 1 --compute-ms "$compute_ms" --quiet --summary "$work/trainer.json"
"$build/ckptctl" --socket "$work/ckptd.sock" status --json >"$work/status.json"
echo "== restore: a new trainer process restores the newest version (O_DIRECT reads) and checks every byte"
bench_run "$build/ckpt-toy-trainer" --socket "$work/ckptd.sock" --job bench --state-mib "$state_mib" --tensors 16 \
  --iters "$iters" --resume --quiet >"$work/restore.txt"
cat "$work/restore.txt"
restore_ms=$(sed -n 's/.*restored version [0-9]* from [a-z]* ([0-9.]* MiB) in \([0-9.]*\) ms.*/\1/p' "$work/restore.txt")
rss_kib=$(awk '/VmHWM/ {print $2}' /proc/$daemon/status)

python3 - "$work/trainer.json" "$work/status.json" "$write_mbps" "$read_mbps" "$compute_ms" "$rss_kib" "$out" "$dir" "$restore_ms" <<'PY'
import json, statistics, sys
trainer = json.load(open(sys.argv[1]))
status = json.load(open(sys.argv[2]))
write_mbps, read_mbps, compute_ms, rss_kib = float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
shards = [s for s in status["shards"] if s["job"] == "bench" and s["durable_ms"] > 0]
flush = [int(s["total_bytes"]) / 1e6 / (s["durable_ms"] / 1000) for s in shards]
capture = [s["capture_ms"] for s in shards]
result = {
    "dir": sys.argv[8],
    "limits": {"write_MBps": write_mbps, "read_MBps": read_mbps},
    "state_bytes": trainer["state_bytes"], "iters": trainer["iters"], "compute_ms": compute_ms,
    "stall_ms_p50": trainer["stall_ms_p50"], "stall_ms_p99": trainer["stall_ms_p99"],
    "snapshot_call_us_p50": trainer["snapshot_call_us_p50"], "iter_ms_p50": trainer["iter_ms_p50"],
    "capture_ms_p50": statistics.median(capture),
    "flush_MBps_p50": statistics.median(flush), "flush_fraction_of_fio": statistics.median(flush) / write_mbps,
    "shards_measured": len(shards), "daemon_peak_rss_MB": rss_kib / 1024,
    "restore_ms": float(sys.argv[9]),
    "restore_MBps": trainer["state_bytes"] / 1e6 / (float(sys.argv[9]) / 1000),
}
result["restore_fraction_of_fio"] = result["restore_MBps"] / read_mbps
json.dump(result, open(sys.argv[7], "w"), indent=2)
print(f"== result ({len(shards)} checkpoints of {trainer['state_bytes'] >> 20} MiB)")
print(f"   stall per checkpoint      p50 {result['stall_ms_p50']:.3f} ms   p99 {result['stall_ms_p99']:.3f} ms"
      f"   ({100 * result['stall_ms_p50'] / result['iter_ms_p50']:.2f} % of the {result['iter_ms_p50']:.0f} ms iteration)")
print(f"   snapshot call             p50 {result['snapshot_call_us_p50']:.0f} us")
print(f"   capture (copy out)        p50 {result['capture_ms_p50']:.0f} ms")
print(f"   flush throughput          p50 {result['flush_MBps_p50']:.0f} MB/s = {100 * result['flush_fraction_of_fio']:.0f} % of fio write {write_mbps:.0f} MB/s")
print(f"   restore                   {result['restore_ms']:.0f} ms = {result['restore_MBps']:.0f} MB/s = {100 * result['restore_fraction_of_fio']:.0f} % of fio read {read_mbps:.0f} MB/s")
print(f"   daemon peak RSS           {result['daemon_peak_rss_MB']:.0f} MB (pool 1024 MiB)")
print(f"   written to {sys.argv[7]}")
PY
