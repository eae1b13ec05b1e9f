#!/usr/bin/env python3
"""Trains a small byte-level GPT (on CPU, or a GPU with --device cuda) and checkpoints every iteration through ckptd.

The text is the licence collection every Debian machine has (/usr/share/common-licenses).
The whole run is deterministic (seeds, one thread, deterministic algorithms, a data order
that is a function of the seed and the epoch), and everything it depends on is in the
checkpoint: parameters and AdamW state (tensor items in shared memory, copied by the daemon
while the next iteration computes), param groups, LR schedule, RNG states (dropout) and the
data position (pickled per save). So a run killed at any step and resumed with --resume
continues with the losses an uninterrupted run has, bit for bit.

  PYTHONPATH=build/python python3 examples/train_gpt.py --socket S --job J --steps 40 \\
      [--resume] [--log FILE] [--seed N] [--crash-at K] [--device cuda]
  examples/train_gpt.py --bench [torch_compare options]     # runs bench/torch_compare.py

--log FILE appends one line per step: "STEP LOSS_HEX LOSS_REPR" (the float's exact value),
and "# resumed at step K" when it resumes. --crash-at K kills the process with SIGKILL right
after the save of step K (a crash, no cleanup). Without --socket: $CKPTD_SOCKET or the
client's default socket. --no-checkpoint trains without a daemon.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, dropout on both outputs."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def attention(self, q, k, v):
        # On a GPU the fused kernels' backward passes are not all deterministic; the plain
        # one is, and the run must repeat bit for bit.
        if hasattr(F, "scaled_dot_product_attention") and not q.is_cuda:  # torch >= 2.0
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        return att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = self.attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """Byte-level GPT: 256-symbol vocabulary, learned positions, pre-norm blocks."""

    def __init__(self, d: int, layers: int, heads: int, seq: int, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def load_text() -> torch.Tensor:
    """The licence texts every Debian machine has, concatenated, as bytes (int64 tensor)."""
    seen, chunks = set(), []
    for p in sorted(Path("/usr/share/common-licenses").iterdir()):
        real = p.resolve()
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        chunks.append(real.read_bytes())
    data = b"\n".join(chunks)
    if len(data) < 10_000:
        sys.exit("train_gpt: too little text under /usr/share/common-licenses")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Batches:
    """Non-overlapping windows of the text in an order drawn per epoch from (seed, epoch). The
    position lives in `state` ({"epoch", "position"}), which the checkpoint carries."""

    def __init__(self, data: torch.Tensor, seq: int, batch: int, seed: int, state: dict):
        self.data, self.seq, self.batch, self.seed, self.state = data, seq, batch, seed, state
        self.windows = (len(data) - 1) // seq
        state.setdefault("epoch", 0)
        state.setdefault("position", 0)
        self._order_epoch, self._order = None, None

    def order(self) -> torch.Tensor:
        if self._order_epoch != self.state["epoch"]:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.state["epoch"])
            self._order, self._order_epoch = torch.randperm(self.windows, generator=g), self.state["epoch"]
        return self._order

    def next(self):
        if self.state["position"] + self.batch > self.windows:
            self.state["epoch"] += 1
            self.state["position"] = 0
        starts = self.order()[self.state["position"]:self.state["position"] + self.batch] * self.seq
        self.state["position"] += self.batch
        x = torch.stack([self.data[s:s + self.seq] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1:s + self.seq + 1] for s in starts.tolist()])
        return x, y


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (two parameter groups)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def warmup_cosine(total: int, warmup: int):
    """LR multiplier: linear warm-up, then cosine decay to 10%."""
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def deterministic(seed: int, device: str = "cpu") -> None:
    if device.startswith("cuda"):
        # cuBLAS is deterministic only with a fixed workspace, set before CUDA starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    random.seed(seed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=os.environ.get("CKPTD_SOCKET", ""), help="ckptd socket")
    ap.add_argument("--job", default="train-gpt", help="checkpoint job id (default train-gpt)")
    ap.add_argument("--steps", type=int, default=40, help="train until this step (default 40)")
    ap.add_argument("--resume", action="store_true", help="continue from the job's latest checkpoint")
    ap.add_argument("--log", help="append per-step losses to this file")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--crash-at", type=int, metavar="K", help="SIGKILL this process right after step K")
    ap.add_argument("--no-checkpoint", action="store_true", help="train without checkpointing")
    ap.add_argument("--bench", action="store_true",
                    help="run the checkpointing benchmark (bench/torch_compare.py) with the other arguments")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--quiet", action="store_true", help="no per-step output")
    ap.add_argument("--device", default="cpu",
                    help="where the model trains: cpu (default) or cuda[:N] (state stays in GPU memory; "
                         "the daemon copies it through CUDA IPC)")
    argv = sys.argv[1:] if argv is None else argv
    if "--bench" in argv:
        bench = REPO / "bench" / "torch_compare.py"
        rest = [a for a in argv if a != "--bench"]
        os.execv(sys.executable, [sys.executable, str(bench), *rest])
    args = ap.parse_args(argv)

    deterministic(args.seed, args.device)
    data = load_text()
    model = GPT(args.d_model, args.layers, args.heads, args.seq, args.dropout).to(args.device)
    opt = make_optimizer(model, args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps, max(1, args.steps // 10)))
    position: dict = {}
    batches = Batches(data, args.seq, args.batch, args.seed, position)

    ck = None
    step = 0
    log = open(args.log, "a") if args.log else None
    if not args.no_checkpoint:
        import ckpt.torch

        ck = ckpt.torch.Checkpointer(args.socket or None, args.job, model=model, optimizer=opt,
                                     scheduler=sched, extra_state=position)
        if args.resume:
            try:
                step = ck.load("latest")
            except ckpt.torch.VersionNotFoundError as e:
                print(f"train_gpt: nothing to resume ({e}); starting at step 0", flush=True)
            else:
                print(f"train_gpt: resumed at step {step}", flush=True)
                if log:
                    log.write(f"# resumed at step {step}\n")
                    log.flush()
    nparams = sum(p.numel() for p in model.parameters())
    if not args.quiet:
        print(f"train_gpt: {nparams / 1e6:.2f} M parameters, torch {torch.__version__}, "
              f"{len(data)} bytes of text, steps {step + 1}..{args.steps}", flush=True)

    t0 = time.perf_counter()
    first = step
    loss_value = float("nan")
    while step < args.steps:
        x, y = batches.next()
        x, y = x.to(args.device), y.to(args.device)
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # with a Checkpointer: waits first until the previous save is captured
        sched.step()
        step += 1
        loss_value = loss.item()
        if log:
            log.write(f"{step} {loss_value.hex()} {loss_value!r}\n")
            log.flush()
        if ck is not None:
            ck.save(step)
        if not args.quiet:
            print(f"step {step:5d}  loss {loss_value:.4f}  lr {sched.get_last_lr()[0]:.2e}", flush=True)
        if args.crash_at is not None and step == args.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
    elapsed = time.perf_counter() - t0
    if ck is not None:
        if step > first:
            ck.wait_durable()
        stall = ck.total_stall_s
        ck.close()
        print(f"train_gpt: steps {first + 1}..{step} in {elapsed:.2f} s, final loss {loss_value:.4f}, "
              f"checkpoint stall {stall * 1e3:.1f} ms in all", flush=True)
    else:
        print(f"train_gpt: steps {first + 1}..{step} in {elapsed:.2f} s, final loss {loss_value:.4f}", flush=True)
    if log:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
