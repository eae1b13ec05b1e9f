"""The daemon-less loader opens only regular files, without blocking or following links, and
refuses a shard whose header was changed after it was written (fixtures: conftest.py).

A load that would block on a FIFO runs in a child interpreter with a timeout, so that a
regression fails the test instead of hanging it."""

import os
import struct
import subprocess
import sys

import pytest
import torch

import ckpt

JOB = "ftypes"
CHILD_TIMEOUT_S = 30


@pytest.fixture
def committed(daemon):
    """Version 1 of a one-rank job with one F32 tensor [4, 8], committed; returns the daemon."""
    client = daemon.client()
    region = ckpt.SharedRegion.create(4 * 8 * 4)
    t = torch.frombuffer(region, dtype=torch.float32, count=32).view(4, 8)
    t.copy_(torch.arange(32, dtype=torch.float32).view(4, 8))
    client.register_items(JOB, 0, 1, [("w", "F32", [4, 8], region, 0)])
    client.snapshot(1, {})
    client.wait_durable(1, ckpt.Level.COMMITTED, timeout=60)
    yield daemon
    client.unregister()
    del client


def version_dir(root, version=1):
    return os.path.join(os.fspath(root), JOB, "v%010d" % version)


def shard_path(root, version=1):
    return os.path.join(version_dir(root, version), "rank-00000.safetensors")


def make_fifo(path):
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path, 0o600)


def run_child(code, *args):
    """Runs `code` in a fresh interpreter (same ckpt module); returns (returncode, stderr)."""
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                       timeout=CHILD_TIMEOUT_S)
    return r.returncode, r.stderr


def test_load_file_of_a_fifo_fails_at_once(temp_dir):
    fifo = os.path.join(os.fspath(temp_dir), "rank-00000.safetensors")
    make_fifo(fifo)
    rc, err = run_child("import ckpt, sys; ckpt.load_file(sys.argv[1])", fifo)
    assert rc != 0
    assert f"{fifo} is a FIFO, not a regular file" in err
    with pytest.raises(ckpt.Error, match="is a FIFO, not a regular file") as e:
        # In this process too, now that it is known not to block.
        ckpt.read_header(fifo)
    assert e.value.code == 15


def test_load_version_with_a_fifo_committed_fails_at_once(committed):
    marker = os.path.join(version_dir(committed.root), "COMMITTED")
    make_fifo(marker)
    rc, err = run_child("import ckpt, sys; ckpt.load_version(sys.argv[1], sys.argv[2], 1)", committed.root, JOB)
    assert rc != 0
    assert f"{marker} is a FIFO, not a regular file" in err


def test_load_version_with_a_fifo_shard_fails_at_once(committed):
    make_fifo(shard_path(committed.root))
    rc, err = run_child("import ckpt, sys; ckpt.load_version(sys.argv[1], sys.argv[2], 'latest')",
                        committed.root, JOB)
    assert rc != 0
    assert f"{shard_path(committed.root)} is a FIFO, not a regular file" in err


def test_a_shard_linked_from_outside_the_root_is_refused(committed, temp_dir):
    outside = os.path.join(os.fspath(temp_dir), "outside.safetensors")
    os.rename(shard_path(committed.root), outside)
    os.symlink(outside, shard_path(committed.root))
    assert ckpt.load_file(outside).tensors["w"].shape == (4, 8)  # the file itself is good
    with pytest.raises(ckpt.Error, match="is a symbolic link, not a regular file"):
        ckpt.load_file(shard_path(committed.root))
    with pytest.raises(ckpt.Error, match="is a symbolic link, not a regular file"):
        ckpt.load_version(committed.root, JOB, 1)


def test_a_dtype_changed_in_the_header_is_refused(committed):
    path = shard_path(committed.root)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + n]
    at = header.index(b'"dtype":"F32"')
    header[at:at + 13] = b'"dtype":"I32"'  # same size: the bytes are still a valid int32 [4, 8]
    data[8:8 + n] = header
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ckpt.Error, match="header checksum mismatch") as e:
        ckpt.load_file(path)
    assert e.value.code == 15
    with pytest.raises(ckpt.Error, match="header checksum mismatch"):
        ckpt.load_version(committed.root, JOB, 1)
    with pytest.raises(ckpt.Error, match="header checksum mismatch"):
        ckpt.read_header(path)


def test_a_placeholder_is_never_written_through_a_fifo_or_a_link(temp_dir):
    # ckpt.deepspeed writes its placeholder files with this; a FIFO or link in their place is
    # left alone and refused (FAILED_PRECONDITION), a regular file is truncated as before.
    fifo = os.path.join(os.fspath(temp_dir), "mp_rank_00_model_states.pt")
    make_fifo(fifo)
    code = ("import ckpt.loader as l, os, sys\n"
            "os.close(l._open_regular(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))")
    rc, err = run_child(code, fifo)
    assert rc != 0
    assert f"{fifo} is a FIFO, not a regular file" in err
    target = os.path.join(os.fspath(temp_dir), "elsewhere")
    with open(target, "w") as f:
        f.write("untouched")
    link = os.path.join(os.fspath(temp_dir), "linked.pt")
    os.symlink(target, link)
    rc, err = run_child(code, link)
    assert rc != 0 and "is a symbolic link, not a regular file" in err
    with open(target) as f:
        assert f.read() == "untouched"
    rc, err = run_child(code, target)
    assert rc == 0, err
    assert os.path.getsize(target) == 0
