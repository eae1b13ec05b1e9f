#!/usr/bin/env bash
# Capacity: the bytes a version costs when most of the state does not change (differential
# versions) and the memory peer redundancy takes (full replicas vs an erasure code), one run
# on this machine.
#
# Usage: bench/capacity.sh [--out FILE.json] [--build DIR] [--dir DIR] [--mib N] [--steps N]
#                          [--frozen-percent P] [--compute-ms MS] [--memory-mib N] [--base-every N]
#                          [--ec-mib N] [--ec-steps N] [--only erasure]
#   --dir             where the persistent and local tiers go (default /tmp/ckptd-capacity)
#   --mib             state per rank, MiB (default 1024, in 20 tensors)
#   --steps           iterations, each checkpointed (default 20)
#   --frozen-percent  share of the tensors that never change after the first step (default 90)
#   --compute-ms      compute phase of an iteration (default 5000: on this 2-core VM, with both
#                     "nodes" on one disk, persistence and replication keep up with it)
#   --base-every      the differential runs' --persistent-base-every (default 10: versions 1
#                     and 11 whole, the others differential over them)
#   --memory-mib      each daemon's --memory-mib (default 6 x --mib + 512: its rank's newest
#                     version and the ones still being written, and two versions of the
#                     peer's rank, a delta's base and the version composed beside it)
#
# Two daemons stand for two nodes (--replicas 1, loopback TCP, the setup of the replication
# tests), one rank on each. The trainers (ckpt-toy-trainer --frozen-tensors) checkpoint every
# step; the frozen tensors keep the values of step 0, the others change every step.
#   differential  replicas sent as deltas on the version the peer holds (the default), and
#                 --persistent-base-every: the persistent tier's shards written with only the
#                 items changed since a base version. For every version after the first:
#                 peer_bytes_ratio        bytes sent to the peer for a rank's shard / the shard's
#                                         bytes (the sender's log: "N of M bytes sent")
#                 persistent_bytes_ratio  bytes of the version's shard files on the persistent
#                                         tier / those of the first version
#                 medians over versions after the first. Then every committed version is
#                 restored by a fresh trainer per rank (--resume-version), which checks every
#                 byte: restored_byte_exact.
#   full          the same run with --no-replica-deltas and every persistent shard whole. The
#                 runs go differential, full, full,
#                 differential (the first pair keeps every version, the second pair the newest
#                 2, and only the first restores), so that the machine's drift does not land
#                 on one side: trainer_stall_ratio is the
#                 median stall p50 of the differential runs' ranks / that of the full runs'
#                 (the trainers' copies are the same in both; what differs is the daemons'
#                 work beside them). peer_bytes_ratio pools both differential runs; a delta the
#                 peer refused (at its first piece, before any data) counts as the whole image
#                 that followed.
#   erasure       ckpt-erasure-bench (k=4, m=1) on 256 MiB: encode and decode GB/s next to a
#                 memcpy of the same bytes. Then five daemons (one group of --erasure 4+1), one
#                 rank each of --ec-mib MiB (default 256: five ranks, their replicas and
#                 parity fit this machine's memory), --ec-steps steps (default 4), twice:
#                 ecrepl  --replicas 1 and --erasure 4+1 together: peer_memory_ratio is the
#                         parity the five daemons hold / the replicas they hold, same versions
#                         (ckptctl status: erasure_parity_bytes, peers' held_bytes); then node
#                         2 is lost (kill -9, a fresh daemon in its place) and its rank
#                         restored from the replica: replica.rebuild_ms.
#                 ec      --erasure 4+1 alone: node 2 lost the same way, its rank rebuilt from
#                         the other four: erasure.rebuild_ms, and node_loss_restored_byte_exact
#                         (the trainer checks every byte; the tier must be "peer", the daemon's
#                         log must say it rebuilt). rebuild_ms is the trainer's restore_ms
#                         (the whole restore, same state, same machine), and the daemon's own
#                         time for the fetch or the rebuild is beside it.
#   --only erasure  runs the erasure part alone (its fields only).
# JSON to --out (default bench/out/capacity.json) and docs/results/capacity.json. Everything it
# starts and makes is removed however it ends (bench/cleanup.sh).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=/tmp/ckptd-capacity
out="$here/bench/out/capacity.json"
build="$here/build"
mib=1024
steps=20
frozen_percent=90
compute_ms=5000
memory_mib=""
base_every=10
ec_mib=256
ec_steps=4
only=""
tensors=20
args="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --mib) mib="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --frozen-percent) frozen_percent="$2"; shift 2 ;;
    --compute-ms) compute_ms="$2"; shift 2 ;;
    --memory-mib) memory_mib="$2"; shift 2 ;;
    --base-every) base_every="$2"; shift 2 ;;
    --ec-mib) ec_mib="$2"; shift 2 ;;
    --ec-steps) ec_steps="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out="$(realpath -m "$out")"
