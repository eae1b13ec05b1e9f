#!/usr/bin/env bash
# The GPU proof: a real ckptd checkpoints a trainer whose state lives in GPU
# memory (4 GiB by default), every iteration, once with stream-ordered waits
# (wait_snapshot_on_stream) and once with host waits (wait_snapshot); after each run a new
# trainer process restores the newest version into fresh GPU buffers and checks every byte,
# and `ckptctl verify` rechecks the shard on disk. Prints, and writes to
# tests/gpu/out/gpu_run.json: stall per checkpoint, the snapshot engine's D2H throughput
# next to plain cudaMemcpy into pinned memory, flush and restore throughput next to the
# storage's (dd, O_DIRECT).
#
# Then the checks (tests/gpu/checks.py, with PyTorch): small allocations, a
# trainer killed with an event pending, the daemon killed during a stream-ordered wait,
# memory returned after unregister, the PyTorch path next to DCP async_save, two trainers,
# capture under load, restore rates, a throughput matrix, a thread with no context, the
# pool's pin time, and the torn-snapshot matrix with the model on the GPU (`--only torn`:
# GPU staging, trainers killed at random steps, every committed version exact); written to
# tests/gpu/out/gpu_checks.json.
#
# Usage: tests/gpu/run.sh [--dir DIR] [--state-gib S] [--iters I] [--compute-ms C]
#                         [--build DIR | --prebuilt BUNDLE] [--jobs N] [--skip-proof]
#   --prebuilt    binaries made here by tests/gpu/bundle.sh, for a GPU machine without
#                 gRPC's development files (the Python module is linked there, against
#                 that machine's interpreter, from the bundle's objects)
#   --skip-proof  only the checks, not the two 20-iteration runs
#
# On a lent GPU machine (the device tool: one command of at most 10 minutes, files back
# only from $OUT): run `bash tests/gpu/bundle.sh` here first, then there, carrying
# .gpu-bundle:
#   timeout -s TERM 540 bash tests/gpu/run.sh --prebuilt .gpu-bundle --skip-proof;
#   cp tests/gpu/out/gpu_checks.json tests/gpu/out/checks.log "$OUT"/
# (checks.py rewrites its JSON after every check, so a run cut short keeps what it did),
# and the proof alone, if time is left, with --iters 10.
#   --dir         checkpoint storage (default: the fastest local file system with room)
#   --compute-ms  compute phase per iteration (default: the time the storage needs to
#                 absorb one checkpoint plus 20 %, between 200 and 4000 ms)
# Without a GPU it runs the CPU-side preflight only (build, ctest -R cuda_, the trainer's
# --help and its "no CUDA device" exit), says so and exits 0. Exits non-zero if any check
# fails. Logs of every step go to tests/gpu/out/.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
build="$here/build-gpu"
jobs="$(nproc)"
dir=""
state_gib=4
iters=20
compute_ms=""
tensors=16
pool_mib=8192
chunk_mib=32
prebuilt=""
skip_proof=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir="$2"; shift 2 ;;
    --state-gib) state_gib="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --compute-ms) compute_ms="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --prebuilt) prebuilt="$(cd "$2" && pwd)"; shift 2 ;;
    --skip-proof) skip_proof=1; shift ;;
    --jobs) jobs="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out_dir="$here/tests/gpu/out"
out="$out_dir/gpu_run.json"
mkdir -p "$out_dir"
fail() { echo "FAIL: $*" >&2; exit 1; }
step() { echo "== $*"; }
command -v python3 >/dev/null || fail "python3 is needed to read the JSON figures"

daemon=""
work=""
stop_daemon() {  # SIGTERM, then the daemon's exit status
  local pid="$daemon" rc=0
  daemon=""
  kill "$pid" 2>/dev/null || true
  wait "$pid" || rc=$?
  return "$rc"
}
cleanup() {
  if [ -n "$daemon" ]; then stop_daemon || true; fi
  if [ -n "$work" ]; then rm -rf "$work"; fi
}
trap cleanup EXIT

