#!/usr/bin/env python3
"""What checkpointing every step costs a short-step PyTorch trainer on CPU.

The workload: a small CNN with batch-norm layers (so the Checkpointer waits before every
forward, the tighter of its two waits), SGD with nesterov momentum, and a step of about 30 ms
on this machine's CPU, trained twice over for each LR scheduler (StepLR and OneCycleLR, whose
torch 1.x state_dict() pickles a bound method and the optimizer behind it):
  none   no checkpointing
  ckpt   ckpt.torch.Checkpointer against a real ckptd, save(step) after every step
The two modes alternate in blocks of --iters steps, the order flipping every round (none ckpt,
ckpt none, ...), so drift of the shared machine hits both alike. Each block starts with untimed
lead-in steps (the ckpt block's first save registers the optimizer's momentum buffers), and a
ckpt block ends by waiting for its last version to be committed, outside the timings.

Figures per scheduler: whether the versions held exactly the state of their step (every committed
version of a ckpt block compared value by value with the state cloned at its save(), outside
the timings; and the versions aborted), the cost of the version counters (record and compare,
for the tensors the Checkpointer guards), median step time of each mode, overhead = ckpt / none - 1 (also the
median over rounds of each round's own ratio, and the same ratio of the training thread's CPU
time per step, which a busy shared machine disturbs far less than wall time), and the
medians of the two things the trainer waits for per step in ckpt mode: save() and the wait
before the next optimizer step (the Checkpointer's hook; its time is ck.last_stall_s). --profile adds a cProfile of save() over one more ckpt block
per scheduler (top functions by cumulative time, printed and put in the JSON).

  PYTHONPATH=BUILD/python /usr/bin/python3 bench/torch_overhead.py --ckptd BUILD/ckptd
      [--iters 40] [--rounds 6] [--threads 1] [--batch 32] [--out FILE.json] [--profile]

bench/torch_overhead.sh builds the module and the daemon and runs this.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import operator
import os
import platform
import pstats
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import ckpt
import ckpt.torch
from exit_on_signal import exit_on_signals

SCHEDULERS = ("StepLR", "OneCycleLR")


class Daemon:
    """A ckptd on a private socket and root, ready when it writes 'ready' to --ready-fd."""

    def __init__(self, binary: str, work: Path):
        self.sock = str(work / "s" / "ckptd.sock")
        self.root = str(work / "root")
        self.log_path = work / "ckptd.log"
        r, w = os.pipe()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, "--socket", self.sock, "--root", self.root, "--create-root", "--pool-mib", "64",
                 "--ready-fd", str(w), "--log-level", "warn"],
                pass_fds=(w,), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        os.close(w)
        try:
            got, deadline = b"", time.monotonic() + 60
            while b"\n" not in got:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    raise RuntimeError(f"ckptd did not report ready within 60 s; log: {self.log_path}")
                chunk = os.read(r, 64)
                if not chunk:
                    raise RuntimeError(f"ckptd exited before ready (rc {self.proc.wait()}): "
                                       f"{self.log_path.read_text()[-2000:]}")
                got += chunk
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(r)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_model() -> torch.nn.Module:
    def block(cin, cout, pool):
        layers = [torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False), torch.nn.BatchNorm2d(cout),
                  torch.nn.ReLU()]
        return layers + ([torch.nn.MaxPool2d(2)] if pool else [])

    return torch.nn.Sequential(*block(3, 16, False), *block(16, 32, True), *block(32, 32, False),
                               *block(32, 64, True), *block(64, 64, False), *block(64, 64, True),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))


class Workload:
    """Model, optimizer and scheduler of one scheduler kind, and a fixed set of batches."""

    def __init__(self, kind: str, batch: int, total_steps: int):
        torch.manual_seed(0)
        self.kind = kind
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                   weight_decay=5e-4)
        if kind == "StepLR":
            self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=50, gamma=0.9)
        else:
            self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=0.1, total_steps=total_steps)
        g = torch.Generator().manual_seed(1)
        self.batches = [(torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
                        for _ in range(8)]
        self.step = 0
        self.data = {"position": 0}  # the trainer's own state (extra_state)

    def train_step(self) -> None:
        x, y = self.batches[self.step % len(self.batches)]
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.data["position"] += len(x)

    def state_bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        for st in self.opt.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        return n


def run_block(w: Workload, mode: str, iters: int, lead_in: int, daemon: Daemon, profiler=None, torn=None):
    """`iters` timed steps of one mode; returns (step seconds, save seconds, wait seconds,
    training-thread CPU seconds per step). torn (ckpt mode): a dict whose counts this block
    adds to: every committed version of the block compared value by value with the state the
    trainer had at its save() (cloned after the timed part of each step), and the versions
    the Checkpointer aborted."""
    steps, saves, waits, cpus = [], [], [], []
    saved = {}
    ck = None
    if mode == "ckpt":
        ck = ckpt.torch.Checkpointer(daemon.sock, f"overhead-{w.kind}", model=w.model, optimizer=w.opt,
                                     scheduler=w.sched, extra_state=w.data)
    clock = time.perf_counter
    try:
        for i in range(lead_in + iters):
            c0 = time.thread_time()
            t0 = clock()
            if ck is not None:
                ck.last_stall_s = 0.0  # the wait before the update sets it (none: no wait)
            w.train_step()
            t2 = clock()
            if ck is not None:
                if profiler is not None:
                    profiler.enable()
                ck.save(w.step)
                if profiler is not None:
                    profiler.disable()
            t3 = clock()
            c3 = time.thread_time()
            if i >= lead_in:
                cpus.append(c3 - c0)
                steps.append(t3 - t0)
                saves.append(t3 - t2)
                waits.append(ck.last_stall_s if ck is not None else 0.0)
            if ck is not None and torn is not None:
                saved[w.step] = {n: t.detach().clone() for n, t in ck.tensors().items()}
        if ck is not None:
            try:
                ck.wait_durable(timeout=60)
            except ckpt.Error as e:
                if e.code != 10:  # ABORTED: the last version was (counted below)
                    raise
            if torn is not None:
                committed = set(ckpt.list_versions(daemon.root, f"overhead-{w.kind}"))
                for step, want in saved.items():
                    if step not in committed:
                        continue
                    got = ckpt.torch.load_checkpoint(daemon.root, f"overhead-{w.kind}", step)["tensors"]
                    torn["versions_checked"] = torn.get("versions_checked", 0) + 1
                    torn["values_differing"] = torn.get("values_differing", 0) + sum(
                        int((got[n] != t).sum()) for n, t in want.items())
                torn["aborted"] = torn.get("aborted", 0) + len(getattr(ck, "aborted_versions", []))
    finally:
        if ck is not None:
            ck.close()
            del ck
            gc.collect()  # drops the client's connection now, not at some later collection
    return steps, saves, waits, cpus


def median_ms(values) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def profile_text(profiler: cProfile.Profile, lines: int) -> str:
    s = io.StringIO()
    pstats.Stats(profiler, stream=s).strip_dirs().sort_stats("cumulative").print_stats(lines)
    return s.getvalue()


def blob_bytes(daemon: Daemon, kind: str) -> int:
    """Size of the pickled blob of the newest version of that scheduler's job."""
    shard = ckpt.load_version(daemon.root, f"overhead-{kind}", "latest", rank=0)
    return len(shard.blobs[ckpt.torch.BLOB])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckptd", required=True, help="the ckptd binary")
    ap.add_argument("--iters", type=int, default=10, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=12, help="blocks per mode and scheduler")
    ap.add_argument("--lead-in", type=int, default=3, help="untimed steps at the start of each block")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (the machine has 2 cores: "
                    "one is left to the daemon and the rest of the machine)")
    ap.add_argument("--batch", type=int, default=12, help="batch size (sets the step time)")
    ap.add_argument("--profile", action="store_true", help="cProfile save() over one more ckpt block")
    ap.add_argument("--dir", default="/tmp", help="where the daemon's root goes")
    ap.add_argument("--out", help="JSON output file")
    args = ap.parse_args()
    exit_on_signals()
    torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="ckpt-ovh-", dir=args.dir))
    daemon = None
    runs, profiles = [], {}
    t_start, load_start = time.monotonic(), os.getloadavg()[0]
    try:
        daemon = Daemon(args.ckptd, work)
        total = (args.rounds * 2 + 2) * (args.iters + args.lead_in) + 10
        for kind in SCHEDULERS:
            w = Workload(kind, args.batch, total)
            times = {"none": ([], [], [], []), "ckpt": ([], [], [], [])}
            blocks = []
            torn = {}
            for r in range(args.rounds):
                for mode in (("none", "ckpt") if r % 2 == 0 else ("ckpt", "none")):
                    got = run_block(w, mode, args.iters, args.lead_in, daemon, torn=torn)
                    for acc, values in zip(times[mode], got):
                        acc.extend(values)
                    blocks.append([mode, round(median_ms(got[0]), 2)])
            none_ms, ckpt_ms = median_ms(times["none"][0]), median_ms(times["ckpt"][0])
            # Paired: each ckpt block against the none block of its round (same drift).
            pairs = [(c[1] / n[1] - 1) * 100 for n, c in
                     ((b[0] if b[0][0] == "none" else b[1], b[1] if b[0][0] == "none" else b[0])
                      for b in zip(blocks[0::2], blocks[1::2]))]
            none_cpu, ckpt_cpu = median_ms(times["none"][3]), median_ms(times["ckpt"][3])
            run = {"scheduler": kind, "step_ms_none": round(none_ms, 3), "step_ms_ckpt": round(ckpt_ms, 3),
                   "overhead_pct": round((ckpt_ms / none_ms - 1) * 100, 2),
                   "save_ms_p50": round(median_ms(times["ckpt"][1]), 4),
                   "wait_ms_p50": round(median_ms(times["ckpt"][2]), 4),
                   "overhead_pct_paired_p50": round(statistics.median(pairs), 2),
                   "step_cpu_ms_none": round(none_cpu, 3), "step_cpu_ms_ckpt": round(ckpt_cpu, 3),
                   "overhead_cpu_pct": round((ckpt_cpu / none_cpu - 1) * 100, 2),
                   "steps_per_mode": len(times["none"][0]), "blocks_ms_p50": blocks,
                   "state_bytes": w.state_bytes(),
                   "tensor_items": None, "blob_bytes": blob_bytes(daemon, kind), "torn": torn}
            with ckpt.torch.Checkpointer(daemon.sock, f"overhead-{kind}", model=w.model, optimizer=w.opt,
                                         scheduler=w.sched, extra_state=w.data) as ck:
                run["tensor_items"] = len(ck.items)
                guard = getattr(ck, "_guard", None)
                if guard is not None:  # what save() and the wait do with the version counters
                    version = operator.attrgetter("_version")
                    reps = 2000
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        recorded = list(map(version, guard))
                    t1 = time.perf_counter()
                    for _ in range(reps):
                        _ = list(map(version, guard)) != recorded
                    t2 = time.perf_counter()
                    run["guarded_tensors"] = len(guard)
                    run["counters_record_us"] = round((t1 - t0) / reps * 1e6, 2)
                    run["counters_compare_us"] = round((t2 - t1) / reps * 1e6, 2)
            gc.collect()
            if args.profile:
                prof = cProfile.Profile()
                run_block(w, "ckpt", args.iters, args.lead_in, daemon, profiler=prof)
                profiles[kind] = profile_text(prof, 25)
            runs.append(run)
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "benchmark": "torch_overhead",
        "runs": runs,
        "config": {"iters_per_block": args.iters, "rounds": args.rounds, "lead_in": args.lead_in,
                   "threads": args.threads, "batch": args.batch, "model": "CNN, 6 conv+BN blocks, SGD nesterov",
                   "torch": torch.__version__, "python": platform.python_version(),
                   "cpus": os.cpu_count(), "wall_s": round(time.monotonic() - t_start, 1),
                   "loadavg_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)]},
    }
    if profiles:
        result["save_profile"] = profiles
    if load_start > 1.5:
        print(f"note: 1-minute load average {load_start:.1f} on {os.cpu_count()} CPUs at the start: other work "
              f"shares the machine, and block medians (blocks_ms_p50 in the JSON) swing far more than the "
              f"overhead measured; save_ms_p50 and wait_ms_p50, timed on the training thread, are the "
              f"figures that hold")
    print(f"{'scheduler':<11} {'step none':>10} {'step ckpt':>10} {'overhead':>9} {'paired':>8} {'cpu ovh':>8} "
          f"{'save p50':>9} {'wait p50':>9} {'blob':>8}  torn values / versions checked, aborted")
    for r in runs:
        t = r["torn"]
        print(f"{r['scheduler']:<11} {r['step_ms_none']:>8.2f}ms {r['step_ms_ckpt']:>8.2f}ms "
              f"{r['overhead_pct']:>8.2f}% {r['overhead_pct_paired_p50']:>7.2f}% {r['overhead_cpu_pct']:>7.2f}% "
              f"{r['save_ms_p50']:>7.3f}ms {r['wait_ms_p50']:>7.3f}ms {r['blob_bytes']:>7}B  "
              f"{t.get('values_differing', 0)} / {t.get('versions_checked', 0)}, {t.get('aborted', 0)}")
        if "guarded_tensors" in r:
            print(f"{'':<11} version counters of {r['guarded_tensors']} tensors: record {r['counters_record_us']} us, "
                  f"compare {r['counters_compare_us']} us")
    for kind, text in profiles.items():
        print(f"--- cProfile of save(), {kind} ---\n{text}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
