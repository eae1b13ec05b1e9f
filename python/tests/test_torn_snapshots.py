"""A committed version is exactly the state of its step, whatever the trainer changes in place
while the daemon copies it: the torn-snapshot matrix.

For every case of torn_trainer.py (batch norm, buffers of any dtype changed in forward, EMA
copies before and after forward, weight clipping and re-initialisation at the start of an
iteration, parametrize, tied weights, gradient accumulation, scheduler and grad scaler, RNG
states, a buffer too large to stage, a large EMA changed before forward, a write through
.data), a reference trajectory runs without ckptd (each step's every checkpointed value);
then the trainer runs with ckptd saving every step and is killed with SIGKILL right after
the save of random steps (a seeded RNG: CKPT_TORN_SEED, printed), restarted, restored from
the newest committed version, until it finishes. Asserted: zero differing values between
every committed version and the reference state of its step; the resumed losses and the
final state bit-identical to the reference; versions the Checkpointer aborted are neither
committed nor restorable; cases protected by construction abort nothing.

Synchronised on the trainer's own output (a line per save), never on sleeps.
"""

import os
import random
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ckpt = pytest.importorskip("ckpt")
pytest.importorskip("numpy")
import ckpt.torch as ct  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torn_trainer  # noqa: E402

from torn_trainer import differing  # noqa: E402

STEPS = 8
KILLS = 2
SEED = int(os.environ.get("CKPT_TORN_SEED") or random.SystemRandom().randrange(1 << 31))


def run(daemon, case, job, temp_dir, kills):
    env = daemon.env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return torn_trainer.run_with_kills(daemon.socket, env, case, job, STEPS, Path(temp_dir) / f"{job}.final.pt",
                                       kills)


@pytest.mark.parametrize("case", torn_trainer.CASES)
def test_committed_versions_are_exact_and_the_resume_bit_identical(case, daemon, temp_dir):
    rng = random.Random(f"{SEED}:{case}")
    kills = sorted(rng.sample(range(1, STEPS), KILLS))
    print(f"CKPT_TORN_SEED={SEED}: case {case}, SIGKILL right after the saves of steps {kills}")
    ref_losses, ref_states = torn_trainer.reference(case, STEPS)
    job = f"torn-{case.replace('_', '-')}"
    starts, losses, aborted, final = run(daemon, case, job, temp_dir, kills)

    committed = ckpt.list_versions(daemon.root, job)
    assert committed and committed[-1] == STEPS or STEPS in aborted, (committed, aborted)
    torn = {}
    for v in committed:
        stored = ct.load_checkpoint(daemon.root, job, v)
        assert stored["step"] == v
        d = differing(stored["tensors"], ref_states[v])
        if d:
            torn[v] = d
    assert not torn, f"committed versions differ from the state of their step (seed {SEED}): {torn}"
    for v in aborted:
        assert v not in committed, f"version {v} was aborted but is committed"
        with pytest.raises(ckpt.VersionNotFoundError):
            ct.load_checkpoint(daemon.root, job, v)
    if case not in torn_trainer.DETECTED:
        assert not aborted, f"case {case} is protected from the first step, yet versions {aborted} were aborted"

    # Each run resumed from a committed version, and every step it ran gave the reference's loss.
    assert starts[0] == 0 and all(s == 0 or s in committed for s in starts[1:]), (starts, committed)
    for step, seen in losses.items():
        assert all(x == ref_losses[step].hex() for x in seen), f"step {step}: losses {seen}, reference " \
                                                                f"{ref_losses[step].hex()} (seed {SEED})"
    assert sorted(losses) == list(range(1, STEPS + 1))
    d = differing(final, ref_states[STEPS])
    assert not d, f"the final state differs from the reference: {d}"


