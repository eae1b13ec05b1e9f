#!/usr/bin/env bash
# Recovery after a trainer crash: from kill -9 of a trainer (16 tensors, a checkpoint every
# iteration) to the end of its restarted process's restore, for each state size of --mib,
# with the daemon's default settings, and where that time goes.
#
# Usage: bench/recovery.sh [--out FILE.json] [--build DIR] [--dir DIR] [--local DIR|none]
#                          [--mib "N ..."] [--rounds N] [--crash-at N] [--restart-waits "MODE ..."]
#   --mib    state sizes in MiB (default "1024 4096 16384"); a size whose run would not fit
#            in the machine's MemAvailable (3 x the state + 2 GiB: the crashed trainer's
#            memory, two memory-tier images, the pool) is skipped, and the JSON says why
#   --restart-waits  the daemon's --restart-waits modes to measure, each with its rounds
#            (default "newest", the daemon's default: waits for the version snapshotted just
#            before the kill; "none" restores the newest version committed by then at once)
#   --dir    the persistent tier (default /tmp/ckptd-recovery; the parallel file system on
#            a cluster)
#   --local  a local tier (default none, as the daemon's default; e.g.
#            /dev/shm/ckptd-recovery-$UID, as bench/tiers.sh runs it)
#
# The daemon runs with its defaults (no local tier, a 1 GiB pool, a memory tier of one
# version per rank in 4 GiB) but for --memory-mib, raised to two images of the state where
# 4 GiB does not hold them, so that the restore can come from memory at every size. Each
# round uses a fresh daemon and a job of its own: a trainer (compute phase: state / fio
# write + 20 %, so that the persistent tier just absorbs one checkpoint per iteration)
# SIGKILLs itself right after the snapshot of iteration --crash-at (default 4); a new
# trainer process starts at once, registers, restores the newest committed version into
# newly created shared memory and checks every byte. "kill to restored" runs from the
# crashed process's exit to the end of the restore call (process start and registration
# included). The breakdown comes from the daemon's log (timestamps to the millisecond):
# death noticed (the session of the dead trainer closed), registered (the new process's
# registration, its wait for the newest version in flight included, and the faulting in of
# its regions' pages where that outlasts the wait), and the restore's own
# phases (wait, plan: the choice of version and tier, verify, copy, registration). In the
# same run: single-thread memcpy of the same bytes (ckpt-memcpy-bw), and the ratio of each
# phase to it. Everything the run starts is stopped, and everything it creates removed, on
# exit, on INT, TERM and HUP (a `timeout` included).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=/tmp/ckptd-recovery
local_dir=none
out="$here/bench/out/recovery.json"
build="$here/build-bench"
mibs="1024 4096 16384"
rounds=3
crash_at=4
modes="newest"
args="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --local) local_dir="$2"; shift 2 ;;
    --mib) mibs="$2"; shift 2 ;;
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
ninja -C "$build" -j2 ckptd ckptctl ckpt-toy-trainer ckpt-memcpy-bw >/dev/null
mkdir -p "$dir" "$(dirname "$out")"
work="$(mktemp -d "$dir/recovery-XXXXXX")"
local_tier=""
[ "$local_dir" = none ] || local_tier="$local_dir/$(basename "$work")"
daemon=""
child=""      # the trainer or tool running now
trainers=()   # every trainer pid started: their shared memory names go too
cleanup() {
  trap - EXIT INT TERM HUP
  if [ -n "$child" ]; then kill -KILL "$child" 2>/dev/null || true; wait "$child" 2>/dev/null || true; fi
  if [ -n "$daemon" ]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  local pid
  for pid in "${trainers[@]}"; do
    rm -f "/dev/shm/ckpt-$(id -u)-$pid-"* "/dev/shm/ckpt-release-$pid-"*
  done
  [ -z "${CKPT_BENCH_KEEP:-}" ] || { echo "kept $work ${local_tier}"; return; }
  rm -rf "$work"
  [ -z "$local_tier" ] || rm -rf "$local_tier"
  # The parent directories too, if this run left them empty.
  rmdir "$dir" 2>/dev/null || true
  [ -z "$local_tier" ] || rmdir "$local_dir" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
. "$here/bench/limits.sh"

# Runs "$@" in the background and waits for it, so that a signal to this script is handled
# at once (bash runs traps only between foreground commands). Returns its exit status.
run_child() {
  "$@" &
  child=$!
  local rc=0
  wait "$child" || rc=$?
  child=""
  return $rc
}

echo "== limits: fio O_DIRECT write of $dir"
write_persistent=$(fio_mbps "$work" write)
rm -f "$work/fio.dat"
echo "   persistent write $write_persistent MB/s"
[ -z "$local_tier" ] || mkdir -p "$local_tier"

mem_available_mib() { awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo; }

trainer() {  # MIB COMPUTE_MS JOB TAG [extra trainer flags]
  local mib=$1 compute=$2 job=$3 tag=$4
  shift 4
  "$build/ckpt-toy-trainer" --socket "$work/ckptd.sock" --job "$job" --state-mib "$mib" --tensors 16 \
    --compute-ms "$compute" --quiet --summary "$work/$tag.json" "$@" >>"$work/trainers.log" 2>&1 &
  child=$!
  trainers+=("$child")
  local rc=0
  # (wait's stderr: bash's "Killed" note for the trainer that kills itself on purpose)
  wait "$child" 2>/dev/null || rc=$?
  child=""
  return $rc
}

sizes_run=()
sizes_skipped=()
killed=()
for mib in $mibs; do
  need=$((3 * mib + 2048))
  avail=$(mem_available_mib)
  if [ "$avail" -lt "$need" ]; then
    echo "== $mib MiB: skipped: needs about $need MiB of memory (3 x the state + 2 GiB), MemAvailable is $avail MiB"
    sizes_skipped+=("$mib=$need=$avail")
    continue
  fi
  sizes_run+=("$mib")
  compute_ms=$(compute_ms_for "$mib" "$write_persistent")
  # The default memory tier (4 GiB) when it holds two images of the state (the version
  # restored and the one before it, committed), else just that.
  memory_mib=4096
  [ $((2 * mib + 64)) -le 4096 ] || memory_mib=$((2 * mib + 64))
  memcpy_gbps=$(run_child "$build/ckpt-memcpy-bw" --mode memcpy --mib "$(( mib < 4096 ? mib : 4096 ))" --repeats 3)
  echo "== $mib MiB: compute phase $compute_ms ms, memory tier $memory_mib MiB, memcpy $memcpy_gbps GB/s"
  echo "$mib $compute_ms $memory_mib $memcpy_gbps" >>"$work/sizes.txt"
  # Modes take turns round by round, so that drift of the machine hits them alike.
  for round in $(seq 1 "$rounds"); do
    for mode in $modes; do
      id="$mib-$mode-$round"
      echo "== $mib MiB, round $round, --restart-waits $mode: kill -9 after the snapshot of iteration $crash_at, restart at once"
      extra=(--socket "$work/ckptd.sock" --create-root --root "$work/persistent" --memory-mib "$memory_mib")
      [ -z "$local_tier" ] || extra+=(--local "$local_tier")
      # The daemon's default is newest: it is not passed then.
      [ "$mode" = newest ] || extra+=(--restart-waits "$mode")
      start_ckptd "$build/ckptd" "$work/ckptd-$id.log" "${extra[@]}"
      rc=0
      trainer "$mib" "$compute_ms" "recovery-$id" "crash-$id" --iters $((crash_at + 6)) --crash-at "$crash_at" || rc=$?
      killed+=("$id=$(date +%s%3N)")
      [ "$rc" -eq 137 ] || { echo "the trainer should have died of SIGKILL (rc $rc)"; tail "$work/trainers.log"; exit 1; }
      trainer "$mib" "$compute_ms" "recovery-$id" "restored-$id" --iters "$crash_at" --resume
      run_child "$build/ckptctl" --socket "$work/ckptd.sock" status --json >"$work/status-$id.json"
      stop_ckptd
      # The next round starts from a clean tier: the versions of this one go.
      rm -rf "$work/persistent"
      [ -z "$local_tier" ] || rm -rf "${local_tier:?}/"*
    done
  done
done

python3 - "$work" "$out" "$crash_at" "$write_persistent" "bench/recovery.sh $args" "$local_dir" \
  "${sizes_skipped[*]:-}" "${killed[@]}" <<'PY'
import datetime, json, os, platform, re, statistics, sys
work, out, crash_at, write_mbps, command, local_dir, skipped, *killed = sys.argv[1:]
crash_at = int(crash_at)
sizes = {}
if os.path.exists(os.path.join(work, "sizes.txt")):
    for line in open(os.path.join(work, "sizes.txt")):
        mib, compute, memory, gbps = line.split()
        sizes[int(mib)] = {"compute_ms": int(compute), "memory_mib": int(memory), "memcpy_GBps": float(gbps)}

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) ckptd\[\d+\] \w+: (.*)$")
def log_lines(i):
    for line in open(os.path.join(work, f"ckptd-{i}.log"), errors="replace"):
        m = LINE.match(line.rstrip("\n"))
        if m:
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp() * 1000
            yield t, m.group(2)