frozen=$((tensors * frozen_percent / 100))
[ -n "$memory_mib" ] || memory_mib=$((mib * 6 + 512))

echo "== machine"
df -h /dev/shm "$(dirname "$dir")" | cat
free -m | cat
# The differential run keeps every version on the persistent tier (so that each can be
# restored): steps x 2 ranks x mib, and each node's local tier the newest 2 of its rank; plus
# a margin. Its files are removed before the full run.
need_mib=$((steps * 2 * mib + 4 * mib + 2048))
probe="$dir"
while [ ! -d "$probe" ]; do probe="$(dirname "$probe")"; done
avail_mib=$(($(df --output=avail -k "$probe" | tail -1) / 1024))
if [ "$avail_mib" -lt "$need_mib" ]; then
  echo "capacity.sh: $need_mib MiB needed in $probe, $avail_mib MiB free: use --dir, --mib or --steps" >&2
  exit 1
fi
# Two daemons' memory tiers and two trainers' state, at most, plus a margin.
need_mem_mib=$((2 * memory_mib + 2 * mib + 1024))
avail_mem_mib=$(($(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) / 1024))
if [ "$avail_mem_mib" -lt "$need_mem_mib" ]; then
  echo "capacity.sh: up to $need_mem_mib MiB of memory needed, $avail_mem_mib MiB available: use --mib or --memory-mib" >&2
  exit 1
fi
echo "== build ($build)"
ninja -C "$build" -j2 ckptd ckptctl ckpt-toy-trainer ckpt-erasure-bench >/dev/null
made_dir=0
[ -d "$dir" ] || made_dir=1
mkdir -p "$dir" "$(dirname "$out")"
. "$here/bench/cleanup.sh"
bench_cleanup_init
[ "$made_dir" = 0 ] || bench_cleanup_hook "rmdir '$dir' 2>/dev/null"
work="$(mktemp -d "$dir/run-XXXXXX")"
bench_cleanup_add "$work"

