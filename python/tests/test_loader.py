"""The daemon-less loader (ckpt.load_file / load_version) and the binding's item and stream
arguments, against shards written by a real ckptd (fixtures: conftest.py)."""

import os
import pickle
import threading
import time

import numpy as np
import pytest
import torch

import ckpt

JOB = "loader"

# name -> (safetensors dtype, torch dtype, shape)
SPECS = {
    "w": ("F32", torch.float32, (4, 8)),
    "h": ("F16", torch.float16, (3,)),
    "b16": ("BF16", torch.bfloat16, (2, 5)),
    "steps": ("I64", torch.int64, (6,)),
    "mask": ("BOOL", torch.bool, (7,)),
    "bytes": ("U8", torch.uint8, (9,)),
    "scalar": ("F64", torch.float64, ()),
    "empty": ("F32", torch.float32, (0, 3)),
}


class State:
    """Tensors living in one SharedRegion, registered with the daemon as one rank."""

    def __init__(self, client, rank=0, world_size=1, seed=0):
        sizes = {n: int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
                 for n, (_, dt, shape) in SPECS.items()}
        self.offsets, off = {}, 0
        for name, size in sizes.items():
            self.offsets[name] = off
            off += (size + 63) // 64 * 64
        self.region = ckpt.SharedRegion.create(max(off, 64))
        self.tensors = {}
        g = torch.Generator().manual_seed(seed)
        for name, (_, dt, shape) in SPECS.items():
            n = sizes[name] // torch.empty((), dtype=dt).element_size()
            t = torch.frombuffer(self.region, dtype=dt, count=n, offset=self.offsets[name]).view(shape) \
                if n else torch.empty(shape, dtype=dt)
            if dt.is_floating_point:
                t.copy_(torch.randn(shape, generator=g).to(dt))
            elif dt == torch.bool:
                t.copy_(torch.randint(0, 2, shape, generator=g).bool())
            else:
                t.copy_(torch.randint(0, 200, shape, generator=g).to(dt))
            self.tensors[name] = t
        self.registration = client.register_items(
            JOB, rank, world_size,
            [(name, SPECS[name][0], list(SPECS[name][2]), self.region, self.offsets[name]) for name in SPECS])

    def expected(self):
        return {n: t.clone() for n, t in self.tensors.items()}


def save(client, version, blobs=None):
    client.snapshot(version, blobs or {})
    client.wait_snapshot(version, timeout=60)
    client.wait_durable(version, ckpt.Level.COMMITTED, timeout=60)


def shard_path(root, version, rank=0):
    return os.path.join(root, JOB, "v%010d" % version, "rank-%05d.safetensors" % rank)


def assert_same(got, want):
    assert list(got) == list(want)
    for name, t in want.items():
        g = got[name]
        assert isinstance(g, torch.Tensor), (name, type(g))
        assert g.dtype == t.dtype and tuple(g.shape) == tuple(t.shape), (name, g.dtype, g.shape)
        assert torch.equal(g, t), name


@pytest.fixture
def saved(daemon):
    """Versions 1 and 2 of a one-rank job, committed; returns (daemon, state, {version: tensors})."""
    client = daemon.client()
    state = State(client)
    want = {1: state.expected()}
    save(client, 1, {"meta": pickle.dumps({"step": 1}), "raw": b"\x00\x01"})
    for t in state.tensors.values():
        if t.numel() and t.dtype != torch.bool:
            t.add_(1)
    want[2] = state.expected()
    save(client, 2, {"meta": pickle.dumps({"step": 2})})
    yield daemon, state, want
    # Drop the connection before the daemon stops: ckptd's shutdown waits up to 5 s for
    # connected clients.
    client.unregister()
    del client


def test_load_file_gives_the_saved_tensors_and_blobs(saved):
    daemon, state, want = saved
    shard = ckpt.load_file(shard_path(daemon.root, 1))
    assert isinstance(shard, ckpt.Shard)
    assert shard.meta == {"job": JOB, "version": 1, "rank": 0, "world_size": 1, "path": shard_path(daemon.root, 1)}
    assert_same(shard.tensors, want[1])
    assert shard.blobs == {"meta": pickle.dumps({"step": 1}), "raw": b"\x00\x01"}
    assert [i["name"] for i in shard.items] == list(SPECS) + ["meta", "raw"]
    assert {i["kind"] for i in shard.items} == {"tensor", "blob"}

    # The result owns its memory: writing the trainer's state or the result changes only it.
    state.tensors["w"].fill_(0)
    assert torch.equal(shard.tensors["w"], want[1]["w"])
    shard.tensors["w"].fill_(7)
    assert torch.equal(ckpt.load_file(shard_path(daemon.root, 1)).tensors["w"], want[1]["w"])