def breakdown(i, killed_ms, restore_end_ms):
    job = f"recovery-{i}"
    died = registered = None
    waited = restore = fault_tail = faulted = None
    for t, msg in log_lines(i):
        if died is None and msg.startswith(f"job {job} rank 0: trainer pid") and "exited" in msg:
            died = t
        elif msg.startswith(f"registered job {job} rank 0/"):
            registered = t  # the last one: the restarted trainer's
        m = re.match(rf"job {re.escape(job)} rank 0: restart waited ([\d.]+) ms for .*, then ([\d.]+) ms for its "
                     r"regions to be faulted in", msg)
        if m:
            waited, fault_tail = float(m.group(1)), float(m.group(2))
        m = re.match(rf"job {re.escape(job)} rank 0: regions faulted in for the restore in ([\d.]+) ms", msg)
        if m:
            faulted = float(m.group(1))
        m = re.match(rf"job {re.escape(job)} rank 0: restore of version (\d+) from (\w+): wait ([\d.]+) ms, "
                     r"plan ([\d.]+) ms, verify ([\d.]+) ms \(preallocation beside it ([\d.]+) ms\), "
                     r"copy ([\d.]+) ms, registration ([\d.]+) ms, total ([\d.]+) ms", msg)
        if m:
            restore = {k: float(m.group(n)) for n, k in
                       enumerate(["wait", "plan", "verify", "preallocate", "copy", "registration", "total"], start=3)}
    rel = lambda t: None if t is None else round(t - killed_ms, 1)
    b = {
        # kill to the daemon closing the dead trainer's session (its reaper, every 250 ms,
        # or the new registration, whichever comes first)
        "detect_death_ms": rel(died),
        # kill to the end of the new process's registration: process start, connect, and
        # the registration's wait for the newest version in flight
        "reregister_ms": rel(registered),
        "register_wait_ms": waited,
        # the new regions' pages faulted in (from the capture of the newest version on,
        # beside the wait), and the part of it that outlasted the wait
        "prefault_ms": faulted,
        "prefault_after_wait_ms": fault_tail,
    }
    if restore:
        b.update({"restore_wait_ms": restore["wait"], "plan_ms": restore["plan"], "verify_ms": restore["verify"],
                  "preallocate_ms": restore["preallocate"],
                  "copy_ms": restore["copy"], "registration_ms": restore["registration"],
                  "restore_in_daemon_ms": restore["total"]})
    b["total_ms"] = round(restore_end_ms - killed_ms, 1)
    return b