head -c 48 /dev/urandom | base64 >"$work/secret"
chmod 600 "$work/secret"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start NAME ARGS...: a daemon on $work/NAME.sock, ready when it returns; its pid in pid_NAME.
start() {
  local name=$1
  shift
  rm -f "$work/ready-$name"
  mkfifo "$work/ready-$name"
  "$build/ckptd" --socket "$work/$name.sock" --create-root --pool-mib 512 --chunk-mib 16 "$@" \
    --ready-fd 3 3>"$work/ready-$name" >>"$work/$name.log" 2>&1 &
  local pid=$!
  bench_track_daemon "$pid"
  eval "pid_$name=$pid"
  read -r _ <"$work/ready-$name"
}
stop() {  # NAME
  local pid
  eval "pid=\$pid_$1"
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
trainer() {  # NODE RUN RANK TAG [flags]
  local node=$1 run=$2 rank=$3 tag=$4
  shift 4
  bench_run "$build/ckpt-toy-trainer" --socket "$work/${run}_$node.sock" --job cap --rank "$rank" --world-size 2 \
    --state-mib "$mib" --tensors "$tensors" --frozen-tensors "$frozen" --quiet --summary "$work/$tag.json" "$@" \
    >>"$work/trainers.log" 2>&1
}

# run NAME [daemon flags]: two nodes, both ranks train `steps` steps, each checkpointed; the
# daemons stay up (for the restores) until `finish NAME`.
run() {
  local name=$1 p0 p1 peers i port
  shift
  p0=$(free_port)
  p1=$(free_port)
  peers="127.0.0.1:$p0,127.0.0.1:$p1"
  for i in 0 1; do
    port=$([ "$i" = 0 ] && echo "$p0" || echo "$p1")
    start "${name}_n$i" --root "$work/$name/persistent" --local "$work/$name/local$i" \
      --memory-mib "$memory_mib" --replicas 1 --peer-listen "127.0.0.1:$port" --peers "$peers" \
      --peer-secret "$work/secret" "$@"
  done
  echo "== $name: $steps steps of $mib MiB per rank ($frozen of $tensors tensors frozen), 2 nodes, R=1"
  trainer n0 "$name" 0 "$name-r0" --iters "$steps" --compute-ms "$compute_ms" &
  local t0=$!
  bench_track "$t0"
  trainer n1 "$name" 1 "$name-r1" --iters "$steps" --compute-ms "$compute_ms"
  bench_wait "$t0"
  python3 -c "
import json
for r in (0, 1):
    s = json.load(open('$work/$name-r%d.json' % r))
    print(f'   rank {r}: stall p50 {s[\"stall_ms_p50\"]:.2f} ms, p99 {s[\"stall_ms_p99\"]:.2f} ms, last version {s[\"last_version\"]}')"
}
finish() {
  stop "$1_n0"
  stop "$1_n1"
}

if [ "$only" != erasure ]; then
run differential --persistent-base-every "$base_every"
# The persistent tier's bytes of each committed version, before the restores below set newer
# versions aside.
for d in "$work/differential/persistent/cap"/v*; do
  [ -e "$d/COMMITTED" ] || continue
  echo "$(basename "$d" | sed 's/^v0*//') $(cat "$d"/rank-* | wc -c)"
done >"$work/persistent.txt"
# Every committed version, restored by a fresh trainer per rank that checks every byte. A
# restore of a version older than the newest rolls the job back to it (the newer ones are
# set aside), so the versions go newest first.
: >"$work/restores.txt"
echo "== restoring every committed version of each rank, newest first"
for v in $(sort -rn "$work/persistent.txt" | cut -d' ' -f1); do
  for r in 0 1; do
    if trainer "n$r" differential "$r" "restore-$v-$r" --resume --resume-version "$v" --iters "$v"; then
      echo "$v $r ok $(python3 -c "import json; print(json.load(open('$work/restore-$v-$r.json'))['restore_tier'])")" \
        >>"$work/restores.txt"
    else
      echo "$v $r failed -" >>"$work/restores.txt"
      echo "   version $v rank $r: restore FAILED (trainers.log)" >&2
    fi
  done
done
echo "   $(grep -c ' ok ' "$work/restores.txt") of $(wc -l <"$work/restores.txt") restores byte-exact"
finish differential
rm -rf "$work/differential"
# Then full, full, differential again (the order ABBA, so that the machine's drift does not
# land on one side); these need no old versions: the persistent tier keeps the newest two.
for name in full full2 differential2; do
  case "$name" in
    full) run "$name" --no-replica-deltas ;;
    full2) run "$name" --no-replica-deltas --keep-last 2 ;;
    *) run "$name" --keep-last 2 --persistent-base-every "$base_every" ;;
  esac
  finish "$name"
  rm -rf "${work:?}/$name"
done
else
  : >"$work/persistent.txt"
  : >"$work/restores.txt"
fi

echo "== erasure code k=4 m=1, 256 MiB"
bench_run "$build/ckpt-erasure-bench" --mib 256 --repeats 5 --out "$work/erasure.json" >>"$work/erasure.log" 2>&1
tail -n 12 "$work/erasure.log"

