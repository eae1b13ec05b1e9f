"""Global layouts from Python (ckpt.Layout, ckpt.TensorItem, ckpt.Blob.for_rank): what a
version's shards and its index.json hold, opened with the real safetensors package.

Two ranks (two clients of one daemon) write a row-split tensor, a 2-D grid split, a
replicated tensor and a private item; blobs for every rank and for one."""

import json
import os
import struct

import pytest

import ckpt


def _rank_items(rank, region):
    # "w" [4, 3]: rows split in two; "grid" [2, 4]: rank r holds columns [2r, 2r + 2);
    # "bias" replicated; "step" private.
    return [
        ckpt.TensorItem("w.part", "F32", [2, 3], region, 0,
                        layout=ckpt.Layout("w", [4, 3], [2 * rank, 0])),
        ("grid", "F32", [2, 2], region, 24, ckpt.Layout(global_shape=[2, 4], offsets=[0, 2 * rank])),
        ("bias", "F32", [3], region, 40, ckpt.Layout(replicated=True)),
        ("step", "I64", [1], region, 56),
    ]


def test_layouts_reach_the_shards_and_the_index(daemon):
    clients, regions = [], []
    for rank in range(2):
        region = ckpt.SharedRegion.create(64)
        view = memoryview(region).cast("B")
        view[0:24] = struct.pack("6f", *[float(10 * rank + i) for i in range(6)])
        view[24:40] = struct.pack("4f", *[float(100 + 10 * rank + i) for i in range(4)])
        view[40:52] = struct.pack("3f", 1.0, 2.0, 3.0)
        view[56:64] = struct.pack("q", 7 + rank)
        c = daemon.client()
        c.register_items("pylayout", rank, 2, _rank_items(rank, region))
        clients.append(c)
        regions.append(region)
    for rank, c in enumerate(clients):
        blobs = {"rng": b"rng%d" % rank}
        if rank == 1:
            blobs["sampler"] = ckpt.Blob(b"only for rank 0", for_rank=0)
        c.snapshot(3, blobs)
    for c in clients:
        c.wait_durable(3)

    vdir = os.path.join(daemon.root, "pylayout", "v0000000003")
    with open(os.path.join(vdir, "index.json")) as f:
        index = json.load(f)
    assert index["format"] == "ckptd-index/1"
    assert index["world_size"] == 2
    assert set(index["tensors"]) == {"w", "grid", "bias"}
    assert index["tensors"]["w"]["shape"] == [4, 3]
    assert index["tensors"]["w"]["chunks"][1] == {"rank": 1, "file": "rank-00001.safetensors", "key": "w.part",
                                                 "offsets": [2, 0], "shape": [2, 3]}
    assert index["tensors"]["grid"]["chunks"][0]["offsets"] == [0, 0]
    assert index["tensors"]["bias"]["replicated"] is True
    assert len(index["tensors"]["bias"]["chunks"]) == 2
    assert index["private"]["1"] == [{"name": "step", "file": "rank-00001.safetensors", "key": "step",
                                      "dtype": "I64", "shape": [1]}]
    sampler = [b for b in index["blobs"] if b["name"] == "sampler"]
    assert sampler == [{"rank": 1, "name": "sampler", "file": "rank-00001.safetensors", "key": "__blob__/sampler",
                        "bytes": 15, "for_rank": 0}]

    safetensors = pytest.importorskip("safetensors", reason="pip install --target build/pydeps safetensors")
    from safetensors import safe_open
    for rank in range(2):
        with safe_open(os.path.join(vdir, "rank-%05d.safetensors" % rank), framework="np") as f:
            md = f.metadata()
            assert md["ckpt.format_version"] == "3"
            assert json.loads(md["ckpt.layout.grid"]) == {"global": "grid", "shape": [2, 4], "offsets": [0, 2 * rank]}
            assert md["ckpt.blocks.w.part"].startswith("1048576 ")
            assert f.get_tensor("w.part").tolist() == [[10.0 * rank + 3 * r + c for c in range(3)] for r in range(2)]
            assert f.get_tensor("step").tolist() == [7 + rank]
    assert safetensors is not None

    # The restore result object: the old tuple form is unchanged beside it.
    result = clients[1].restore(result=True)
    assert isinstance(result, ckpt.RestoreResult)
    assert result.version == 3
    assert {b.name for b in result.blobs} == {"rng", "sampler"}
    assert all(isinstance(b.from_rank, int) for b in result.blobs)
    version, blobs = clients[0].restore()
    assert version == 3 and blobs["rng"] == b"rng0"


def test_a_bad_layout_is_refused_naming_the_item(daemon):
    region = ckpt.SharedRegion.create(64)
    c = daemon.client()
    with pytest.raises(ckpt.Error) as e:
        c.register_items("pybad", 0, 1, [("w", "F32", [2, 3], region, 0, ckpt.Layout("w", [4, 3], [3, 0]))])
    assert e.value.code == 3
    assert "'w': layout box offsets [3,0] + shape [2,3] does not fit the global shape [4,3]" in str(e.value)
    c.register_items("pybad", 0, 1, [("w", "F32", [2, 3], region, 0)])
    with pytest.raises(ckpt.Error) as e:
        c.snapshot(1, {"x": ckpt.Blob(b"1", for_rank=1)})
    assert "blob 'x' is for rank 1, which is not a rank of world size 1" in str(e.value)
    with pytest.raises(ValueError):
        c.snapshot(1, {"x": ckpt.Blob(b"1", name="y")})


def test_layout_objects_round_trip():
    import pickle
    l = ckpt.Layout("g", [4, 6], [2, 3])
    assert pickle.loads(pickle.dumps(l)) == l
    assert l != ckpt.Layout("g", [4, 6], [2, 0])
    assert "global_shape=[4, 6]" in repr(l)
    t = ckpt.TensorItem("x", "BF16", [3], device_ptr=4096, layout=ckpt.Layout(replicated=True))
    assert t.dtype == "BF16" and t.device_ptr == 4096 and t.layout.replicated
    b = ckpt.Blob(bytearray(b"ab"), for_rank=2)
    assert b.data == b"ab" and b.for_rank == 2 and b.from_rank == 0