def newest_shard(i):
    # The version snapshotted just before the kill (the kill follows its snapshot call at
    # once), from the daemon's own timings.
    status = json.load(open(os.path.join(work, f"status-{i}.json")))
    for s in status.get("shards", []):
        if s["job"] == f"recovery-{i}" and s["version"] == crash_at:
            return {"captured_ms": round(s["capture_ms"], 1), "committed_ms": round(s["durable_ms"], 1),
                    "level": s["level"]}
    return None

rounds = []
for entry in killed:
    i, killed_ms = entry.split("=")
    mib, mode, _ = i.split("-")
    r = json.load(open(os.path.join(work, f"restored-{i}.json")))
    status = json.load(open(os.path.join(work, f"status-{i}.json")))
    b = breakdown(i, float(killed_ms), r["restore_end_unix_ms"])
    rounds.append({
        "round": i, "mib": int(mib), "restart_waits": mode,
        "kill_to_restored_ms": b["total_ms"],
        "restore_call_ms": round(r["restore_ms"], 1),
        "breakdown": b,
        "restored_version": r["restored_version"],
        "newest_snapshotted_version": crash_at,
        "restore_tier": r["restore_tier"],
        "daemon_bytes_read_total": int(status["bytes_read_total"]),
        "newest_after_its_snapshot": newest_shard(i),
    })

def med(vals):
    vals = [v for v in vals if v is not None]
    return round(statistics.median(vals), 1) if vals else None

