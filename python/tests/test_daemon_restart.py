"""A PyTorch trainer survives a daemon restart: ckptd is killed with SIGKILL at a
deterministic point (CKPTD_TEST_PAUSE: before it copies a version) under a training loop that
checkpoints through ckpt.torch.Checkpointer, and a new ckptd is started on the same root and
socket. Training must go on, the version in flight be reported as lost, later versions commit,
and a resume from them be bit-exact. A daemon that stays down past the reconnect budget gives a
clear error."""

import gc
import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ckpt = pytest.importorskip("ckpt")
import ckpt.torch as ct  # noqa: E402

from test_torch_checkpointer import assert_same, make, state_of, train_step  # noqa: E402

UNAVAILABLE = 14
ABORTED = 10


@pytest.fixture(autouse=True)
def _clients_gone_before_daemons_stop(start_daemon):
    yield
    gc.collect()


def start_paused(start_daemon, pause: Path, point: str, version: int):
    """A ckptd that stops at `point` of `version` until `pause` is removed (common/test_pause.h)."""
    pause.write_text("x")
    os.environ["CKPTD_TEST_PAUSE"] = f"{point}:{version}:{pause}"
    try:
        return start_daemon()
    finally:
        del os.environ["CKPTD_TEST_PAUSE"]


def eventually(done, limit=60.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.005)
    return done()


def committed(d, job, v):
    return (Path(d.root) / job / f"v{v:010d}" / "COMMITTED").exists()


def test_training_goes_on_through_a_daemon_kill_and_restart(start_daemon, temp_dir):
    pause = temp_dir / "pause"
    d = start_paused(start_daemon, pause, "capture", 4)
    model, opt, sched = make(seed=0)
    ck = ct.Checkpointer(d.socket, "rs", model=model, optimizer=opt, scheduler=sched, reconnect_budget=60)
    for step in range(1, 5):
        train_step(model, opt, sched, 100 + step)
        ck.save(step)
    # save(4) returned; the daemon holds version 4 without having copied a byte of it.
    assert eventually(lambda: Path(f"{pause}.reached").exists())
    d.kill()
    d.restart()  # as systemd's Restart=on-failure would; no pause this time

    # The automatic wait before the next update finds version 4 lost and says so; the update runs.
    with pytest.warns(RuntimeWarning, match="daemon restarted; version 4 was not captured"):
        train_step(model, opt, sched, 105)
    assert 4 in ck.lost_versions
    assert any("version 4 was not captured" in m for m in ck.restart_errors)
    ck.save(5)
    for step in range(6, 9):
        train_step(model, opt, sched, 100 + step)
        ck.save(step)
    ck.wait_durable()
    # Versions lost at the restart are at most those saved before it.
    assert all(v <= 4 for v in ck.lost_versions)
    with pytest.raises(ckpt.DaemonRestartedError, match="version 4 was not captured") as lost:
        ck.wait_durable(4)
    assert lost.value.code == ABORTED and 4 in lost.value.versions
    ck.close()
    rng = torch.get_rng_state()
    reference = [train_step(model, opt, sched, 100 + step) for step in range(9, 12)]
    expected = state_of(model, opt)

    for v in range(5, 9):
        assert eventually(lambda: committed(d, "rs", v)), f"version {v} saved after the restart did not commit"
    assert not committed(d, "rs", 4)
    assert "latest committed 8" in d.ctl("ls", "--job", "rs").stdout

    # A later resume, into fresh objects, continues bit-exact.
    model2, opt2, sched2 = make(seed=1)
    ck2 = ct.Checkpointer(d.socket, "rs", model=model2, optimizer=opt2, scheduler=sched2)
    torch.manual_seed(12345)
    assert ck2.load("latest") == 8
    assert torch.equal(torch.get_rng_state(), rng)
    resumed = [train_step(model2, opt2, sched2, 100 + step) for step in range(9, 12)]
    assert [x.hex() for x in resumed] == [x.hex() for x in reference]
    assert_same(state_of(model2, opt2), expected)
    ck2.close()


def test_a_daemon_down_longer_than_the_budget_gives_a_clear_error(start_daemon, temp_dir):
    pause = temp_dir / "pause"
    d = start_paused(start_daemon, pause, "capture", 2)
    model, opt, sched = make(seed=0)
    ck = ct.Checkpointer(d.socket, "down", model=model, optimizer=opt, scheduler=sched, reconnect_budget=1.0)
    assert ck.client.reconnect_budget == 1.0
    for step in (1, 2):
        train_step(model, opt, sched, 100 + step)
        ck.save(step)
    assert eventually(lambda: Path(f"{pause}.reached").exists())
    # Timed from the kill: the Checkpointer's worker thread, waiting for version 2 since
    # save(2), finds the daemon gone then.
    t0 = time.monotonic()
    d.kill()  # and not started again
    with pytest.raises(ckpt.Error, match=r"did not come back within 1 s") as down:
        train_step(model, opt, sched, 103)
    waited = time.monotonic() - t0
    assert down.value.code == UNAVAILABLE
    assert not isinstance(down.value, ckpt.DaemonRestartedError)
    assert d.socket in str(down.value)
    assert 1.0 <= waited < 30
    ck.close()


def test_the_reconnect_budget_is_checked_and_shown(daemon, monkeypatch):
    with pytest.raises(ValueError, match="reconnect_budget"):
        ckpt.Client.connect(daemon.socket, reconnect_budget=-1)
    monkeypatch.setenv("CKPT_RECONNECT_BUDGET_S", "3.5")
    assert ckpt.Client.connect(daemon.socket).reconnect_budget == 3.5
    assert ckpt.Client.connect(daemon.socket, reconnect_budget=0).reconnect_budget == 0
    monkeypatch.delenv("CKPT_RECONNECT_BUDGET_S")
    assert ckpt.Client.connect(daemon.socket).reconnect_budget >= 60
    with pytest.raises(ValueError, match="reconnect_budget applies"):
        ct.Checkpointer(ckpt.Client.connect(daemon.socket), "x", reconnect_budget=5)
