#!/usr/bin/env python3
"""Per-iteration checkpointing of a small PyTorch training loop on CPU, four ways, one run.

Modes (every mode checkpoints the full state, model + AdamW state, every iteration):
  none        no checkpointing (the baseline)
  torch_save  torch.save of {model, optimizer, scheduler} state dicts to FILE.tmp, flush,
              fsync, rename to FILE: the trainer waits for the whole save
  dcp_async   torch.distributed.checkpoint.async_save of get_state_dict(model, optimizer)
              (single-process gloo process group), waiting for the previous save's future
              just before the next async_save: the trainer waits for the state-dict build,
              the staging copy inside async_save and whatever of the previous write is left
  ckptd       ckpt.torch.Checkpointer: parameters and optimizer state live in shared memory
              registered with ckptd; per iteration: forward/backward, wait_snapshot()
              (what the Checkpointer's optimizer hook does; called here to time it), step,
              save(iteration) (pickles the non-tensor state, asks for the snapshot): the
              trainer waits for the save call and for copies not finished when the next
              step begins

All modes train the SAME model, examples/train_gpt.py's GPT with its optimizer and LR
schedule (parameters and optimizer state sit in the Checkpointer's shared memory for every
mode, so compute is identical) in one continuous run, in rounds of blocks of --iters
iterations per mode, the mode order rotating each round, so machine drift hits all modes
alike. Each block starts with an untimed lead-in iteration (so every timed iteration finds
its predecessor's checkpoint in flight, as in steady state), and ends by draining the mode's
background work (outside the timings), so no mode pays for another's writes. Stall = wall time the training loop is blocked by
checkpointing in an iteration. The last checkpoint of each mode is read back and compared
with the trainer's state.

  PYTHONPATH=build/python .venv-bench/bin/python bench/torch_compare.py [--iters N] [--rounds R]
      [--dir DIR] [--out bench/out/torch_compare.json] [--ckptd build/ckptd]
  (or .venv-bench/bin/python examples/train_gpt.py --bench [the same options])

Needs: torch 2.x (bench/setup_torch_venv.sh) and the ckpt module (cmake -DCKPT_BUILD_PYTHON=ON).
"""

from __future__ import annotations

import argparse
import gc
import getpass
import json
import math
import os
import platform
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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckpt
import ckpt.torch
from exit_on_signal import exit_on_signals

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
from train_gpt import GPT, load_text, make_optimizer, warmup_cosine  # noqa: E402  (one model for both)
MODES = ["none", "torch_save", "dcp_async", "ckptd"]
MODE_TEXT = {
    "none": "no checkpointing",
    "torch_save": "torch.save(model+optim+sched) to file.tmp + fsync + rename, every iteration",
    "dcp_async": "DCP async_save(get_state_dict(model, optim)), wait previous future first",
    "ckptd": "ckpt.torch.Checkpointer: state in shm, wait_snapshot() before step, save(it) after",
}


# ----------------------------------------------------------------------------------------
# The daemon


class Daemon:
    """build/ckptd on a private socket and root; ready when it writes 'ready' to --ready-fd."""

    def __init__(self, binary: Path, work: Path, pool_mib: int):
        self.sock = work / "sock" / "ckptd.sock"
        self.root = work / "ckptd-root"
        self.log_path = work / "ckptd.log"
        r, w = os.pipe()
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(binary), "--socket", str(self.sock), "--root", str(self.root), "--create-root", "--pool-mib", str(pool_mib),
             "--ready-fd", str(w), "--log-level", "warn"],
            pass_fds=(w,), stdout=self.log, stderr=subprocess.STDOUT)
        os.close(w)
        try:
            got = b""
            deadline = time.monotonic() + 30
            while b"\n" not in got:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    raise RuntimeError("ckptd did not report ready within 30 s")
                chunk = os.read(r, 64)
                if not chunk:
                    raise RuntimeError(f"ckptd exited before ready (rc {self.proc.wait()}); "
                                       f"log: {self.log_path.read_text()[-2000:]}")
                got += chunk
            if got.strip() != b"ready":
                raise RuntimeError(f"ckptd wrote {got!r} on its ready fd")
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(r)

    def peak_rss_mib(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ----------------------------------------------------------------------------------------
# Helpers


def percentile(values, p):
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]


