"""Peer replication from Python: two daemons stand for two nodes (--replicas 1,
loopback TCP), one rank on each. Node 1's shard headers never reach the persistent tier
(CKPTD_TEST_FAULT), so version 2 is replicated but not committed; node 1 is then lost (kill -9,
its local tier deleted) and a replacement daemon takes its place. restore() of the newest
version gives version 2 on both ranks, byte-exact, from memory (node 1's rank from node 0's
replica), and says it was not committed."""

import os
import shutil
import socket
import struct
from pathlib import Path

import pytest

ckpt = pytest.importorskip("ckpt")


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def fill(region, v, rank):
    memoryview(region).cast("B")[0:64] = struct.pack("16f", *[float(1000 * v + 100 * rank + i) for i in range(16)])


def content(region):
    return list(struct.unpack("16f", bytes(memoryview(region).cast("B")[0:64])))


def launch(nodes, job):
    """A rank on each node, registered: (client, region) per rank."""
    ranks = []
    for rank in range(2):
        region = ckpt.SharedRegion.create(64)
        c = nodes[rank].client()
        c.register_items(job, rank, 2, [("w", "F32", [16], region, 0)])
        ranks.append((c, region))
    return ranks


def test_a_replicated_version_not_committed_restores_after_a_node_loss(start_daemon, temp_dir):
    root = temp_dir / "persistent"
    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    secret = temp_dir / "peer-secret"
    secret.write_text("a secret the two test daemons share\n")
    os.chmod(secret, 0o600)
    gate = temp_dir / "persistence-hangs"

    def node(i, slow=False):
        args = ["--local", str(temp_dir / f"node{i}" / "local"), "--memory-mib", "64", "--replicas", "1",
                "--peer-listen", peers[i], "--peers", ",".join(peers), "--peer-secret", str(secret)]
        if slow:
            os.environ["CKPTD_TEST_FAULT"] = ("file=header,op=write,fault=slow,delay_ms=600000,under="
                                              f"{root},while={gate}")
        try:
            return start_daemon(root=root, socket=temp_dir / f"node{i}" / "ckptd.sock", extra_args=args)
        finally:
            os.environ.pop("CKPTD_TEST_FAULT", None)

    nodes = [node(0), node(1, slow=True)]

    ranks = launch(nodes, "pyrepl")
    for v in (1, 2):
        if v == 2:
            gate.write_text("x")
        for rank, (c, region) in enumerate(ranks):
            fill(region, v, rank)
            c.snapshot(v, {"step": b"%d" % v})
        for c, _ in ranks:
            c.wait_durable(v, ckpt.Level.REPLICATED if v == 2 else ckpt.Level.COMMITTED)
    vdir = root / "pyrepl" / "v0000000002"
    assert not (vdir / "COMMITTED").exists()
    assert "v2          replicated" in nodes[0].ctl("ls", "--job", "pyrepl").stdout

    # Node 1 is gone; its replacement has a sound disk.
    del ranks
    nodes[1].kill()
    shutil.rmtree(temp_dir / "node1" / "local")
    nodes[1] = node(1)
    for rank, (c, region) in enumerate(launch(nodes, "pyrepl")):
        r = c.restore(result=True)
        assert r.version == 2
        assert r.uncommitted is True
        assert r.tier == ("peer" if rank == 1 else "memory")
        assert content(region) == [float(2000 + 100 * rank + i) for i in range(16)]
        assert {b.name: b.data for b in r.blobs} == {"step": b"2"}
        assert "uncommitted=True" in repr(r)
    assert "1 restore(s) of a version not committed yet" in nodes[1].ctl("status").stdout


def test_replicas_stay_when_trainers_end_and_go_when_the_job_is_finished(start_daemon, temp_dir):
    """A trainer that ends (a crash, a failed collective: Python leaves through an exception,
    and the client unregisters) keeps the job's replicas at the peers for the restart;
    unregister(finished=True) from the job's last trainer on a node lets the job go there."""
    import json

    root = temp_dir / "persistent"
    peers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    secret = temp_dir / "peer-secret"
    secret.write_text("a secret the two test daemons share\n")
    os.chmod(secret, 0o600)
    nodes = [start_daemon(root=root, socket=temp_dir / f"node{i}" / "ckptd.sock",
                          extra_args=["--memory-mib", "64", "--replicas", "1", "--peer-listen", peers[i],
                                      "--peers", ",".join(peers), "--peer-secret", str(secret)])
             for i in range(2)]

    def held(i):
        status = json.loads(nodes[i].ctl("status", "--json").stdout)
        return sum(int(p.get("held_bytes", 0)) for p in status.get("peers", []))

    ranks = launch(nodes, "pyfinish")
    for rank, (c, region) in enumerate(ranks):
        fill(region, 1, rank)
        c.snapshot(1)
    for c, _ in ranks:
        c.wait_durable(1, ckpt.Level.COMMITTED)
    for c, _ in ranks:
        c.unregister()  # ended, not finished
    assert held(0) > 0 and held(1) > 0
    # The restart restores from memory (own images, not files), then the run completes.
    for rank, (c, region) in enumerate(launch(nodes, "pyfinish")):
        assert c.restore(result=True).tier == "memory"
        c.unregister(finished=True)
    assert held(0) == 0 and held(1) == 0