def test_load_version_by_number_and_latest(saved):
    daemon, _, want = saved
    assert ckpt.list_versions(daemon.root, JOB) == [1, 2]
    one = ckpt.load_version(daemon.root, JOB, 1, rank=0)
    assert one.version == 1 and one.rank == 0
    assert_same(one.tensors, want[1])

    latest = ckpt.load_version(daemon.root, JOB, "latest")
    assert isinstance(latest, ckpt.Checkpoint)
    assert (latest.job, latest.version, latest.world_size, list(latest.shards)) == (JOB, 2, 1, [0])
    assert_same(latest.shards[0].tensors, want[2])
    assert pickle.loads(latest.shards[0].blobs["meta"]) == {"step": 2}
    with open(os.path.join(daemon.root, JOB, "latest")) as f:
        assert int(f.read()) == 2


def test_numpy_and_raw_backends(saved):
    daemon, _, want = saved
    shard = ckpt.load_file(shard_path(daemon.root, 1), backend="numpy")
    for name, t in want[1].items():
        got = shard.tensors[name]
        if SPECS[name][0] == "BF16":  # numpy has no bfloat16
            assert isinstance(got, ckpt.RawTensor) and got.dtype == "BF16" and got.shape == (2, 5)
            assert torch.equal(torch.frombuffer(bytearray(got.data), dtype=torch.bfloat16).view(2, 5), t)
        else:
            assert isinstance(got, np.ndarray) and got.shape == tuple(t.shape), name
            assert np.array_equal(got, t.numpy()), name
    raw = ckpt.load_file(shard_path(daemon.root, 1), backend="raw").tensors["steps"]
    assert raw == ckpt.RawTensor("I64", (6,), want[1]["steps"].numpy().tobytes())
    with pytest.raises(ValueError, match="backend"):
        ckpt.load_file(shard_path(daemon.root, 1), backend="jax")


def test_read_header_reads_no_data(saved):
    daemon, _, _ = saved
    shard = ckpt.read_header(shard_path(daemon.root, 2))
    assert shard.version == 2 and shard.tensors == {} and shard.blobs == {}
    w = next(i for i in shard.items if i["name"] == "w")
    assert (w["dtype"], w["shape"], w["length"], len(w["checksum"])) == ("F32", (4, 8), 128, 16)


def test_a_corrupt_byte_is_reported_with_the_item_and_the_file(saved):
    daemon, _, want = saved
    path = shard_path(daemon.root, 1)
    header = ckpt.read_header(path)
    data_start = ckpt._ckpt.read_shard_header(path)["data_start"]
    item = next(i for i in header.items if i["name"] == "steps")
    with open(path, "r+b") as f:
        f.seek(data_start + item["offset"] + 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ckpt.Error) as e:
        ckpt.load_file(path)
    assert "'steps'" in str(e.value) and path in str(e.value) and "checksum" in str(e.value)
    assert e.value.code == 15  # DATA_LOSS
    with pytest.raises(ckpt.Error, match="steps"):
        ckpt.load_version(daemon.root, JOB, 1)
    # Without verification the (corrupt) bytes come back; other versions are untouched.
    bad = ckpt.load_file(path, verify=False).tensors["steps"]
    assert not torch.equal(bad, want[1]["steps"])
    assert_same(ckpt.load_version(daemon.root, JOB, 2, rank=0).tensors, want[2])


def test_a_truncated_shard_is_an_error(saved):
    daemon, _, _ = saved
    path = shard_path(daemon.root, 2)
    os.truncate(path, os.path.getsize(path) - 1)
    with pytest.raises(ckpt.Error):
        ckpt.load_file(path)


