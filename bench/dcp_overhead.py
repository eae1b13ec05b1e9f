#!/usr/bin/env python3
"""What a DCP async_save every step costs the trainer: ckpt.dcp against DCP's FileSystemWriter.

The workload: an MLP of --mib MiB of float32 parameters with AdamW (its state doubles that:
3x --mib in all), trained on CPU with a step of some hundred ms. Every step calls
torch.distributed.checkpoint.async_save, then the next step's forward and backward run, and the
trainer blocks in three places, each timed:
  call     async_save() itself
  stall    the wait before the next optimizer.step(): ckptd: the Writer's step pre-hook, until
           the daemon has captured the version (staging_completion); fs: nothing (DCP's
           default stager copied everything during the call)
  upload   the wait for the previous upload_completion before the next async_save (one save
           in flight at a time, as DCP requires)
Modes, alternating in blocks of --iters steps (the order flips every round):
  ckptd    ckpt.dcp.Writer(level=COMMITTED) with ckpt.dcp.share_memory(model, optimizer)
  fs       FileSystemWriter(DIR/step-N) with DCP's default stager (a copy into CPU memory)
Figures: medians per step of each, and of the step time without the checkpoint waits.

  PYTHONPATH=BUILD/python VENV/bin/python bench/dcp_overhead.py --ckptd BUILD/ckptd
      [--mib 64] [--iters 6] [--rounds 3] [--dir /tmp] [--out docs/results/dcp_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckpt
import ckpt.dcp
from exit_on_signal import exit_on_signals

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Daemon:
    def __init__(self, binary: str, work: Path):
        self.sock = str(work / "s" / "ckptd.sock")
        self.root = str(work / "root")
        r, w = os.pipe()
        self.log = open(work / "ckptd.log", "wb")
        self.proc = subprocess.Popen([binary, "--socket", self.sock, "--root", self.root, "--create-root",
                                      "--pool-mib", "512", "--keep-last", "2", "--ready-fd", str(w),
                                      "--log-level", "warn"],
                                     pass_fds=(w,), stdout=self.log, stderr=subprocess.STDOUT)
        os.close(w)
        deadline, got = time.monotonic() + 60, b""
        while b"\n" not in got:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                raise RuntimeError("ckptd did not report ready within 60 s")
            chunk = os.read(r, 64)
            if not chunk:
                raise RuntimeError(f"ckptd exited (rc {self.proc.wait()})")
            got += chunk
        os.close(r)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def build(mib: int):
    torch.manual_seed(0)
    width = 1024
    layers = max(1, mib * 2**20 // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, width


def run_block(mode, model, opt, width, iters, writer, fsdir, step0):
    calls, stalls, uploads, steps = [], [], [], []
    pending = None
    x = torch.randn(256, width)
    hook_time = [0.0]

    def timed_wait(*_):
        t = time.perf_counter()
        writer.wait_captured()
        hook_time[0] += time.perf_counter() - t

    hook = opt.register_step_pre_hook(timed_wait) if mode == "ckptd" else None
    try:
        for i in range(iters):
            t0 = time.perf_counter()
            hook_time[0] = 0.0
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            stall = hook_time[0]
            tu = time.perf_counter()
            if pending is not None:
                (pending.upload_completion if mode == "ckptd" else pending).result()
            upload = time.perf_counter() - tu
            msd, osd = get_state_dict(model, opt)
            step = step0 + i
            tc = time.perf_counter()
            if mode == "ckptd":
                pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=step, storage_writer=writer)
            else:
                d = os.path.join(fsdir, f"step-{step}")
                pending = dcp.async_save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(d))
                old = os.path.join(fsdir, f"step-{step - 2}")
                shutil.rmtree(old, ignore_errors=True)
            call = time.perf_counter() - tc
            total = time.perf_counter() - t0
            calls.append(call)
            stalls.append(stall)
            uploads.append(upload)
            steps.append(total - call - stall - upload)
        (pending.upload_completion if mode == "ckptd" else pending).result()
    finally:
        if hook is not None:
            hook.remove()
    return calls, stalls, uploads, steps


def med_ms(xs):
    return round(statistics.median(xs) * 1e3, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckptd", required=True)
    ap.add_argument("--mib", type=int, default=64, help="MiB of parameters (AdamW state: twice that more)")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--out")
    args = ap.parse_args()
    exit_on_signals()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="dcp-bench-", dir=args.dir))
    daemon = None
    try:
        daemon = Daemon(args.ckptd, work)
        model, opt, width = build(args.mib)
        opt.zero_grad()
        model(torch.randn(8, width)).sum().backward()
        opt.step()  # AdamW's state exists: share_memory moves it too
        moved = ckpt.dcp.share_memory(model, opt)
        writer = ckpt.dcp.Writer(daemon.sock, "bench-dcp")
        fsdir = str(work / "fs")
        os.makedirs(fsdir)
        res = {m: ([], [], [], []) for m in ("ckptd", "fs")}
        step = 1
        for r in range(args.rounds):
            for mode in (("ckptd", "fs") if r % 2 == 0 else ("fs", "ckptd")):
                out = run_block(mode, model, opt, width, args.iters, writer, fsdir, step)
                step += args.iters
                for acc, xs in zip(res[mode], out):
                    acc.extend(xs[1:])  # the first step of a block waits for nothing before it
        state_mib = round(sum(p.numel() * 4 for p in model.parameters()) * 3 / 2**20, 1)
        figures = {
            "workload": {"param_mib": round(state_mib / 3, 1), "state_mib": state_mib, "shared_bytes": moved,
                         "threads": args.threads, "iters": args.iters, "rounds": args.rounds},
            "torch": torch.__version__, "host": platform.node(), "cpus": os.cpu_count(),
            "last_staged_bytes": writer.last_staged_bytes,
        }
        for mode, (calls, stalls, uploads, steps) in res.items():
            figures[mode] = {"call_ms": med_ms(calls), "stall_ms": med_ms(stalls), "upload_wait_ms": med_ms(uploads),
                             "blocked_ms": med_ms([a + b + c for a, b, c in zip(calls, stalls, uploads)]),
                             "step_ms_without_waits": med_ms(steps), "samples": len(calls)}
        print(json.dumps(figures, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    finally:
        ckpt.dcp.close_all()
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