# The erasure part: five daemons, one group of 4+1, one rank each.
ec_ports=()
ec_start() {  # RUN NODE FLAGS...: node NODE of RUN
  local run=$1 node=$2
  shift 2
  start "${run}_n$node" --root "$work/$run/persistent" --memory-mib "$ec_memory_mib" --keep-last 2 \
    --peer-listen "127.0.0.1:${ec_ports[$node]}" --peers "$ec_peers" --peer-secret "$work/secret" "$@"
}
ec_trainer() {  # RUN NODE TAG [flags]
  local run=$1 node=$2 tag=$3
  shift 3
  bench_run "$build/ckpt-toy-trainer" --socket "$work/${run}_n$node.sock" --job ec --rank "$node" --world-size 5 \
    --state-mib "$ec_mib" --tensors 8 --quiet --summary "$work/$tag.json" "$@" >>"$work/trainers.log" 2>&1
}
ec_status() {  # RUN NODE: ckptctl status --json of the node
  "$build/ckptctl" --socket "$work/${1}_n$2.sock" status --json
}
# ec_run RUN FLAGS...: five nodes train ec_steps steps; then every node has sent its chunks.
ec_run() {
  local run=$1 i t pids=()
  shift
  ec_ports=()
  for i in 0 1 2 3 4; do ec_ports+=("$(free_port)"); done
  ec_peers=$(printf '127.0.0.1:%s,' "${ec_ports[@]}")
  ec_peers=${ec_peers%,}
  for i in 0 1 2 3 4; do ec_start "$run" "$i" "$@"; done
  echo "== $run: $ec_steps steps of $ec_mib MiB per rank, 5 nodes, $*"
  for i in 0 1 2 3 4; do
    ec_trainer "$run" "$i" "$run-r$i" --iters "$ec_steps" --compute-ms 1000 &
    t=$!
    bench_track "$t"
    pids+=("$t")
  done
  for t in "${pids[@]}"; do bench_wait "$t"; done
  # Every node has sent the chunks of what it published (a version published while the one
  # before was still being sent supersedes it: the newest is what matters).
  for i in 0 1 2 3 4; do
    for _ in $(seq 1200); do
      [ "$(ec_status "$run" "$i" | python3 -c 'import json,sys; print(int(json.load(sys.stdin).get("erasure_pending", 0)))')" = 0 ] && break
      sleep 0.1
    done
  done
}
# ec_lose RUN FLAGS...: node 2 lost (kill -9) and replaced by a fresh daemon; its rank restores.
ec_lose() {
  local run=$1
  shift
  kill -KILL "$(eval echo "\$pid_${run}_n2")"
  wait "$(eval echo "\$pid_${run}_n2")" 2>/dev/null || true
  ec_start "$run" 2 "$@"
  if ec_trainer "$run" 2 "$run-restore" --resume --iters "$ec_steps"; then
    echo ok >"$work/$run-restore.ok"
  fi
}
ec_stop() {
  local i
  for i in 0 1 2 3 4; do stop "${1}_n$i"; done
  rm -rf "${work:?}/$1"
}
ec_memory_mib=$((ec_mib * 8 + 256))
ec_run ecrepl --replicas 1 --erasure 4+1
for i in 0 1 2 3 4; do ec_status ecrepl "$i" >"$work/ecrepl-status-$i.json"; done
ec_lose ecrepl --replicas 1 --erasure 4+1
ec_stop ecrepl
ec_run ec --erasure 4+1
ec_lose ec --erasure 4+1
ec_status ec 2 >"$work/ec-status-lost.json"
ec_stop ec

python3 - "$work" "$out" "$here/docs/results/capacity.json" "$mib" "$steps" "$tensors" "$frozen" "$compute_ms" \
  "$memory_mib" "bench/capacity.sh $args" "$base_every" "$ec_mib" "$ec_steps" "$ec_memory_mib" <<'PY'
import datetime, glob, json, os, platform, re, statistics, sys
(work, out, docs_out, mib, steps, tensors, frozen, compute_ms, memory_mib, command, base_every, ec_mib, ec_steps,
 ec_memory_mib) = sys.argv[1:]
mib, steps, tensors, frozen = int(mib), int(steps), int(tensors), int(frozen)

def med(xs):
    return round(statistics.median(xs), 4) if xs else None

# Peer bytes: every replica the senders' logs report, per (version, rank).
sent = re.compile(r"replicated version (\d+) of job cap rank (\d+) to \S+ (whole|as a delta on version \d+): "
                  r"(\d+) of (\d+) bytes sent")
def peer(run):
    per = {}
    for log in glob.glob(os.path.join(work, f"{run}_n[0-9].log")):
        for line in open(log, errors="replace"):
            m = sent.search(line)
            if m:
                v, r, how, n, total = int(m[1]), int(m[2]), m[3], int(m[4]), int(m[5])
                per[(v, r)] = {"version": v, "rank": r, "sent": n, "shard_bytes": total,
                               "delta": how != "whole", "ratio": n / total}
    return sorted(per.values(), key=lambda x: (x["version"], x["rank"]))