def test_missing_versions_raise_version_not_found(saved, temp_dir):
    daemon, _, _ = saved
    with pytest.raises(ckpt.VersionNotFoundError, match=r"version 7 .* does not exist \(committed versions: 1, 2\)"):
        ckpt.load_version(daemon.root, JOB, 7)
    # Both an Error (code NOT_FOUND, as the daemon says it) and a FileNotFoundError.
    with pytest.raises(FileNotFoundError):
        ckpt.load_version(daemon.root, JOB, 7, rank=0)
    with pytest.raises(ckpt.Error) as e:
        ckpt.load_version(daemon.root, JOB, 7)
    assert e.value.code == 5
    with pytest.raises(ckpt.VersionNotFoundError, match="no checkpoints of job 'nojob'"):
        ckpt.load_version(daemon.root, "nojob", "latest")
    # A version directory without COMMITTED (a crash mid-checkpoint) does not exist for readers.
    os.makedirs(os.path.join(daemon.root, JOB, "v%010d" % 3))
    with pytest.raises(ckpt.VersionNotFoundError, match="version 3 .* is not committed"):
        ckpt.load_version(daemon.root, JOB, 3)
    assert ckpt.load_version(daemon.root, JOB, "latest").version == 2
    os.makedirs(temp_dir / "empty" / JOB)
    with pytest.raises(ckpt.VersionNotFoundError, match="has no committed version"):
        ckpt.load_version(temp_dir / "empty", JOB, "latest")
    with pytest.raises(ValueError, match="rank 1 is outside"):
        ckpt.load_version(daemon.root, JOB, 1, rank=1)
    with pytest.raises(FileNotFoundError):
        ckpt.load_file(temp_dir / "no-such.safetensors")


@pytest.mark.parametrize("marker", [b'{"world_size": Infinity}', b"[" * 100000, b'{"world_size": 1e400}',
                                    b'{"world_size": true}', b'{"world_size": "1"}', b"\xff\xfe", b""])
def test_a_damaged_committed_marker_leaves_the_world_size_to_the_shards(saved, marker):
    daemon, _, want = saved
    with open(os.path.join(daemon.root, JOB, "v%010d" % 2, "COMMITTED"), "wb") as f:
        f.write(marker)
    checkpoint = ckpt.load_version(daemon.root, JOB, 2)
    assert (checkpoint.version, checkpoint.world_size, list(checkpoint.shards)) == (2, 1, [0])
    assert_same(checkpoint.shards[0].tensors, want[2])


def test_load_version_of_every_rank(daemon):
    clients = [daemon.client() for _ in range(2)]
    states = [State(c, rank=r, world_size=2, seed=r) for r, c in enumerate(clients)]
    for c in clients:
        c.snapshot(5, {"rank": pickle.dumps(clients.index(c))})
    for c in clients:
        c.wait_durable(5, ckpt.Level.COMMITTED, timeout=60)
    checkpoint = ckpt.load_version(daemon.root, JOB, "latest")
    assert (checkpoint.version, checkpoint.world_size, sorted(checkpoint.shards)) == (5, 2, [0, 1])
    for r, s in enumerate(states):
        assert_same(checkpoint.shards[r].tensors, s.expected())
        assert pickle.loads(checkpoint.shards[r].blobs["rank"]) == r
    assert not torch.equal(checkpoint.shards[0].tensors["w"], checkpoint.shards[1].tensors["w"])
    for c in clients:
        c.unregister()


def test_item_and_stream_arguments(daemon):
    client = daemon.client()
    region = ckpt.SharedRegion.create(4096)
    # A 4-element item is at offset 0 of its region.
    assert client.register_items(JOB, 0, 1, [("w", "F32", [16], region)]).item_count == 1
    with pytest.raises(TypeError, match="4th element"):
        client.register_items(JOB, 0, 1, [("w", "F32", [16], "region", 0)])
    with pytest.raises(TypeError, match="4th element"):
        client.register_items(JOB, 0, 1, [("w", "F32", [16], True, 0)])
    with pytest.raises(TypeError, match="4 or 5 elements"):
        client.register_items(JOB, 0, 1, [("w", "F32", [16])])
    with pytest.raises(ValueError, match="device pointer is 0"):
        client.register_items(JOB, 0, 1, [("w", "F32", [16], 0)])
    with pytest.raises(TypeError, match="stream"):
        client.snapshot(1, None, stream="default")
    with pytest.raises(TypeError, match="stream"):
        client.wait_snapshot_on_stream(1, 1.5)
    # On a host-only registration the stream-ordered wait is wait_snapshot.
    client.snapshot(1, None, stream=0)
    assert client.wait_snapshot_on_stream(1, 0) >= 0
    client.wait_durable(1, timeout=60)
    assert ckpt.load_version(daemon.root, JOB, 1, rank=0).tensors["w"].shape == (16,)
    client.unregister()


def test_a_device_pointer_without_a_gpu_is_a_clear_error(daemon):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CUDA path is tested by tests/gpu")
    client = daemon.client()
    fake = 0x7F0000000000  # not a device allocation: libckpt must refuse it, not crash
    with pytest.raises(ckpt.Error) as e:
        client.register_items(JOB, 0, 1, [("w", "F32", [16], fake)])
    assert str(e.value)


