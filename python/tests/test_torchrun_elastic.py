"""Real multi-process training through ckptd: torchrun (torch.distributed.run) starts a
tensor-parallel trainer (torchrun_trainer.py) with 4 processes on gloo, and 2 ckptd daemons
stand for 2 nodes (ranks 0-1 use one, ranks 2-3 the other; each has its own local tier, both
share one persistent root, as tests/tiers_test.cc runs them).

- kill -9 of one rank in mid-run: torchrun (--max_restarts 1) restarts the group, every rank
  resumes from ckptd, and the state at the last step is bit-identical to that of an
  uninterrupted run of the same steps.
- then 2 processes (one per node) resume the same job: the restore reshards (W1 split along dimension 0 and
  W2 along dimension 1 into halves instead of quarters; b2 and Adam's step replicated), each
  rank's tensors equal the slices of the global tensors the 4-rank run gathered at that step,
  and training goes on at world size 2.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ckpt")
import torch.distributed as dist  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="this torch has no torch.distributed with gloo")

TRAINER = Path(__file__).resolve().parent / "torchrun_trainer.py"
STEPS, KILL_RANK, KILL_STEP, MORE = 8, 3, 5, 3


@pytest.fixture
def nodes(start_daemon, temp_dir):
    """Two daemons (two nodes) on one persistent root, each with its own local tier."""
    root = temp_dir / "persistent"
    return [start_daemon(root=root, socket=temp_dir / f"node{i}" / "ckptd.sock",
                         extra_args=["--local", str(temp_dir / f"node{i}" / "local"), "--create-root"])
            for i in range(2)]


@pytest.fixture
def workers_shm():
    """Removes the shared memory of the trainer processes listed in it (pids) at teardown: a
    rank killed by SIGKILL, or by torchrun's SIGTERM, cannot unlink its regions itself."""
    pids = set()
    yield pids
    for pid in pids:
        for path in Path("/dev/shm").glob(f"ckpt-{os.getuid()}-{pid}-*"):
            path.unlink(missing_ok=True)


def torchrun(nodes, nproc, out, *args, max_restarts=0, timeout=240, pids=None):
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["CKPT_TEST_SOCKETS"] = ",".join(n.socket for n in nodes)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["OMP_NUM_THREADS"] = "1"
    # torch 2.x's torchrun shares one rendezvous TCP store across restarts by default, and the
    # keys the first attempt's process group left there (the gloo address of every rank) are
    # read again by the restarted ranks: they connect to dead peers ("Gloo connectFullMesh
    # failed ... Connection refused") or hang. Opting out of the sharing gives each round a store
    # of its own. torch 1.13 does not read the variable.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # --redirects/--tee: the workers' stdout to the console (and files), their stderr to files
    # under --log_dir. Values other than 1 and 2 break torch 1.13's torchrun under Python
    # 3.11 (its Std.from_str iterates an IntFlag, which no longer yields 0 nor ALL).
    logs = out / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max_restarts", str(max_restarts), "--monitor_interval", "1", "--log_dir", str(logs),
           "--redirects", "2", "--tee", "1", str(TRAINER), "--out", str(out), *map(str, args)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Each worker runs in a session of its own, so only torchrun can stop them: SIGTERM, which
        # it passes on (the SIGKILL of subprocess.run's timeout would leave them running).
        timed_out = True
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
    output = stdout + stderr
    if pids is not None:
        pids.update(int(p) for p in re.findall(r"start at step \d+ \(pid (\d+)\)", output))
    if timed_out or proc.returncode != 0:
        files = "".join(f"--- {p}\n{p.read_text(errors='replace')[-4000:]}\n" for p in sorted(logs.rglob("*.log")))
        how = f"did not finish in {timeout} s (stopped with SIGTERM)" if timed_out else f"exited {proc.returncode}"
        pytest.fail(f"torchrun {how}:\n{output}\nworkers' logs:\n{files}")
    return output


def ls(daemon, job):
    return json.loads(daemon.ctl("ls", "--job", job, "--json").stdout)


def assert_same(a, b, what):
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), f"{what}: {name} differs"


def test_kill_9_of_one_rank_resumes_bit_identical_then_2_ranks_reshard_and_train_on(nodes, temp_dir, workers_shm):
    # The uninterrupted run.
    ref_out = temp_dir / "ref"
    torchrun(nodes, 4, ref_out, "--job", "tp-ref", "--steps", STEPS, pids=workers_shm)
    ref = torch.load(ref_out / "final.pt")
    assert ref["step"] == STEPS and ref["world_size"] == 4

    # The same run, with rank 3 killed (SIGKILL) right after its save of step KILL_STEP.
    out = temp_dir / "killed"
    log = torchrun(nodes, 4, out, "--job", "tp", "--steps", STEPS, "--kill-rank", KILL_RANK,
                   "--kill-step", KILL_STEP, max_restarts=1, pids=workers_shm)
    assert f"rank {KILL_RANK}: SIGKILL at step {KILL_STEP}" in log, log
    resumed = re.findall(r"attempt 1: start at step (\d+)", log)
    assert len(resumed) == 4, log  # torchrun restarted all four ranks
    starts = {int(s) for s in resumed}
    assert len(starts) == 1 and KILL_STEP - 1 <= starts.pop() <= KILL_STEP, log  # all from one committed version
    killed = torch.load(out / "final.pt")
    assert killed["step"] == STEPS and killed["samples_seen"] == ref["samples_seen"]
    assert_same(killed["tensors"], ref["tensors"], "the resumed run against the uninterrupted one")
    # Both nodes' daemons see the job committed at the last step.
    for n in nodes:
        assert ls(n, "tp")["latest"] == STEPS

    # Then 2 ranks (one per node) resume the job: resharded, checked against the global tensors the
    # 4 ranks gathered at that step, and trained on at world size 2.
    out2 = temp_dir / "two"
    log = torchrun(nodes, 2, out2, "--job", "tp", "--steps", STEPS + MORE, "--ranks-per-node", 1,
                   "--expect", out / "final.pt", pids=workers_shm)
    for r in range(2):
        assert f"rank {r}: 16 tensors equal the global ones at step {STEPS}" in log, log
        assert f"rank {r}: done at step {STEPS + MORE}" in log, log
    listed = ls(nodes[0], "tp")
    assert listed["latest"] == STEPS + MORE
    newest = next(v for v in listed["versions"] if v["version"] == STEPS + MORE)
    assert newest["committed"] and newest["durable_ranks"] == [0, 1]
    two = torch.load(out2 / "final.pt")
    assert two["world_size"] == 2 and two["samples_seen"] == killed["samples_seen"] + MORE * 32
