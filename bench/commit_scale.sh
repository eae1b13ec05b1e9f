#!/usr/bin/env bash
# Commit at scale: the commit protocol of 8, 64 and 512 simulated daemons x 8
# ranks on one shared directory, with the real Catalog and CommitTracker of each daemon
# (bench/commit_scale.cc says what is simulated). Each size runs twice in one go: with the
# protocol of this tree ("per-node": one marker per daemon and version) and with the one of
# the baseline commit ("per-rank": one done marker and one registration read per rank,
# polling every 20 ms), the same harness built against both trees. Reports the metadata
# operations per committed version, by kind, and the commit latency (last shard durable ->
# the commit seen by every daemon), median of the versions.
#
# Usage: bench/commit_scale.sh [--out FILE.json] [--build DIR] [--gluster] [--baseline REV]
#   --gluster   also on a GlusterFS volume (replica 2, FUSE; tests/ops/gluster.sh sets it up
#               under its own directory and volume name; needs root)
#   --baseline  the tree of the "per-rank" runs (default 5421de7, before the node markers)
# Env: NODES (default "8 64 512"), RANKS_PER_NODE (8), VERSIONS (tmpfs, default 5),
#      GLUSTER_VERSIONS (default 2), GLUSTER_PER_RANK_MAX (default 64: the per-rank protocol
#      on GlusterFS only up to this many nodes; at 512 it alone ran past 10 minutes here).
# Writes JSON {"runs":[{"fs","nodes","ranks_per_node","protocol","meta_ops_per_version":{..},
# "commit_latency_ms_p50",..}]} (default bench/out/commit_scale.json).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="$here/bench/out/commit_scale.json"
build="$here/build-bench"
gluster=0
baseline=5421de7
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --gluster) gluster=1; shift ;;
    --baseline) baseline="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
nodes_list="${NODES:-8 64 512}"
rpn="${RANKS_PER_NODE:-8}"
versions="${VERSIONS:-5}"
gluster_versions="${GLUSTER_VERSIONS:-2}"
gluster_per_rank_max="${GLUSTER_PER_RANK_MAX:-64}"
mkdir -p "$(dirname "$out")" "$build"
build="$(cd "$build" && pwd)"
. "$here/bench/cleanup.sh"
bench_cleanup_init
work="$(mktemp -d "${TMPDIR:-/tmp}/ckpt-commit-scale-XXXXXX")"
bench_cleanup_add "$work"
tmpfs_dir="$(mktemp -d /dev/shm/ckpt-commit-scale-XXXXXX)"
bench_cleanup_add "$tmpfs_dir"
export CKPTD_GLUSTER_DIR="/tmp/ckptd-gluster-commit-scale" CKPTD_GLUSTER_VOLUME="ckptdscale"
gluster_up=0
bench_cleanup_hook 'if [ "$gluster_up" = 1 ]; then bash "$here/tests/ops/gluster.sh" stop || true; fi'

# This tree's harness.
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_BUILD_TESTS=OFF >/dev/null
ninja -C "$build" -j2 ckpt-commit-scale >/dev/null
# The same harness against the baseline tree (its own source and build under $build).
base_src="$build/commit-scale-baseline/src"
base_build="$build/commit-scale-baseline/build"
if [ ! -f "$base_src/.rev" ] || [ "$(cat "$base_src/.rev")" != "$baseline" ]; then
  rm -rf "$base_src"
  mkdir -p "$base_src"
  git -C "$here" archive "$baseline" | tar -x -C "$base_src"
  echo "$baseline" >"$base_src/.rev"
fi
# The harness names headers where they are now; the baseline has them in their old places.
old_catalog=daemon/commit  # the baseline's directory of catalog.h and catalog.cc
sed -e "s#\"daemon/catalog/catalog.h\"#\"$old_catalog/catalog.h\"#" \
    -e 's#"daemon/base/\([a-z_]*\.h\)"#"daemon/\1"#' \
    "$here/bench/commit_scale.cc" >"$base_src/bench/commit_scale.cc"
cp "$here/daemon/io/counting_storage.h" "$base_src/daemon/io/"
cp "$here/bench/signal_cleanup.h" "$base_src/bench/"
# Only the commit stage's sources, not the whole daemon: a quicker build.
if ! grep -q ckpt-commit-scale "$base_src/CMakeLists.txt"; then
  cat >>"$base_src/CMakeLists.txt" <<'CMAKE'

add_executable(ckpt-commit-scale bench/commit_scale.cc daemon/commit/catalog.cc daemon/commit/commit_tracker.cc
  daemon/pipeline/shard_registry.cc daemon/pipeline/shard_job.cc daemon/pipeline/item_hasher.cc daemon/io/storage.cc)
target_link_libraries(ckpt-commit-scale PRIVATE ckpt_backend ckpt_format spdlog::spdlog CLI11::CLI11 Threads::Threads)
CMAKE
fi
cmake -S "$base_src" -B "$base_build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_BUILD_TESTS=OFF \
  -DCKPT_BUILD_PYTHON=OFF >/dev/null
ninja -C "$base_build" -j2 ckpt-commit-scale >/dev/null

targets="tmpfs:$tmpfs_dir"
if [ "$gluster" = 1 ]; then
  mounts="$(bash "$here/tests/ops/gluster.sh" start)"
  gluster_up=1
  mkdir -p "${mounts%%:*}/commit-scale"
  targets="$targets glusterfs:${mounts%%:*}/commit-scale"
fi

results="$work/runs.jsonl"
: >"$results"
for target in $targets; do
  fs="${target%%:*}"
  dir="${target#*:}"
  v="$versions"
  [ "$fs" = glusterfs ] && v="$gluster_versions"
  for n in $nodes_list; do
    bins=("$base_build/ckpt-commit-scale" "$build/ckpt-commit-scale")
    if [ "$fs" = glusterfs ] && [ "$n" -gt "$gluster_per_rank_max" ]; then
      echo "glusterfs, $n nodes: per-rank skipped (GLUSTER_PER_RANK_MAX=$gluster_per_rank_max)" >&2
      bins=("$build/ckpt-commit-scale")
    fi
    for bin in "${bins[@]}"; do
      root="$dir/run-$n-$RANDOM"
      bench_run nice -n 5 "$bin" --root "$root" --fs "$fs" --nodes "$n" --ranks-per-node "$rpn" --versions "$v" \
        --timeout-s 120 >>"$results"
      rm -rf "$root"
    done
  done
done

python3 - "$results" "$out" <<'EOF'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump({"runs": runs}, open(sys.argv[2], "w"), indent=1)
print(f"{'fs':10} {'nodes':>5} {'ranks':>6} {'protocol':9} {'ops/version':>11} {'open':>7} {'stat':>7} "
      f"{'readdir':>7} {'rename':>7} {'unlink':>6} {'fsync':>7} {'p50 ms':>8}")
for r in runs:
    o = r["meta_ops_per_version"]
    print(f"{r['fs']:10} {r['nodes']:5} {r['nodes'] * r['ranks_per_node']:6} {r['protocol']:9} "
          f"{o['total']:11.0f} {o['open']:7.0f} {o['stat']:7.0f} {o['readdir']:7.0f} {o['rename']:7.0f} "
          f"{o['unlink']:6.0f} {o['fsync']:7.0f} {r['commit_latency_ms_p50']:8.1f}")
print(f"wrote {sys.argv[2]}")
EOF
