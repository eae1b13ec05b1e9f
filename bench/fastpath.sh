#!/usr/bin/env bash
# The fast-path benchmarks, one after the other, into one JSON next to their
# targets and the figures at 8059c89 (before the work):
#   rpc_latency   snapshot / wait_snapshot p50 against an empty gRPC call (the floor),
#                 1, 1,000 and 10,000 items                        (bench/rpc_latency.sh)
#   torch         PyTorch overhead at ~30 ms CPU steps, StepLR and OneCycleLR
#                                                                  (bench/torch_overhead.sh)
#   recovery      kill -9 of a 1 GiB trainer to its restarted process's restore
#                                                                  (bench/recovery.sh)
#   restore_mem   restore of 1 GiB from daemon memory into a fresh process
#                                                                  (bench/restore_mem.sh)
#   commit_scale  metadata operations and latency of a commit, 8 / 64 / 512 nodes x 8 ranks
#                                                                  (bench/commit_scale.sh)
# Usage: bench/fastpath.sh [--out FILE.json] [--build DIR] [--only "NAME ..."] [--gluster]
# bench/run.sh calls it last. Each part writes its own JSON beside FILE (FILE-NAME.json);
# a part that fails is recorded as failed (with its exit status) and the others still run;
# the script then exits 1.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="$here/bench/out/fastpath.json"
build="$here/build-bench"
only="rpc_latency torch_overhead recovery restore_mem commit_scale"
gluster=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    --gluster) gluster=(--gluster); shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out="$(realpath -m "$out")"
mkdir -p "$(dirname "$out")"
# A part runs as a child that the cleanup ends (SIGTERM: it then cleans up after itself).
. "$here/bench/cleanup.sh"
bench_cleanup_init
failed=0
parts=()
for name in $only; do
  script="$here/bench/$name.sh"
  part="${out%.json}-$name.json"
  [ -x "$script" ] || [ -f "$script" ] || { echo "no $script" >&2; exit 2; }
  echo "== fastpath: $name"
  extra=()
  if [ "$name" = commit_scale ]; then extra=("${gluster[@]}"); fi
  rc=0
  start=$(date +%s)
  bench_run bash "$script" --out "$part" --build "$build" "${extra[@]}" || rc=$?
  echo "   $name: exit $rc in $(($(date +%s) - start)) s"
  if [ $rc -ne 0 ]; then failed=1; fi
  parts+=("$name=$part=$rc")
done
python3 - "$out" "${parts[@]}" <<'EOF'
import json, sys
out, parts = sys.argv[1], sys.argv[2:]
# The targets, and the figures measured at 8059c89, before the fast path was built.
targets = {
    "rpc_latency": {"target": "snapshot and wait_snapshot p50 <= 2x the floor, 1 / 1,000 / 10,000 items",
                    "before": {"floor_p50_us": "34-52", "snapshot_p50_us": {"1": 423, "1000": 509, "10000": 1090},
                               "wait_p50_us": {"1": 1000, "1000": 4500, "10000": 30600}}},
    "torch_overhead": {"target": "<= 3 % overhead at ~30 ms CPU steps, StepLR and OneCycleLR",
                       "before": {"overhead_pct": "10-28", "save_ms": {"StepLR": 1.2, "OneCycleLR": 3.2}}},
    "recovery": {"target": "kill_to_restored_ms <= 1500, restore from daemon memory",
                 "before": {"kill_to_restored_ms": "4949-6202"}},
    "restore_mem": {"target": ">= 2x the restore throughput from memory at 8059c89, or a profile of its bound",
                    "before": {"restore_MBps": 2675}},
    "commit_scale": {"target": "metadata operations per version grow with nodes, not ranks; polling backs off",
                     "before": "unknown beyond 3 daemons"},
}
result = {}
for p in parts:
    name, path, rc = p.split("=", 2)
    entry = {"exit": int(rc), "file": path, **targets.get(name, {})}
    try:
        with open(path) as f:
            entry["result"] = json.load(f)
    except (OSError, ValueError) as e:
        entry["result"] = None
        entry["error"] = f"no result: {e}"
    result[name] = entry
with open(out, "w") as f:
    json.dump(result, f, indent=2)
print(f"== fastpath: wrote {out}")
EOF
exit $failed
