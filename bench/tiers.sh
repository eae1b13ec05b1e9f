#!/usr/bin/env bash
# Restore from each tier, measured in one run: 1 GiB of trainer state (16 tensors),
# restored by a fresh trainer process from daemon memory, from the local tier and from
# the persistent tier, next to fio's O_DIRECT read bandwidth of the persistent directory;
# and the time from a trainer's kill -9 to the end of its restarted process's restore.
#
# Usage: bench/tiers.sh [--out FILE.json] [--dir DIR] [--local DIR] [--build DIR] [--mib N]
#   --dir    the persistent tier (default /tmp/ckptd-tiers; the parallel file system on a
#            cluster)
#   --local  the local tier (default /dev/shm/ckptd-tiers-$UID: node-local memory-backed,
#            as NVMe stands in for it here)
#
# Steps (one daemon, --local and --root, 1 GiB pool, memory tier of 3 x the state):
#   1. a trainer checkpoints every iteration (compute phase: state / fio write + 20 %) and
#      kills itself (SIGKILL) right after the
#      snapshot of iteration 4; a new trainer process starts at once and restores: the
#      daemon finishes version 4 (flush, promotion, commit), then hands it back from
#      memory. "kill to restored" is from the crashed process's exit to the end of the
#      restore call (process start and registration included).
#   2. three more fresh processes restore again: memory, with nothing in flight;
#   3. the daemon restarts with --memory-mib 0: three restores read the local tier;
#   4. the daemon restarts without --local: three restores read the persistent tier.
# Figures are medians of the three.
# Every restore checks every byte. Writes JSON (default bench/out/tiers.json).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=/tmp/ckptd-tiers
local_dir="/dev/shm/ckptd-tiers-$(id -u)"
out="$here/bench/out/tiers.json"
build="$here/build-bench"
mib=1024
args="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --local) local_dir="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --mib) mib="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out="$(realpath -m "$out")"

echo "== build ($build)"
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_BUILD_TESTS=OFF >/dev/null
fi
ninja -C "$build" -j2 ckptd ckptctl ckpt-toy-trainer >/dev/null
. "$here/bench/cleanup.sh"
bench_cleanup_init
[ "$made_dir" = 0 ] || bench_cleanup_hook "rmdir '$dir' 2>/dev/null"
# The directories this run creates go with it; the parent of the local tier too, once empty
# (it is in memory, and other runs may share it).
bench_cleanup_hook "rmdir '$local_dir' 2>/dev/null"
# The default directory is removed at the end if this run made it and left it empty.
made_dir=0
[ -d "$dir" ] || made_dir=1
mkdir -p "$dir" "$(dirname "$out")"
work="$(mktemp -d "$dir/tiers-XXXXXX")"
local_tier="$local_dir/$(basename "$work")"
bench_cleanup_add "$work" "$local_tier"
daemon=""
. "$here/bench/limits.sh"

echo "== limits: fio O_DIRECT read of $dir and of $local_dir"
write_persistent=$(fio_mbps "$work" write)
# A compute phase in which the persistent tier absorbs one checkpoint, as in bench/run.sh.
compute_ms=$(compute_ms_for "$mib" "$write_persistent")
read_persistent=$(fio_mbps "$work" read)
rm -f "$work/fio.dat"
mkdir -p "$local_tier"
fio_mbps "$local_tier" write >/dev/null
read_local=$(fio_mbps "$local_tier" read)
rm -f "$local_tier/fio.dat"
echo "   persistent $read_persistent MB/s, local $read_local MB/s"

start_daemon() {  # MEMORY_MIB [extra ckptd flags]
  local memory=$1
  shift
  start_ckptd "$build/ckptd" "$work/ckptd.log" --socket "$work/ckptd.sock" --create-root --root "$work/persistent" \
    --pool-mib 1024 --memory-mib "$memory" "$@"
}
trainer() {  # TAG [extra trainer flags]
  local tag=$1
  shift
  bench_run "$build/ckpt-toy-trainer" --socket "$work/ckptd.sock" --job tiers --state-mib "$mib" --tensors 16 \
    --compute-ms "$compute_ms" --quiet --summary "$work/$tag.json" "$@" >>"$work/trainers.log" 2>&1
}

# Room for the version kept, the one being written and one being promoted.
start_daemon $((mib * 3)) --local "$local_tier"
echo "== 1. kill -9 of a trainer after the snapshot of iteration 4, restart at once"
rc=0
trainer crash --iters 10 --crash-at 4 || rc=$?
killed_ms=$(date +%s%3N)
[ "$rc" -eq 137 ] || { echo "the trainer should have died of SIGKILL (rc $rc)"; tail "$work/trainers.log"; exit 1; }
trainer after_kill --iters 4 --resume
echo "== 2. restore again, 3 times (memory, nothing in flight)"
for i in 1 2 3; do trainer "memory-$i" --iters 4 --resume; done
stop_ckptd
echo "== 3. daemon restarted without its memory tier: restore from the local tier, 3 times"
start_daemon 0 --local "$local_tier"
for i in 1 2 3; do trainer "local-$i" --iters 4 --resume; done
stop_ckptd
echo "== 4. daemon without the local tier: restore from the persistent tier, 3 times"
start_daemon 0
for i in 1 2 3; do trainer "persistent-$i" --iters 4 --resume; done
stop_ckptd

python3 - "$work" "$out" "$killed_ms" "$read_persistent" "$read_local" "$mib" "bench/tiers.sh $args" <<'PY'
import datetime, json, os, platform, sys
work, out, killed_ms, read_p, read_l, mib, command = sys.argv[1:]
load = lambda tag: json.load(open(os.path.join(work, tag + ".json")))
state = int(mib) * 2**20
import statistics
rows = []
for tag in ("after_kill", "memory", "local", "persistent"):
    runs = [load(tag)] if tag == "after_kill" else [load(f"{tag}-{i}") for i in (1, 2, 3)]
    tiers = {r["restore_tier"] for r in runs}
    ms = statistics.median(r["restore_ms"] for r in runs)
    rows.append({"run": tag, "tier": "/".join(sorted(tiers)), "restores": len(runs), "restore_ms": ms,
                 "restore_ms_each": [r["restore_ms"] for r in runs],
                 "restore_MBps": state / 1e6 / (ms / 1000)})
after = load("after_kill")
result = {
    "command": command,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}",
    "state_bytes": state,
    "limits": {"persistent_read_MBps": float(read_p), "local_read_MBps": float(read_l)},
    "restores": rows,
    "kill_to_restored_ms": after["restore_end_unix_ms"] - float(killed_ms),
}
json.dump(result, open(out, "w"), indent=2)
print(f"== restore of {state / 2**30:.1f} GiB by a fresh trainer process (every byte checked)")
print(f"| run | tier | restore (median of n) | throughput | of fio read |")
print(f"|---|---|---|---|---|")
for r in rows:
    lim = {"local": float(read_l), "persistent": float(read_p)}.get(r["tier"])
    frac = f"{100 * r['restore_MBps'] / lim:.0f} %" if lim else "-"
    print(f"| {r['run']} | {r['tier']} | {r['restore_ms']:.0f} ms ({r['restores']}) | {r['restore_MBps']:.0f} MB/s | {frac} |")
print(f"kill -9 of the trainer to the end of its restarted process's restore: {result['kill_to_restored_ms']:.0f} ms")
print(f"written to {out}")
PY
