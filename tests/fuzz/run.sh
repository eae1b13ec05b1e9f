#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (ASan+UBSan) into build-fuzz and runs
# each one for SECONDS from its committed corpus (tests/fuzz/corpus/<target>, plus
# tests/fuzz/regressions/<target>). SECONDS=0 only replays the corpora.
#
#   tests/fuzz/run.sh [SECONDS] [TARGET...]     default: 60 seconds, every target
#
# Prints per target the executions, exec/s and crashes, and writes the same table to
# build-fuzz/fuzz-summary.txt. New inputs go to build-fuzz/corpus/<target> (the committed
# corpora are never written). A crash or broken invariant makes the script exit 1 after all
# targets ran; the input is kept as build-fuzz/artifacts/<target>/crash-* and the report as
# build-fuzz/logs/<target>.log. Environment: FUZZ_FLAGS (extra libFuzzer flags), CC/CXX
# (default clang/clang++).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
build="$repo/build-fuzz"
seconds="${1:-60}"
shift || true
if ! [[ "$seconds" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 [SECONDS] [TARGET...]" >&2
  exit 2
fi
all_targets=(shard_header descriptor_table config latest committed registration job_owner version_index layout_metadata markers shard_piece)
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  if [ ! -f "$here/${t}_fuzz.cc" ]; then
    echo "run.sh: no fuzz target '$t' (targets: ${all_targets[*]})" >&2
    exit 2
  fi
done

export CC="${CC:-clang}" CXX="${CXX:-clang++}"
# Debian's clang only recommends the runtimes of libFuzzer and the sanitizers.
probe="$(mktemp -d)"
trap 'rm -rf "$probe"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe/p.cc"
if ! "$CXX" -fsanitize=fuzzer,address,undefined "$probe/p.cc" -o "$probe/p" 2>"$probe/err"; then
  echo "run.sh: $CXX cannot link -fsanitize=fuzzer,address,undefined:" >&2
  head -3 "$probe/err" >&2
  echo "run.sh: on Debian 12: apt-get install clang libclang-rt-14-dev" >&2
  exit 2
fi
cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_FUZZ=ON \
  -DCKPT_BUILD_PYTHON=OFF -DCKPT_WITH_CUDA=OFF >/dev/null
ninja -C "$build" "${targets[@]/%/_fuzz}"

# A sanitizer report is fatal and names its input; leaks count as crashes too.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
mkdir -p "$build/logs"
summary="$build/fuzz-summary.txt"
{
  echo "# tests/fuzz/run.sh $seconds ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?'))"
  printf '%-18s %12s %10s %8s %8s\n' target executions exec/s crashes corpus
} >"$summary"
failed=0
total=0
for t in "${targets[@]}"; do
  work="$build/corpus/$t"
  artifacts="$build/artifacts/$t"
  log="$build/logs/$t.log"
  mkdir -p "$work" "$artifacts"
  inputs=("$work" "$here/corpus/$t")
  [ -d "$here/regressions/$t" ] && inputs+=("$here/regressions/$t")
  dict=()
  [ -f "$here/$t.dict" ] && dict=("-dict=$here/$t.dict")
  if [ "$seconds" -eq 0 ]; then
    mode=(-runs=0)
  else
    mode=(-max_total_time="$seconds" -print_final_stats=1)
  fi
  stamp="$build/logs/$t.start"
  touch "$stamp"
  rc=0
  # -max_len: room for a shard header of one page, its data, and more.
  "$build/tests/fuzz/${t}_fuzz" "${mode[@]}" "${dict[@]}" -max_len=16384 -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$artifacts/" ${FUZZ_FLAGS:-} "${inputs[@]}" >"$log" 2>&1 || rc=$?
  execs=$(awk '/stat::number_of_executed_units:/ {n += $2} END {print n + 0}' "$log")
  rate=$(awk '/stat::average_exec_per_sec:/ {n += $2} END {print n + 0}' "$log")
  [ "$seconds" -eq 0 ] && execs=$(find "${inputs[@]}" -type f | wc -l)
  crashes=$(find "$artifacts" -type f -newer "$stamp" | wc -l)
  if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then crashes=1; fi
  corpus=$(find "$work" "$here/corpus/$t" -type f | wc -l)
  printf '%-18s %12s %10s %8s %8s\n' "$t" "$execs" "$rate" "$crashes" "$corpus" | tee -a "$summary"
  total=$((total + execs))
  if [ "$crashes" -ne 0 ]; then
    failed=1
    echo "run.sh: $t FAILED (exit $rc): report in $log, input(s) in $artifacts/" >&2
    grep -m 5 -E 'ERROR: |runtime error|invariant broken|deadly signal' "$log" >&2 || true
  fi
done
echo "total executions: $total" | tee -a "$summary"
echo "summary written to $summary"
exit $failed
