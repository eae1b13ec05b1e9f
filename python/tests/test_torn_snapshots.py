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
import sys
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
    through .data (invisible to the counter; the daemon's verify mode sees it). The version
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
    listing = daemon.ctl("ls", job).stdout
    for v in expected:
        assert any(line.split()[:2] == [f"v{v}", "aborted"] for line in listing.splitlines() if line.strip()), listing
    for v in committed:
        assert not differing(ct.load_checkpoint(daemon.root, job, v)["tensors"], states[v]), v
