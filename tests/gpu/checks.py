#!/usr/bin/env python3
"""The GPU checks: what only a GPU can settle, each printed PASS/FAIL (or SKIP,
with the reason) with its figures, all written to one JSON file.

    python3 tests/gpu/checks.py --bin DIR --out FILE.json [--work DIR] [--only NAME,...]

--bin holds ckptd, ckptctl and ckpt-gpu-trainer; `import ckpt` must find the Python module
(PYTHONPATH), built for this interpreter, and torch must see a GPU. tests/gpu/run.sh runs
this after its own proof. The checks (names for --only):

  small_allocs      cudaMalloc'd 1 KiB, 256 KiB, 1 MiB+123 and 3 MiB buffers: the driver's
                    allocation ranges (cuMemGetAddressRange next to the pointer attributes),
                    and a byte-exact snapshot, file and restore
  killed_pending    a trainer killed while its snapshot's event is still pending (a host
                    function queued before the record): the version is abandoned, no sticky
                    error, the daemon serves a new trainer on that GPU, SIGTERM ends it within
                    10 s, and its GPU memory returns to the baseline
  daemon_killed     the daemon killed during a stream-ordered wait: the trainer's stream does
                    not hang
  unregister_frees  a trainer unregisters and exits: the GPU memory it had comes back
  torch             the caching allocator with hundreds of segments; expandable_segments and
                    cudaMallocAsync refused with their messages; a reallocation caught;
                    BatchNorm consistency; bit-exact resume of a small GPT on the GPU; the
                    stall and overhead next to torch.distributed.checkpoint.async_save
  two_trainers      two trainers on one GPU at once: per trainer and total D2H rate
  under_load        a trainer running matrix products during capture: its slowdown, the
                    daemon's rate
  restore_rates     restore into fresh buffers from the memory tier and from disk: H2D GB/s
  matrix            capture rate at copy streams 1/2/4 (32 MiB chunks) and chunks 16/32/64
                    MiB (2 streams), single-thread xxh3, plain pinned copies (the limits)
  no_context        registration and snapshot from a thread with no current CUDA context
  pin_time          the daemon's start-up with an 8 GiB pool next to a 64 MiB one
  torn              the torn-snapshot matrix with the model on the GPU (GPU staging, the
                    counters before the stream-ordered wait, aborts), trainers killed with
                    SIGKILL at random steps: every committed version exact, resumes bit-exact

Each check runs its own daemon (and removes its files); a check that fails does not stop the
others. Exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GiB = 1 << 30
MiB = 1 << 20


# ------------------------------------------------------------------------------ harness

class CheckFailed(Exception):
    """A failed check; figures (the second argument) gathered before the failure are kept."""

    def __init__(self, message, figures=None):
        super().__init__(message)
        self.figures = figures or {}


class Skip(Exception):
    pass


def expect(cond, message, figures=None):
    if not cond:
        raise CheckFailed(message, figures)


class Daemon:
    """A ckptd process of its own (socket and roots under `work`), ready when constructed."""

    def __init__(self, bindir, work, name, *args, env=None):
        self.dir = Path(work) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = str(self.dir / "ckptd.sock")
        self.root = str(self.dir / "root")
        self.log = self.dir / "ckptd.log"
        self.bindir = bindir
        r, w = os.pipe()
        cmd = [str(Path(bindir) / "ckptd"), "--socket", self.socket, "--root", self.root, "--create-root", "--ready-fd", str(w),
               *map(str, args)]
        self.started = time.perf_counter()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, pass_fds=(w,),
                                         env=env or os.environ.copy())
        os.close(w)
        ready = b""
        deadline = time.monotonic() + 180
        while not ready.endswith(b"\n") and time.monotonic() < deadline:
            rl, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not rl:
                break
            chunk = os.read(r, 64)
            if not chunk:
                break
            ready += chunk
        os.close(r)
        self.ready_s = time.perf_counter() - self.started
        if ready.strip() != b"ready":
            self.proc.kill()
            self.proc.wait()
            raise CheckFailed(f"ckptd did not become ready: {self.tail()}")

    def tail(self, n=15):
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def status(self):
        out = subprocess.run([str(Path(self.bindir) / "ckptctl"), "--socket", self.socket, "status", "--json"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise CheckFailed(f"ckptctl status: {out.stderr.strip()}")
        return json.loads(out.stdout)

    def shards(self, job):
        return [s for s in self.status().get("shards", []) if s.get("job") == job]

    def stop(self, timeout=60):
        """SIGTERM; returns (exit status, seconds to exit), or (None, timeout) if it did not."""
        if self.proc.poll() is not None:
            return self.proc.returncode, 0.0
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None, timeout
        return rc, time.perf_counter() - t0

    def kill9(self):
        self.proc.kill()
        self.proc.wait()


def capture_rates(shards):
    """GB/s of bytes / capture_ms of every captured shard."""
    return [int(s["total_bytes"]) / 1e9 / (s["capture_ms"] / 1e3) for s in shards
            if not s.get("error") and s.get("capture_ms", 0) > 0]


def median(xs):
    return statistics.median(xs) if xs else None


def worker_cmd(*args):
    """The command line of this script as worker `args[0]` (`--worker NAME ARGS`)."""
    return [sys.executable, str(Path(__file__).resolve()), "--worker", *map(str, args)]


def run_json(what, cmd, timeout, env=None):
    """Runs `cmd`: (the JSON of its last stdout line, or None if it printed none; None), or
    (None, "what: why") when it fails."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        return None, f"{what}: exit {r.returncode}: {r.stderr.strip()[-800:]}"
    lines = r.stdout.strip().splitlines()
    try:
        return (json.loads(lines[-1]) if lines else None), None
    except ValueError:
        return None, f"{what}: no JSON in its last line: {lines[-1][:200]!r}"


def worker(args, *, stdin=False):
    """Runs this script as a worker process (`--worker NAME ARGS`); returns the Popen."""
    return subprocess.Popen(worker_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)


def read_line(proc, timeout):
    """The worker's next stdout line, or None after `timeout` seconds."""
    rl, _, _ = select.select([proc.stdout], [], [], timeout)
    if not rl:
        return None
    return proc.stdout.readline().strip()


