"""ckpt.dcp: torch.distributed.checkpoint save / async_save / load through a real ckptd.

Needs torch >= 2 with DCP's storage API and async_save (the venv of scripts/setup_torch2_venv.sh,
where ctest python_tests_torch2 runs it); under Debian's torch 1.13 every test skips, saying
why. Run:

  PYTHONPATH=build/python CKPTD_BINARY=build/ckptd CKPTCTL_BINARY=build/ckptctl \
    .venv-torch2/bin/python -m pytest -q python/tests/test_dcp.py
"""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

try:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_saver

    from torch.distributed.checkpoint.api import CheckpointException

    import ckpt.dcp
    _HAVE = hasattr(dcp, "async_save") and hasattr(state_dict_saver, "AsyncSaveResponse")
    _WHY = f"torch {torch.__version__}: DCP async_save has no AsyncSaveResponse (torch < 2.7)"
except ImportError as e:  # torch 1.x
    _HAVE, _WHY = False, f"torch {torch.__version__} has no usable torch.distributed.checkpoint ({e})"

import ckpt
from rank_processes import LEAVE  # noqa: E402

pytestmark = [pytest.mark.skipif(not _HAVE, reason=_WHY),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 32, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _state(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"step": 3, "note": "hello"}}


def _same(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, sorted(a), sorted(b))
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def _clone(sd):
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: _clone(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_clone(v) for v in sd]
    return sd


@pytest.fixture(autouse=True)
def _fresh_sessions():
    yield
    ckpt.dcp.close_all()


def test_save_load_round_trip(daemon):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt, 1)
    ckpt.dcp.share_memory(model, opt)  # the lazy path: no copies on the trainer's side
    writer = ckpt.dcp.Writer(daemon.socket, "dcp-rt")
    extra = {"scale": torch.tensor(2.5), "nothing": torch.zeros(0, 4)}  # a 0-d and an empty tensor
    saved = _clone(dict(_state(model, opt), extra=dict(_state(model, opt)["extra"], **extra)))
    dcp.save(dict(_state(model, opt), extra=dict(_state(model, opt)["extra"], **extra)), checkpoint_id="step-7",
             storage_writer=writer)
    assert writer.last_version == 7
    assert writer.last_staged_bytes == 4  # model and optimizer registered where they are; the 0-d tensor copied
    assert os.path.exists(os.path.join(daemon.root, "dcp-rt", "v0000000007", "COMMITTED"))  # level COMMITTED

    model2 = _model(seed=5)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5e-2)
    _train_step(model2, opt2, 9)  # different values everywhere
    target = _state(model2, opt2)
    target["extra"] = {"step": 0, "note": "", "scale": torch.tensor(0.0), "nothing": torch.ones(0, 4)}
    reader = ckpt.dcp.Reader(daemon.socket, "dcp-rt")
    dcp.load(target, storage_reader=reader)  # checkpoint_id None: the newest committed
    assert reader.version == 7
    model2.load_state_dict(target["model"])
    opt2.load_state_dict(target["optim"])
    _same(saved, dict(_state(model2, opt2), extra=target["extra"]))


