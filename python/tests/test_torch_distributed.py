"""ckpt.torch.Checkpointer takes its rank and world size from torch.distributed when that is
initialised (explicit values must agree with it), and its socket from the one rule of the C++
client ($CKPTD_SOCKET here). torch.distributed runs as a gloo group: of world size 1 in this
process (file:// rendezvous), and of world size 2 as two processes (tcp://127.0.0.1)."""

import gc
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
ckpt = pytest.importorskip("ckpt")
import ckpt.torch as ct  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="this torch has no torch.distributed with gloo")


@pytest.fixture(autouse=True)
def _clients_gone_before_daemons_stop(start_daemon):
    yield
    gc.collect()


@pytest.fixture
def gloo_world_of_one(temp_dir):
    dist.init_process_group("gloo", init_method=f"file://{temp_dir / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def ls(daemon, job):
    return json.loads(daemon.ctl("ls", "--job", job, "--json").stdout)


def test_rank_and_world_come_from_torch_distributed_and_the_socket_from_ckptd_socket(
        daemon, gloo_world_of_one, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    m = model()
    ck = ct.Checkpointer(None, "dist1", model=m)  # no socket, no rank: both found
    assert (ck.rank, ck.world_size) == (0, 1)
    ck.save(1)
    ck.wait_durable()
    ck.close()
    listed = ls(daemon, "dist1")
    assert listed["latest"] == 1
    assert listed["versions"][0]["durable_ranks"] == [0]
    # Explicit values that agree are taken.
    ck = ct.Checkpointer(None, "dist1", model=m, rank=0, world_size=1)
    ck.close()


@pytest.mark.parametrize("kwargs, word", [({"rank": 1}, "rank=1"), ({"world_size": 2}, "world_size=2"),
                                          ({"rank": 1, "world_size": 2}, "rank=1")])
def test_explicit_values_that_disagree_with_torch_distributed_are_an_error(daemon, gloo_world_of_one, kwargs,
                                                                           word):
    with pytest.raises(ValueError) as e:
        ct.Checkpointer(daemon.socket, "dist1", model=model(), **kwargs)
    assert word in str(e.value)
    assert "torch.distributed is initialised with rank 0 of world size 1" in str(e.value)
    # Nothing was registered: the job has no session and no version.
    status = json.loads(daemon.ctl("status", "--json").stdout)
    assert status["clients"] == []


def test_without_torch_distributed_explicit_values_or_rank_0_of_1(daemon):
    assert not dist.is_initialized()
    ck = ct.Checkpointer(daemon.socket, "solo", model=model())
    assert (ck.rank, ck.world_size) == (0, 1)
    ck.close()
    ck = ct.Checkpointer(daemon.socket, "pair", model=model(), rank=1, world_size=2)
    assert (ck.rank, ck.world_size) == (1, 2)
    ck.close()


RANK_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    import ckpt.torch as ct
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=2)
    torch.manual_seed(rank)
    m = torch.nn.Linear(4, 3)
    ck = ct.Checkpointer(None, "dist2", model=m)  # socket: $CKPTD_SOCKET; rank and world: dist
    assert (ck.rank, ck.world_size) == (rank, 2), (ck.rank, ck.world_size)
    ck.save(1)
    ck.wait_durable()  # commits only once both ranks are durable
    dist.barrier()
    ck.close()
    dist.destroy_process_group()
    print("rank", rank, "committed")
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_of_a_gloo_group_commit_one_version_as_ranks_0_and_1(daemon):
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), port], env=daemon.env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r}: {out}"
        assert f"rank {r} committed" in out
    listed = ls(daemon, "dist2")
    assert listed["latest"] == 1
    assert listed["versions"][0]["durable_ranks"] == [0, 1]
    assert listed["versions"][0]["committed"] is True