@pytest.mark.parametrize("case", ["large_ema_before", "data_write"])
def test_a_change_the_guard_cannot_prevent_is_detected_and_that_version_aborted(case, daemon, temp_dir):
    """No kill: a large EMA weight changed before the forward (the version counter sees it,
    but the tensor is too large to stage and the change comes before any wait), and a write
    through .data (invisible to the counter; made after the daemon's copy, the daemon's verify
    mode sees it at the seal: a write before the copy would go into it unseen). The version
    is aborted: not committed, shown aborted by the daemon, while the one before stays
    restorable; then the Checkpointer protects the tensor and later versions commit."""
    job = f"detect-{case.replace('_', '-')}"
    _, states = torn_trainer.reference(case, STEPS)
    starts, _, aborted, _ = run(daemon, case, job, temp_dir, kills=[])
    assert starts == [0]
    committed = ckpt.list_versions(daemon.root, job)
    # large_ema_before: version 1 (wait before the step), then version 2 (wait before the
    # forward); from then on save() waits. data_write: the first version pending when the
    # writes begin (step 3), then the tensor is staged.
    expected = {"large_ema_before": [1, 2], "data_write": [2]}[case]
    assert aborted == expected, (aborted, committed)
    assert committed == [v for v in range(1, STEPS + 1) if v not in expected]
    listing = daemon.ctl("ls", "--job", job).stdout
    for v in expected:
        assert any(line.split()[:2] == [f"v{v}", "aborted"] for line in listing.splitlines() if line.strip()), listing
    for v in committed:
        assert not differing(ct.load_checkpoint(daemon.root, job, v)["tensors"], states[v]), v


