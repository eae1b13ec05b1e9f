"""`ckptctl export` end to end: 4 ranks of a real ckptd write pieces of global tensors, a
replicated tensor, a private item each and a blob each; `ckptctl export` consolidates the
committed version, and the real `safetensors` package (safetensors.numpy.load_file and
safe_open) opens every file it wrote: every global tensor equals the original, the private
items are there as rank<R>/<name>, the index's weight_map and total_size are right. Also with
a --max-shard-size small enough to make several files, with --filter, and with --blobs.

Each rank declares where its items sit (ckpt.Layout); the daemon writes the version's
index.json at commit, and export reads that. Item names differ from the global names for some
tensors ("emb.shard" is a piece of "emb"), as they do in sharded trainers. One blob is written
for one rank only (for_rank); export names every blob by the rank that wrote it.
(fixtures: conftest.py)"""

import json
import os

import numpy as np
import pytest

import ckpt

st_numpy = pytest.importorskip("safetensors.numpy", reason="the `safetensors` package (PyPI) is not installed")
from safetensors import safe_open  # noqa: E402  (after the skip above)

JOB = "export"
WORLD = 4
VERSION = 1

# Global tensors and how the 4 ranks hold them: (offsets, shape) per rank.
W = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) * 0.5 - 3          # split 2 x 2 (N-d)
EMB = (np.arange(16 * 4, dtype=np.int64).reshape(16, 4) * 7919) % 1000   # split along dimension 0
CUBE = np.arange(4 * 4 * 2, dtype=np.float16).reshape(4, 4, 2)           # split along dimension 1
BIAS = np.linspace(-1, 1, 6, dtype=np.float32)                           # replicated
GLOBALS = {
    "w": (W, [((0, 0), (4, 3)), ((0, 3), (4, 3)), ((4, 0), (4, 3)), ((4, 3), (4, 3))]),
    "emb": (EMB, [((4 * r, 0), (4, 4)) for r in range(WORLD)]),
    "cube": (CUBE, [((0, r, 0), (4, 1, 2)) for r in range(WORLD)]),
}
ITEM_NAMES = {"w": "w", "emb": "emb.shard", "cube": "cube.piece"}  # the items' own names
DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.float16): "F16",
          np.dtype(np.uint8): "U8"}


def piece(array, offsets, shape):
    """The box of `array` at `offsets` of `shape`, contiguous."""
    return np.ascontiguousarray(array[tuple(slice(o, o + s) for o, s in zip(offsets, shape))])


def step_of(rank):
    return np.array([100 * rank + 7], dtype=np.int64)


def blob_of(rank):
    return ("rng state of rank %d" % rank).encode()


def rank_items(rank):
    """(name, array, layout) of everything rank `rank` registers: its pieces, the replica, its step."""
    items = []
    for name, (array, boxes) in GLOBALS.items():
        offsets, shape = boxes[rank]
        items.append((ITEM_NAMES[name], piece(array, offsets, shape),
                      ckpt.Layout(name, list(array.shape), list(offsets))))
    items.append(("bias", BIAS.copy(), ckpt.Layout(replicated=True)))
    items.append(("step", step_of(rank), None))
    return items


SAMPLER = b"sampler position, for rank 0 only"  # written by rank 3, for rank 0


def expected(blobs=False):
    """Exported name -> numpy array."""
    want = {name: array for name, (array, _) in GLOBALS.items()}
    want["bias"] = BIAS
    for r in range(WORLD):
        want["rank%d/step" % r] = step_of(r)
        if blobs:
            want["rank%d/__blob__/rng" % r] = np.frombuffer(blob_of(r), dtype=np.uint8)
    if blobs:
        want["rank3/__blob__/sampler"] = np.frombuffer(SAMPLER, dtype=np.uint8)
    return want


@pytest.fixture
def committed(daemon, temp_dir):
    """Version 1 of a 4-rank job with layouts, committed by `daemon`; yields (daemon, temp_dir)."""
    clients, regions = [], []
    for rank in range(WORLD):
        items = rank_items(rank)
        region = ckpt.SharedRegion.create(sum(a.nbytes for _, a, _ in items))
        view = np.frombuffer(region, dtype=np.uint8)
        spec, at = [], 0
        for name, array, layout in items:
            view[at:at + array.nbytes] = np.frombuffer(array.tobytes(), dtype=np.uint8)
            spec.append(ckpt.TensorItem(name, DTYPES[array.dtype], list(array.shape), region, at, layout=layout))
            at += array.nbytes
        client = daemon.client()
        client.register_items(JOB, rank, WORLD, spec)
        clients.append(client)
        regions.append(region)
    for rank, client in enumerate(clients):
        blobs = {"rng": blob_of(rank)}
        if rank == 3:
            blobs["sampler"] = ckpt.Blob(SAMPLER, for_rank=0)
        client.snapshot(VERSION, blobs)
    for client in clients:
        client.wait_durable(VERSION, ckpt.Level.COMMITTED, timeout=60)
    with open(os.path.join(daemon.root, JOB, "v%010d" % VERSION, "index.json")) as f:
        index = json.load(f)  # the daemon's, which export reads
    assert index["tensors"]["emb"]["chunks"][2]["key"] == "emb.shard"
    yield daemon, temp_dir
    for client in clients:
        client.unregister()
    del clients, regions