by_size = {}
for mib in sorted({r["mib"] for r in rounds}):
    memcpy_ms = mib * 2**20 / (sizes[mib]["memcpy_GBps"] * 1e9) * 1000
    per_mode = {}
    for mode in dict.fromkeys(r["restart_waits"] for r in rounds if r["mib"] == mib):
        mine = [r for r in rounds if r["mib"] == mib and r["restart_waits"] == mode]
        keys = list(dict.fromkeys(k for r in mine for k in r["breakdown"]))
        median = {k: med([r["breakdown"].get(k) for r in mine]) for k in keys}
        per_mode[mode] = {
            "kill_to_restored_ms": median["total_ms"],
            "restore_call_ms": med([r["restore_call_ms"] for r in mine]),
            "breakdown_median": median,
            # How many plain memcpys of the same bytes each phase costs.
            "x_memcpy": {k: (round(v / memcpy_ms, 2) if v is not None else None) for k, v in median.items()
                         if k.endswith("_ms")},
            "restored_versions": [r["restored_version"] for r in mine],
            "restored_from": "/".join(sorted({r["restore_tier"] for r in mine})),
        }
    by_size[str(mib)] = {"state_bytes": mib * 2**20, **sizes[mib], "memcpy_ms": round(memcpy_ms, 1),
                         "by_mode": per_mode}
skips = []
for s in skipped.split():
    mib, need, avail = s.split("=")
    skips.append({"mib": int(mib), "skipped": f"needs about {need} MiB of memory (3 x the state + 2 GiB), "
                                             f"MemAvailable was {avail} MiB", "need_mib": int(need),
                  "mem_available_mib": int(avail)})
result = {
    "command": command,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}",
    "local_tier": local_dir,
    "persistent_write_MBps": float(write_mbps),
    "sizes": by_size,
    "skipped": skips,
    "rounds": rounds,
    "target_ms": 1500,
}
# The top-level figure: 1 GiB with the daemon's default (newest), when it ran.
first = by_size.get("1024") or (next(iter(by_size.values())) if by_size else None)
if first:
    mode = "newest" if "newest" in first["by_mode"] else next(iter(first["by_mode"]))
    result["kill_to_restored_ms"] = first["by_mode"][mode]["kill_to_restored_ms"]
    result["kill_to_restored_mode"] = mode
    result["state_bytes"] = first["state_bytes"]
json.dump(result, open(out, "w"), indent=2)
for mib, s in by_size.items():
    print(f"== kill -9 of a trainer with {int(mib) / 1024:.1f} GiB to the end of its restarted process's restore "
          f"(memcpy of the same bytes: {s['memcpy_ms']:.0f} ms)")
    print("| round | restart waits | total | death noticed | registered (its wait + faulting after it) | restore: wait / plan / "
          "verify / copy / registration | newest captured / committed | restored / newest | tier |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rounds:
        if str(r["mib"]) != mib:
            continue
        b, n = r["breakdown"], r["newest_after_its_snapshot"] or {}
        f = lambda v: "-" if v is None else f"{v:.0f}"
        print(f"| {r['round']} | {r['restart_waits']} | {f(b['total_ms'])} ms | {f(b['detect_death_ms'])} ms "
              f"| {f(b['reregister_ms'])} ({f(b['register_wait_ms'])} + {f(b.get('prefault_after_wait_ms'))}) ms | {f(b.get('restore_wait_ms'))} / "
              f"{f(b.get('plan_ms'))} / {f(b.get('verify_ms'))} / {f(b.get('copy_ms'))} / "
              f"{f(b.get('registration_ms'))} ms | {f(n.get('captured_ms'))} / {f(n.get('committed_ms'))} ms "
              f"| {r['restored_version']} / {r['newest_snapshotted_version']} | {r['restore_tier']} |")
    for m, b in s["by_mode"].items():
        print(f"--restart-waits {m}: median {b['kill_to_restored_ms']} ms ({b['x_memcpy']['total_ms']} x memcpy), "
              f"breakdown {b['breakdown_median']}, restored versions {b['restored_versions']} from {b['restored_from']}")
for s in skips:
    print(f"== {s['mib']} MiB skipped: {s['skipped']}")
if first:
    print(f"median (1 GiB or the first size, {result['kill_to_restored_mode']}) {result['kill_to_restored_ms']} ms "
          f"(target 1500 ms)")
print(f"written to {out}")
PY