def ticks_while(fn):
    """Runs fn() while another thread ticks about every millisecond, sleeping in between
    (so it needs the GIL only to tick); returns (ticks during the call, seconds the call took).
    A call that holds the GIL throughout lets through at most a tick or two at its edges."""
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.wait(0.001):
            ticks[0] += 1

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.01)
    before, start = ticks[0], time.monotonic()
    fn()
    took, during = time.monotonic() - start, ticks[0] - before
    stop.set()
    thread.join()
    return during, took


def test_blocking_calls_release_the_gil(daemon):
    client = daemon.client()
    n = 64 << 20  # 256 MiB of F32: the flush and the read take tens of milliseconds at least
    region = ckpt.SharedRegion.create(n * 4)
    torch.frombuffer(region, dtype=torch.float32, count=n).fill_(1.5)
    client.register_items(JOB, 0, 1, [("big", "F32", [n], region, 0)])
    client.snapshot(1)
    during, took = ticks_while(lambda: client.wait_durable(1, timeout=120))
    path = shard_path(daemon.root, 1)
    read_during, read_took = ticks_while(lambda: ckpt._ckpt.read_shard(path, True))
    for what, ticks, seconds in (("wait_durable", during, took), ("read_shard", read_during, read_took)):
        if seconds >= 0.03:  # shorter calls cannot tell a release from the ticks at the edges
            assert ticks >= 5, f"{what} took {seconds * 1000:.0f} ms and let only {ticks} ticks through"
    assert torch.equal(ckpt.load_file(path).tensors["big"][:4], torch.full((4,), 1.5))
    client.unregister()


def test_levels_and_the_tier_a_restore_reads(start_daemon, temp_dir):
    d = start_daemon(extra_args=("--local", str(temp_dir / "local")))
    client = d.client()
    state = State(client, rank=0, world_size=1, seed=3)
    client.snapshot(1, {})
    client.wait_durable(1, ckpt.Level.LOCAL, timeout=60)
    client.wait_durable(1, ckpt.Level.PERSISTED, timeout=60)
    client.wait_durable(1, ckpt.Level.COMMITTED, timeout=60)
    assert ckpt.Level.PERSISTED == ckpt.Level.DURABLE
    want = state.expected()
    for t in state.tensors.values():
        t.zero_()
    version, blobs, tier = client.restore(1, with_tier=True)
    assert (version, tier) == (1, "memory")
    assert_same(state.tensors, want)
    assert client.restore(1) == (1, {})  # the two-tuple form stays
    # The loader ignores the done markers and the rank registrations beside the shards.
    assert ckpt.load_version(d.root, JOB, "latest").version == 1
    client.unregister()


def test_a_differential_shard_loads_whole_through_its_base(start_daemon, temp_dir):
    """ckptd --persistent-base-every writes a version whose items mostly did not change with
    only the changed ones; load_file and load_version read the others from the base version's
    shard, and a standard safetensors reader sees the changed items only."""
    d = start_daemon(extra_args=("--local", str(temp_dir / "local"), "--persistent-base-every", "4"))
    client = d.client()
    state = State(client)
    want = {1: state.expected()}
    save(client, 1)
    state.tensors["steps"].add_(7)
    want[2] = state.expected()
    save(client, 2)
    client.unregister()
    del client

    header = ckpt.read_header(shard_path(d.root, 2))
    left = sorted(item["name"] for item in header.items if item["in_base"])
    assert "steps" not in left and "w" in left
    # The stored items come first, then those read from the base (in name order).
    def by_name(tensors):
        return dict(sorted(tensors.items()))
    assert_same(by_name(ckpt.load_file(shard_path(d.root, 2)).tensors), by_name(want[2]))
    assert_same(by_name(ckpt.load_version(d.root, JOB, 2, rank=0).tensors), by_name(want[2]))
    assert_same(ckpt.load_file(shard_path(d.root, 1)).tensors, want[1])

    # The base gone, the version cannot be read, and the error names the base.
    base = shard_path(d.root, 1)
    os.rename(base, base + ".moved")
    with pytest.raises(ckpt.Error) as e:
        ckpt.load_file(shard_path(d.root, 2))
    assert "v0000000001" in str(e.value) and "cannot be read" in str(e.value)

    safetensors = pytest.importorskip("safetensors.torch", reason="the safetensors package is not installed")
    plain = safetensors.load_file(shard_path(d.root, 2))
    assert sorted(plain) == ["empty", "steps"]  # an empty item costs nothing to store
    assert torch.equal(plain["steps"], want[2]["steps"])