def test_async_save_lazy_then_train(daemon):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_step(model, opt, 1)
    ckpt.dcp.share_memory(model, opt)
    writer = ckpt.dcp.Writer(daemon.socket, "dcp-async", optimizer=opt)  # waits before each step
    expected = _clone(_state(model, opt))
    resp = dcp.async_save(_state(model, opt), checkpoint_id=1, storage_writer=writer)
    assert isinstance(resp, state_dict_saver.AsyncSaveResponse)
    _train_step(model, opt, 2)  # the pre-step hook waited for the capture of version 1
    # The writer's staged future is done (the hook cleared it); DCP's staging_completion is
    # set by a callback of that future, which may run just after the hook's wait returns.
    assert writer._staged is None
    resp.staging_completion.result(timeout=60)
    resp.upload_completion.result(timeout=60)
    after = _clone(_state(model, opt))
    resp = dcp.async_save(_state(model, opt), checkpoint_id=2, storage_writer=writer)
    resp.staging_completion.result(timeout=60)
    resp.upload_completion.result(timeout=60)
    assert not any(torch.equal(a, b) for a, b in zip(expected["model"].values(), after["model"].values()))

    # read_only: version 1 from the files, the job left as it is; then through the daemon:
    # 2, and 1 again, which rolls the job back (version 2 set aside).
    for version, want, read_only in ((1, expected, True), (2, after, False), (1, expected, False)):
        m = _model(seed=3)
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        _train_step(m, o, 4)
        target = _state(m, o)
        reader = ckpt.dcp.Reader(daemon.socket, "dcp-async", read_only=read_only)
        dcp.load(target, checkpoint_id=version, storage_reader=reader)
        assert reader.source == ("files" if read_only else "daemon")
        m.load_state_dict(target["model"])
        o.load_state_dict(target["optim"])
        _same(want, _state(m, o), f"version {version}")
        assert ckpt.list_versions(daemon.root, "dcp-async") == ([1, 2] if version == 2 or read_only else [1])


def test_async_save_errors_never_leave_staging_pending(daemon):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    model = _model()
    writer = ckpt.dcp.Writer(daemon.socket, "dcp-err")
    resp = dcp.async_save({"model": model.state_dict()}, checkpoint_id="no-number-here", storage_writer=writer)
    with pytest.raises(ValueError, match="names no ckptd version"):
        resp.upload_completion.result(timeout=60)
    # Nothing was captured: staging completes (DCP reports an early failure as done), no hang.
    concurrent.futures.wait([resp.staging_completion], timeout=60)
    assert resp.staging_completion.done()

    class Broken(DefaultSavePlanner):  # fails between the writer's calls, in DCP's own code
        def create_local_plan(self):
            raise RuntimeError("planner broke")

    resp = dcp.async_save({"model": model.state_dict()}, checkpoint_id=4, storage_writer=writer, planner=Broken())
    with pytest.raises(CheckpointException, match="planner broke"):
        resp.upload_completion.result(timeout=60)
    concurrent.futures.wait([resp.staging_completion], timeout=60)
    assert resp.staging_completion.done()
    # The next wait (the optimizer hook's, or this one) reports it once, then nothing is pending.
    with pytest.raises(RuntimeError, match="async_save ended before the daemon took the snapshot"):
        writer.wait_captured(timeout=60)
    writer.wait_captured(timeout=60)
    # The writer works on after both failures.
    dcp.save({"model": model.state_dict()}, checkpoint_id=5, storage_writer=writer)
    assert writer.last_version == 5


def test_bad_checkpoint_id_and_missing_version(daemon):
    model = _model()
    writer = ckpt.dcp.Writer(daemon.socket, "dcp-bad")
    with pytest.raises(ValueError, match="names no ckptd version.*step-100"):
        dcp.save({"model": model.state_dict()}, checkpoint_id="latest-run", storage_writer=writer)
    dcp.save({"model": model.state_dict()}, checkpoint_id=3, storage_writer=writer)
    assert writer.last_staged_bytes == sum(p.numel() * 4 for p in model.parameters())  # not shared: copied
    with pytest.raises(CheckpointException, match="version 2 is not higher than 3"):  # DCP wraps it
        dcp.save({"model": model.state_dict()}, checkpoint_id=2, storage_writer=writer)
    # DCP wraps the reader's error (a ckpt.VersionNotFoundError) in a CheckpointException.
    with pytest.raises(CheckpointException, match=r"version 5 of job 'dcp-bad'.*committed versions: 3"):
        dcp.load({"model": model.state_dict()}, checkpoint_id="step-5",
                 storage_reader=ckpt.dcp.Reader(daemon.socket, "dcp-bad"))
    with pytest.raises(CheckpointException, match="job 'dcp-none' has no committed version"):
        dcp.load({"model": model.state_dict()}, storage_reader=ckpt.dcp.Reader(daemon.socket, "dcp-none"))


