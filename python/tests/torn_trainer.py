#!/usr/bin/env python3
"""The trainer of the torn-snapshot matrix (test_torn_snapshots.py): a small CNN trained on
the CPU, one variant per case of in-place change, with or without ckpt.torch.

    torn_trainer.py --case CASE --steps N --socket SOCK --job JOB [--out FILE]
        trains with a Checkpointer that saves every step, resuming from the newest committed
        version if the job has one; prints "@ready L" (L: the step it resumed from, 0 for a
        fresh start), then "@step K LOSS" after each save(K) (LOSS: float.hex), "@aborted V"
        for each version the Checkpointer aborted, and "@done" after the last version is
        committed (other lines: warnings); --out gets the final state (torch.save). Killed with SIGKILL at any point,
        it is restarted by the test with the same arguments.
    reference(case, steps) (imported by the test): the same trajectory without a daemon:
        the losses and every checkpointed value after each step.
    run_with_kills(...), differing(...): the harness that runs, kills and restarts this
        script, and the value-by-value comparison of a version with the reference.

Cases: the in-place changes a trainer makes between save() and the next update. Each case
uses batch norm (train mode), dropout, a StepLR scheduler, and the global torch, python and
numpy RNGs.
"""

from __future__ import annotations

import argparse
import copy
import glob
import inspect
import os
import random
import select
import subprocess
import sys

import numpy as np
import torch
from torch import nn

CASES = ("batchnorm", "buffers", "ema_module_before", "ema_buffers_after", "clip_before", "reinit",
         "parametrize", "tied", "accumulate", "scheduler_scaler", "large_buffer", "large_ema_before",
         "data_write")
# Cases whose change the version counters cannot stop the first time: detected, and the version
# aborted (then the Checkpointer protects the tensor). The others must never abort anything...
DETECTED = {"clip_before", "reinit", "large_ema_before", "data_write"}
# ... except what the very first version of a process can meet: nothing, for these.
ACCUMULATE = 3  # optimizer.step every ACCUMULATE iterations in case "accumulate"
LARGE = 1 << 19  # elements of a large (2 MiB, float32) buffer or EMA weight: too large to stage


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(0, 1)