# ---------------------------------------------------------------- build and preflight
t_start=$(date +%s)
cuda_tests=()
for src in "$here"/cuda/tests/*_test.cc; do cuda_tests+=("$(basename "$src" .cc)"); done
pydir=""  # where `import ckpt` finds the module built for this machine's python3
if [ -n "$prebuilt" ]; then
  step "prebuilt binaries from $prebuilt (commit $(cat "$prebuilt/COMMIT" 2>/dev/null || echo unknown))"
  [ -x "$prebuilt/bin/ckptd" ] || fail "$prebuilt is not a bundle of tests/gpu/bundle.sh"
  # The bundle's programs find its libraries through wrappers that set LD_LIBRARY_PATH
  # for them alone (exec: the pid is the program's), so python and torch keep their own.
  bin="$out_dir/bin"
  rm -rf "$bin"; mkdir -p "$bin"
  for f in "$prebuilt"/bin/*; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
      "$prebuilt/lib" "$f" >"$bin/$(basename "$f")"
    chmod +x "$bin/$(basename "$f")"
  done
  "$bin/ckptd" --help >/dev/null 2>"$out_dir/ckptd-help.log" ||
    { cat "$out_dir/ckptd-help.log"; fail "the bundled ckptd does not start here (libraries?)"; }
  step "preflight: the cuda_ tests"
  for t in "${cuda_tests[@]}"; do
    CUDA_IPC_EXPORTER_BINARY="$bin/cuda_ipc_exporter" CKPTD_BINARY="$bin/ckptd" \
      CKPTD_TEST_DEVICE_BINARY="$bin/ckptd-test-device" "$bin/$t" >"$out_dir/$t.log" 2>&1 ||
      { tail -40 "$out_dir/$t.log"; fail "$t"; }
    echo "   $t: $(grep -E "test cases|No tests ran" "$out_dir/$t.log" | tail -1)"
  done
  # The Python module: the bundle's, where it was prebuilt for this interpreter, else
  # built here from the sources with the bundle's headers (or this machine's Python.h).
  pydir="$prebuilt/py"
  ext="$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  pyver="$(python3 -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')"
  if [ -e "$pydir/ckpt/_ckpt$ext" ]; then
    echo "   the Python module prebuilt for $pyver: in the bundle"
  else
    pyinc="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
    [ -f "$pyinc/Python.h" ] || pyinc="$prebuilt/py/include/$pyver"
    if bash "$here/tests/gpu/build_module.sh" "$prebuilt" python3 "$pyinc" >"$out_dir/ext-build.log" 2>&1; then
      echo "   the Python module, built here for $(python3 --version): ok"
    else
      tail -20 "$out_dir/ext-build.log"
      echo "   the Python module could not be built for $(python3 --version) (see $out_dir/ext-build.log)"
      pydir=""
    fi
  fi
else
  step "configure $build (CUDA on)"
  cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_WITH_CUDA=ON \
      -DPython3_EXECUTABLE="$(command -v python3)" \
    >"$out_dir/configure.log" 2>&1 || { tail -30 "$out_dir/configure.log"; fail "cmake configure"; }
  grep -q "ckptd: CUDA toolkit .* found: ON" "$out_dir/configure.log" ||
    fail "the CUDA toolkit was not found (headers and libcudart are needed to build the GPU path); see $out_dir/configure.log"
  py_target=()
  if grep -q "ckptd: Python module for" "$out_dir/configure.log"; then py_target=(_ckpt); pydir="$build/python"; fi
  step "build ckptd ckptctl ckpt-gpu-trainer and the cuda_ tests (-j$jobs)"
  cmake --build "$build" -j "$jobs" --target ckptd ckptctl ckpt-gpu-trainer cuda_ipc_exporter "${cuda_tests[@]}" \
      "${py_target[@]}" >"$out_dir/build.log" 2>&1 || { tail -60 "$out_dir/build.log"; fail "build"; }
  echo "   built in $(( $(date +%s) - t_start )) s"
  bin="$build"
  step "preflight: ctest -R cuda_"
  ctest --test-dir "$build" -R cuda_ --no-tests=error --output-on-failure -j "$jobs" >"$out_dir/ctest-cuda.log" 2>&1 ||
    { tail -60 "$out_dir/ctest-cuda.log"; fail "ctest -R cuda_"; }
  grep -E "tests passed|tests failed" "$out_dir/ctest-cuda.log" | sed 's/^/   /'
fi
"$bin/ckpt-gpu-trainer" --help >"$out_dir/trainer-help.txt" || fail "ckpt-gpu-trainer --help"
echo "   ckpt-gpu-trainer --help: ok"

# A GPU is there when the trainer can use one: it measures plain cudaMemcpy to and from
# pinned memory (1 GiB) and exits 0, or exits 4 saying "no CUDA device".
smi="$(nvidia-smi -L 2>/dev/null | head -1 || true)"
probe_rc=0
"$bin/ckpt-gpu-trainer" --iters 0 --measure-d2h --summary "$out_dir/plain_copy.json" \
  >"$out_dir/plain_copy.log" 2>&1 || probe_rc=$?
if [ "$probe_rc" = 4 ] && [ -z "$smi" ]; then
  echo "   the trainer starts without a GPU and says: $(cat "$out_dir/plain_copy.log")"
  step "no GPU: preflight only"
  step "preflight: checks.py without a GPU (its harness, and the checks that need no GPU)"
  PYTHONPATH="${pydir:+$pydir:}${PYTHONPATH:-}" python3 "$here/tests/gpu/checks.py" --bin "$bin" \
      --out "$out_dir/gpu_checks_cpu.json" >"$out_dir/checks-cpu.log" 2>&1 ||
    { cat "$out_dir/checks-cpu.log"; fail "checks.py without a GPU"; }
  sed 's/^/   /' "$out_dir/checks-cpu.log"
  echo "   build, the cuda_ tests, the trainer's --help and checks.py's harness passed; nothing was measured on a GPU ($out not written)."
  exit 0
fi
[ "$probe_rc" = 0 ] || { cat "$out_dir/plain_copy.log"; fail "nvidia-smi sees '${smi:-no GPU}' but the trainer cannot use it (exit $probe_rc)"; }
step "GPU: ${smi:-$(python3 -c "import json; print(json.load(open('$out_dir/plain_copy.json'))['device'])")}"
sed 's/^/   /' "$out_dir/plain_copy.log"

# ---------------------------------------------------------------- storage
# Each mode runs against its own daemon and root, removed afterwards: at most the two
# versions kept plus two in flight (the pool holds two) at a time.
# The checks need about 20 GiB at their peak (each removes its files before the next).
need_gib=$(python3 -c "import math; print(max(24, math.ceil($state_gib * 4 + 3)))")
dd_gbps() {  # $1 write|read, $2 file: 1 GiB in 16 MiB blocks, O_DIRECT where the file system takes it
  local t0 t1
  t0=$(date +%s.%N)
  if [ "$1" = write ]; then
    dd if=/dev/zero of="$2" bs=16M count=64 oflag=direct 2>/dev/null ||
      dd if=/dev/zero of="$2" bs=16M count=64 conv=fdatasync 2>/dev/null || return 1
  else
    dd if="$2" of=/dev/null bs=16M iflag=direct 2>/dev/null || dd if="$2" of=/dev/null bs=16M 2>/dev/null || return 1
  fi
  t1=$(date +%s.%N)
  python3 -c "print(round(1.073741824 / ($t1 - $t0), 2))"
}
candidates=()
if [ -n "$dir" ]; then
  mkdir -p "$dir"
  candidates=("$dir")
else
  for c in /nvme* /scratch* /local* /data* /raid* /mnt/nvme* /mnt/local* /mnt/scratch* /mnt/data* /mnt/disk* \
           /var/tmp /tmp "$here"; do
    [ -d "$c" ] && [ -w "$c" ] && candidates+=("$c")
  done
fi
step "storage: candidates with $need_gib GiB free (dd, 1 GiB, O_DIRECT, 16 MiB blocks)"
best="" best_write=0 best_read=0
declare -A seen=()
for c in "${candidates[@]}"; do
  read -r src fstype avail_kib < <(df --output=source,fstype,avail -k "$c" 2>/dev/null | tail -1) || continue
  if [ -n "${seen[$src]:-}" ] || { [ -z "$dir" ] && [ "$fstype" = tmpfs ]; }; then continue; fi
  seen[$src]=1
  if [ "$avail_kib" -lt $(( need_gib * 1024 * 1024 )) ]; then
    echo "   $c ($src, $fstype): $(( avail_kib / 1024 / 1024 )) GiB free, too little"
    continue
  fi
  probe="$(mktemp "$c/.ckpt-gpu-probe-XXXXXX")"
  w=$(dd_gbps write "$probe" || echo 0)
  r=$(dd_gbps read "$probe" || echo 0)
  rm -f "$probe"
  echo "   $c ($src, $fstype): $(( avail_kib / 1024 / 1024 )) GiB free, write $w GB/s, read $r GB/s"
  if python3 -c "import sys; sys.exit(0 if $w > $best_write else 1)"; then best="$c" best_write=$w best_read=$r; fi
done
if [ -z "$best" ] && [ -z "$dir" ] && [ -d /dev/shm ] &&
   [ "$(df --output=avail -k /dev/shm | tail -1)" -ge $(( need_gib * 1024 * 1024 )) ]; then
  best=/dev/shm best_write=$(dd_gbps write /dev/shm/.ckpt-gpu-probe || echo 0)
  best_read=$(dd_gbps read /dev/shm/.ckpt-gpu-probe || echo 0)
  rm -f /dev/shm/.ckpt-gpu-probe
  echo "   no disk has room: using /dev/shm (memory: flush and restore figures are not storage figures)"
fi
[ -n "$best" ] || fail "no local file system has $need_gib GiB free for the checkpoints (pass --dir)"
work="$(mktemp -d "$best/ckpt-gpu-XXXXXX")"
echo "   using $work"
if [ -z "$compute_ms" ]; then
  compute_ms=$(python3 -c "print(min(4000, max(200, int($state_gib * 1.073741824 / $best_write * 1000 * 1.2) + 1)))")
fi

# ---------------------------------------------------------------- the runs
run_mode() {  # $1 stream|host
  local mode="$1" d="$work/$1" line rc
  local job="gpu-$mode"
  mkdir -p "$d"
  mkfifo "$d/ready"
  "$bin/ckptd" --socket "$d/ckptd.sock" --create-root --root "$d/root" --pool-mib "$pool_mib" --chunk-mib "$chunk_mib" \
    --keep-last 2 --ready-fd 3 3>"$d/ready" >"$out_dir/ckptd-$mode.log" 2>&1 &
  daemon=$!
  if ! read -r -t 120 line <"$d/ready" || [ "$line" != ready ]; then
    tail -20 "$out_dir/ckptd-$mode.log"
    fail "ckptd ($mode) did not become ready"
  fi
  step "$mode mode: $state_gib GiB in $tensors GPU tensors, $iters iterations, a checkpoint every iteration, compute $compute_ms ms"
  rc=0
  timeout 300 "$bin/ckpt-gpu-trainer" --socket "$d/ckptd.sock" --job "$job" --state-gib "$state_gib" \
    --tensors "$tensors" --iters "$iters" --every 1 --compute-ms "$compute_ms" --mode "$mode" \
    --summary "$out_dir/train-$mode.json" >"$out_dir/train-$mode.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    tail -20 "$out_dir/train-$mode.log"
    fail "trainer ($mode mode) exited $rc"
  fi
  grep '^summary:' "$out_dir/train-$mode.log" | sed 's/^/   /'
  "$bin/ckptctl" --socket "$d/ckptd.sock" status --json >"$out_dir/status-$mode.json" || fail "ckptctl status"
  step "$mode mode: a new trainer restores the newest version into fresh GPU buffers and checks every byte"
  rc=0
  timeout 300 "$bin/ckpt-gpu-trainer" --socket "$d/ckptd.sock" --job "$job" --state-gib "$state_gib" \
    --tensors "$tensors" --iters "$iters" --mode "$mode" --resume \
    --summary "$out_dir/resume-$mode.json" >"$out_dir/resume-$mode.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    tail -20 "$out_dir/resume-$mode.log"
    fail "resume ($mode mode) exited $rc"
  fi
  grep '^restored' "$out_dir/resume-$mode.log" | sed 's/^/   /'
  local shard
  shard="$d/root/$job/$(printf 'v%010d' "$iters")/rank-00000.safetensors"
  "$bin/ckptctl" verify "$shard" >"$out_dir/verify-$mode.log" 2>&1 ||
    { cat "$out_dir/verify-$mode.log"; fail "ckptctl verify $shard"; }
  echo "   ckptctl verify $(basename "$(dirname "$shard")")/$(basename "$shard"): every checksum matches"
  awk '/VmHWM/ {print $2}' "/proc/$daemon/status" >"$d/rss_kib"
  cp "$d/rss_kib" "$out_dir/ckptd-$mode.rss_kib"
  stop_daemon || fail "ckptd ($mode) did not exit cleanly on SIGTERM; see $out_dir/ckptd-$mode.log"
  rm -rf "$d"
}
checks_rc=0
run_checks() {  # the checks (tests/gpu/checks.py), with this machine's PyTorch
  if [ -z "$pydir" ]; then
    echo "FAIL: no Python module for $(python3 --version) was built: the PyTorch checks cannot run" >&2
    checks_rc=1
    return
  fi
  step "the checks (tests/gpu/checks.py)"
  PYTHONPATH="$pydir${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 python3 "$here/tests/gpu/checks.py" \
      --bin "$bin" --out "$out_dir/gpu_checks.json" --work "$work/checks" 2>&1 | tee "$out_dir/checks.log" |
      sed 's/^/   /' || checks_rc=1
  rm -rf "$work/checks"
}
if [ "$skip_proof" = 1 ]; then
  run_checks
  exit "$checks_rc"
fi
run_mode stream
run_mode host
run_checks


# ---------------------------------------------------------------- figures and checks
python3 - "$out_dir" "$out" "$iters" "$compute_ms" "$best" "$best_write" "$best_read" "$pool_mib" "$chunk_mib" \
  "$(( $(date +%s) - t_start ))" <<'PY'
import json, statistics, sys
out_dir, out, iters, compute_ms = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
storage, write_gbps, read_gbps = sys.argv[5], float(sys.argv[6]), float(sys.argv[7])
pool_mib, chunk_mib, elapsed_s = int(sys.argv[8]), int(sys.argv[9]), int(sys.argv[10])
plain = json.load(open(f"{out_dir}/plain_copy.json"))
failed = []
result = {"device": plain["device"], "storage": {"dir": storage, "dd_write_GBps": write_gbps, "dd_read_GBps": read_gbps},
          "pool_mib": pool_mib, "chunk_mib": chunk_mib, "iters": iters, "compute_ms": compute_ms,
          "plain_d2h_pinned_GBps": plain["d2h_pinned_GBps"], "plain_h2d_pinned_GBps": plain["h2d_pinned_GBps"],
          "modes": {}}
for mode in ("stream", "host"):
    train = json.load(open(f"{out_dir}/train-{mode}.json"))
    resume = json.load(open(f"{out_dir}/resume-{mode}.json"))
    status = json.load(open(f"{out_dir}/status-{mode}.json"))
    job = f"gpu-{mode}"
    shards = [s for s in status.get("shards", []) if s["job"] == job]
    bad = [f"v{s['version']}: {s['error']}" for s in shards if s.get("error")]
    done = [s for s in shards if not s.get("error") and s["capture_ms"] > 0 and s["durable_ms"] > 0]
    d2h = [int(s["total_bytes"]) / 1e9 / (s["capture_ms"] / 1000) for s in done]
    flush = [int(s["total_bytes"]) / 1e9 / (s["durable_ms"] / 1000) for s in done]
    m = {
        "state_bytes": train["state_bytes"], "tensors": train["tensors"], "checkpoints": train["checkpoints"],
        "stall_ms_p50": train["stall_ms_p50"], "stall_ms_p99": train["stall_ms_p99"], "stall_ms_max": train["stall_ms_max"],
        "gpu_wait_ms_p50": train["gpu_wait_ms_p50"], "gpu_wait_ms_p99": train["gpu_wait_ms_p99"],
        "gpu_wait_ms_max": train["gpu_wait_ms_max"],
        "snapshot_call_us_p50": train["snapshot_call_us_p50"], "iter_ms_p50": train["iter_ms_p50"],
        "iter_ms_p99": train["iter_ms_p99"], "final_durable_ms": train["final_durable_ms"],
        "shards_measured": len(done),
        "capture_ms_p50": statistics.median(s["capture_ms"] for s in done) if done else None,
        "engine_d2h_GBps_p50": statistics.median(d2h) if d2h else None,
        "engine_d2h_GBps_max": max(d2h) if d2h else None,
        "flush_GBps_p50": statistics.median(flush) if flush else None,
        "restored_version": resume["restored_version"], "restore_ms": resume["restore_ms"],
        "restore_GBps": resume["restore_GBps"], "verified_bytes": resume["verified_bytes"],
        "daemon_peak_rss_MB": int(open(f"{out_dir}/ckptd-{mode}.rss_kib").read() or 0) / 1024,
        "daemon_errors": status.get("errors", []), "shard_errors": bad,
    }
    result["modes"][mode] = m
    if train["iters"] != iters or train["checkpoints"] != iters:
        failed.append(f"{mode}: ran {train['iters']} iterations and {train['checkpoints']} checkpoints, expected {iters}")
    if len(done) != iters:
        failed.append(f"{mode}: the daemon reports {len(done)} durable shards of {job}, expected {iters}")
    if resume["restored_version"] != iters:
        failed.append(f"{mode}: restored version {resume['restored_version']}, expected {iters}")
    if resume["verified_bytes"] != train["state_bytes"]:
        failed.append(f"{mode}: verified {resume['verified_bytes']} bytes of {train['state_bytes']}")
    if bad or m["daemon_errors"]:
        failed.append(f"{mode}: daemon errors {m['daemon_errors']} {bad}")
result["checks_failed"] = failed
result["elapsed_s"] = elapsed_s
json.dump(result, open(out, "w"), indent=2)

def f(x, fmt="{:.3f}"):
    return "n/a" if x is None else fmt.format(x)
s, h = result["modes"]["stream"], result["modes"]["host"]
print(f"== result: {s['state_bytes'] / 2**30:.2f} GiB in {s['tensors']} tensors on {result['device']}, "
      f"{iters} iterations, a checkpoint every iteration, compute {compute_ms} ms")
print(f"   stall per checkpoint (host blocked)  stream mode p50 {f(s['stall_ms_p50'])} ms  p99 {f(s['stall_ms_p99'])} ms"
      f"   host mode p50 {f(h['stall_ms_p50'])} ms  p99 {f(h['stall_ms_p99'])} ms")
print(f"   stream mode: the stream waited       p50 {f(s['gpu_wait_ms_p50'])} ms  p99 {f(s['gpu_wait_ms_p99'])} ms"
      "   (GPU-side wait on the daemon's event, CUDA events)")
print(f"   iteration p50                        stream mode {f(s['iter_ms_p50'], '{:.1f}')} ms   host mode "
      f"{f(h['iter_ms_p50'], '{:.1f}')} ms   (compute {compute_ms} ms)")
for name, m in (("stream", s), ("host", h)):
    frac = "" if not m["engine_d2h_GBps_p50"] or not result["plain_d2h_pinned_GBps"] else \
        f" = {100 * m['engine_d2h_GBps_p50'] / result['plain_d2h_pinned_GBps']:.0f} % of plain"
    print(f"   D2H, snapshot engine ({name:6})      p50 {f(m['engine_d2h_GBps_p50'], '{:.1f}')} GB/s "
          f"(bytes / capture_ms, {m['shards_measured']} shards){frac}")
print(f"   D2H, plain cudaMemcpy, pinned        {f(result['plain_d2h_pinned_GBps'], '{:.1f}')} GB/s (1 GiB, median of 5)")
for name, m in (("stream", s), ("host", h)):
    print(f"   flush ({name:6}, snapshot->durable)  p50 {f(m['flush_GBps_p50'], '{:.2f}')} GB/s"
          f"   (dd write {write_gbps:.2f} GB/s)")
for name, m in (("stream", s), ("host", h)):
    print(f"   restore into GPU ({name:6})          {f(m['restore_GBps'], '{:.2f}')} GB/s ({f(m['restore_ms'], '{:.0f}')} ms, "
          f"{m['verified_bytes'] / 2**30:.2f} GiB verified)   (dd read {read_gbps:.2f} GB/s, plain H2D "
          f"{f(result['plain_h2d_pinned_GBps'], '{:.1f}')} GB/s)")
print(f"   daemon peak RSS                      stream {s['daemon_peak_rss_MB']:.0f} MB, host {h['daemon_peak_rss_MB']:.0f} MB"
      f" (pool {pool_mib} MiB)")
print(f"   written to {out}")
if failed:
    print("FAIL:\n   " + "\n   ".join(failed), file=sys.stderr)
    sys.exit(1)
print(f"== all checks passed in {elapsed_s} s")
PY
exit "$checks_rc"