def test_refusals_name_the_cause(daemon):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    with pytest.raises(ValueError, match="versions start at 1"):
        ckpt.dcp.version_of(0)
    assert [ckpt.dcp.version_of(x) for x in (None, 7, "12", "step-100", "/a/b/step_9/")] == [None, 7, 12, 100, 9]
    with pytest.raises(ValueError, match="needs a job name"):
        ckpt.dcp.Writer(daemon.socket, "")
    with pytest.raises(ValueError, match="needs a job name"):
        ckpt.dcp.Reader(daemon.socket, "")
    with pytest.raises(TypeError, match="share_memory takes modules, optimizers and tensors, not dict"):
        ckpt.dcp.share_memory({"a": torch.ones(2)})
    writer = ckpt.dcp.Writer(daemon.socket, "dcp-refuse")
    with pytest.raises(CheckpointException, match="dtype torch.complex64 is not supported by ckptd"):
        dcp.save({"c": torch.ones(2, dtype=torch.complex64)}, checkpoint_id=1, storage_writer=writer)
    sd = {"a": torch.ones(3)}
    dcp.save(sd, checkpoint_id=1, storage_writer=writer, planner=DefaultSavePlanner(enable_plan_caching=True))
    with pytest.raises(CheckpointException, match="plan caching"):
        dcp.save(sd, checkpoint_id=2, storage_writer=writer, planner=DefaultSavePlanner(enable_plan_caching=True))
    with pytest.raises(ValueError, match="rank 0 is open in this process with world size 1, not 2"):
        ckpt.dcp.Writer(daemon.socket, "dcp-refuse", rank=0, world_size=2)._session()
    # A version ckpt.dcp did not write (no Metadata blob).
    with daemon.client() as c:
        region = ckpt.SharedRegion.create(64)
        c.register_items("dcp-foreign", 0, 1, [("w", "F32", [4], region, 0)])
        c.snapshot(1, {"other": b"x"})
        c.wait_durable(1)
    with pytest.raises(CheckpointException, match="version 1 of job 'dcp-foreign' was not written by ckpt.dcp"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=ckpt.dcp.Reader(daemon.socket, "dcp-foreign"))


@pytest.mark.skipif(_HAVE and not hasattr(ckpt._ckpt, "Layout"), reason="the ckpt module has no Layout (the client API of global layouts)")
def test_load_falls_back_to_the_files_when_the_daemon_cannot(daemon, monkeypatch):
    model = _model()
    sd = {"model": model.state_dict(), "extra": {"step": 9}}
    with monkeypatch.context() as m:  # a version saved without layouts (by a ckpt module that had none)
        m.setattr(ckpt._dcp_writer, "_LAYOUT", None)
        m.setattr(ckpt._dcp_writer, "_BLOB", None)
        dcp.save(sd, checkpoint_id=1, storage_writer=ckpt.dcp.Writer(daemon.socket, "dcp-old"))
    ckpt.dcp.close_all()
    # Rank 0 of 2 loads it: the daemon gives the blobs, but cannot assemble boxes of items that
    # have no layout (FAILED_PRECONDITION); the reader reads them from the files and says so.
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "extra": {"step": 0}}
    reader = ckpt.dcp.Reader(daemon.socket, "dcp-old", rank=0, world_size=2)
    with pytest.warns(RuntimeWarning, match="reading the shard files instead"):
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.source == "daemon+files"
    _same(sd, target)


# -- 2 processes on gloo (torchrun), a sharded state --------------------------------------