class Net(nn.Module):
    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.fc = nn.Linear(16 * 4 * 4, 256)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(256, 10)
        if case == "buffers":
            self.register_buffer("mean64", torch.zeros(64, dtype=torch.float64))  # a float64 running mean
            self.register_buffer("count", torch.zeros((), dtype=torch.int64))  # a 0-dim step counter
            self.register_buffer("temperature", torch.ones(()))  # a 0-dim float
            self.register_buffer("seen", torch.zeros(10, dtype=torch.bool))
        if case == "ema_module_before":
            self.ema = copy.deepcopy(self.fc).requires_grad_(False)  # parameters no optimizer updates
        if case == "ema_buffers_after":
            self.register_buffer("ema_weight", self.fc.weight.detach().clone())
            self.register_buffer("ema_bias", self.fc.bias.detach().clone())
        if case == "parametrize":
            self.sq = nn.Linear(256, 256)
            torch.nn.utils.parametrize.register_parametrization(self.sq, "weight", Symmetric())
        if case == "tied":
            self.a = nn.Linear(256, 256, bias=False)
            self.b = nn.Linear(256, 256, bias=False)
            self.b.weight = self.a.weight
        if case == "large_buffer":
            self.register_buffer("big", torch.zeros(LARGE))
        if case == "large_ema_before":
            self.big_ema = nn.Linear(LARGE // 512, 512).requires_grad_(False)

    def forward(self, x):
        h = self.features(x).flatten(1)
        if self.case == "buffers" and self.training:
            with torch.no_grad():
                self.mean64.mul_(0.9).add_(h[:, :64].mean(0).double(), alpha=0.1)
                self.count.add_(1)
                self.temperature.mul_(0.99)
                self.seen.logical_or_(torch.zeros_like(self.seen).index_fill_(0, self.count % 10, True))
            h = h * self.temperature
        if self.case == "large_buffer" and self.training:
            with torch.no_grad():
                self.big.mul_(0.5).add_(h.mean())
        h = self.drop(torch.relu(self.fc(h)))
        if self.case == "ema_buffers_after" and self.training:  # after the forward, before backward
            with torch.no_grad():
                for e, p in ((self.ema_weight, self.fc.weight), (self.ema_bias, self.fc.bias)):
                    e.mul_(0.9).add_(p, alpha=0.1)
        if self.case == "parametrize":
            h = h + 0.01 * self.sq(h)
        if self.case == "tied":
            h = h + 0.01 * self.b(self.a(h))
        return self.head(h)


def make(case: str, device: str = "cpu"):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = Net(case).to(device)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trained, lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    scaler = None
    if case == "scheduler_scaler" and hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        try:
            scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
        except (TypeError, RuntimeError, AssertionError):  # a torch without CPU grad scaling
            scaler = None
    accum = None
    if case == "accumulate":  # gradients accumulate in buffers (state, so that a resume is exact)
        accum = nn.Module()
        for i, p in enumerate(trained):
            accum.register_buffer(f"g{i}", torch.zeros_like(p))
        model.accum = accum
    return model, opt, sched, scaler


def batch(step: int, device: str):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    # The global RNGs too: the resumed run must draw what the uninterrupted one drew.
    x = x + 0.01 * torch.randn(x.shape) + random.random() * 0.01 + float(np.random.rand()) * 0.01
    return x.to(device), y.to(device)


def train_step(model, opt, sched, scaler, case: str, step: int, captured=None) -> float:
    """Iteration `step` (1-based); the caller saves after it. captured (with ckpt): waits until
    the pending version is out of trainer memory, without sealing it."""
    with torch.no_grad():  # changes at the start of the iteration, after the previous save
        if case == "ema_module_before":
            for e, p in zip(model.ema.parameters(), model.fc.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
        if case == "clip_before":
            for p in model.features.parameters():
                p.clamp_(-0.5, 0.5)
        if case == "reinit" and step % 3 == 0:
            model.head.reset_parameters()
        if case == "large_ema_before":
            model.big_ema.weight.mul_(0.9).add_(0.01)
    if case == "data_write" and step >= 3:
        # Through .data: invisible to the version counter. Made once the daemon has copied the
        # version, as the daemon's verify can see it: at the seal it compares memory with its
        # copy (a write before the copy of the item would go into the copy unseen).
        if captured is not None:
            captured()
        model.head.weight.data.mul_(0.999)
    x, y = batch(step, next(model.parameters()).device)
    loss = nn.functional.cross_entropy(model(x), y)
    if scaler is not None:
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    elif case == "accumulate":
        loss.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for a, p in zip(model.accum.buffers(), params):
                a.add_(p.grad)
                p.grad = None
        if step % ACCUMULATE == 0:
            for a, p in zip(model.accum.buffers(), params):
                p.grad = a / ACCUMULATE
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for a in model.accum.buffers():
                    a.zero_()
        return loss.item()
    else:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sched.step()
    return loss.item()


def state(model, opt) -> dict:
    """Every checkpointed tensor by item name (ckpt.torch's names), cloned."""
    out = {}
    seen = set()
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) in seen or v.numel() == 0:
            continue
        seen.add(id(v))
        out[f"model.{k}"] = v.detach().clone()
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v):
                out[f"optim.state.{i}.{k}"] = v.clone()
    return out


def deterministic(device: str) -> None:
    torch.set_num_threads(1)
    if device != "cpu":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)


def reference(case: str, steps: int, device: str = "cpu"):
    """(losses, {step: state}) of the uninterrupted run without ckpt (states on the CPU)."""
    threads = torch.get_num_threads()
    deterministic(device)
    try:
        model, opt, sched, scaler = make(case, device)
        losses, states = {}, {}
        for step in range(1, steps + 1):
            losses[step] = train_step(model, opt, sched, scaler, case, step)
            states[step] = {k: v.cpu() for k, v in state(model, opt).items()}
        return losses, states
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# The harness (test_torn_snapshots.py, tests/gpu/checks.py): runs this script, kills it, reads it.

LINE_TIMEOUT_S = 120.0