class CpuMeter:
    """CPU seconds used on the machine by processes other than this one and the daemon (the
    machine has 2 cores: anything else running skews the figures, so it is reported)."""

    def __init__(self, daemon_pid: int):
        self.daemon_pid = daemon_pid
        self.tick = os.sysconf("SC_CLK_TCK")
        self.start = self._sample()

    def _sample(self):
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (f[0] + f[1] + f[2] + f[5] + f[6] + f[7]) / self.tick  # user nice system irq softirq steal
        own = sum(os.times()[:2])
        try:
            st = Path(f"/proc/{self.daemon_pid}/stat").read_text().rsplit(")", 1)[1].split()
            own += (int(st[11]) + int(st[12])) / self.tick
        except (OSError, IndexError):
            pass
        return busy, own

    def other_cpu_s(self):
        """Since the last call (or creation)."""
        now = self._sample()
        other = (now[0] - self.start[0]) - (now[1] - self.start[1])
        self.start = now
        return max(0.0, other)


def source_info():
    """Which sources the daemon and client were built from (for the record)."""
    def git(*a):
        try:
            return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return None
    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted_changes": git("status", "--porcelain", "--untracked-files=no")}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ----------------------------------------------------------------------------------------
# The trainer


class Trainer:
    def __init__(self, args, work: Path, daemon: Daemon):
        torch.manual_seed(args.seed)
        self.args = args
        self.data = load_text()
        self.gen = torch.Generator().manual_seed(args.seed + 1)
        self.model = GPT(args.d_model, args.layers, args.heads, args.seq)
        self.opt = make_optimizer(self.model, args.lr)
        total = (args.rounds * (args.iters + args.lead_in) + args.warmup) * len(MODES) + 1
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup_cosine(total, max(1, total // 20)))
        self.it = 0
        # One step first, so that AdamW's state exists when the Checkpointer moves the state
        # into shared memory: every mode then runs on the same memory from the start.
        self.train_step(lambda: None)
        self.job = "torch-compare"
        self.position = {"iteration": self.it}
        self.ck = ckpt.torch.Checkpointer(str(daemon.sock), self.job, model=self.model, optimizer=self.opt,
                                          scheduler=self.sched, extra_state=self.position)
        self.state_bytes = sum(t.numel() * t.element_size() for _, t in self.state_tensors())
        self.work = work
        (work / "torch_save").mkdir()
        (work / "dcp").mkdir()
        self.save_path = work / "torch_save" / "state.pt"
        self.daemon = daemon
        self.dcp_future = None
        self.dcp_dirs: list[Path] = []
        self.ckptd_last = 0

    def state_tensors(self):
        """(item name, tensor): parameters and optimizer state, as the Checkpointer registers them."""
        return self.ck.tensors().items()

    # -- one iteration ----------------------------------------------------------------------
    def train_step(self, before_step):
        """forward/backward, before_step(), optimizer step; returns (loss, fwd_bwd_s, step_s)."""
        a = self.args
        t0 = time.perf_counter()
        ix = torch.randint(len(self.data) - a.seq - 1, (a.batch,), generator=self.gen)
        x = torch.stack([self.data[i:i + a.seq] for i in ix])
        y = torch.stack([self.data[i + 1:i + a.seq + 1] for i in ix])
        loss = F.cross_entropy(self.model(x).view(-1, 256), y.view(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        t1 = time.perf_counter()
        before_step()
        t2 = time.perf_counter()
        self.opt.step()
        self.sched.step()
        self.it += 1
        return loss.item(), t1 - t0, time.perf_counter() - t2

    def iteration(self, mode):
        """One training iteration with `mode`'s checkpointing; returns its record."""
        rec = {"mode": mode}
        t_start = time.perf_counter()
        stall = 0.0

        def before_step():
            nonlocal stall
            if mode == "ckptd" and self.ck.pending is not None:
                t = time.perf_counter()
                rec["wait_snapshot_reported_s"] = self.ck.wait_snapshot()
                rec["wait_snapshot_s"] = time.perf_counter() - t
                stall += rec["wait_snapshot_s"]

        loss, rec["fwd_bwd_s"], rec["step_s"] = self.train_step(before_step)
        if mode == "torch_save":
            t = time.perf_counter()
            state = {"model": self.model.state_dict(), "optim": self.opt.state_dict(),
                     "sched": self.sched.state_dict(), "iteration": self.it}
            tmp = self.save_path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.save_path)
            rec["save_s"] = time.perf_counter() - t
            stall += rec["save_s"]
        elif mode == "dcp_async":
            t = time.perf_counter()
            if self.dcp_future is not None:
                self.dcp_future.result()
                self.dcp_future = None
            t1 = time.perf_counter()
            model_sd, optim_sd = get_state_dict(self.model, self.opt)
            state = {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict(), "iteration": self.it}
            t2 = time.perf_counter()
            path = self.work / "dcp" / f"it-{self.it:07d}"
            self.dcp_future = dcp.async_save(state, checkpoint_id=str(path))
            t3 = time.perf_counter()
            self.dcp_dirs.append(path)
            rec.update(wait_prev_s=t1 - t, state_dict_s=t2 - t1, async_save_call_s=t3 - t2)
            stall += t3 - t
        elif mode == "ckptd":
            t = time.perf_counter()
            self.position["iteration"] = self.it
            self.ck.save(self.it)
            rec["save_call_s"] = time.perf_counter() - t
            stall += rec["save_call_s"]
            self.ckptd_last = self.it
        rec.update(iteration=self.it, loss=loss, stall_s=stall, iter_s=time.perf_counter() - t_start)
        return rec

    # -- between blocks (not timed) ----------------------------------------------------------
    def drain(self, mode):
        """Finishes `mode`'s background work so that the next block does not pay for it."""
        t = time.perf_counter()
        if mode == "dcp_async" and self.dcp_future is not None:
            self.dcp_future.result()
            self.dcp_future = None
        if mode == "ckptd" and self.ckptd_last:
            self.ck.wait_snapshot()
            self.ck.wait_durable(self.ckptd_last, ckpt.Level.COMMITTED)
        return time.perf_counter() - t

    def prune(self):
        """Removes all but the newest checkpoint of each mode (keeps the disk bounded)."""
        for d in self.dcp_dirs[:-1]:
            shutil.rmtree(d, ignore_errors=True)
        self.dcp_dirs = self.dcp_dirs[-1:]
        job_dir = self.daemon.root / self.job
        if job_dir.is_dir() and self.ckptd_last:
            keep = f"v{self.ckptd_last:010d}"
            for d in job_dir.iterdir():
                if d.is_dir() and d.name.startswith("v") and d.name != keep and not d.name.endswith(".tmp"):
                    shutil.rmtree(d, ignore_errors=True)

    def disk_bytes(self, mode):
        if mode == "torch_save":
            return self.save_path.stat().st_size
        if mode == "dcp_async":
            return dir_bytes(self.dcp_dirs[-1])
        if mode == "ckptd":
            return dir_bytes(self.daemon.root / self.job / f"v{self.ckptd_last:010d}")
        return 0

    def verify(self, mode):
        """Reads `mode`'s newest checkpoint back and compares it with the trainer's state
        (called right after drain, when the state equals that checkpoint)."""
        ref = {n: t.detach().clone() for n, t in self.state_tensors()}
        params = [p for g in self.opt.param_groups for p in g["params"]]

        def by_item(model_sd, optim_state, key_of):
            """The loaded tensors under the Checkpointer's item names."""
            got = {f"model.{k}": v for k, v in model_sd.items()}
            for i, p in enumerate(params):
                for k, v in optim_state.get(key_of(i, p), {}).items():
                    got[f"optim.state.{i}.{k}"] = v
            return got

        if mode == "torch_save":
            loaded = torch.load(self.save_path, weights_only=True)
            got = by_item(loaded["model"], loaded["optim"]["state"], lambda i, p: i)
            ok = loaded["iteration"] == self.it
        elif mode == "dcp_async":
            model_sd, optim_sd = get_state_dict(self.model, self.opt)
            target = {"model": {k: torch.zeros_like(v) for k, v in model_sd.items()},
                      "optim": {"state": {n: {k: torch.zeros_like(v) for k, v in st.items()}
                                          for n, st in optim_sd["state"].items()},
                                "param_groups": optim_sd["param_groups"]}}
            dcp.load(target, checkpoint_id=str(self.dcp_dirs[-1]))
            names = {id(p): n for n, p in self.model.named_parameters()}
            got = by_item(target["model"], target["optim"]["state"], lambda i, p: names[id(p)])
            ok = True
        elif mode == "ckptd":
            with torch.no_grad():
                for _, t in self.state_tensors():
                    t.zero_()
            try:
                step = self.ck.load(self.ckptd_last)
            finally:
                with torch.no_grad():
                    got = {n: t.clone() for n, t in self.state_tensors()}
                    for n, t in self.state_tensors():
                        t.copy_(ref[n])  # whatever happened, continue from the true state
            ok = step == self.ckptd_last and self.position["iteration"] == self.it
        else:
            return None
        if got.keys() != ref.keys():
            print(f"verify {mode}: items {sorted(got.keys() ^ ref.keys())[:5]} differ", file=sys.stderr)
            return False
        return ok and all(torch.equal(ref[n], got[n]) for n in ref)


# ----------------------------------------------------------------------------------------


def summarize(records, state_bytes):
    out = {}
    base = statistics.median(r["iter_s"] for r in records if r["mode"] == "none")
    for mode in MODES:
        rs = [r for r in records if r["mode"] == mode]
        iters = [r["iter_s"] for r in rs]
        stalls = [r["stall_s"] for r in rs]
        s = {
            "n": len(rs),
            "iter_p50_s": statistics.median(iters),
            "iter_mean_s": statistics.fmean(iters),
            "overhead_p50_pct": (statistics.median(iters) / base - 1) * 100,
            "fwd_bwd_p50_s": statistics.median(r["fwd_bwd_s"] for r in rs),
            "step_p50_s": statistics.median(r["step_s"] for r in rs),
            "stall_p50_s": statistics.median(stalls),
            "stall_p99_s": percentile(stalls, 99),
            "stall_max_s": max(stalls),
        }
        p50 = s["stall_p50_s"]
        s["trainer_seen_gb_per_s"] = state_bytes / p50 / 1e9 if mode != "none" and p50 > 0 else None
        for k in ("save_s", "wait_prev_s", "state_dict_s", "async_save_call_s", "save_call_s",
                  "wait_snapshot_s", "wait_snapshot_reported_s"):
            vals = [r[k] for r in rs if k in r]
            if vals:
                s[k[:-2] + "_p50_s"] = statistics.median(vals)
                s[k[:-2] + "_p99_s"] = percentile(vals, 99)
        out[mode] = s
    return out


def add_quiet_summary(result, limit_s):
    """Adds the figures of the rounds in which no block saw more than `limit_s` CPU seconds
    used by other processes (other work on a 2-core machine skews every mode), if some
    rounds were noisy and some were quiet."""
    noisy = {b["round"] for b in result["blocks"] if b["other_processes_cpu_s"] > limit_s}
    quiet = sorted({b["round"] for b in result["blocks"]} - noisy)
    result.pop("summary_quiet_rounds", None)
    if noisy and quiet:
        records = [r for r in result["records"] if r["round"] in quiet]
        result["summary_quiet_rounds"] = {"other_cpu_limit_s_per_block": limit_s, "rounds": quiet,
                                          "summary": summarize(records, result["state_bytes"])}


def print_table(summary, verified):
    print(f"{'mode':<11}{'iter p50':>10}{'overhead':>10}{'stall p50':>11}{'stall p99':>11}"
          f"{'GB/s seen':>11}{'verified':>10}")
    for mode in MODES:
        s = summary[mode]
        gbs = f"{s['trainer_seen_gb_per_s']:.2f}" if s["trainer_seen_gb_per_s"] else "-"
        ver = "-" if mode == "none" else ("yes" if verified[mode]["ok"] else "NO")
        print(f"{mode:<11}{s['iter_p50_s'] * 1e3:>8.1f}ms{s['overhead_p50_pct']:>9.1f}%"
              f"{s['stall_p50_s'] * 1e3:>9.2f}ms{s['stall_p99_s'] * 1e3:>9.2f}ms{gbs:>11}{ver:>10}")
    n = summary["none"]["n"]
    print(f"(n = {n} iterations per mode; p99 is nearest-rank, i.e. the maximum when n < 100; "
          f"overhead = iteration p50 / none's p50 - 1; GB/s seen = state bytes / stall p50)")
    dc, ck = summary["dcp_async"], summary["ckptd"]
    print(f"dcp_async stall parts p50: wait previous {dc['wait_prev_p50_s'] * 1e3:.1f} ms, get_state_dict "
          f"{dc['state_dict_p50_s'] * 1e3:.1f} ms, async_save call {dc['async_save_call_p50_s'] * 1e3:.1f} ms")
    print(f"ckptd stall parts p50: save call {ck['save_call_p50_s'] * 1e3:.2f} ms (checks, pickling the "
          f"non-tensor state, snapshot request), wait_snapshot {ck.get('wait_snapshot_p50_s', float('nan')) * 1e3:.2f} ms")


def report(result):
    rss = result["daemon_peak_rss_mib"]
    print(f"\nAll {result['rounds']} rounds; CPU used by other processes during the timed blocks: "
          f"{result['other_processes_cpu_s_in_blocks']:.1f} s of {result['run_s']:.0f} s; daemon peak RSS "
          f"{rss or float('nan'):.0f} MiB (pool {result['pool_mib']} MiB)")
    print_table(result["summary"], result["verified"])
    q = result.get("summary_quiet_rounds")
    if q:
        print(f"\nQuiet rounds only ({len(q['rounds'])} of {result['rounds']}: no block with more than "
              f"{q['other_cpu_limit_s_per_block']} CPU s used by other processes)")
        print_table(q["summary"], result["verified"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per mode block (default 5)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of one block per mode (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per mode first (default 2)")
    ap.add_argument("--lead-in", type=int, default=1, help="untimed iterations at the start of every block, so "
                    "that each timed iteration finds its predecessor's checkpoint in flight (default 1)")
    ap.add_argument("--dir", default="/tmp", help="storage directory; a fresh subdirectory is made "
                    "there and removed at the end (default /tmp)")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "torch_compare.json"))
    ap.add_argument("--ckptd", default=str(REPO / "build" / "ckptd"), help="daemon binary")
    ap.add_argument("--pool-mib", type=int, default=1024, help="ckptd host pool (default 1024)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--keep", action="store_true", help="keep the storage subdirectory")
    ap.add_argument("--quiet-cpu-s", type=float, default=0.5, help="a round counts as quiet if no block in "
                    "it saw more CPU seconds used by other processes than this (default 0.5)")
    ap.add_argument("--summarize", metavar="JSON", help="print the tables of a saved run and exit")
    args = ap.parse_args()
    exit_on_signals()
    if args.summarize:
        result = json.loads(Path(args.summarize).read_text())
        print(f"{result['command']}\ntorch {result['torch']}")
        add_quiet_summary(result, args.quiet_cpu_s)
        report(result)
        return

    # torch (DCP) creates an empty inductor cache directory in /tmp; remove it if it is ours.
    inductor_dir = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    inductor_existed = inductor_dir.exists()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt-torch-compare-", dir=base))
    free = shutil.disk_usage(work).free
    load_start = os.getloadavg()
    print(f"torch {torch.__version__}, python {platform.python_version()}, {torch.get_num_threads()} torch "
          f"threads, {os.cpu_count()} CPUs, load average {load_start[0]:.2f}; storage {work} "
          f"({free / 2**30:.1f} GiB free)")
    for m in MODES:
        print(f"  {m:<10}  {MODE_TEXT[m]}")

    daemon = None
    trainer = None
    try:
        daemon = Daemon(Path(args.ckptd), work, args.pool_mib)
        # async_save runs with a process group as trainers have one: gloo, world size 1.
        dist.init_process_group("gloo", init_method=f"file://{work}/pg-init", rank=0, world_size=1)
        trainer = Trainer(args, work, daemon)
        nparams = sum(p.numel() for p in trainer.model.parameters())
        print(f"model: {args.layers} layers, d_model {args.d_model}, {nparams / 1e6:.2f} M parameters; "
              f"batch {args.batch} x {args.seq} bytes; checkpointed state (params + AdamW moments) "
              f"{trainer.state_bytes / 2**20:.1f} MiB in {len(trainer.ck.items)} tensor items (shared memory)")
        need = 4 * trainer.state_bytes * (args.iters + 2)
        if free < need:
            sys.exit(f"torch_compare: {work} has {free / 2**30:.1f} GiB free, needs ~{need / 2**30:.1f} GiB")
        print(f"{args.rounds} rounds x {len(MODES)} modes x {args.iters} timed iterations (+{args.lead_in} untimed "
              f"at each block start, +{args.warmup} untimed per mode first), mode order rotating per round")

        for mode in MODES:  # warm-up: first-call costs (thread pools, page faults) off the record
            for _ in range(args.warmup):
                trainer.iteration(mode)
            trainer.drain(mode)
        trainer.prune()

        records, blocks, verified = [], [], {}
        meter = CpuMeter(daemon.proc.pid)
        other_total = 0.0
        t_run = time.perf_counter()
        for rnd in range(args.rounds):
            order = MODES[rnd % len(MODES):] + MODES[:rnd % len(MODES)]
            for mode in order:
                for _ in range(args.lead_in):  # untimed: puts the previous checkpoint in flight
                    trainer.iteration(mode)
                meter.other_cpu_s()  # start of the block
                rs = [trainer.iteration(mode) for _ in range(args.iters)]
                for r in rs:
                    r["round"] = rnd
                records += rs
                other = meter.other_cpu_s()
                other_total += other
                drain_s = trainer.drain(mode)
                blocks.append({"round": rnd, "mode": mode, "drain_s": drain_s, "other_processes_cpu_s": other,
                               "iter_p50_s": statistics.median(r["iter_s"] for r in rs),
                               "loss_last": rs[-1]["loss"]})
                if rnd == args.rounds - 1 and mode != "none":
                    verified[mode] = {"ok": trainer.verify(mode), "disk_bytes": trainer.disk_bytes(mode)}
                trainer.prune()
            print(f"round {rnd + 1}/{args.rounds} done: iteration {trainer.it}, loss {records[-1]['loss']:.3f}, "
                  f"{time.perf_counter() - t_run:.0f} s; CPU used by other processes (and kernel threads) during blocks so far {other_total:.1f} s", flush=True)

        summary = summarize(records, trainer.state_bytes)
        daemon_rss = daemon.peak_rss_mib()
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "torch_compare",
            "command": " ".join([sys.executable] + sys.argv),
            "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "storage_dir": str(work), "modes": MODE_TEXT, "source": source_info(),
            "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
                      "batch": args.batch, "parameters": nparams},
            "state_bytes": trainer.state_bytes, "iters_per_block": args.iters, "rounds": args.rounds,
            "warmup_per_mode": args.warmup, "lead_in_per_block": args.lead_in,
            "daemon_peak_rss_mib": daemon_rss, "pool_mib": args.pool_mib,
            "loadavg_start": load_start, "run_s": time.perf_counter() - t_run,
            "other_processes_cpu_s_in_blocks": other_total,
            "summary": summary, "verified": verified, "blocks": blocks, "records": records,
        }
        add_quiet_summary(result, args.quiet_cpu_s)
        report(result)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    finally:
        if trainer is not None:
            try:
                trainer.drain("dcp_async")
                trainer.ck.close()
            except Exception as e:  # report, but still clean up
                print(f"cleanup: {e}", file=sys.stderr)
            trainer = None
            gc.collect()  # drops the client: a daemon with a client connected takes 5 s to stop
        if dist.is_initialized():
            dist.destroy_process_group()
        if daemon is not None:
            if daemon.proc.poll() is not None:
                print(f"ckptd exited early with status {daemon.proc.returncode}; its log ends:\n"
                      f"{daemon.log_path.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            daemon.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        if not inductor_existed and inductor_dir.is_dir() and not any(inductor_dir.iterdir()):
            inductor_dir.rmdir()


if __name__ == "__main__":
    main()
