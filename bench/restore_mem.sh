#!/usr/bin/env bash
# Restore from daemon memory into a fresh process: one ckptd with a memory tier, a trainer
# that checkpoints 1 GiB (16 tensors in one shm region), then fresh trainer processes
# (ckpt-toy-trainer --resume, every byte checked) that each restore the newest version from
# the daemon's memory into their newly created shared memory. Next to it, in the same run:
# single-thread memcpy, and the first touch of a fresh shm object (a memset through its
# mapping: what a fresh trainer pays to fill its new shared memory; and pwrite calls, the
# way ckptd writes a restore into it).
#
# Usage: bench/restore_mem.sh [--out FILE.json] [--build DIR] [--mib N] [--restores N] [--huge]
#                             [--compute-ms N] [--pool-mib N] [--no-build]
#   --huge   (root) run in a private mount namespace whose /dev/shm is a tmpfs mounted with
#            huge=within_size (transparent huge pages for shm objects), to show what such a
#            node gets; nothing outside this script's processes sees that mount.
#   --compute-ms  the trainers' compute phase (default 50)
#   --pool-mib    the daemon's host pool (default 1024)
#   --no-build    use the binaries in --build as they are (tests/scripts/leftovers_test.sh)
# Its files go under $TMPDIR (default /tmp); bench/cleanup.sh removes them on any exit.
# Writes JSON (default bench/out/restore_mem.json): restore_ms (median), restore_MBps,
# memcpy_GBps, first_touch_MBps, pwrite_fresh_MBps, state_bytes, bytes_read_from_disk
# (the daemon's bytes_read_total: must be 0).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="$here/bench/out/restore_mem.json"
build="$here/build-bench"
mib=1024
restores=3
huge=0
compute_ms=50
pool_mib=1024
build_it=1
args="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --mib) mib="$2"; shift 2 ;;
    --restores) restores="$2"; shift 2 ;;
    --huge) huge=1; shift ;;
    --compute-ms) compute_ms="$2"; shift 2 ;;
    --pool-mib) pool_mib="$2"; shift 2 ;;
    --no-build) build_it=0; shift ;;
    --in-private-shm) huge=2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out="$(realpath -m "$out")"
build="$(realpath -m "$build")"
[ "$restores" -ge 3 ] || { echo "--restores must be at least 3 (the figure is a median)" >&2; exit 2; }

if [ "$huge" = 1 ]; then
  [ "$(id -u)" = 0 ] || { echo "--huge needs root (a private mount namespace)" >&2; exit 2; }
  exec unshare --mount --propagation private bash "$0" --out "$out" --build "$build" --mib "$mib" \
    --restores "$restores" --compute-ms "$compute_ms" --pool-mib "$pool_mib" --in-private-shm
fi
if [ "$huge" = 2 ]; then
  mount -t tmpfs -o "size=$((mib * 4))m,huge=within_size,mode=1777" ckpt-bench-shm /dev/shm
  args="$args --huge"
fi

if [ "$build_it" = 1 ]; then
  echo "== build ($build)"
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_BUILD_TESTS=OFF >/dev/null
  fi
  ninja -C "$build" -j2 ckptd ckptctl ckpt-toy-trainer ckpt-memcpy-bw >/dev/null
fi
mkdir -p "$(dirname "$out")"
. "$here/bench/cleanup.sh"
bench_cleanup_init
work="$(mktemp -d "${TMPDIR:-/tmp}/ckpt-restore-mem-XXXXXX")"
bench_cleanup_add "$work"
daemon=""
. "$here/bench/limits.sh"

echo "== limits: memcpy, first touch of fresh shm ($mib MiB, best of 3)"
memcpy_gbps=$("$build/ckpt-memcpy-bw" --mib "$mib" --repeats 3)
first_touch_gbps=$("$build/ckpt-memcpy-bw" --mode first-touch --mib "$mib" --repeats 3)
pwrite_gbps=$("$build/ckpt-memcpy-bw" --mode pwrite --mib "$mib" --repeats 3)
echo "   memcpy $memcpy_gbps GB/s, first touch $first_touch_gbps GB/s, pwrite into fresh shm $pwrite_gbps GB/s"

