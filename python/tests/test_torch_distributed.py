"""ckpt.torch.Checkpointer takes its rank and world size from torch.distributed when that is
initialised (explicit values must agree with it), else from explicit values, else from the
launcher's environment (torchrun's $RANK/$WORLD_SIZE, then srun's $SLURM_PROCID/
$SLURM_STEP_NUM_TASKS), and its socket from the one rule of the C++
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
from rank_processes import LEAVE  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="this torch has no torch.distributed with gloo")


@pytest.fixture(autouse=True)
def _clients_gone_before_daemons_stop(start_daemon):
    yield
    gc.collect()


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    """Each test sets the launcher variables it means (the runner may be under Slurm itself)."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


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
    ck.close()
    print("rank", rank, "committed")
""") + LEAVE


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


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),                                      # torchrun
    ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3"}, (2, 3)),  # srun
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, (0, 1)),  # an sbatch -n2 batch script, not an srun step
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "4"}, (1, 2)),  # srun -n2 of 4
    ({"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, (3, 4)),  # torchrun in srun
    ({"RANK": "0", "WORLD_SIZE": "1", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, (0, 1)),
])
def test_without_torch_distributed_rank_and_world_come_from_the_launchers_environment(
        daemon, monkeypatch, env, expected):
    assert not dist.is_initialized()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ck = ct.Checkpointer(daemon.socket, "fromenv", model=model())
    assert (ck.rank, ck.world_size) == expected
    status = json.loads(daemon.ctl("status", "--json").stdout)
    assert [(c["rank"], c["world_size"]) for c in status["clients"]] == [expected]
    ck.close()


def test_explicit_values_win_over_the_launchers_environment(daemon, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ck = ct.Checkpointer(daemon.socket, "explicit", model=model(), rank=0, world_size=1)
    assert (ck.rank, ck.world_size) == (0, 1)
    ck.close()
    ck = ct.Checkpointer(daemon.socket, "explicit2", model=model(), rank=0)  # world size: $WORLD_SIZE
    assert (ck.rank, ck.world_size) == (0, 2)
    ck.close()


def test_an_initialised_torch_distributed_wins_over_the_launchers_environment(daemon, gloo_world_of_one,
                                                                              monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ck = ct.Checkpointer(daemon.socket, "distwins", model=model())
    assert (ck.rank, ck.world_size) == (0, 1)
    ck.close()
    with pytest.raises(ValueError, match="torch.distributed is initialised with rank 0 of world size 1"):
        ct.Checkpointer(daemon.socket, "distwins", model=model(), rank=1)


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2"}, r"\$WORLD_SIZE=2 says this process is one of 2 \(torchrun\), but \$RANK is not set"),
    ({"SLURM_STEP_NUM_TASKS": "4"}, r"\$SLURM_STEP_NUM_TASKS=4 .*\(srun\), but \$SLURM_PROCID is not set"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"\$RANK=2 is not a rank of \$WORLD_SIZE=2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, r"\$RANK='x' is not an integer"),
])
def test_a_launchers_environment_that_does_not_add_up_is_an_error(daemon, monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        ct.Checkpointer(daemon.socket, "badenv", model=model())
    assert json.loads(daemon.ctl("status", "--json").stdout)["clients"] == []


ENV_RANK_SCRIPT = textwrap.dedent("""
    import sys, torch
    import ckpt.torch as ct
    torch.manual_seed(int(sys.argv[1]))
    m = torch.nn.Linear(4, 3)
    ck = ct.Checkpointer(None, sys.argv[2], model=m)  # no torch.distributed: the launcher's environment
    ck.save(1)
    ck.wait_durable(timeout=60)  # commits only once both ranks are durable
    print("rank", ck.rank, "of", ck.world_size, "committed")
    ck.close()
""")


@pytest.mark.parametrize("rank_var, world_var", [("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")])
def test_two_processes_started_by_a_launcher_commit_one_version_as_ranks_0_and_1(daemon, rank_var, world_var):
    job = "env-" + rank_var.lower()
    procs = [subprocess.Popen([sys.executable, "-c", ENV_RANK_SCRIPT, str(r), job],
                              env=daemon.env(**{rank_var: r, world_var: 2}),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r}: {out}"
        assert f"rank {r} of 2 committed" in out
    listed = ls(daemon, job)
    assert listed["latest"] == 1
    assert listed["versions"][0]["durable_ranks"] == [0, 1]
    assert listed["versions"][0]["committed"] is True
