#!/usr/bin/env bash
# Recovery after a trainer crash: from kill -9 of a trainer with 1 GiB of state (16
# tensors, a checkpoint every iteration) to the end of its restarted process's restore.
#
# Usage: bench/recovery.sh [--out FILE.json] [--build DIR] [--dir DIR] [--local DIR]
#                          [--mib N] [--rounds N] [--crash-at N] [--restart-waits "MODE ..."]
#   --restart-waits  the daemon's --restart-waits modes to measure, each with its rounds
#            (default "newest none"): newest waits for the version snapshotted just before
#            the kill; none restores the newest version committed by then at once
#   --dir    the persistent tier (default /tmp/ckptd-recovery; the parallel file system on
#            a cluster)
#   --local  the local tier (default /dev/shm/ckptd-recovery-$UID)
#
# The daemon, as in bench/tiers.sh: --local and --root, a 1 GiB pool, a memory tier of
# 3 x the state. Each round uses a job of its own: a trainer (compute phase: state / fio
# write + 20 %, so that the persistent tier just absorbs one checkpoint per iteration)
# SIGKILLs itself right after the snapshot of iteration --crash-at (default 4); a new
# trainer process starts at once, registers, restores the newest committed version into
# newly created shared memory and checks every byte. "kill to restored" runs from the
# crashed process's exit to the end of the restore call (process start and registration
# included). Each round has a fresh daemon. The JSON has the median over the rounds and
# each round: the version restored against the newest one snapshotted before the kill, the
# tier it came from, and the daemon's bytes_read_total (0: the restore read no file).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=/tmp/ckptd-recovery
local_dir="/dev/shm/ckptd-recovery-$(id -u)"
out="$here/bench/out/recovery.json"
build="$here/build-bench"
mib=1024
rounds=3
crash_at=4
modes="newest none"
args="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --local) local_dir="$2"; shift 2 ;;
    --mib) mib="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --crash-at) crash_at="$2"; shift 2 ;;
    --restart-waits) modes="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out="$(realpath -m "$out")"

echo "== build ($build)"
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_BUILD_TESTS=OFF >/dev/null
fi
ninja -C "$build" -j2 ckptd ckptctl ckpt-toy-trainer >/dev/null
mkdir -p "$dir" "$(dirname "$out")"
work="$(mktemp -d "$dir/recovery-XXXXXX")"
local_tier="$local_dir/$(basename "$work")"
daemon=""
cleanup() {
  [ -z "${CKPT_BENCH_KEEP:-}" ] || { echo "kept $work and $local_tier"; return; }
  if [ -n "$daemon" ]; then kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null; fi
  rm -rf "$work" "$local_tier"
}
trap cleanup EXIT
. "$here/bench/limits.sh"

echo "== limits: fio O_DIRECT write of $dir"
write_persistent=$(fio_mbps "$work" write)
rm -f "$work/fio.dat"
compute_ms=$(compute_ms_for "$mib" "$write_persistent")
echo "   persistent write $write_persistent MB/s: compute phase $compute_ms ms"

mkdir -p "$local_tier"
start_daemon() {
  start_ckptd "$build/ckptd" "$work/ckptd.log" --socket "$work/ckptd.sock" --create-root --root "$work/persistent" \
    --pool-mib 1024 --memory-mib $((mib * 3)) --local "$local_tier" --restart-waits "$1"
}
trainer() {  # JOB TAG [extra trainer flags]
  local job=$1 tag=$2
  shift 2
  "$build/ckpt-toy-trainer" --socket "$work/ckptd.sock" --job "$job" --state-mib "$mib" --tensors 16 \
    --compute-ms "$compute_ms" --quiet --summary "$work/$tag.json" "$@" >>"$work/trainers.log" 2>&1
}
# A fresh daemon each round, so that rounds do not share the memory tier's budget.
# Modes take turns round by round, so that drift of the machine hits them alike.
killed=()
for round in $(seq 1 "$rounds"); do
  for mode in $modes; do
    id="$mode-$round"
    echo "== round $round, --restart-waits $mode: kill -9 after the snapshot of iteration $crash_at, restart at once"
    start_daemon "$mode"
    rc=0
    { trainer "recovery-$id" "crash-$id" --iters $((crash_at + 6)) --crash-at "$crash_at"; } 2>/dev/null || rc=$?
    killed+=("$id=$(date +%s%3N)")
    [ "$rc" -eq 137 ] || { echo "the trainer should have died of SIGKILL (rc $rc)"; tail "$work/trainers.log"; exit 1; }
    trainer "recovery-$id" "restored-$id" --iters "$crash_at" --resume
    "$build/ckptctl" --socket "$work/ckptd.sock" status --json >"$work/status-$id.json"
    stop_ckptd
  done