# The memory tier keeps the newest version (room for it and the next); nothing goes to a
# local tier, and the persistent tier is only written.
start_ckptd "$build/ckptd" "$work/ckptd.log" --socket "$work/ckptd.sock" --create-root --root "$work/persistent" \
  --pool-mib "$pool_mib" --memory-mib $((mib * 3))
trainer() {  # TAG [extra trainer flags]
  local tag=$1
  shift
  bench_run "$build/ckpt-toy-trainer" --socket "$work/ckptd.sock" --job restore-mem --state-mib "$mib" --tensors 16 \
    --compute-ms "$compute_ms" --quiet --summary "$work/$tag.json" "$@" >>"$work/trainers.log" 2>&1
}
echo "== a trainer checkpoints $mib MiB (2 versions, the second committed before it exits)"
trainer checkpoint --iters 2
echo "== $restores fresh processes restore from daemon memory"
for i in $(seq 1 "$restores"); do trainer "restore-$i" --iters 0 --resume; done
"$build/ckptctl" --socket "$work/ckptd.sock" status --json >"$work/status.json"
stop_ckptd

python3 - "$work" "$out" "$restores" "$mib" "$memcpy_gbps" "$first_touch_gbps" "$pwrite_gbps" \
  "bench/restore_mem.sh $args" <<'PY'
import datetime, json, os, platform, statistics, sys
work, out, restores, mib, memcpy, first_touch, pwrite, command = sys.argv[1:]
state = int(mib) * 2**20
runs = [json.load(open(os.path.join(work, f"restore-{i}.json"))) for i in range(1, int(restores) + 1)]
tiers = sorted({r["restore_tier"] for r in runs})
if tiers != ["memory"]:
    sys.exit(f"every restore must come from memory, got {tiers}")
status = json.load(open(os.path.join(work, "status.json")))
read = int(status.get("bytes_read_total", 0))
ms = statistics.median(r["restore_ms"] for r in runs)
shm = open("/proc/mounts").read().split("\n")
# The last mount on /dev/shm is the one in effect (--huge stacks one on the system's).
shm_opts = ([l.split()[3] for l in shm if len(l.split()) > 3 and l.split()[1] == "/dev/shm"] or [""])[-1]
result = {
    "command": command,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}",
    "dev_shm": shm_opts,
    "state_bytes": state,
    "restores": len(runs),
    "restore_ms": ms,
    "restore_ms_each": [r["restore_ms"] for r in runs],
    "restore_MBps": state / 1e6 / (ms / 1000),
    "memcpy_GBps": float(memcpy),
    "first_touch_MBps": float(first_touch) * 1000,
    "pwrite_fresh_MBps": float(pwrite) * 1000,
    "bytes_read_from_disk": read,
}
json.dump(result, open(out, "w"), indent=2)
print(f"== restore of {state / 2**30:.1f} GiB from daemon memory into a fresh process (/dev/shm: {shm_opts})")
print("| figure | value |")
print("|---|---|")
print(f"| restore (median of {len(runs)}) | {ms:.0f} ms ({', '.join(f'{r:.0f}' for r in result['restore_ms_each'])}) |")
print(f"| restore throughput | {result['restore_MBps']:.0f} MB/s |")
print(f"| first touch of fresh shm (memset) | {result['first_touch_MBps']:.0f} MB/s |")
print(f"| pwrite into fresh shm | {result['pwrite_fresh_MBps']:.0f} MB/s |")
print(f"| single-thread memcpy | {result['memcpy_GBps']:.2f} GB/s |")
print(f"| bytes read from disk | {read} |")
print(f"written to {out}")
if read != 0:
    sys.exit("the daemon read shard files: the restores did not all come from memory")
PY
