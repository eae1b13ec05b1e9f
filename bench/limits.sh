# Sourced by the benchmark scripts: the storage limit of a directory and the compute phase
# that lets that storage absorb one checkpoint per iteration.

# fio_mbps DIR write|read: sequential O_DIRECT bandwidth of DIR in MB/s (16 MiB blocks,
# 4 in flight, 2 GiB, one job). Leaves DIR/fio.dat behind for the read after the write;
# the caller removes it.
fio_mbps() {
  fio --name=limit --directory="$1" --filename=fio.dat --rw="$2" --direct=1 --bs=16M \
      --ioengine=libaio --iodepth=4 --size=2G --numjobs=1 --output-format=json 2>/dev/null |
    python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(round(j['$2']['bw_bytes']/1e6, 1))"
}

# compute_ms_for STATE_MIB WRITE_MBPS: the time storage needs to write STATE_MIB at
# WRITE_MBPS, plus 20 %, in whole ms.
compute_ms_for() {
  python3 -c "print(int($1 * 1.048576 / $2 * 1000 * 1.2) + 1)"
}

# start_ckptd BINARY LOG ARGS...: starts ckptd with ARGS in the background, its output
# appended to LOG, and returns once it serves (its --ready-fd, through $work/ready); sets
# $daemon to its pid (and, in a script that sourced bench/cleanup.sh, hands it to the
# cleanup, which ends it however the script ends). stop_ckptd: SIGTERM, then waits for it.
start_ckptd() {
  local binary=$1 log=$2
  shift 2
  rm -f "$work/ready"
  mkfifo "$work/ready"
  "$binary" "$@" --ready-fd 3 3>"$work/ready" >>"$log" 2>&1 &
  daemon=$!
  if declare -F bench_track_daemon >/dev/null; then bench_track_daemon "$daemon"; fi
  read -r _ <"$work/ready"
}
stop_ckptd() {
  kill "$daemon"
  wait "$daemon" || true
  daemon=""
}
