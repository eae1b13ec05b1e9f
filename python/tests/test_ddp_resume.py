"""Resuming a DistributedDataParallel job through ckpt.torch continues bit for bit where DDP's
gradient reduction does not depend on its bucket layout: at world size 2 (each element is a
sum of two terms), and at any world size with `find_unused_parameters=True` (DDP then keeps
its first bucket layout for good). Elsewhere DDP rebuilds its buckets after its first
iteration, in the order gradients became ready; a resumed process's first iteration is in
the initial layout, gloo's ring then sums some elements of that step in another order than
the uninterrupted run did, and the losses drift by an ulp or two (docs/pytorch.md, "DDP").
Each rank is a process of its own (gloo over tcp://127.0.0.1), and the comparison is with an
uninterrupted run of the same ranks."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ckpt")
import torch.distributed as dist  # noqa: E402
from rank_processes import LEAVE, run_script_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="this torch has no torch.distributed with gloo")

DDP_SCRIPT = """
import hashlib, json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import ckpt.torch as ct
rank, world, port, job, start_mode, steps, unused = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                     sys.argv[5], int(sys.argv[6]), sys.argv[7] == "1")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=world)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                        torch.nn.Linear(128, 10))
ddp = DistributedDataParallel(m, find_unused_parameters=unused)
opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
ck = ct.Checkpointer(None, job, model=m, optimizer=opt, replicated=True)
start = ck.load("latest") if start_mode == "resume" else 0
losses = []
for step in range(start, steps):
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1000 * rank + step))
    opt.zero_grad()
    loss = ddp(x).square().mean()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    ck.save(step + 1)
ck.wait_durable(timeout=60)
ck.close()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())).hexdigest()
print("RESULT " + json.dumps({"start": start, "losses": losses, "params": digest}), flush=True)
""" + LEAVE


def run_ranks(daemon, world, job, start_mode, steps, unused):
    return run_script_ranks(daemon, world, DDP_SCRIPT, job, start_mode, steps, "1" if unused else "0")


@pytest.mark.parametrize("world, unused", [(2, False), (3, True)], ids=["2 ranks", "3 ranks, find_unused_parameters"])
def test_a_ddp_job_resumed_from_its_checkpoint_trains_on_bit_for_bit(daemon, world, unused):
    tag = f"ddp{world}{'u' if unused else ''}"
    whole = run_ranks(daemon, world, tag + "-whole", "fresh", 6, unused)
    run_ranks(daemon, world, tag + "-cut", "fresh", 3, unused)  # the job stops after step 3
    resumed = run_ranks(daemon, world, tag + "-cut", "resume", 6, unused)
    for r in range(world):
        assert resumed[r]["start"] == 3
        assert resumed[r]["losses"] == whole[r]["losses"][3:], f"rank {r}"
        assert resumed[r]["params"] == whole[r]["params"], f"rank {r}"
