#!/usr/bin/env bash
# The ckptd demo: starts a daemon with its three tiers (memory, a local directory, the
# persistent root), runs a trainer that checkpoints every iteration and is killed with
# SIGKILL mid-run, restarts it so it restores the newest committed version (from daemon
# memory, reading no file) and checks every byte, then shows what the daemon and the
# files look like.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="$here/build"
bash "$here/scripts/install-deps.sh" >/dev/null
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C "$build" ckptd ckptctl ckpt-toy-trainer >/dev/null

# The daemon, the trainers and the files go when the demo ends, however it ends (Ctrl-C too).
. "$here/bench/cleanup.sh"
bench_cleanup_init
work="$(mktemp -d "${TMPDIR:-/tmp}/ckptd-demo-XXXXXX")"
bench_cleanup_add "$work"
sock="$work/run/ckptd.sock"
root="$work/checkpoints"
local_tier="$work/local"

echo "== 1. start ckptd (tiers: memory, local $local_tier, persistent $root; pool 256 MiB)"
mkfifo "$work/ready"
"$build/ckptd" --socket "$sock" --create-root --root "$root" --local "$local_tier" --keep-last 3 --pool-mib 256 \
  --memory-mib 2048 --ready-fd 4 4>"$work/ready" \
  >"$work/ckptd.log" 2>&1 &
daemon=$!
bench_track_daemon "$daemon"
read -r _ <"$work/ready"
echo "   ckptd pid $daemon serving on $sock"

trainer=("$build/ckpt-toy-trainer" --socket "$sock" --job demo --state-mib 256 --tensors 16 --compute-ms 150)
echo
echo "== 2. a trainer with 256 MiB of state checkpoints every iteration; it is killed (-9) after snapshot 8"
bench_run "${trainer[@]}" --iters 20 --crash-at 8 || echo "   trainer died with status $? (as planned)"

echo
echo "== 3. the restarted trainer restores the newest committed version (from daemon memory), verifies"
echo "   every byte, trains on to 12"
bench_run "${trainer[@]}" --iters 12 --resume

echo
echo "== 4. ckptctl status"
"$build/ckptctl" --socket "$sock" status
echo
echo "== 5. ckptctl ls (which tier holds which version), and the files (valid safetensors;"
echo "   ckptctl verify checks every checksum)"
"$build/ckptctl" --socket "$sock" ls --job demo
latest=$(cat "$root/demo/latest")
shard="$root/demo/$(printf 'v%010d' "$latest")/rank-00000.safetensors"
"$build/ckptctl" inspect "$shard" | head -5
"$build/ckptctl" verify "$shard"
echo
echo "== 6. the daemon's log"
cat "$work/ckptd.log"
