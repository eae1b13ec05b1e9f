#!/usr/bin/env bash
# What verify mode costs the trainer: the toy trainer checkpoints every iteration against one
# ckptd, alternating runs without and with --verify (the daemon re-reads the host state at
# each wait and compares it with the copy's checksums), and reports the median stall and
# iteration time of each, and their ratio, from the same run.
#
#   bench/verify_cost.sh [--state-mib N] [--iters N] [--rounds N] [--compute-ms N] [--out FILE]
#
# Writes docs/results/verify.json (or --out). Cleans up (daemon, trainers, temp dir, shm) on any
# exit (bench/cleanup.sh).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD:-$here/build}"
state_mib=256 iters=20 rounds=3 compute_ms=100 out="$here/docs/results/verify.json"
while [ $# -gt 0 ]; do
  case "$1" in
    --state-mib) state_mib="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --compute-ms) compute_ms="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "verify_cost.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
. "$here/bench/cleanup.sh"
bench_cleanup_init
work="$(mktemp -d "${TMPDIR:-/tmp}/ckpt-verify-cost.XXXXXX")"
bench_cleanup_add "$work"
mkdir -p "$work/sock"
"$build/ckptd" --root "$work/root" --create-root --socket "$work/sock/ckptd.sock" --pool-mib 512 \
  --memory-mib 2048 >"$work/daemon.log" 2>&1 &
bench_track_daemon $!
for _ in $(seq 200); do [ -S "$work/sock/ckptd.sock" ] && break; sleep 0.05; done
run() {  # run MODE ROUND
  local extra=()
  [ "$1" = verify ] && extra=(--verify)
  bench_run "$build/ckpt-toy-trainer" --socket "$work/sock/ckptd.sock" --job "j-$1-$2" --state-mib "$state_mib" \
    --tensors 16 --compute-ms "$compute_ms" --iters "$iters" --quiet --summary "$work/$1-$2.json" "${extra[@]}" \
    >/dev/null
}
for r in $(seq "$rounds"); do
  run plain "$r"
  run verify "$r"
done
python3 - "$work" "$rounds" "$state_mib" "$iters" "$compute_ms" "$out" <<'PY'
import json, statistics, sys
work, rounds, state_mib, iters, compute_ms, out = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6]), sys.argv[6]
runs = {m: [json.load(open(f"{work}/{m}-{r}.json")) for r in range(1, rounds + 1)] for m in ("plain", "verify")}
med = lambda m, k: statistics.median(x[k] for x in runs[m])
res = {"state_mib": state_mib, "iters": iters, "rounds": rounds, "compute_ms": compute_ms,
       "command": f"bench/verify_cost.sh --state-mib {state_mib} --iters {iters} --rounds {rounds} --compute-ms {compute_ms}"}
for m in runs:
    res[m] = {"stall_ms_p50": med(m, "stall_ms_p50"), "stall_ms_p99": med(m, "stall_ms_p99"),
              "iter_ms_p50": med(m, "iter_ms_p50")}
res["stall_p50_ratio"] = res["verify"]["stall_ms_p50"] / max(res["plain"]["stall_ms_p50"], 1e-9)
res["iter_p50_ratio"] = res["verify"]["iter_ms_p50"] / res["plain"]["iter_ms_p50"]
res["verify_extra_ms_per_gib"] = (res["verify"]["stall_ms_p50"] - res["plain"]["stall_ms_p50"]) * 1024 / state_mib
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res, indent=1))
PY