def export(daemon, out, *extra, check=True):
    return daemon.ctl("export", "--root", daemon.root, "--job", JOB, "--out", out, *extra, check=check)


def load_export(out):
    """name -> array over every file the index names; checks the index against the files."""
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index) == {"metadata", "weight_map"}
    files = sorted(set(index["weight_map"].values()))
    assert sorted(n for n in os.listdir(out) if n != "model.safetensors.index.json") == files
    got, total = {}, 0
    for name in files:
        path = os.path.join(out, name)
        tensors = st_numpy.load_file(path)
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata()
            assert meta["format"] == "pt"
            assert meta["ckpt.job"] == JOB and meta["ckpt.version"] == str(VERSION)
            assert sorted(f.keys()) == sorted(tensors)
            for key in f.keys():
                np.testing.assert_array_equal(f.get_tensor(key), tensors[key])
        for key, array in tensors.items():
            assert index["weight_map"][key] == name, key
            assert key not in got
            got[key] = array
            total += array.nbytes
    assert index["metadata"]["total_size"] == total
    assert sorted(index["weight_map"]) == sorted(got)
    return got, index


def check_equal(got, want):
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype, name
        assert got[name].shape == array.shape, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_export_opens_with_safetensors_and_equals_the_global_tensors(committed):
    d, tmp = committed
    out = str(tmp / "out-all")
    r = export(d, out)
    assert "exported job %s version %d (4 ranks): 8 tensors" % (JOB, VERSION) in r.stdout
    assert "5 blobs not exported" in r.stdout
    got, index = load_export(out)
    check_equal(got, expected())
    assert sorted(os.listdir(out)) == ["model.safetensors", "model.safetensors.index.json"]
    assert index["weight_map"]["rank3/step"] == "model.safetensors"


def test_export_in_several_files_with_a_small_max_shard_size(committed):
    d, tmp = committed
    out = str(tmp / "out-small")
    # In name order: bias (24 bytes) and cube (64) fit one file, emb (512) is above the limit (a
    # file of its own), w (192) and rank0/step (8) fill the next to exactly 200 bytes.
    r = export(d, out, "--max-shard-size", "0.2KB", "--json")
    report = json.loads(r.stdout)
    assert [f["tensors"] for f in report["files"]] == [
        ["bias", "cube"], ["emb"], ["w", "rank0/step"], ["rank1/step", "rank2/step", "rank3/step"]]
    got, index = load_export(out)
    check_equal(got, expected())
    assert sorted(os.listdir(out)) == ["model-%05d-of-00004.safetensors" % i for i in range(1, 5)] + [
        "model.safetensors.index.json"]
    assert index["weight_map"]["emb"] == "model-00002-of-00004.safetensors"
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in expected().values())


def test_export_with_filter_and_blobs(committed):
    d, tmp = committed
    out = str(tmp / "out-filter")
    export(d, out, "--filter", r"^(emb|cube|rank2/)", "--blobs")
    got, _ = load_export(out)
    want = {k: v for k, v in expected(blobs=True).items() if k in ("emb", "cube") or k.startswith("rank2/")}
    assert sorted(want) == ["cube", "emb", "rank2/__blob__/rng", "rank2/step"]
    check_equal(got, want)
    assert bytes(got["rank2/__blob__/rng"]) == blob_of(2)
    out = str(tmp / "out-blobs")
    export(d, out, "--blobs")
    got, _ = load_export(out)
    check_equal(got, expected(blobs=True))
    assert bytes(got["rank3/__blob__/sampler"]) == SAMPLER


def test_export_refuses_and_explains(committed):
    d, tmp = committed
    out = str(tmp / "out-refused")
    r = export(d, out, "--filter", "^decoder\\.", check=False)
    assert r.returncode == 3
    assert "ckptctl: export: --filter '^decoder\\.' matches none of the 13 tensors" in r.stderr
    assert not os.path.exists(out)
    r = export(d, out, "--max-shard-size", "5Gb", check=False)
    assert r.returncode == 2 and "ambiguous unit 'Gb'" in r.stderr
    export(d, out)
    r = export(d, out, check=False)
    assert r.returncode == 2 and "--force" in r.stderr
    export(d, out, "--force", "--max-shard-size", "200")
    got, _ = load_export(out)  # the single file of the first export was replaced, not left beside
    check_equal(got, expected())
