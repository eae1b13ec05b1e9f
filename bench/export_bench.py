#!/usr/bin/env python3
"""How fast `ckptctl export` consolidates a version of 4 ranks, and how little memory it takes.

A real ckptd; 4 ranks (one process, 4 clients) register pieces of 3 global F32 tensors of
--dim x --dim each: A split along dimension 0 (each chunk one run), B along dimension 1 (runs
of dim/4 elements), C in a 2 x 2 grid (runs of dim/2), each with its ckpt.Layout, and commit
version 1 (the daemon writes its index.json). Then, --rounds times: `ckptctl verify` of the
version (reads and hashes every byte: the floor of any verified export) and `ckptctl export`
into a fresh directory, timed, with the export's peak RSS; the page cache is warm for both (the
shards were just written).

  PYTHONPATH=BUILD/python /usr/bin/python3 bench/export_bench.py --ckptd BUILD/ckptd
      --ckptctl BUILD/ckptctl [--dim 8192] [--rounds 3] [--out docs/results/export.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import ckpt
from exit_on_signal import exit_on_signals

WORLD = 4
JOB = "exportbench"


def start_daemon(binary: str, work: Path, pool_mib: int) -> subprocess.Popen:
    r, w = os.pipe()
    proc = subprocess.Popen([binary, "--root", str(work / "root"), "--create-root", "--socket",
                             str(work / "ckptd.sock"), "--pool-mib", str(pool_mib), "--ready-fd", str(w)],
                            pass_fds=(w,), stdout=open(work / "ckptd.log", "wb"), stderr=subprocess.STDOUT)
    os.close(w)
    got = b""
    deadline = time.monotonic() + 60
    while not got.startswith(b"ready") and select.select([r], [], [], max(0, deadline - time.monotonic()))[0]:
        chunk = os.read(r, 16)
        if not chunk:
            break
        got += chunk
    os.close(r)
    if not got.startswith(b"ready"):
        proc.kill()
        raise SystemExit("ckptd did not become ready: " + (work / "ckptd.log").read_text())
    return proc


def boxes(dim: int):
    q, h = dim // 4, dim // 2
    return {
        "A": [((r * q, 0), (q, dim)) for r in range(WORLD)],
        "B": [((0, r * q), (dim, q)) for r in range(WORLD)],
        "C": [((0, 0), (h, h)), ((0, h), (h, h)), ((h, 0), (h, h)), ((h, h), (h, h))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckptd", required=True)
    ap.add_argument("--ckptctl", required=True)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    exit_on_signals()
    layout = boxes(args.dim)
    per_rank = sum(np.prod(layout[n][0][1]) for n in layout) * 4
    total = per_rank * WORLD
    work = Path(tempfile.mkdtemp(prefix="ckpt-exportbench-", dir=tempfile.gettempdir()))
    daemon = None
    clients, regions = [], []
    try:
        daemon = start_daemon(args.ckptd, work, pool_mib=int(per_rank * WORLD // (1 << 20)) + 64)
        for rank in range(WORLD):
            region = ckpt.SharedRegion.create(int(per_rank))
            view = np.frombuffer(region, dtype=np.float32)
            view[:] = np.arange(view.size, dtype=np.float32) + rank
            spec, at = [], 0
            for name, bx in layout.items():
                shape = bx[rank][1]
                spec.append(ckpt.TensorItem(name, "F32", list(shape), region, at,
                                            layout=ckpt.Layout(name, [args.dim, args.dim], list(bx[rank][0]))))
                at += int(np.prod(shape)) * 4
            client = ckpt.Client.connect(str(work / "ckptd.sock"))
            client.register_items(JOB, rank, WORLD, spec)
            clients.append(client)
            regions.append(region)
        for client in clients:
            client.snapshot(1)
        for client in clients:
            client.wait_durable(1, ckpt.Level.COMMITTED, timeout=600)
        rounds = []
        for i in range(args.rounds):
            t0 = time.monotonic()
            subprocess.run([args.ckptctl, "verify", "--root", str(work / "root"), "--job", JOB], check=True,
                           capture_output=True)
            verify_s = time.monotonic() - t0
            out = work / ("out%d" % i)
            t0 = time.monotonic()
            # Peak RSS by GNU time: rusage of a child forked from here would count this process's
            # pages the child had before its exec.
            rss_file = work / "rss"
            subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(rss_file), args.ckptctl, "export", "--root",
                            str(work / "root"), "--job", JOB, "--out", str(out), "--max-shard-size", "1GB"],
                           check=True, stdout=subprocess.DEVNULL)
            export_s = time.monotonic() - t0
            rss = int(rss_file.read_text().split()[-1])  # KiB
            rounds.append({"verify_s": verify_s, "export_s": export_s,
                           "export_peak_rss_kib": rss})
            print("round %d: verify %.2f s (%.0f MiB/s), export %.2f s (%.0f MiB/s)" % (
                i, verify_s, total / verify_s / 2**20, export_s, total / export_s / 2**20))
            shutil.rmtree(out)
        med_v = statistics.median(r["verify_s"] for r in rounds)
        med_e = statistics.median(r["export_s"] for r in rounds)
        rss = max(r["export_peak_rss_kib"] for r in rounds)
        result = {"bench": "export", "dim": args.dim, "world_size": WORLD, "bytes": int(total),
                  "tensors": {n: "split " + ("dim 0" if n == "A" else "dim 1" if n == "B" else "2 x 2")
                              for n in layout},
                  "verify_median_s": med_v, "export_median_s": med_e,
                  "verify_mib_s": total / med_v / 2**20, "export_mib_s": total / med_e / 2**20,
                  "export_peak_rss_mib": rss / 1024, "rounds": rounds,
                  "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                  "page_cache": "warm (shards just written)"}
        print("median: verify %.2f s, export %.2f s of %.0f MiB (%.0f MiB/s), export peak RSS %.1f MiB" % (
            med_v, med_e, total / 2**20, result["export_mib_s"], result["export_peak_rss_mib"]))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        for client in clients:
            client.unregister()
        del clients, regions
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