class Trainer:
    """One trainer process; lines() yields its output lines, each within LINE_TIMEOUT_S."""

    def __init__(self, socket, env, case, job, steps, out, device):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--case", case, "--steps",
                                      str(steps), "--socket", socket, "--job", job, "--out", str(out),
                                      "--device", device], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env)
        self.output = []

    def lines(self):
        buf = b""
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" not in buf:
                ready, _, _ = select.select([fd], [], [], LINE_TIMEOUT_S)
                if not ready:
                    raise AssertionError(f"the trainer said nothing for {LINE_TIMEOUT_S} s; so far: {self.output}")
                chunk = os.read(fd, 4096)
                if not chunk:
                    return
                buf += chunk
            line, buf = buf.split(b"\n", 1)
            text = line.decode()
            self.output.append(text)
            yield text

    def finish(self):
        rc = self.proc.wait(timeout=LINE_TIMEOUT_S)
        self.cleanup()
        return rc

    def cleanup(self):
        """Shared memory a killed trainer leaves (its regions are named after its pid)."""
        pid = self.proc.pid
        for path in glob.glob(f"/dev/shm/ckpt-{os.getuid()}-{pid}-*") + glob.glob(f"/dev/shm/ckpt-release-{pid}-*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.proc.stdout.close()


def differing(stored, want):
    """{item: number of values that differ} between a committed version's tensors and the
    reference state of its step (missing or extra items count as all their values)."""
    diff = {}
    for name in set(stored) | set(want):
        if name not in stored or name not in want:
            diff[name] = "missing" if name not in stored else "extra"
            continue
        a, b = stored[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            diff[name] = f"{a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
            continue
        n = int((a.reshape(-1).view(torch.uint8 if a.element_size() == 1 else
                                    {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]) !=
                 b.reshape(-1).view(torch.uint8 if b.element_size() == 1 else
                                    {2: torch.int16, 4: torch.int32, 8: torch.int64}[b.element_size()])).sum())
        if n:
            diff[name] = n
    return diff


def run_with_kills(socket, env, case, job, steps, out, kills, device="cpu"):
    """Runs the trainer (ckptd at `socket`, environment `env`) until it finishes, killing it
    with SIGKILL right after the save of each step in `kills` (a restarted trainer resumes
    from the newest committed version). Returns (the step each run resumed from, {step: [loss
    hex of each run]}, the versions aborted, the final state); `out`: a file for that state."""
    pending_kills = list(kills)
    starts, losses, aborted = [], {}, []

    def take(line):
        """Notes one line; True if it is the save after which to kill."""
        if not line.startswith("@"):
            return False  # a warning or a traceback (stderr comes along)
        word, _, rest = line[1:].partition(" ")
        if word == "ready":
            starts.append(int(rest))
            pending_kills[:] = [k for k in pending_kills if k > int(rest)]
        elif word == "aborted":
            aborted.append(int(rest))
        elif word == "step":
            step, loss = rest.split()
            losses.setdefault(int(step), []).append(loss)
            if pending_kills and int(step) == pending_kills[0]:
                pending_kills.pop(0)
                return True
        return False

    while True:
        t = Trainer(socket, env, case, job, steps, out, device)
        killed = False
        try:
            lines = t.lines()
            for line in lines:
                if take(line):
                    t.proc.kill()
                    t.proc.wait()
                    killed = True
                    break
            for line in lines:  # what it wrote before it died
                take(line)
        finally:
            if t.proc.poll() is None:
                t.proc.kill()
                t.proc.wait()
        if killed:
            t.cleanup()
            continue
        rc = t.finish()
        assert rc == 0, f"the trainer exited {rc}; its output:\n" + "\n".join(t.output)
        assert t.output[-1] == "@done", t.output
        return starts, losses, aborted, torch.load(out)


# ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=CASES)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--out")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    deterministic(args.device)
    import ckpt
    import ckpt.torch

    model, opt, sched, scaler = make(args.case, args.device)
    objects = {"scaler": scaler} if scaler is not None else {}
    if args.case == "data_write" and "verify" in inspect.signature(ckpt.torch.Checkpointer).parameters:
        objects["verify"] = True  # the daemon re-hashes the host regions at the sealing wait
    ck = ckpt.torch.Checkpointer(args.socket, args.job, model=model, optimizer=opt, scheduler=sched, **objects)
    try:
        start = ck.load("latest")
    except ckpt.VersionNotFoundError:
        start = 0
    print(f"@ready {start}", flush=True)
    reported = 0
    def captured():
        if ck._job is not None:  # the worker thread's snapshot call and wait for the capture
            ck._job.result()
        elif ck.pending is not None:
            ck.client.wait_snapshot(ck.pending, seal=False)

    for step in range(start + 1, args.steps + 1):
        loss = train_step(model, opt, sched, scaler, args.case, step, captured)
        ck.save(step)
        aborted = getattr(ck, "aborted_versions", [])
        for version, _ in aborted[reported:]:
            print(f"@aborted {version}", flush=True)
        reported = len(aborted)
        print(f"@step {step} {loss.hex()}", flush=True)
    try:
        if start < args.steps:  # (a run killed late may have committed the last step already)
            ck.wait_durable(args.steps)
    except ckpt.Error as e:
        if e.code != 10:  # ABORTED: the last version was aborted (printed below)
            raise
    for version, _ in getattr(ck, "aborted_versions", [])[reported:]:
        print(f"@aborted {version}", flush=True)
    if args.out:
        torch.save({k: v.cpu() for k, v in state(model, opt).items()}, args.out)
    ck.close()
    print("@done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