_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import ckpt.dcp
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

    mode, sock, job = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    W = torch.randn(8, 6, generator=g)                                # rows split over the ranks
    B = torch.randn(3, 4, 10, generator=g).to(torch.bfloat16)         # split along dimension 2
    R = torch.arange(12, dtype=torch.int64).view(3, 4)                # replicated (a plain tensor)

    def state(fill):
        if fill:
            w, b, r, meta = W, B, R, {"step": 41, "lr": [0.5, 0.25]}
        else:
            w, b, r, meta = torch.zeros_like(W), torch.zeros_like(B), torch.zeros_like(R), {"step": 0, "lr": []}
        return {"model": {"w": distribute_tensor(w.clone(), mesh, [Shard(0)]),
                          "b": distribute_tensor(b.clone(), mesh, [Shard(2)]),
                          "r": r.clone()},
                "meta": meta}

    if mode == "save":
        sd = state(True)
        ckpt.dcp.share_memory(sd["model"]["w"])                          # one lazy, the others staged
        writer = ckpt.dcp.Writer(sock, job)
        resp = dcp.async_save(sd, checkpoint_id="step-41", storage_writer=writer)
        resp.staging_completion.result(timeout=120)
        resp.upload_completion.result(timeout=120)
        print(json.dumps({"rank": rank, "version": writer.last_version}))
    else:
        sd = state(False)
        reader = ckpt.dcp.Reader(sock, job)
        dcp.load(sd, checkpoint_id=41, storage_reader=reader)
        assert reader.source == "daemon", reader.source               # each rank its own shard
        m = sd["model"]
        assert torch.equal(m["w"].full_tensor(), W), "w"
        assert torch.equal(m["b"].full_tensor(), B), "b"
        assert torch.equal(m["w"].to_local(), W.chunk(world, 0)[rank]), "w local"
        assert torch.equal(m["r"], R), "r"
        assert sd["meta"] == {"step": 41, "lr": [0.5, 0.25]}, sd["meta"]
        # Same world size, other sharding: w split by columns now (boxes of both ranks' chunks).
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        cols = {"model": {"w": distribute_tensor(torch.zeros_like(W), mesh, [Shard(1)])}}
        reader = ckpt.dcp.Reader(sock, job)
        dcp.load(cols, checkpoint_id=41, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
        assert torch.equal(cols["model"]["w"].to_local(), W.chunk(world, 1)[rank]), "w by columns"
        print(json.dumps({"rank": rank, "loaded": True, "columns_from": reader.source}))
    ckpt.dcp.close_all()
""") + LEAVE


def _torchrun(daemon, temp_dir, nproc, *args):
    script = temp_dir / "dcp_worker.py"
    script.write_text(_WORKER)
    env = daemon.env(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    # --log-dir: torchrun's files for the run; without it torchrun makes a /tmp/torchelastic_*
    # directory and never removes it.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--log-dir={temp_dir / 'torchrun-logs'}", str(script), *map(str, args)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return [json.loads(m.group(0)) for m in re.finditer(r"\{[^{}]*\}", p.stdout)]  # ranks' lines may interleave


def test_two_ranks_dtensor_save_then_load(daemon, temp_dir):
    out = _torchrun(daemon, temp_dir, 2, "save", daemon.socket, "dcp-2r")
    assert sorted((o["rank"], o["version"]) for o in out) == [(0, 41), (1, 41)]
    vdir = os.path.join(daemon.root, "dcp-2r", "v0000000041")
    assert os.path.exists(os.path.join(vdir, "COMMITTED"))
    # Each rank's shard holds its own box of w and b (DCP's chunks), under the chunk's name.
    shard1 = ckpt.load_file(os.path.join(vdir, "rank-00001.safetensors"))
    assert torch.equal(shard1.tensors["model.w@4,0"], _globals()["W"][4:])
    assert torch.equal(shard1.tensors["model.b@0,0,5"], _globals()["B"][:, :, 5:])
    assert ckpt.dcp.METADATA_BLOB in shard1.blobs
    if hasattr(ckpt._ckpt, "Layout"):  # the items carry their DCP chunk as a layout: the version's index
        index = json.load(open(os.path.join(vdir, "index.json")))
        w = index["tensors"]["model.w"]
        assert (w["shape"], w["replicated"]) == ([8, 6], False)
        assert sorted((c["rank"], tuple(c["offsets"]), tuple(c["shape"])) for c in w["chunks"]) == \
            [(0, (0, 0), (4, 6)), (1, (4, 0), (4, 6))]
        b = index["tensors"]["model.b"]
        assert sorted(tuple(c["offsets"]) for c in b["chunks"]) == [(0, 0, 0), (0, 0, 5)]
        assert index["tensors"]["model.r"]["replicated"] is True
        assert sorted(c["rank"] for c in index["tensors"]["model.r"]["chunks"]) == [0, 1]  # each rank's own copy
    out = _torchrun(daemon, temp_dir, 2, "load", daemon.socket, "dcp-2r")
    assert sorted(o["rank"] for o in out) == [0, 1]
    # The column boxes came from the daemon (a restore by layout), else from the files.
    want = "daemon" if hasattr(ckpt._ckpt, "RestoreResult") else "daemon+files"
    assert [o["columns_from"] for o in out] == [want, want]

    # One process loads what 2 ranks wrote (resharding: every box comes from both shards).
    g = _globals()
    target = {"model": {"w": torch.zeros(8, 6), "b": torch.zeros(3, 4, 10, dtype=torch.bfloat16),
                        "r": torch.zeros(3, 4, dtype=torch.int64)},
              "meta": {"step": 0, "lr": []}}
    reader = ckpt.dcp.Reader(daemon.socket, "dcp-2r")
    dcp.load(target, checkpoint_id="step-41", storage_reader=reader)
    # Through the daemon, which assembles each box from both ranks' chunks (a restore by layout
    # at another world size); from the shard files with a ckpt module without that client API.
    if hasattr(ckpt._ckpt, "RestoreResult"):
        assert (reader.source, reader.resharded) == ("daemon", True)
    else:
        assert reader.source == "files"
    for key, want in (("w", g["W"]), ("b", g["B"]), ("r", g["R"])):
        assert torch.equal(target["model"][key], want), key
    assert target["meta"] == {"step": 41, "lr": [0.5, 0.25]}
    # The same from the files alone (read_only: the job is left as it is).
    again = {"model": {k: torch.zeros_like(v) for k, v in target["model"].items()}, "meta": {"step": 0, "lr": []}}
    reader = ckpt.dcp.Reader(daemon.socket, "dcp-2r", read_only=True)
    dcp.load(again, checkpoint_id=41, storage_reader=reader)
    assert reader.source == "files"
    _same(target, again)
    # A box that straddles both ranks' chunks: rows 2..5 of w (rank 0 wrote 0..3, rank 1 4..7).
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    part = {"model": {"w": torch.zeros(8, 6)}}
    dcp.load(part, checkpoint_id=41, storage_reader=ckpt.dcp.Reader(daemon.socket, "dcp-2r"),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(part["model"]["w"], g["W"])

    # Training goes on at the new world size: version 42 by 1 rank.
    writer = ckpt.dcp.Writer(daemon.socket, "dcp-2r")
    dcp.save(target, checkpoint_id=42, storage_writer=writer)
    back = {"model": {k: torch.zeros_like(v) for k, v in target["model"].items()}, "meta": {"step": 0, "lr": []}}
    reader = ckpt.dcp.Reader(daemon.socket, "dcp-2r")
    dcp.load(back, storage_reader=reader)
    assert (reader.version, reader.source) == (42, "daemon")
    _same(target, back)


def _globals():
    g = torch.Generator().manual_seed(11)
    W = torch.randn(8, 6, generator=g)
    B = torch.randn(3, 4, 10, generator=g).to(torch.bfloat16)
    return {"W": W, "B": B, "R": torch.arange(12, dtype=torch.int64).view(3, 4)}


# -- the guide's example -------------------------------------------------------------------

_GUIDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "pytorch.md")


def test_guide_example_runs_and_resumes(daemon, temp_dir):
    blocks = re.findall(r"^```py\n(# dcp-example: (\S+)\n.*?)^```", open(_GUIDE).read(), re.S | re.M)
    assert [name for _, name in blocks] == ["dcp_train.py"]
    script = temp_dir / "dcp_train.py"
    script.write_text(blocks[0][0])
    env = daemon.env(PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    outs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, f"{script} exited {p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"
        outs.append(p.stdout.split())
    assert " ".join(outs[0]) == "resumed at step 0 saved step 3"
    assert " ".join(outs[1]) == "resumed at step 3 saved step 6"
