"""ckpt.deepspeed.CkptdCheckpointEngine against a real ckptd.

Always: a driver that calls the engine the way DeepSpeed 0.19's DeepSpeedEngine does
(save_checkpoint: makedirs(save_dir), create(CheckpointCommitInfo), makedirs(tag dir),
save(state_dict, path) per file, commit(info), then `latest` written by DeepSpeed;
load_checkpoint: `latest`, glob of the tag directory, load(path, map_location) per file).
Where `deepspeed` imports (not in Debian; e.g. a venv with `pip install deepspeed`): also a
real DeepSpeedEngine on the CPU (gloo) saving and loading through the engine, in a
subprocess."""

import dataclasses
import gc
import glob
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
ckpt = pytest.importorskip("ckpt")
import ckpt.deepspeed as cds  # noqa: E402


@pytest.fixture(autouse=True)
def _clients_gone_before_daemons_stop(start_daemon):
    """A ckptd asked to stop waits (5 s) for connected clients; tests drop theirs first."""
    yield
    gc.collect()


@dataclasses.dataclass
class CommitInfo:  # DeepSpeed's CheckpointCommitInfo (0.19), for the driver
    tag: str
    save_dir: str
    save_latest: bool


def ds_save_checkpoint(engine, save_dir, tag, files):
    """The calls DeepSpeedEngine.save_checkpoint makes (rank 0, no ZeRO partitions to sync)."""
    engine.makedirs(save_dir, exist_ok=True)
    info = CommitInfo(tag=tag, save_dir=save_dir, save_latest=True)
    engine.create(info)
    engine.makedirs(os.path.join(save_dir, tag), exist_ok=True)
    for name, state in files.items():
        engine.save(state, os.path.join(save_dir, tag, name))
    engine.commit(info)
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write(tag)


def ds_load_checkpoint(engine, load_dir):
    """The calls DeepSpeedEngine.load_checkpoint makes: the tag from `latest`, the files from
    a glob of its directory, load(path, map_location='cpu') per file."""
    with open(os.path.join(load_dir, "latest")) as f:
        tag = f.read().strip()
    paths = sorted(glob.glob(os.path.join(load_dir, tag, "*.pt")))
    return tag, {os.path.basename(p): engine.load(p, map_location=torch.device("cpu")) for p in paths}


def training_state(model, opt, step):
    return {
        "mp_rank_00_model_states.pt": {"module": model.state_dict(), "global_steps": step,
                                       "ds_config": {"train_batch_size": 4}, "shapes": [torch.Size([8, 4])]},
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": {"optimizer_state_dict": opt.state_dict(),
                                                      "ds_version": "0.19.8"},
    }


def clone(obj):
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return obj