# ------------------------------------------------------------------------------ CUDA driver

class Driver:
    """The few driver calls the checks need beyond torch, through ctypes."""

    RANGE_START, RANGE_SIZE = 11, 12  # CU_POINTER_ATTRIBUTE_RANGE_START_ADDR / _SIZE (cuda.h)

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetAddressRange_v2", "cuPointerGetAttribute",
                     "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuCtxGetCurrent", "cuGetErrorName"):
            getattr(self.lib, name)

    def _ok(self, rc, what):
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise CheckFailed(f"{what}: CUDA error {rc} {name.value.decode() if name.value else ''}")

    def alloc(self, n):
        p = ctypes.c_uint64()
        self._ok(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), f"cuMemAlloc({n})")
        return p.value

    def free(self, p):
        self._ok(self.lib.cuMemFree_v2(ctypes.c_uint64(p)), "cuMemFree")

    def address_range(self, p):
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._ok(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(p)),
                 "cuMemGetAddressRange")
        return base.value, size.value

    def range_attributes(self, p):
        start, size = ctypes.c_uint64(), ctypes.c_uint64()
        self._ok(self.lib.cuPointerGetAttribute(ctypes.byref(start), self.RANGE_START, ctypes.c_uint64(p)),
                 "cuPointerGetAttribute(RANGE_START_ADDR)")
        self._ok(self.lib.cuPointerGetAttribute(ctypes.byref(size), self.RANGE_SIZE, ctypes.c_uint64(p)),
                 "cuPointerGetAttribute(RANGE_SIZE)")
        return start.value, size.value

    def upload(self, p, data: bytes):
        buf = ctypes.create_string_buffer(data, len(data))
        self._ok(self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(p), buf, ctypes.c_size_t(len(data))), "cuMemcpyHtoD")

    def download(self, p, n) -> bytes:
        buf = ctypes.create_string_buffer(n)
        self._ok(self.lib.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(p), ctypes.c_size_t(n)), "cuMemcpyDtoH")
        return buf.raw

    def current_context(self):
        ctx = ctypes.c_void_p()
        self._ok(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        return ctx.value


def gpu_process_memory_mib(pid):
    """GPU memory NVML reports for `pid`, or None where it does not list it (containers,
    gVisor, other PID namespaces: not listed is not the same as none)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid:
                return None if p.usedGpuMemory is None else p.usedGpuMemory / MiB
        return None
    except Exception:  # noqa: BLE001 -- no NVML, or no per-process figures here
        return None


def free_gpu_mib():
    """Free memory of the whole device (every process's allocations count)."""
    import torch
    return torch.cuda.mem_get_info()[0] / MiB


def shards_ok(d, job, fig):
    """The job's shards in the daemon's status; fails the check on any shard error or none."""
    shards = d.shards(job)
    bad = [f"v{s['version']}: {s['error']}" for s in shards if s.get("error")]
    expect(shards and not bad, f"job {job}: {'no shards' if not shards else bad}", fig)
    return shards


def pattern(n, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# ------------------------------------------------------------------------------ the checks

def check_small_allocs(ctx):
    import ckpt
    import torch
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    drv = Driver()
    sizes = [("a_1k", 1024), ("b_256k", 256 * 1024), ("c_1m123", MiB + 123), ("d_3m", 3 * MiB)]
    ptrs = {name: drv.alloc(n) for name, n in sizes}
    fig = {"allocations": {}}
    try:
        for name, n in sizes:
            base, size = drv.address_range(ptrs[name])
            rbase, rsize = drv.range_attributes(ptrs[name])
            fig["allocations"][name] = {"bytes": n, "ptr": hex(ptrs[name]), "cuMemGetAddressRange": [hex(base), size],
                                        "range_attributes": [hex(rbase), rsize],
                                        "agree": (base, size) == (rbase, rsize)}
        bases = [drv.address_range(ptrs[name])[0] for name, _ in sizes]
        fig["allocations_sharing_a_block"] = len(bases) - len(set(bases))
        d = Daemon(ctx.bin, ctx.work, "small", "--pool-mib", 256, "--chunk-mib", 16)
        try:
            data = {name: bytes(pattern(n, i + 1).numpy()) for i, (name, n) in enumerate(sizes)}
            for name, _ in sizes:
                drv.upload(ptrs[name], data[name])
            c = ckpt.Client.connect(d.socket, reconnect_budget=0)
            c.register_items("small", 0, 1, [(name, "U8", [n], ptrs[name]) for name, n in sizes])
            c.snapshot(1)
            c.wait_snapshot(1, timeout=60)
            c.wait_durable(1, timeout=120)
            shard = ckpt.load_file(f"{d.root}/small/v0000000001/rank-00000.safetensors")
            for name, _ in sizes:
                expect(bytes(shard.tensors[name].numpy().tobytes()) == data[name], f"file: {name} differs")
            for name, n in sizes:
                drv.upload(ptrs[name], bytes(n))
            v, _ = c.restore(1)
            for name, n in sizes:
                expect(drv.download(ptrs[name], n) == data[name], f"restore: {name} differs")
            c.unregister()
            fig["snapshot_file_restore_byte_exact"] = True
        finally:
            d.stop()
    finally:
        for p in ptrs.values():
            drv.free(p)
    disagree = [k for k, a in fig["allocations"].items() if not a["agree"]]
    fig["note"] = ("the pointer attributes' range differs from cuMemGetAddressRange for " + ", ".join(disagree)
                   if disagree else "the pointer attributes' range equals cuMemGetAddressRange for every size")
    return fig


def check_killed_pending(ctx):
    d = Daemon(ctx.bin, ctx.work, "pending", "--pool-mib", 1024, "--chunk-mib", 32, "--keep-last", 1)
    fig = {}
    try:
        fig["daemon_gpu_mib_baseline"] = gpu_process_memory_mib(d.proc.pid)
        free_before = free_gpu_mib()
        fig["device_free_mib_before"] = round(free_before)
        w = worker(["pending", d.socket, "pending", 256])
        line = read_line(w, 60)
        if line != "snapshotted":
            w.kill()
            raise CheckFailed(f"the trainer did not snapshot: {line!r} {w.communicate()[1][-800:]}")
        fig["daemon_gpu_mib_with_trainer"] = gpu_process_memory_mib(d.proc.pid)
        w.kill()
        w.wait()
        t0 = time.perf_counter()
        state = None
        while time.perf_counter() - t0 < 60:
            shards = d.shards("pending")
            if shards and all(s.get("error") for s in shards):
                state = shards[0]["error"]
                break
            if not shards:
                state = "gone from status"
                break
            time.sleep(0.2)
        fig["abandoned_after_s"] = round(time.perf_counter() - t0, 2)
        fig["abandoned_as"] = state
        expect(state is not None, f"version 1 of the killed trainer neither failed nor left status in 60 s: "
                                  f"{d.shards('pending')}", fig)
        errors = d.status().get("errors", [])
        sticky = [e for e in errors if "illegal" in e.lower() or "sticky" in e.lower() or "context" in e.lower()]
        fig["daemon_errors"] = errors[-5:]
        expect(not sticky, f"a sticky CUDA error: {sticky}", fig)
        expect(d.proc.poll() is None, f"ckptd exited ({d.proc.returncode}): {d.tail()}", fig)
        r = subprocess.run(worker_cmd("roundtrip", d.socket, "pending-next", 64), capture_output=True, text=True,
                           timeout=120)
        expect(r.returncode == 0, f"a new trainer on that GPU failed: {r.stdout}{r.stderr[-800:]}", fig)
        fig["new_trainer"] = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        deadline = time.perf_counter() + 10
        free_after = free_gpu_mib()
        while free_after < free_before - 256 and time.perf_counter() < deadline:
            time.sleep(0.2)
            free_after = free_gpu_mib()
        fig["device_free_mib_after"] = round(free_after)
        fig["daemon_gpu_mib_after"] = gpu_process_memory_mib(d.proc.pid)
        expect(free_after >= free_before - 256,
               f"the device has {free_before - free_after:.0f} MiB less free memory than before the killed trainer "
               f"(the daemon still maps its memory?)", fig)
    finally:
        rc, secs = d.stop(timeout=30)
    fig["sigterm_exit"] = rc
    fig["sigterm_s"] = round(secs, 2)
    expect(rc == 0 and secs <= 10, f"SIGTERM of ckptd: exit {rc} after {secs:.1f} s (at most 10 s expected)", fig)
    return fig


def check_daemon_killed(ctx):
    d = Daemon(ctx.bin, ctx.work, "dkill", "--pool-mib", 1024, "--chunk-mib", 32, "--keep-last", 1)
    w = worker(["streamwait", d.socket, "dkill", 512], stdin=True)
    fig = {}
    try:
        line = read_line(w, 60)
        if line is None or not line.startswith("waiting"):
            w.kill()
            raise CheckFailed(f"the trainer did not reach the stream wait: {line!r} {w.communicate()[1][-800:]}")
        fig["trainer"] = line
        d.kill9()
        expect(w.poll() is None, f"the trainer exited {w.returncode} when the daemon was killed: "
                                 f"{w.communicate()[1][-800:]}", fig)
        w.stdin.write("go\n")
        w.stdin.flush()
        line = read_line(w, 90)
        fig["released"] = line
        if line is None or not line.startswith("released"):
            if w.poll() is None:
                w.kill()
            raise CheckFailed(f"the trainer's stream hangs after the daemon was killed: {line!r} "
                              f"{w.communicate()[1][-800:]}", fig)
    finally:
        if w.poll() is None:
            w.kill()
        w.wait()
        d.stop()
    return fig


def check_unregister_frees(ctx):
    import torch
    torch.zeros(1, device="cuda")
    d = Daemon(ctx.bin, ctx.work, "unreg", "--pool-mib", 1024, "--chunk-mib", 32, "--keep-last", 1)
    fig = {}
    try:
        free0, total = torch.cuda.mem_get_info()
        fig["free_GiB_before"] = round(free0 / GiB, 2)
        r = subprocess.run(worker_cmd("unregister", d.socket, "unreg", 4096), capture_output=True, text=True,
                           timeout=180)
        expect(r.returncode == 0, f"the trainer failed: {r.stdout}{r.stderr}")
        fig["trainer"] = r.stdout.strip().splitlines()[-1]
        deadline = time.perf_counter() + 10
        free1 = torch.cuda.mem_get_info()[0]
        while free1 < free0 - 512 * MiB and time.perf_counter() < deadline:
            time.sleep(0.2)
            free1 = torch.cuda.mem_get_info()[0]
        fig["free_GiB_after"] = round(free1 / GiB, 2)
        fig["daemon_gpu_mib_after"] = gpu_process_memory_mib(d.proc.pid)
        expect(free1 >= free0 - 512 * MiB, f"free GPU memory {free1 / GiB:.2f} GiB after the trainer unregistered and "
                                           f"exited, {free0 / GiB:.2f} GiB before (it held 4 GiB)", fig)
    finally:
        d.stop()
    return fig


TORCH_PRELUDE = r"""
import os, sys, json, time, torch, ckpt, ckpt.torch
sock, job = sys.argv[1], sys.argv[2]
"""


def check_torch(ctx):
    fig = {}
    d = Daemon(ctx.bin, ctx.work, "torch", "--pool-mib", 2048, "--chunk-mib", 32, "--memory-mib", 8192)
    failures = []
    try:
        # Hundreds of segments of the caching allocator: tensors of 3 to 25 MiB, each past
        # the large pool's 20 MiB segments or filling them, then a save and a bit-exact load.
        code = TORCH_PRELUDE + r"""
g = torch.Generator(device="cuda").manual_seed(7)
params = torch.nn.ParameterList()
for i in range(400):
    n = (3 + (i * 7919) % 23) << 18            # 3..25 MiB of float32
    params.append(torch.nn.Parameter(torch.rand(n, device="cuda", generator=g)))
segments = torch.cuda.memory_stats()["segment.all.current"]
model = torch.nn.Module(); model.p = params
ck = ckpt.torch.Checkpointer(sock, job, model=model, rng=False)
ck.save(1); ck.wait_durable(1)
want = [p.detach().clone() for p in params]
with torch.no_grad():
    for p in params: p.zero_()
ck.load(1)
ok = all(torch.equal(a, b) for a, b in zip(want, params))
ck.close()
print(json.dumps({"segments": segments, "tensors": len(params), "bytes": sum(p.numel() * 4 for p in params), "bit_exact": ok}))
"""
        out, err = run_json("segments", [sys.executable, "-c", code, d.socket, "segments"], 300)
        if err:
            failures.append(err)
        else:
            fig["segments"] = out
            if not fig["segments"]["bit_exact"]:
                failures.append("segments: the loaded tensors differ")
            if fig["segments"]["segments"] < 100:
                fig["segments"]["note"] = "fewer than 100 segments: the allocator merged more than expected"

        # Allocators whose memory legacy CUDA IPC cannot export: refused, with their name.
        refuse = TORCH_PRELUDE + r"""
model = torch.nn.Linear(1024, 1024).cuda()
try:
    ckpt.torch.Checkpointer(sock, job, model=model, rng=False)
    print("ACCEPTED")
except Exception as e:
    print("REFUSED " + type(e).__name__ + ": " + str(e))
"""
        fig["refusals"] = {}
        for key, conf, word in (("expandable_segments", "expandable_segments:True", "expandable"),
                                ("cudaMallocAsync", "backend:cudaMallocAsync", "pool")):
            r = subprocess.run([sys.executable, "-c", refuse, d.socket, f"refuse-{key}"], capture_output=True,
                               text=True, timeout=120,
                               env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTORCH_ALLOC_CONF": conf})
            out = (r.stdout.strip().splitlines() or [""])[-1]
            fig["refusals"][key] = out or r.stderr.strip()[-400:]
            if not out.startswith("REFUSED") or word not in out.lower():
                failures.append(f"{key}: expected a refusal naming it, got {fig['refusals'][key]!r}")

        # A tensor freed and reallocated after registration: the next snapshot says so.
        realloc = TORCH_PRELUDE + r"""
c = ckpt.Client.connect(sock, reconnect_budget=0)
t = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
c.register_items(job, 0, 1, [("t", "U8", [t.numel()], t.data_ptr())])
c.snapshot(1); c.wait_snapshot(1)
del t; torch.cuda.synchronize(); torch.cuda.empty_cache()
u = torch.zeros(96 << 20, dtype=torch.uint8, device="cuda")
try:
    c.snapshot(2); c.wait_snapshot(2)
    print("NOT CAUGHT")
except ckpt.Error as e:
    print("CAUGHT " + str(e))
"""
        r = subprocess.run([sys.executable, "-c", realloc, d.socket, "realloc"], capture_output=True, text=True,
                           timeout=120)
        out = (r.stdout.strip().splitlines() or [""])[-1]
        fig["reallocation"] = out or r.stderr.strip()[-400:]
        if not out.startswith("CAUGHT"):
            failures.append(f"reallocation: {fig['reallocation']!r}")

        # BatchNorm: running statistics change in forward, so the Checkpointer waits before
        # each forward; every version holds exactly the state of its own step.
        bn = TORCH_PRELUDE + r"""
torch.manual_seed(3)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                            torch.nn.Flatten(), torch.nn.LazyLinear(10)).cuda()
model(torch.randn(2, 3, 16, 16, device="cuda"))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ck = ckpt.torch.Checkpointer(sock, job, model=model, optimizer=opt)
saved = {}
for step in range(1, 11):
    x = torch.randn(8, 3, 16, 16, device="cuda")
    loss = model(x).square().mean(); opt.zero_grad(); loss.backward(); opt.step()
    ck.save(step)
    saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
ck.wait_durable(10)
ck.close()
differ = []
for step in saved:
    loaded = ckpt.torch.load_checkpoint(sys.argv[3], job, step)["model"]
    if not all(torch.equal(saved[step][k].cpu(), loaded[k].cpu()) for k in saved[step]):
        differ.append(step)
print(json.dumps({"bit_exact": not differ, "versions_differing": differ, "versions": len(saved)}))
"""
        out, err = run_json("batchnorm", [sys.executable, "-c", bn, d.socket, "bn", d.root], 180)
        if err:
            failures.append(err)
        else:
            fig["batchnorm"] = out
            if not fig["batchnorm"]["bit_exact"]:
                failures.append(f"batchnorm: versions {fig['batchnorm']['versions_differing']} differ from the "
                                "model's state at their step")
    finally:
        d.stop()

    # A small GPT on the GPU: killed at step 12 and resumed; the losses match an
    # uninterrupted run bit for bit.
    d = Daemon(ctx.bin, ctx.work, "gpt", "--pool-mib", 1024, "--chunk-mib", 16, "--keep-last", 1)
    try:
        gpt = [sys.executable, str(REPO / "examples" / "train_gpt.py"), "--socket", d.socket, "--device", "cuda",
               "--steps", "24", "--quiet", "--d-model", "128", "--layers", "2", "--seq", "64", "--batch", "16"]
        logs = Path(d.dir)
        r1 = subprocess.run(gpt + ["--job", "gpt-a", "--log", str(logs / "a.log")], capture_output=True, text=True,
                            timeout=300)
        r2 = subprocess.run(gpt + ["--job", "gpt-b", "--log", str(logs / "b.log"), "--crash-at", "12"],
                            capture_output=True, text=True, timeout=300)
        r3 = subprocess.run(gpt + ["--job", "gpt-b", "--log", str(logs / "b.log"), "--resume"], capture_output=True,
                            text=True, timeout=300)
        if r1.returncode != 0 or r3.returncode != 0 or r2.returncode != -signal.SIGKILL:
            failures.append(f"gpt: runs exited {r1.returncode}, {r2.returncode}, {r3.returncode}: "
                            f"{(r1.stderr + r2.stderr + r3.stderr).strip()[-800:]}")
        else:
            def losses(p):
                out = {}
                for line in Path(p).read_text().splitlines():
                    if line and not line.startswith("#"):
                        s, h, _ = line.split(" ", 2)
                        out[int(s)] = h
                return out
            a, b = losses(logs / "a.log"), losses(logs / "b.log")
            resumed = [line for line in r3.stdout.splitlines() if "resumed at step" in line]
            fig["gpt"] = {"steps": len(a), "resumed": resumed[-1] if resumed else "(not said)", "bit_exact": a == b,
                          "first_difference": next((s for s in sorted(a) if a.get(s) != b.get(s)), None)}
            if a != b:
                failures.append(f"gpt: the resumed run's losses differ from step {fig['gpt']['first_difference']}")
    finally:
        d.stop()

    # Next to DCP async_save, on the same model and schedule.
    d = Daemon(ctx.bin, ctx.work, "dcp", "--pool-mib", 4096, "--chunk-mib", 32, "--keep-last", 1)
    try:
        out, err = run_json("dcp comparison", worker_cmd("dcp", d.socket, "dcp", Path(d.dir) / "dcp"), 400)
        if err:
            failures.append(err)
        else:
            fig["vs_dcp"] = out
    finally:
        d.stop()
    expect(not failures, "; ".join(failures), fig)
    return fig


def check_two_trainers(ctx):
    d = Daemon(ctx.bin, ctx.work, "two", "--pool-mib", 4096, "--chunk-mib", 32, "--copiers", 2, "--keep-last", 1)
    try:
        procs = []
        try:
            for i in (1, 2):
                cmd = [str(Path(ctx.bin) / "ckpt-gpu-trainer"), "--socket", d.socket, "--job", f"two-{i}",
                       "--state-gib", "1", "--tensors", "8", "--iters", "4", "--compute-ms", "500", "--mode", "host",
                       "--seed", str(i), "--summary", str(Path(d.dir) / f"t{i}.json"), "--quiet"]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        expect(all(p.returncode == 0 for p in procs), f"trainers exited {[p.returncode for p in procs]}: {outs}")
        fig = {}
        per = []
        for i in (1, 2):
            rates = capture_rates(shards_ok(d, f"two-{i}", fig))
            expect(rates, f"trainer {i}: no captured shard has a capture time", fig)
            per.append(median(rates))
            fig[f"trainer{i}_d2h_GBps_p50"] = per[-1]
        fig["total_d2h_GBps"] = sum(per)
        fig["note"] = "1 GiB each, both checkpoint every 500 ms iteration at once; total = sum of the medians"
        return fig
    finally:
        d.stop()


def check_under_load(ctx):
    d = Daemon(ctx.bin, ctx.work, "load", "--pool-mib", 4096, "--chunk-mib", 32, "--keep-last", 1)
    try:
        fig, err = run_json("the trainer", worker_cmd("underload", d.socket, "load"), 300)
        expect(not err, err)
        rates = capture_rates(shards_ok(d, "load", fig))
        expect(rates, "no captured shard has a capture time", fig)
        fig["daemon_d2h_GBps_p50"] = median(rates)
        return fig
    finally:
        d.stop()


def check_restore_rates(ctx):
    d = Daemon(ctx.bin, ctx.work, "rates", "--pool-mib", 4096, "--chunk-mib", 32, "--memory-mib", 8192, "--keep-last", 1)
    fig = {}
    try:
        _, err = run_json("the saving trainer", worker_cmd("restore", d.socket, "rates", "save", 4096), 300)
        expect(not err, err)
        fig["from_memory"], err = run_json("the restore from memory",
                                           worker_cmd("restore", d.socket, "rates", "load", 4096), 300)
        expect(not err, err, fig)
    finally:
        d.stop()
    d = Daemon(ctx.bin, ctx.work, "rates", "--pool-mib", 4096, "--chunk-mib", 32, "--memory-mib", 0, "--keep-last", 1)
    try:
        fig["from_disk"], err = run_json("the restore from disk",
                                         worker_cmd("restore", d.socket, "rates", "load", 4096), 300)
        expect(not err, err, fig)
        fig["note"] = "from disk after a daemon restart; the page cache may hold the file (not dropped)"
    finally:
        d.stop()
    expect(fig["from_memory"]["tier"] == "memory", f"the first restore came from {fig['from_memory']['tier']}")
    expect(fig["from_disk"]["tier"] != "memory", "the restore after a restart came from memory")
    return fig


def check_matrix(ctx):
    import torch
    import xxhash
    fig = {"capture_GBps": {}}
    # Copy streams at 32 MiB chunks, and chunk sizes at 2 streams (the default).
    for streams, chunk in ((1, 32), (2, 32), (4, 32), (2, 16), (2, 64)):
        d = Daemon(ctx.bin, ctx.work, f"m{streams}-{chunk}", "--pool-mib", 2048, "--chunk-mib", chunk,
                   "--copy-streams", streams, "--memory-mib", 0, "--keep-last", 1)
        try:
            _, err = run_json(f"streams {streams} chunk {chunk}", worker_cmd("capture", d.socket, "m", 1024, 2), 300)
            expect(not err, err, fig)
            shards = shards_ok(d, "m", fig)
            entry = {"GBps_p50": median(capture_rates(shards))}
            dma = [s.get("dma_ms") for s in shards if s.get("dma_ms")]
            if dma:
                entry["dma_only_GBps_p50"] = median([int(s["total_bytes"]) / 1e9 / (s["dma_ms"] / 1e3)
                                                     for s in shards if s.get("dma_ms")])
            fig["capture_GBps"][f"streams{streams}_chunk{chunk}"] = entry
        finally:
            d.stop()
        shutil.rmtree(Path(ctx.work) / f"m{streams}-{chunk}", ignore_errors=True)
    if not any("dma_only_GBps_p50" in e for e in fig["capture_GBps"].values()):
        fig["dma_only"] = "the daemon's status gives no dma_ms: DMA-only time not measured"
    buf = torch.randint(0, 256, (GiB,), dtype=torch.uint8).pin_memory()
    mv = memoryview(buf.numpy())
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(mv)
        times.append(time.perf_counter() - t0)
    fig["xxh3_single_thread_GBps"] = round(GiB / 1e9 / median(times), 2)
    src = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    d2h, h2d = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        buf.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        src.copy_(buf, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - t0)
    fig["plain_pinned_d2h_GBps"] = round(GiB / 1e9 / median(d2h), 2)
    fig["plain_pinned_h2d_GBps"] = round(GiB / 1e9 / median(h2d), 2)
    return fig


def check_no_context(ctx):
    import ckpt
    import torch
    t = torch.arange(32 << 20, dtype=torch.int32, device="cuda") * 3
    want = t.clone()
    torch.cuda.synchronize()
    drv = Driver()
    d = Daemon(ctx.bin, ctx.work, "noctx", "--pool-mib", 512, "--chunk-mib", 16)
    result = {}

    def body():
        try:
            result["context_before"] = drv.current_context()
            c = ckpt.Client.connect(d.socket, reconnect_budget=0)
            c.register_items("noctx", 0, 1, [("t", "I32", [t.numel()], t.data_ptr())])
            c.snapshot(1)
            c.wait_snapshot(1, timeout=60)
            c.wait_durable(1, timeout=120)
            result["context_after"] = drv.current_context()
            c.unregister()
            result["ok"] = True
        except Exception as e:  # noqa: BLE001 -- reported as the check's failure
            result["error"] = f"{type(e).__name__}: {e}"

    try:
        th = threading.Thread(target=body, daemon=True)
        th.start()
        th.join(180)
        expect(not th.is_alive(), "registration or snapshot from a fresh thread hangs")
        expect(result.get("ok"), result.get("error", "failed"))
        import ckpt as _c
        shard = _c.load_file(f"{d.root}/noctx/v0000000001/rank-00000.safetensors")
        expect(torch.equal(shard.tensors["t"], want.cpu()), "the shard differs from the tensor")
    finally:
        d.stop()
    return {"context_before": hex(result.get("context_before") or 0), "context_after":
            hex(result.get("context_after") or 0), "byte_exact": True}


def check_pin_time(ctx):
    fig = {}
    big = 8192 if ctx.gpu else 1024  # without a GPU: the harness only, and nothing is pinned
    for mib in (64, big):
        d = Daemon(ctx.bin, ctx.work, f"pin{mib}", "--pool-mib", mib, "--chunk-mib", 16)
        fig[f"ready_s_pool_{mib}_mib"] = round(d.ready_s, 3)
        lines = [line for line in d.log.read_text(errors="replace").splitlines()
                 if ("pool" in line or "pinned" in line or "NUMA" in line) and "serving on" not in line]
        if lines:
            fig[f"log_pool_{mib}_mib"] = [line[line.find("] ") + 2:][:200] for line in lines]
        rc, _ = d.stop()
        expect(rc == 0, f"ckptd --pool-mib {mib} exited {rc}: {d.tail()}")
    fig[f"pool_{big}_mib_start_s_beyond_64_mib"] = round(fig[f"ready_s_pool_{big}_mib"] - fig["ready_s_pool_64_mib"], 3)
    return fig


TORN_GPU_CASES = ("batchnorm", "buffers", "ema_module_before", "ema_buffers_after", "clip_before", "accumulate",
                  "large_buffer", "large_ema_before")


def check_torn(ctx):
    """The torn-snapshot matrix (python/tests/test_torn_snapshots.py) with the model on the GPU:
    staging into GPU memory (a device-side copy ordered before the snapshot's event), the
    counters compared before wait_snapshot_on_stream, aborts; each case killed with SIGKILL
    right after the saves of two random steps (seed $CKPT_TORN_SEED, in the figures), resumed,
    every committed version compared value by value with a reference run, and the resumed
    losses and final state bit for bit."""
    import random

    import ckpt
    import ckpt.torch
    sys.path.insert(0, str(REPO / "python" / "tests"))
    import torn_trainer

    steps = 8
    seed = int(os.environ.get("CKPT_TORN_SEED") or random.SystemRandom().randrange(1 << 31))
    fig = {"seed": seed, "cases": {}}
    failures = []
    d = Daemon(ctx.bin, ctx.work, "torn", "--pool-mib", 256, "--chunk-mib", 16)
    env = {**os.environ, "CKPTD_SOCKET": d.socket,
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        for case in TORN_GPU_CASES:
            kills = sorted(random.Random(f"{seed}:{case}").sample(range(1, steps), 2))
            ref_losses, ref = torn_trainer.reference(case, steps, "cuda")
            job = f"torn-gpu-{case.replace('_', '-')}"
            try:
                starts, losses, aborted, final = torn_trainer.run_with_kills(
                    d.socket, env, case, job, steps, Path(d.dir) / f"{job}.pt", kills, device="cuda")
            except AssertionError as e:
                failures.append(f"{case}: {e}")
                continue
            committed = ckpt.list_versions(d.root, job)
            torn = {}
            for v in committed:
                diff = torn_trainer.differing(ckpt.torch.load_checkpoint(d.root, job, v)["tensors"], ref[v])
                if diff:
                    torn[v] = diff
            bad_losses = sorted(k for k, seen in losses.items() if any(x != ref_losses[k].hex() for x in seen))
            final_diff = torn_trainer.differing(final, ref[steps])
            fig["cases"][case] = {"kills": kills, "resumed_from": starts, "committed": committed,
                                  "aborted": aborted}
            if torn:
                failures.append(f"{case}: committed versions differ from their step: {json.dumps(torn)[:300]}")
            if bad_losses or final_diff:
                failures.append(f"{case}: the resumed run differs (losses of steps {bad_losses}, "
                                f"final state {json.dumps(final_diff)[:200]})")
            if case not in torn_trainer.DETECTED and aborted:
                failures.append(f"{case}: protected from the first step, yet versions {aborted} were aborted")
            if any(v in committed for v in aborted):
                failures.append(f"{case}: aborted versions were committed: {aborted} / {committed}")
    finally:
        d.stop()
    expect(not failures, "; ".join(failures), fig)
    return fig


CHECKS = [
    ("small_allocs", check_small_allocs),
    ("killed_pending", check_killed_pending),
    ("daemon_killed", check_daemon_killed),
    ("unregister_frees", check_unregister_frees),
    ("no_context", check_no_context),
    ("pin_time", check_pin_time),
    ("two_trainers", check_two_trainers),
    ("under_load", check_under_load),
    ("restore_rates", check_restore_rates),
    ("matrix", check_matrix),
    ("torch", check_torch),
    ("torn", check_torn),
]
CPU_CHECKS = {"pin_time"}  # the checks that need no GPU


# ------------------------------------------------------------------------------ workers
# Trainer processes the checks start (and kill): `checks.py --worker NAME ARGS...`.

def _gate(stream):
    """Queues on `stream` a host function that blocks until the returned Event is set."""
    gate = threading.Event()
    cb_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    cb = cb_type(lambda _: gate.wait())
    # The driver's call (CUstream is cudaStream_t): always loadable, whatever runtime torch has.
    rc = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), cb, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc: CUDA error {rc}")
    return gate, cb  # the caller keeps cb alive


def _connect(sock, job, tensors):
    """A client of the daemon at `sock` with `tensors` (name -> CUDA tensor) registered."""
    import ckpt
    c = ckpt.Client.connect(sock, reconnect_budget=0)
    c.register_items(job, 0, 1, [(n, "U8", [t.numel()], t.data_ptr()) for n, t in tensors.items()])
    return c


def _save(c, v):
    """Snapshot `v` of what is registered, waited for until committed."""
    c.snapshot(v)
    c.wait_snapshot(v, timeout=120)
    c.wait_durable(v, timeout=300)


def worker_main(argv):
    import torch
    name, sock, job = argv[0], argv[1], argv[2]
    rest = argv[3:]
    if name == "pending":  # snapshot behind a host function that never returns, then wait to be killed
        c = _connect(sock, job, {"t": torch.ones(int(rest[0]) << 20, dtype=torch.uint8, device="cuda")})
        s = torch.cuda.Stream()
        gate, cb = _gate(s)
        c.snapshot(1, stream=s)
        print("snapshotted", flush=True)
        time.sleep(3600)
    elif name == "roundtrip":
        t = torch.randint(0, 256, (int(rest[0]) << 20,), dtype=torch.uint8, device="cuda")
        want = t.clone()
        c = _connect(sock, job, {"t": t})
        torch.cuda.synchronize()
        _save(c, 1)
        t.zero_()
        torch.cuda.synchronize()
        c.restore(1)
        assert torch.equal(t, want), "restored bytes differ"
        c.unregister()
        print(f"registered, snapshotted and restored {t.numel() >> 20} MiB byte-exact", flush=True)
    elif name == "streamwait":  # the stream waits for a version whose copies the daemon never runs
        c = _connect(sock, job, {"t": torch.ones(int(rest[0]) << 20, dtype=torch.uint8, device="cuda")})
        s = torch.cuda.Stream()
        gate, cb = _gate(s)
        c.snapshot(1, stream=s)
        host_s = c.wait_snapshot_on_stream(1, s)
        done = torch.cuda.Event()
        done.record(s)
        print(f"waiting (host blocked {host_s * 1e3:.1f} ms)", flush=True)
        sys.stdin.readline()  # the daemon is dead now
        gate.set()
        t0 = time.perf_counter()
        while not done.query() and time.perf_counter() - t0 < 20:
            time.sleep(0.01)
        if done.query():
            print(f"released without a call after {time.perf_counter() - t0:.2f} s", flush=True)
            return 0
        err = ""
        try:
            c.snapshot(2, stream=s)
        except Exception as e:  # noqa: BLE001 -- the daemon is gone: expected
            err = f"{type(e).__name__}: {str(e)[:200]}"
        t1 = time.perf_counter()
        while not done.query() and time.perf_counter() - t1 < 40:
            time.sleep(0.01)
        if done.query():
            print(f"released after the next call ({err}) after {time.perf_counter() - t1:.2f} s", flush=True)
        else:
            print(f"hung: the stream is still waiting 60 s after the daemon died ({err})", flush=True)
    elif name == "unregister":
        t = torch.ones(int(rest[0]) << 20, dtype=torch.uint8, device="cuda")
        c = _connect(sock, job, {"t": t})
        torch.cuda.synchronize()
        _save(c, 1)
        c.unregister()
        print(f"held {t.numel() >> 20} MiB, unregistered, exiting", flush=True)
    elif name == "capture":  # N snapshots of S MiB in 8 tensors, each waited for
        mib, n = int(rest[0]), int(rest[1])
        c = _connect(sock, job, {f"t{i}": torch.ones(mib << 17, dtype=torch.uint8, device="cuda") for i in range(8)})
        torch.cuda.synchronize()
        for v in range(1, n + 1):
            c.snapshot(v)
            c.wait_snapshot(v, timeout=120)
        c.wait_durable(n, timeout=300)
        c.unregister()
    elif name == "underload":  # matrix products with and without a snapshot in flight
        state = [torch.ones(512 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]  # 2 GiB
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        c = _connect(sock, job, {f"s{i}": x for i, x in enumerate(state)})

        def step():
            t0 = time.perf_counter()
            for _ in range(40):
                a @ a
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        for _ in range(3):
            step()
        quiet = [step() for _ in range(5)]
        busy = []
        for v in range(1, 4):
            c.snapshot(v)
            busy.append(step())
            c.wait_snapshot(v, timeout=120)
        c.wait_durable(3, timeout=300)
        c.unregister()
        print(json.dumps({"step_s_quiet_p50": median(quiet), "step_s_capturing_p50": median(busy),
                          "slowdown": median(busy) / median(quiet),
                          "note": "40 bf16 8192^3 products per step; 2 GiB captured during each busy step"}))
    elif name == "restore":  # save: S MiB committed; load: fresh buffers restored and verified
        mode, mib = rest[0], int(rest[1])
        ts = [torch.empty(mib << 17, dtype=torch.uint8, device="cuda") for _ in range(8)]
        g = torch.Generator(device="cuda").manual_seed(11)
        if mode == "save":
            for x in ts:
                x.random_(0, 256, generator=g)
        c = _connect(sock, job, {f"t{i}": x for i, x in enumerate(ts)})
        torch.cuda.synchronize()
        if mode == "save":
            _save(c, 1)
            c.unregister()
            return 0
        for x in ts:
            x.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        v, _, tier = c.restore(1, with_tier=True)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        for x in ts:
            x2 = torch.empty_like(x)
            x2.random_(0, 256, generator=g)
            assert torch.equal(x, x2), "restored bytes differ"
        c.unregister()
        print(json.dumps({"tier": tier, "bytes": mib * MiB, "restore_s": secs, "GBps": mib * MiB / 1e9 / secs}))
    elif name == "dcp":
        return worker_dcp(sock, job, rest[0])
    else:
        raise SystemExit(f"unknown worker {name}")
    return 0


def worker_dcp(sock, job, dcp_dir):
    """The same model and schedule three ways: no checkpoint, ckpt.torch every step, DCP
    async_save every step (waiting for the previous save before the next, as its docs do)."""
    import ckpt.torch
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4096, 4096) for _ in range(8)]  # 0.5 GiB of parameters, 1.5 GiB with Adam
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, 4096, device="cuda")

    def one_step():
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        one_step()  # Adam's state exists from here on
    torch.cuda.synchronize()
    steps = 6
    out = {"state_GiB": round((sum(p.numel() for p in model.parameters()) * 4 * 3) / GiB, 2), "steps": steps}

    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    torch.cuda.synchronize()
    base = (time.perf_counter() - t0) / steps
    out["step_s_none"] = base

    ck = ckpt.torch.Checkpointer(sock, job, model=model, optimizer=opt, rng=False)
    t0 = time.perf_counter()
    stalls = []
    for s in range(1, steps + 1):
        one_step()
        t1 = time.perf_counter()
        ck.save(s)
        stalls.append(time.perf_counter() - t1 + ck.last_stall_s)
    torch.cuda.synchronize()
    out["step_s_ckptd"] = (time.perf_counter() - t0) / steps
    ck.wait_durable(steps)
    out["stall_s_ckptd_p50"] = median(stalls)
    ck.close()

    try:  # the state dict DCP expects of an optimizer (parameter names, not indices)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        def dcp_state():
            msd, osd = get_state_dict(model, opt)
            return {"model": msd, "optim": osd}
    except ImportError:  # torch < 2.2
        def dcp_state():
            return {"model": model.state_dict()}
        out["dcp_note"] = "torch has no get_state_dict: DCP saves the model only"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{dcp_dir}.pg", rank=0, world_size=1)
    fut = None
    stalls = []
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        one_step()
        t1 = time.perf_counter()
        if fut is not None:
            fut.result()
            shutil.rmtree(f"{dcp_dir}/step{s - 2}", ignore_errors=True)  # keep the last one, as ckptd does
        r = dcp.async_save(dcp_state(), checkpoint_id=f"{dcp_dir}/step{s}")
        fut = getattr(r, "upload_completion", r)  # newer torch may return a response object
        stalls.append(time.perf_counter() - t1)
    fut.result()
    torch.cuda.synchronize()
    out["step_s_dcp_async"] = (time.perf_counter() - t0) / steps
    out["stall_s_dcp_async_p50"] = median(stalls)
    out["overhead_ckptd"] = out["step_s_ckptd"] / base - 1
    out["overhead_dcp_async"] = out["step_s_dcp_async"] / base - 1
    print(json.dumps(out))
    return 0


# ------------------------------------------------------------------------------ main

def main():
    # An image's allocator settings (expandable_segments:True is common) would make every
    # GPU registration fail; the refusal checks set their own. Before torch is imported.
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if len(sys.argv) < 2 or sys.argv[1] != "--worker":
            os.environ.pop(var, None)
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", help="directory of ckptd, ckptctl and ckpt-gpu-trainer (required)")
    ap.add_argument("--out", help="JSON file to write (required)")
    ap.add_argument("--work", help="scratch directory (default: a new one under /tmp)")
    ap.add_argument("--only", help="comma-separated check names")
    ap.add_argument("--list", action="store_true", help="print the check names and exit")
    args = ap.parse_args()
    if args.list:
        print("\n".join(n for n, _ in CHECKS))
        return 0
    if not args.bin or not args.out:
        ap.error("--bin and --out are required")
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {n for n, _ in CHECKS}
    if unknown:
        ap.error(f"unknown checks: {', '.join(sorted(unknown))}")
    for b in ("ckptd", "ckptctl", "ckpt-gpu-trainer"):
        if not os.access(Path(args.bin) / b, os.X_OK):
            ap.error(f"{args.bin}/{b} is not an executable")
    try:
        import torch
        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    results = {}
    if not gpu:
        # The checks that need no GPU still run (they prove the harness: daemons started,
        # stopped and read); the others are skipped.
        print("checks.py: torch sees no GPU: only the checks that need none run")
        for n, _ in CHECKS:
            if n not in CPU_CHECKS:
                results[n] = {"result": "SKIP", "why": "no GPU visible to torch"}
        only = (only or {n for n, _ in CHECKS}) & CPU_CHECKS
    else:
        importlib.import_module("ckpt")  # fail early if the module is not on the path
    work = args.work or tempfile.mkdtemp(prefix="ckpt-gpu-checks-")
    ctx = argparse.Namespace(bin=str(Path(args.bin).resolve()), work=work, gpu=gpu)
    t_all = time.perf_counter()
    for name, fn in CHECKS:
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            fig = fn(ctx)
            results[name] = {"result": "PASS", **(fig or {})}
        except Skip as e:
            results[name] = {"result": "SKIP", "why": str(e)}
        except CheckFailed as e:
            results[name] = {"result": "FAIL", "why": str(e), **e.figures}
        except Exception as e:  # noqa: BLE001 -- a broken check is a failed one, with its trace
            results[name] = {"result": "FAIL", "why": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc()[-2000:]}
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        for p in Path(work).iterdir():  # each check's daemons and files, before the next
            shutil.rmtree(p, ignore_errors=True)
        r = results[name]
        figures = {k: v for k, v in r.items() if k not in ("result", "why", "trace", "seconds")}
        print(f"{r['result']}: {name} ({r['seconds']} s){' - ' + r['why'] if 'why' in r else ''}", flush=True)
        for k, v in figures.items():
            print(f"     {k}: {json.dumps(v)[:400]}", flush=True)
        Path(args.out).write_text(json.dumps({"checks": results, "elapsed_s": round(time.perf_counter() - t_all, 1)},
                                             indent=2))
    subprocess.run(["rm", "-rf", work])
    failed = [n for n, r in results.items() if r["result"] == "FAIL"]
    counts = {k: sum(1 for r in results.values() if r["result"] == k) for k in ("PASS", "FAIL", "SKIP")}
    print(f"checks.py: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
          f"{' (' + ', '.join(failed) + ')' if failed else ''}; written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