def _step(model, opt, x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_the_abort_names_the_tensor_and_the_step_and_the_tensor_is_staged_from_then_on(daemon):
    """In one process: surgery on a small parameter while its version may be copied. The wait
    before the update sees the counter move: the version is aborted (not committed, shown
    aborted by ckptctl with the reason), the warning names the item, its state_dict key,
    its module and the step, and says the parameter is staged from then on; the same surgery
    after the next save aborts nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = ct.Checkpointer(daemon.socket, "abort-names", model=model, optimizer=opt)
    x = torch.randn(4, 8)
    _step(model, opt, x)
    ck.save(1)
    ck.wait_durable(1)
    _step(model, opt, x)
    ck.save(2)
    with torch.no_grad():
        model[2].weight.mul_(0.5)  # while version 2 may still be copied
    with pytest.warns(RuntimeWarning) as seen:
        _step(model, opt, x)  # the wait before the update compares the counters
    text = " ".join(str(w.message) for w in seen)
    assert re.search(r"version 2 aborted .*model\.2\.weight \(state_dict key '2\.weight', module '2'\) changed in "
                     r"place between save\(2\) and the end of its capture", text), text
    assert "From now on model.2.weight is staged" in text, text
    assert [v for v, _ in ck.aborted_versions] == [2] and "model.2.weight" in ck.aborted_versions[0][1]
    with pytest.raises(ckpt.TornSnapshotError) as e:
        ck.client.wait_durable(2, ckpt.Level.COMMITTED, 60)
    assert e.value.version == 2 and e.value.code == 10
    listing = daemon.ctl("ls", "--job", "abort-names").stdout
    assert re.search(r"v2\s+aborted", listing) and "model.2.weight" in listing, listing

    ck.save(3)  # registers again: the weight is staged now
    saved = model[2].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model[2].weight.mul_(0.5)
        _step(model, opt, x)
        ck.wait_durable(3)
    assert ckpt.list_versions(daemon.root, "abort-names") == [1, 3]
    assert torch.equal(ct.load_checkpoint(daemon.root, "abort-names", 3)["model"]["2.weight"], saved)
    assert ck.load("latest") == 3 and torch.equal(model[2].weight, saved)
    ck.close()


def test_a_large_tensor_changed_before_the_forward_moves_the_wait_step_by_step(daemon):
    """A 2 MiB weight (too large to stage) changed at the start of every iteration: aborted
    with the wait before the step, then with the wait before the forward; then save() waits
    for each capture and nothing more is aborted. Each move is said once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ck = ct.Checkpointer(daemon.socket, "ladder", model=model, optimizer=opt)
    assert ck.wait_before == "step"
    x = torch.randn(2, 1024)
    moves = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(1, 7):
            with torch.no_grad():
                model[0].weight.clamp_(-0.05, 0.05)  # weight clipping before the forward
            _step(model, opt, x)
            ck.save(step)
            moves.append(ck.wait_before)
        ck.wait_durable(6)
    assert [v for v, _ in ck.aborted_versions] == [1, 2], ck.aborted_versions
    assert moves == ["step", "forward"] + ["save"] * 4, moves  # as of each save: the aborts come one step later
    texts = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 2, texts
    assert "before the model's forward" in texts[0] and "save() waits for the capture" in texts[1], texts
    # 3..6 are not aborted; of them only the newest is sure to be on disk: the persist queue
    # skips a version that a newer one superseded before it was written.
    versions = ckpt.list_versions(daemon.root, "ladder")
    assert versions[-1] == 6 and set(versions) <= {3, 4, 5, 6}, versions
    ck.close()


def test_small_buffers_of_any_dtype_are_staged_and_large_ones_move_the_wait_before_the_forward(daemon):
    class Net(torch.nn.Module):
        def __init__(self, big):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.register_buffer("mean", torch.zeros(3, dtype=torch.float64))
            self.register_buffer("count", torch.zeros((), dtype=torch.int64))
            self.register_buffer("flag", torch.zeros(2, dtype=torch.bool))
            if big:
                self.register_buffer("big", torch.zeros(1 << 19))

        def forward(self, x):
            return self.fc(x)

    small = Net(big=False)
    ck = ct.Checkpointer(daemon.socket, "staged-buffers", model=small, optimizer=torch.optim.SGD(small.parameters(),
                                                                                                 lr=0.1))
    staged = {s.name for s in ck._slots if s.staged}
    assert staged == {"model.mean", "model.count", "model.flag"} and ck.wait_before == "step"
    ck.close()
    large = Net(big=True)
    ck = ct.Checkpointer(daemon.socket, "staged-buffers-2", model=large,
                         optimizer=torch.optim.SGD(large.parameters(), lr=0.1))
    assert "model.big" not in {s.name for s in ck._slots if s.staged} and ck.wait_before == "forward"
    ck.save(1)
    large(torch.zeros(1, 4))  # the forward waits
    assert ck.pending is None
    ck.close()


def test_a_trainer_that_exits_without_close_still_commits_its_last_version(daemon, temp_dir):
    """Versions commit only once sealed: the last one of a trainer that ends without close()
    or wait_durable() is sealed at interpreter exit (a killed one is dropped instead)."""
    script = Path(temp_dir) / "no_close.py"
    script.write_text(
        "import sys, torch, ckpt.torch\n"
        "model = torch.nn.Linear(4, 4)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "ck = ckpt.torch.Checkpointer(sys.argv[1], 'no-close', model=model, optimizer=opt)\n"
        "for step in (1, 2):\n"
        "    model(torch.ones(2, 4)).sum().backward()\n"
        "    opt.step()\n"
        "    ck.save(step)\n"
        "torch.save(model.state_dict(), sys.argv[2])\n")
    env = daemon.env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    subprocess.run([sys.executable, str(script), daemon.socket, str(Path(temp_dir) / "sd.pt")], env=env, check=True,
                   timeout=120)
    deadline = time.monotonic() + 60
    while 2 not in ckpt.list_versions(daemon.root, "no-close") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ckpt.list_versions(daemon.root, "no-close") == [1, 2]
    want = torch.load(Path(temp_dir) / "sd.pt")
    got = ct.load_checkpoint(daemon.root, "no-close", 2)["model"]
    assert all(torch.equal(got[k], v) for k, v in want.items())