def assert_equal(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def step(model, opt, seed):
    torch.manual_seed(seed)
    loss = model(torch.randn(4, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_engine_has_deepspeeds_interface(daemon):
    engine = cds.CkptdCheckpointEngine(daemon.socket, "ds-iface")
    for method in ("create", "save", "load", "commit", "makedirs", "wait", "is_data_parallel_writer",
                   "is_decoupled", "preserves_storage_sharing", "cleanup"):
        assert callable(getattr(engine, method)), method
    if cds.HAVE_DEEPSPEED:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
        assert isinstance(engine, CheckpointEngine)
    assert engine.is_data_parallel_writer(0) and not engine.is_decoupled()
    engine.close()


def test_save_and_load_the_way_deepspeed_calls_them(daemon, temp_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    save_dir = str(temp_dir / "ds")
    engine = cds.CkptdCheckpointEngine(daemon.socket, "ds-driver")
    saved = {}
    for s in range(1, 4):
        step(model, opt, s)
        files = training_state(model, opt, s)
        ds_save_checkpoint(engine, save_dir, f"global_step{s}", files)
        saved[s] = clone(files)
        step(model, opt, 100 + s)  # training goes on at once: the engine staged a copy
        # Each tag is loaded below, so each must reach the persistent tier: a version still
        # queued when a newer one of every rank arrives is superseded (not persisted), by design.
        engine.wait()
    assert ckpt.list_versions(daemon.root, "ds-driver") == [1, 2, 3]
    tag, loaded = ds_load_checkpoint(engine, save_dir)
    assert tag == "global_step3"
    assert_equal(saved[3], loaded)
    # Another tag, by the placeholder DeepSpeed's glob finds in its directory.
    assert_equal(saved[2]["mp_rank_00_model_states.pt"],
                 engine.load(os.path.join(save_dir, "global_step2", "mp_rank_00_model_states.pt")))
    engine.close()

    # A restarted trainer: a new engine reads what the old one committed.
    engine2 = cds.CkptdCheckpointEngine(daemon.socket, "ds-driver")
    _, loaded2 = ds_load_checkpoint(engine2, save_dir)
    assert_equal(saved[3], loaded2)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model2.load_state_dict(loaded2["mp_rank_00_model_states.pt"]["module"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(loaded2["zero_pp_rank_0_mp_rank_00_optim_states.pt"]["optimizer_state_dict"])
    with pytest.raises(FileNotFoundError, match="has no file 'missing.pt'"):
        engine2.load(os.path.join(save_dir, "global_step3", "missing.pt"))
    engine2.close()


def test_tag_strings_shared_tensors_and_tags_without_numbers(daemon, temp_dir):
    engine = cds.CkptdCheckpointEngine(daemon.socket, "ds-tags")
    w = torch.arange(6, dtype=torch.float32).view(2, 3)
    state = {"a": w, "b": w, "t": w.t(), "bf": torch.ones(3, dtype=torch.bfloat16), "empty": torch.zeros(0),
             "nested": [{"x": torch.tensor(5)}, (1, "two")]}
    path = str(temp_dir / "tagA" / "state.pt")
    os.makedirs(os.path.dirname(path))
    engine.create("tagA")  # older DeepSpeed passes the tag itself
    engine.save(state, path)
    engine.commit("tagA")  # no number in the tag: version 1 (the last + 1)
    engine.wait()
    got = engine.load(path)
    assert_equal(clone(state), got)
    assert got["a"] is got["b"]  # one tensor saved twice stays one tensor
    assert ckpt.list_versions(daemon.root, "ds-tags") == [1]
    with pytest.raises(ValueError, match="commit of tag 'other'"):
        engine.create("tagB")
        engine.commit("other")
    engine.close()


def test_unsupported_tensors_are_refused(daemon, temp_dir):
    engine = cds.CkptdCheckpointEngine(daemon.socket, "ds-bad")
    engine.create("global_step1")
    with pytest.raises(cds.UnsupportedTensorError, match="f.pt:w"):
        engine.save({"w": torch.zeros(2, device="meta")}, str(temp_dir / "f.pt"))
    with pytest.raises(cds.UnsupportedTensorError, match="dtype torch.complex64"):
        engine.save({"w": torch.zeros(2, dtype=torch.complex64)}, str(temp_dir / "g.pt"))
    engine.close()


REAL_DEEPSPEED = textwrap.dedent("""
    import os, sys, torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed, ckpt.deepspeed
    # On a CPU, init_distributed JIT-compiles DeepSpeed's shared-memory allreduce (about 100 s of
    # g++ on 2 cores, into ~/.cache/torch_extensions) unless that op is marked incompatible; a
    # world of one never uses it, and gloo does the rest.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.checkpoint_engine = ckpt.deepspeed.CkptdCheckpointEngine(sys.argv[1], "ds-real")

    def train():
        loss = engine(torch.randn(4, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()

    for _ in range(3):
        train()
    engine.save_checkpoint(sys.argv[2])
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    saved_opt = {k: v.clone() for k, v in engine.optimizer.state[engine.module[0].weight].items()}
    for _ in range(2):
        train()
    assert not torch.equal(engine.module[0].weight, saved["0.weight"])
    path, client_state = engine.load_checkpoint(sys.argv[2])
    assert path.endswith("global_step3/mp_rank_00_model_states.pt"), path
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, saved[k]), k
    for k, v in engine.optimizer.state[engine.module[0].weight].items():
        assert torch.equal(v, saved_opt[k]), k
    engine.checkpoint_engine.close()
    print("REAL DEEPSPEED OK", deepspeed.__version__)
""")


def test_real_deepspeed_engine_saves_and_loads_through_ckptd(daemon, temp_dir):
    pytest.importorskip("deepspeed", reason="deepspeed (PyPI) is not installed")
    port = str(29500 + os.getpid() % 400)
    r = subprocess.run([sys.executable, "-c", REAL_DEEPSPEED, daemon.socket, str(temp_dir / "ds"), port],
                       env=daemon.env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "REAL DEEPSPEED OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
    assert ckpt.list_versions(daemon.root, "ds-real") == [3]
