#!/usr/bin/env bash
# Restore at another world size: 1 GiB of global state (4 F32 tensors, two split
# by rows and two by columns) written by 4 ranks, then restored, in one run:
#   - into 2 ranks (row boxes: resharded; each rank's pieces come from all 4 shards), and
#   - into 4 ranks with the boxes of the save (the same-size restore, the fast path),
# from the daemon's memory tier, and from the persistent tier (the daemon restarted, so its
# memory is empty; the shard files are in the page cache after the first read, as on a node
# that has read them). The ranks of one restore run on threads of one process
# (bench/reshard_restore.cc), each with its own Client and shm region; the figure is the
# wall time from the first restore call to the last return, every byte then checked.
#
# Usage: bench/reshard_restore.sh [--out FILE.json] [--build DIR] [--mib N] [--reps N]
# Writes JSON (default docs/results/reshard.json): the median and every repetition of each
# (tier, restore) pair.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="$here/docs/results/reshard.json"
build="$here/build"
mib=1024
reps=3
args="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --mib) mib="$2"; shift 2 ;;
    --reps) reps="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out="$(realpath -m "$out")"
build="$(realpath -m "$build")"
[ "$reps" -ge 3 ] || { echo "--reps must be at least 3 (the figures are medians)" >&2; exit 2; }

echo "== build ($build)"
ninja -C "$build" ckptd ckpt-reshard-restore >/dev/null
mkdir -p "$(dirname "$out")"
. "$here/bench/cleanup.sh"
bench_cleanup_init
work="$(mktemp -d "${TMPDIR:-/tmp}/ckpt-reshard-XXXXXX")"
bench_cleanup_add "$work"
daemon=""
. "$here/bench/limits.sh"

driver() { bench_run "$build/ckpt-reshard-restore" --socket "$work/ckptd.sock" --job reshard --mib "$mib" "$@"; }
daemon_up() {  # MEMORY_MIB
  start_ckptd "$build/ckptd" "$work/ckptd.log" --socket "$work/ckptd.sock" --create-root \
    --root "$work/persistent" --pool-mib 256 --memory-mib "$1"
}

echo "== 4 ranks save $mib MiB of global state"
daemon_up $((mib * 2))
driver --ranks 4 save >/dev/null
for tier in memory persistent; do
  for i in $(seq 1 "$reps"); do
    if [ "$tier" = persistent ]; then stop_ckptd; daemon_up 0; fi
    echo "   $tier $i: into 2 ranks"
    driver --ranks 2 restore >>"$work/$tier-2.jsonl"
    if [ "$tier" = persistent ]; then stop_ckptd; daemon_up 0; fi
    echo "   $tier $i: into 4 ranks (as saved)"
    driver --ranks 4 --as-saved restore >>"$work/$tier-4.jsonl"
  done
done
stop_ckptd

python3 - "$work" "$out" "$mib" "$reps" "bench/reshard_restore.sh $args" <<'PY'
import datetime, json, os, platform, statistics, sys
work, out, mib, reps, command = sys.argv[1:]
state = int(mib) * 2**20
result = {
    "command": command,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}",
    "state_bytes": state,
    "written_by": 4,
    "reps": int(reps),
    "restores": {},
}
print(f"== restore of {state / 2**30:.2f} GiB of global state written by 4 ranks (median of {reps})")
print("| tier | restore | resharded | seconds (median) | GB/s | each |")
print("|---|---|---|---|---|---|")
for tier in ("memory", "persistent"):
    for n in (2, 4):
        runs = [json.loads(l) for l in open(os.path.join(work, f"{tier}-{n}.jsonl")) if l.strip()]
        assert all(r["bytes_ok"] for r in runs), runs
        want_tier = "memory" if tier == "memory" else "persistent"
        assert all(r["tier"] == want_tier for r in runs), runs
        assert all(r["resharded"] == (n == 2) for r in runs), runs
        s = statistics.median(r["seconds"] for r in runs)
        key = f"{tier}_into_{n}"
        result["restores"][key] = {
            "tier": tier, "ranks": n, "resharded": n == 2, "seconds": s,
            "seconds_each": [r["seconds"] for r in runs], "GBps": state / 1e9 / s,
        }
        each = ", ".join("%.3f" % r["seconds"] for r in runs)
        print(f"| {tier} | into {n} ranks | {n == 2} | {s:.3f} | {state / 1e9 / s:.2f} | {each} |")
for tier in ("memory", "persistent"):
    r = result["restores"]
    result[f"{tier}_ratio_2_vs_4"] = r[f"{tier}_into_2"]["seconds"] / r[f"{tier}_into_4"]["seconds"]
    print("%s: into 2 ranks takes %.2fx the time of the same-size restore" % (tier, result[tier + "_ratio_2_vs_4"]))
json.dump(result, open(out, "w"), indent=2)
print(f"wrote {out}")
PY
