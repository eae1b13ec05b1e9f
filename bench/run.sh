#!/usr/bin/env bash
# The benchmark suite: ckptd (lazy) next to a synchronous save (sync), a blocking copy to a
# host buffer written in the background (staged) and no checkpoint at all (none), on the
# same state and schedule, against the limits of the machine measured in the same run
# (fio sequential O_DIRECT write and read bandwidth of --dir, single-thread memcpy).
#
# Usage: bench/run.sh [--quick] [--out FILE.json] [--dir DIR] [--build DIR]
#                     [--sizes "MiB ..."] [--ranks "N ..."] [--every "K ..."] [--iters I] [--spin]
#                     [--no-fastpath]
#
# The state size is per node: S MiB split evenly across the ranks (trainer processes),
# which all talk to one ckptd. Each configuration (size x ranks x every) runs the four
# strategies one after the other (none, sync, staged, lazy), so drift of the machine hits
# them alike. The compute phase is a wait (a GPU computing leaves CPU and copy engines
# idle) of state / fio write bandwidth + 20 %, so storage can absorb one checkpoint per
# iteration; --spin busy-waits it instead. Each run has max(I, 4 * every) iterations.
# Default: the full matrix, 1, 2 and 4 GiB x 1, 2 and 4 ranks x every 1 and 5, 10
# iterations. --quick: 1 GiB, 1 rank, every 1, 6 iterations.
# Prints a table, writes JSON (default bench/out/run.json) and a PNG plot beside it. Then
# bench/fastpath.sh runs the fast-path benchmarks (per-call latency against the gRPC floor,
# PyTorch overhead at short steps, trainer-kill recovery, restore from memory, commit at
# scale) into FILE-fastpath.json; --no-fastpath skips them.
#
# Figures (node figures take the slowest rank, as a data-parallel step waits for it):
#   stall          time the trainer is blocked per checkpoint (see examples/toy_trainer.cc);
#   overhead       mean iteration time against none of the same configuration;
#   visible        state bytes / stall p50;
#   flush          sync and staged: state bytes / the write + fsync of the shard files;
#                  lazy: median over versions of state bytes / the time from the snapshot
#                  call to the slowest rank's shard being durable (copy and writes overlap);
#   restore        lazy only: a new trainer process per rank restores the newest version
#                  through ckptd (O_DIRECT reads, checksums) and checks every byte; the
#                  daemon runs without its memory tier (--memory-mib 0), so the restore
#                  reads the disk (bench/tiers.sh measures each tier);
#   daemon RSS     lazy only: VmHWM of a ckptd started for that run (1 GiB pool).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=/tmp/ckptd-bench
out="$here/bench/out/run.json"
build="$here/build-bench"
sizes="1024 2048 4096"
ranks_list="1 2 4"
every_list="1 5"
iters=10
spin=""
compute_mode=wait
fastpath=1
args="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) sizes=1024; ranks_list=1; every_list=1; iters=6; shift ;;
    --out) out="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --sizes) sizes="$2"; shift 2 ;;
    --ranks) ranks_list="$2"; shift 2 ;;
    --every) every_list="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --spin) spin=--spin; compute_mode=spin; shift ;;
    --no-fastpath) fastpath=0; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out="$(realpath -m "$out")"
start_s=$(date +%s)

echo "== build ($build)"
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_BUILD_TESTS=OFF >/dev/null
ninja -C "$build" -j2 ckptd ckptctl ckpt-toy-trainer ckpt-memcpy-bw >/dev/null
# The default directory is removed at the end if this run made it and left it empty.
made_dir=0
[ -d "$dir" ] || made_dir=1
mkdir -p "$dir" "$(dirname "$out")"
. "$here/bench/cleanup.sh"
bench_cleanup_init
[ "$made_dir" = 0 ] || bench_cleanup_hook "rmdir '$dir' 2>/dev/null"
work="$(mktemp -d "$dir/run-XXXXXX")"
bench_cleanup_add "$work"
daemon=""
. "$here/bench/limits.sh"
mkdir -p "$work/res"

echo "== limits: fio on $dir (O_DIRECT, 16 MiB blocks, iodepth 4), single-thread memcpy"
write_mbps=$(fio_mbps "$work" write)
read_mbps=$(fio_mbps "$work" read)
rm -f "$work/fio.dat"
memcpy_gbps=$("$build/ckpt-memcpy-bw" --mib 1024 --repeats 5)
echo "   write $write_mbps MB/s, read $read_mbps MB/s, memcpy $memcpy_gbps GB/s"
echo "{\"write_MBps\": $write_mbps, \"read_MBps\": $read_mbps, \"memcpy_GBps\": $memcpy_gbps}" >"$work/limits.json"