def persistent():
    rows = [line.split() for line in open(os.path.join(work, "persistent.txt"))]
    return sorted(({"version": int(v), "bytes": int(b)} for v, b in rows), key=lambda x: x["version"])

def after_first(rows):
    first = min((x["version"] for x in rows), default=None)
    return [x["ratio"] for x in rows if x["version"] != first]
diff_peer = peer("differential")
diff2_peer = peer("differential2")
peer_ratios = after_first(diff_peer) + after_first(diff2_peer)
pers = persistent()
full_bytes = pers[0]["bytes"] if pers else None
pers_ratios = [p["bytes"] / full_bytes for p in pers[1:]] if full_bytes else []
restores = [line.split() for line in open(os.path.join(work, "restores.txt"))]
def summary(tag):
    path = os.path.join(work, f"{tag}.json")
    return json.load(open(path)) if os.path.exists(path) else None
stall = {}
for kind, runs in (("differential", ("differential", "differential2")), ("full", ("full", "full2"))):
    xs = [(summary(f"{run}-r{r}") or {}).get("stall_ms_p50") for run in runs for r in (0, 1)]
    xs = [x for x in xs if x is not None]  # null: a run without a stall (one step), or not run
    stall[kind] = statistics.median(xs) if xs else None
erasure = json.load(open(os.path.join(work, "erasure.json")))
code = next((c for c in erasure.get("codes", []) if c.get("k") == 4 and c.get("m") == 1), None)

# The node-loss runs: what the five daemons held, and node 2's restore.
def status(tag):
    return json.load(open(os.path.join(work, f"{tag}.json")))
def num(d, key):
    return int(d.get(key, 0) or 0)
ec_status = [status(f"ecrepl-status-{i}") for i in range(5)]
parity_held = sum(num(s, "erasure_parity_bytes") for s in ec_status)
replicas_held = sum(num(p, "held_bytes") for s in ec_status for p in s.get("peers", []))
def daemon_ms(run, pattern):
    ms = None
    for line in open(os.path.join(work, f"{run}_n2.log"), errors="replace"):
        m = re.search(pattern, line)
        if m:
            ms = float(m[1])
    return ms
ecrepl_restore, ec_restore = summary("ecrepl-restore") or {}, summary("ec-restore") or {}
ec_lost = status("ec-status-lost")
rebuilt_ms = daemon_ms("ec", r"erasure: rebuilt .* bytes in (\d+) ms")
fetched_ms = daemon_ms("ecrepl", r"replication: fetched .* bytes in (\d+) ms")
ec_exact = (os.path.exists(os.path.join(work, "ec-restore.ok")) and ec_restore.get("restore_tier") == "peer"
            and num(ec_lost, "erasure_rebuilds") >= 1 and rebuilt_ms is not None)

