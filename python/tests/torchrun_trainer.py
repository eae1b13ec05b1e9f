"""A tensor-parallel trainer run by torchrun in test_torchrun_elastic.py (not a test itself).

Every rank holds a slice of a two-layer MLP, Megatron style: rows [a, b) of W1 and b1, columns
[a, b) of W2 (the hidden units a..b), and the whole of b2 (replicated). Each layout is declared
to the Checkpointer, so a restore at another world size reshards W1 along dimension 0 and W2
along dimension 1. Adam's state follows the parameters' layouts. Dropout on the hidden units
draws from each rank's own torch RNG (seeded per rank), so a resume is bit-identical only if
each rank's RNG stream is restored. The data position is global: every step's batch is drawn
from a generator seeded by the global sample count kept in extra_state.

    torchrun --nproc_per_node W torchrun_trainer.py --job J --steps N --out DIR
             [--ranks-per-node K] [--kill-rank R --kill-step S] [--expect FILE]

$CKPT_TEST_SOCKETS: the daemons' sockets, comma-separated; rank r uses number r // K (K ranks
per node). --kill-rank/--kill-step: in torchrun's first attempt ($TORCHELASTIC_RESTART_COUNT
0), rank R kills itself with SIGKILL right after save(S), once version S - 1 is committed.
--expect FILE: right after load(), the rank's shards must equal the slices of the global
tensors in FILE (torch.save'd by rank 0 of an earlier run). Rank 0 writes DIR/final.pt: the
global tensors gathered at the last step.
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

import ckpt
import ckpt.torch as ct
from rank_processes import leave  # this directory: the script's own

D_IN, HIDDEN, D_OUT, BATCH = 8, 16, 4, 32


class _SumForward(torch.autograd.Function):
    """All-reduce (sum) in the forward, identity in the backward: every rank computes the
    same loss from the summed output, so each holds the full gradient of its partial output."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class ShardedMLP(torch.nn.Module):
    def __init__(self, rank, world):
        super().__init__()
        g = torch.Generator().manual_seed(0)  # the global model, the same at any world size
        w1, b1 = torch.randn(HIDDEN, D_IN, generator=g) * 0.3, torch.randn(HIDDEN, generator=g) * 0.1
        w2, b2 = torch.randn(D_OUT, HIDDEN, generator=g) * 0.3, torch.randn(D_OUT, generator=g) * 0.1
        per = HIDDEN // world
        self.lo, self.hi = rank * per, (rank + 1) * per
        self.w1 = torch.nn.Parameter(w1[self.lo:self.hi].clone())
        self.b1 = torch.nn.Parameter(b1[self.lo:self.hi].clone())
        self.w2 = torch.nn.Parameter(w2[:, self.lo:self.hi].clone())
        self.b2 = torch.nn.Parameter(b2.clone())

    def layouts(self):
        return {self.w1: ct.Layout(global_shape=[HIDDEN, D_IN], offsets=[self.lo, 0]),
                self.b1: ct.Layout(global_shape=[HIDDEN], offsets=[self.lo]),
                self.w2: ct.Layout(global_shape=[D_OUT, HIDDEN], offsets=[0, self.lo])}  # b2: replicated

    def forward(self, x):
        h = torch.nn.functional.dropout(torch.relu(x @ self.w1.T + self.b1), p=0.2, training=True)
        return _SumForward.apply(h @ self.w2.T) + self.b2


# How each local tensor sits in its global one: the dimension it is split along (None: whole).
SPLIT = {"w1": 0, "b1": 0, "w2": 1, "b2": None}


def global_state(model, opt, world):
    """The global tensors (parameters and Adam state), gathered from every rank."""
    out = {}
    for key, p in model.named_parameters():
        local = {"param": p.detach()}
        local.update({k: v for k, v in opt.state[p].items() if k != "step"})
        for what, t in local.items():
            name = key if what == "param" else f"{key}.{what}"
            if SPLIT[key] is None:
                out[name] = t.clone()
                continue
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            out[name] = torch.cat(parts, dim=SPLIT[key])
        out[f"{key}.step"] = opt.state[p]["step"].clone()
    return out


def local_slice(model, name, t):
    key = name.split(".")[0]
    if SPLIT[key] is None or name.endswith(".step"):
        return t
    return t.narrow(SPLIT[key], model.lo, model.hi - model.lo)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--expect")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    sockets = os.environ["CKPT_TEST_SOCKETS"].split(",")
    socket = sockets[rank // args.ranks_per_node]

    model = ShardedMLP(rank, world)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # each rank's own dropout stream
    data = {"samples_seen": 0}  # global: every rank sees the same batches

    with ct.Checkpointer(socket, args.job, model=model, optimizer=opt, extra_state=data,
                         layouts=model.layouts(), replicated=True) as ck:
        try:
            step = ck.load("latest")
        except ckpt.VersionNotFoundError:
            step = 0
        print(f"rank {rank} of {world} attempt {attempt}: start at step {step} (pid {os.getpid()})", flush=True)
        loss = None
        if args.expect:
            expected = torch.load(args.expect)
            assert step == int(expected["step"]), (step, expected["step"])
            assert data["samples_seen"] == expected["samples_seen"], (data, expected["samples_seen"])
            assert (ck.restored_world_size, ck.resharded) == (expected["world_size"], world != expected["world_size"])
            mine = global_state_local(model, opt)
            for name, t in mine.items():
                want = local_slice(model, name, expected["tensors"][name])
                assert torch.equal(t, want), f"rank {rank}: {name} differs after the resharding load"
            print(f"rank {rank}: {len(mine)} tensors equal the global ones at step {step}", flush=True)
        while step < args.steps:
            g = torch.Generator().manual_seed(1000 + data["samples_seen"])
            x, target = torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            data["samples_seen"] += BATCH
            step += 1
            ck.save(step)
            if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
                ck.wait_durable(step - 1, timeout=60)
                print(f"rank {rank}: SIGKILL at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        ck.wait_durable(timeout=60)
        state = global_state(model, opt, world)
        if rank == 0:
            torch.save({"step": step, "samples_seen": data["samples_seen"], "world_size": world,
                        "tensors": state}, os.path.join(args.out, "final.pt"))
        print(f"rank {rank}: done at step {step} loss {None if loss is None else loss.item()!r}", flush=True)
    leave()  # rank_processes.leave: barrier, destroy the group, exit without finalization


def global_state_local(model, opt):
    """This rank's tensors under the names of global_state."""
    out = {}
    for key, p in model.named_parameters():
        out[key] = p.detach()
        for k, v in opt.state[p].items():
            out[f"{key}.{k}"] = v
    return out


if __name__ == "__main__":
    sys.exit(main())