done

python3 - "$work" "$out" "$mib" "$crash_at" "$write_persistent" "bench/recovery.sh $args" "${killed[@]}" <<'PY'
import datetime, json, os, platform, statistics, sys
work, out, mib, crash_at, write_mbps, command, *killed = sys.argv[1:]
def read_total(i):
    status = json.load(open(os.path.join(work, f"status-{i}.json")))
    return int(status["bytes_read_total"])
def newest_shard(i):
    # Where the wait went: the version snapshotted just before the kill (the kill follows
    # its snapshot call at once), from the daemon's own timings.
    status = json.load(open(os.path.join(work, f"status-{i}.json")))
    for s in status.get("shards", []):
        if s["job"] == f"recovery-{i}" and s["version"] == int(crash_at):
            return {"captured_ms": round(s["capture_ms"], 1), "committed_ms": round(s["durable_ms"], 1),
                    "level": s["level"]}
    return None
rounds = []
for entry in killed:
    i, killed_ms = entry.split("=")
    r = json.load(open(os.path.join(work, f"restored-{i}.json")))
    rounds.append({
        "round": i,
        "restart_waits": i.split("-")[0],
        "kill_to_restored_ms": round(r["restore_end_unix_ms"] - float(killed_ms), 1),
        "restore_call_ms": round(r["restore_ms"], 1),
        "restored_version": r["restored_version"],
        "newest_snapshotted_version": int(crash_at),
        "restore_tier": r["restore_tier"],
        "daemon_bytes_read_total": read_total(i),
        "newest_after_its_snapshot": newest_shard(i),
    })
modes = list(dict.fromkeys(r["restart_waits"] for r in rounds))
by_mode = {}
for m in modes:
    mine = [r for r in rounds if r["restart_waits"] == m]
    by_mode[m] = {"kill_to_restored_ms": statistics.median(r["kill_to_restored_ms"] for r in mine),
                  "restore_call_ms": statistics.median(r["restore_call_ms"] for r in mine),
                  "restored_versions": [r["restored_version"] for r in mine],
                  "restored_from": "/".join(sorted({r["restore_tier"] for r in mine}))}
# The top-level figure is the daemon's default (newest) when it ran.
top = "newest" if "newest" in by_mode else modes[0]
ms = [r["kill_to_restored_ms"] for r in rounds if r["restart_waits"] == top]
result = {
    "command": command,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}",
    "state_bytes": int(mib) * 2**20,
    "persistent_write_MBps": float(write_mbps),
    "kill_to_restored_ms": statistics.median(ms),
    "kill_to_restored_mode": top,
    "by_mode": by_mode,
    "rounds": rounds,
    "restored_from": "/".join(sorted({r["restore_tier"] for r in rounds})),
    "daemon_bytes_read_total": sum(r["daemon_bytes_read_total"] for r in rounds),
    "target_ms": 1500,
}
json.dump(result, open(out, "w"), indent=2)
print(f"== kill -9 of a trainer with {int(mib) / 1024:.1f} GiB to the end of its restarted process's restore")
print("| round | restart waits | kill to restored | newest captured / committed after the kill | restore call "
      "| restored / newest snapshotted | tier |")
print("|---|---|---|---|---|---|---|")
for r in rounds:
    n = r["newest_after_its_snapshot"] or {"captured_ms": float("nan"), "committed_ms": float("nan")}
    print(f"| {r['round']} | {r['restart_waits']} | {r['kill_to_restored_ms']:.0f} ms | {n['captured_ms']:.0f} / {n['committed_ms']:.0f} ms "
          f"| {r['restore_call_ms']:.0f} ms | {r['restored_version']} / {r['newest_snapshotted_version']} "
          f"| {r['restore_tier']} |")
for m, b in by_mode.items():
    print(f"--restart-waits {m}: median {b['kill_to_restored_ms']:.0f} ms, restore call {b['restore_call_ms']:.0f} ms, "
          f"restored versions {b['restored_versions']} (newest snapshotted {crash_at}) from {b['restored_from']}")
print(f"median ({top}) {result['kill_to_restored_ms']:.0f} ms (target 1500 ms); "
      f"daemon bytes_read_total {result['daemon_bytes_read_total']} (all rounds)")
print(f"written to {out}")
PY