result = {
    "command": command,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}",
    "setup": {"nodes": 2, "ranks": 2, "replicas": 1, "state_bytes_per_rank": mib * 2**20, "steps": steps,
              "tensors": tensors, "frozen_tensors": frozen, "compute_ms": int(compute_ms),
              "memory_mib_per_daemon": int(memory_mib), "persistent_base_every": int(base_every)},
    "differential": {
        "peer_bytes_ratio": med(peer_ratios),
        "persistent_bytes_ratio": med(pers_ratios),
        "restored_byte_exact": bool(restores) and all(r[2] == "ok" for r in restores),
        "trainer_stall_ratio": (round(stall["differential"] / stall["full"], 3)
                                if stall["differential"] is not None and stall["full"] else None),
        "trainer_stall_ms_p50": {"differential": stall["differential"], "full": stall["full"]},
        "trainer_stall_ms_p50_by_run": {
            run: [(summary(f"{run}-r{r}") or {}).get("stall_ms_p50") for r in (0, 1)]
            for run in ("differential", "full", "full2", "differential2")},
        "versions_replicated": len({x["version"] for x in diff_peer}),
        "versions_replicated_second_run": len({x["version"] for x in diff2_peer}),
        "replicas_sent_whole_after_the_first": sum(
            1 for rows in (diff_peer, diff2_peer) for x in rows
            if not x["delta"] and x["version"] != min(y["version"] for y in rows)),
        "versions_committed": len(pers),
        "restores": len(restores),
        "restores_byte_exact": sum(r[2] == "ok" for r in restores),
        "restore_tiers": sorted({r[3] for r in restores if r[2] == "ok"}),
        "peer": diff_peer,
        "persistent": pers,
        "full_run_peer_bytes_ratio": med([x["ratio"] for x in peer("full") + peer("full2")]),
    },
    "erasure": {
        "k": 4, "m": 1,
        "encode_gbps": code and code.get("encode_gbps"),
        "decode_gbps": code and code.get("decode_gbps"),
        "memcpy_gbps": code and code.get("memcpy_gbps"),
        "peer_memory_ratio": round(parity_held / replicas_held, 4) if replicas_held else None,
        "parity_bytes_held": parity_held,
        "replica_bytes_held": replicas_held,
        "node_loss_restored_byte_exact": ec_exact,
        "rebuild_ms": ec_restore.get("restore_ms"),
        "daemon_rebuild_ms": rebuilt_ms,
        "restore_tier": ec_restore.get("restore_tier"),
        "rebuilds": num(ec_lost, "erasure_rebuilds"),
        "rebuild_failures": num(ec_lost, "erasure_rebuild_failures"),
        "setup": {"nodes": 5, "ranks": 5, "k": 4, "m": 1, "state_bytes_per_rank": int(ec_mib) * 2**20,
                  "steps": int(ec_steps), "memory_mib_per_daemon": int(ec_memory_mib)},
        "codec": code,
    },
    "replica": {"rebuild_ms": ecrepl_restore.get("restore_ms"), "daemon_fetch_ms": fetched_ms,
                "restore_tier": ecrepl_restore.get("restore_tier")},
    "not_measured": {},
}
if pers_ratios and min(pers_ratios) > 0.9:
    result["not_measured"]["differential.persistent_bytes_ratio"] = (
        "measured, but the persistent tier wrote every version whole (no differential shard: see the "
        "daemons' logs, 'persisted differential')")
for path in (out, docs_out):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    json.dump(result, open(path, "w"), indent=2)
d, e = result["differential"], result["erasure"]
def f2(x):
    return "n/a" if x is None else f"{x:.2f}"
print(f"== capacity, {mib} MiB per rank, {frozen}/{tensors} tensors frozen, {steps} steps")
print(f"| differential.peer_bytes_ratio | {d['peer_bytes_ratio']} | (target <= 0.15; "
      f"--no-replica-deltas: {d['full_run_peer_bytes_ratio']})")
print(f"| differential.persistent_bytes_ratio | {d['persistent_bytes_ratio']} | (target <= 0.15)")
print(f"| differential.restored_byte_exact | {d['restored_byte_exact']} | "
      f"({d['restores_byte_exact']} of {d['restores']} restores)")
print(f"| differential.trainer_stall_ratio | {d['trainer_stall_ratio']} | "
      f"(p50 {f2(d['trainer_stall_ms_p50']['differential'])} vs {f2(d['trainer_stall_ms_p50']['full'])} ms)")
print(f"| erasure.encode_gbps / decode_gbps | {f2(e['encode_gbps'])} / {f2(e['decode_gbps'])} | "
      f"(memcpy {f2(e['memcpy_gbps'])} GB/s)")
print(f"| erasure.peer_memory_ratio | {e['peer_memory_ratio']} | (target <= 0.30; parity {e['parity_bytes_held']} "
      f"vs replicas {e['replica_bytes_held']} bytes held)")
print(f"| erasure.node_loss_restored_byte_exact | {e['node_loss_restored_byte_exact']} | "
      f"(tier {e['restore_tier']}, {e['rebuilds']} rebuild(s), {e['rebuild_failures']} failed)")
print(f"| replica.rebuild_ms vs erasure.rebuild_ms | {f2(result['replica']['rebuild_ms'])} vs {f2(e['rebuild_ms'])} | "
      f"(daemon: fetch {result['replica']['daemon_fetch_ms']} ms, rebuild {e['daemon_rebuild_ms']} ms)")
for k, why in result["not_measured"].items():
    print(f"   {k}: {why}")
print(f"written to {out} and {docs_out}")
PY