# trainers TAG STRATEGY ID MIB RANKS EVERY ITERS COMPUTE_MS [extra args]: one trainer
# process per rank, all at once; each writes its summary to $work/res/ID-TAG-rRANK.json.
trainers() {
  local tag=$1 strategy=$2 id=$3 mib=$4 ranks=$5 every=$6 n=$7 compute=$8
  shift 8
  local pids=() r
  for ((r = 0; r < ranks; r++)); do
    "$build/ckpt-toy-trainer" --strategy "$strategy" --socket "$work/ckptd.sock" --dir "$work/files-$id" \
      --job "$id" --rank "$r" --world-size "$ranks" --state-mib $((mib / ranks)) --tensors 16 \
      --iters "$n" --every "$every" --compute-ms "$compute" $spin --quiet --summary "$work/res/$id-$tag-r$r.json" "$@" \
      >>"$work/trainers.log" 2>&1 &
    pids+=($!)
    bench_track $!
  done
  local rc=0
  for p in "${pids[@]}"; do bench_wait "$p" || rc=$?; done
  if [ $rc -ne 0 ]; then
    echo "trainer failed (rc $rc); last lines of its log:" >&2
    tail -20 "$work/trainers.log" >&2
    exit 1
  fi
}

n_run=0
for mib in $sizes; do
  compute_ms=$(compute_ms_for "$mib" "$write_mbps")
  for ranks in $ranks_list; do
    for every in $every_list; do
      n=$((iters > 4 * every ? iters : 4 * every))
      for strategy in none sync staged lazy; do
        n_run=$((n_run + 1))
        id="run$n_run"
        printf '== %-6s %5d MiB, %d rank(s), every %d, %d iterations, compute %d ms\n' \
          "$strategy" "$mib" "$ranks" "$every" "$n" "$compute_ms"
        echo "{\"id\": \"$id\", \"strategy\": \"$strategy\", \"state_mib\": $mib, \"ranks\": $ranks," \
          "\"every\": $every, \"iters\": $n, \"compute_ms\": $compute_ms, \"compute\": \"$compute_mode\"}" \
          >"$work/res/$id.run.json"
        mkdir -p "$work/files-$id"
        if [ "$strategy" = lazy ]; then
          # The disk drifts on a shared machine: measure its limits again right before the
          # lazy run, so flush and restore are also compared with an adjacent figure.
          adj_w=$(fio_mbps "$work" write)
          adj_r=$(fio_mbps "$work" read)
          rm -f "$work/fio.dat"
          echo "{\"write_MBps\": $adj_w, \"read_MBps\": $adj_r}" >"$work/res/$id.fio.json"
        fi
        if [ "$strategy" != lazy ]; then
          trainers train "$strategy" "$id" "$mib" "$ranks" "$every" "$n" "$compute_ms"
        else
          start_ckptd "$build/ckptd" "$work/ckptd-$id.log" --socket "$work/ckptd.sock" --create-root --root "$work/root-$id" \
            --pool-mib 1024 --keep-last 2 --memory-mib 0
          trainers train lazy "$id" "$mib" "$ranks" "$every" "$n" "$compute_ms"
          "$build/ckptctl" --socket "$work/ckptd.sock" status --json >"$work/res/$id.status.json"
          # A new process per rank restores the newest committed version (O_DIRECT reads)
          # and checks every byte.
          trainers restore lazy "$id" "$mib" "$ranks" "$every" "$n" "$compute_ms" --resume
          awk '/VmHWM/ {print $2}' "/proc/$daemon/status" >"$work/res/$id.rss_kib"
          stop_ckptd
          rm -rf "$work/root-$id"
        fi
        rm -rf "$work/files-$id"
      done
    done
  done
done

elapsed_s=$(($(date +%s) - start_s))
bench_run python3 "$here/bench/report.py" --work "$work" --out "$out" --dir "$dir" --elapsed-s "$elapsed_s" \
  --command "bench/run.sh $args"
# The plot needs matplotlib, which Debian packages for its own python3.
plot_py=python3
if ! python3 -c 'import matplotlib' 2>/dev/null && [ -x /usr/bin/python3 ]; then plot_py=/usr/bin/python3; fi
if "$plot_py" -c 'import matplotlib' 2>/dev/null; then
  "$plot_py" "$here/bench/plot.py" "$out" "${out%.json}.png"
else
  echo "no matplotlib (apt-get install python3-matplotlib): no plot"
fi
fastpath_rc=0
if [ "$fastpath" = 1 ]; then
  bench_run bash "$here/bench/fastpath.sh" --out "${out%.json}-fastpath.json" --build "$build" || fastpath_rc=$?
fi
echo "== done in $(($(date +%s) - start_s)) s"
exit $fastpath_rc
