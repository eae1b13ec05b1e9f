#!/usr/bin/env python3
"""Smoke test of the ckpt Python module against a real ckptd (no torch needed; numpy optional).

  PYTHONPATH=build/python python3 python/tests/smoke_test.py [--ckptd build/ckptd]

Starts its own daemon on a temporary socket and root, prints 'N passed, N failed'.
"""

import argparse
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ckpt

REPO = Path(__file__).resolve().parents[2]
results = []


def check(name, fn):
    try:
        fn()
        results.append((name, None))
    except Exception as e:  # noqa: BLE001 - report every failure and go on
        results.append((name, e))
        print(f"FAIL {name}: {type(e).__name__}: {e}")


def expect_raises(exc, fn, contains=""):
    try:
        fn()
    except exc as e:
        assert contains in str(e), f"message {str(e)!r} lacks {contains!r}"
        return e
    raise AssertionError(f"{exc.__name__} not raised")


def start_daemon(binary, work):
    r, w = os.pipe()
    sock = work / "s" / "ckptd.sock"
    proc = subprocess.Popen([binary, "--socket", str(sock), "--root", str(work / "root"), "--pool-mib", "64",
                             "--ready-fd", str(w), "--log-level", "warn"], pass_fds=(w,))
    os.close(w)
    ready = select.select([r], [], [], 30)[0] and os.read(r, 16) == b"ready\n"
    os.close(r)
    if not ready:
        proc.kill()
        sys.exit("ckptd did not become ready")
    return proc, str(sock)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckptd", default=str(REPO / "build" / "ckptd"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-py-smoke-"))
    proc, sock = start_daemon(args.ckptd, work)
    try:
        region = ckpt.SharedRegion.create(1 << 20)
        client = ckpt.Client.connect(sock)

        def buffer_protocol():
            m = memoryview(region)
            assert m.nbytes == len(region) == region.size == 1 << 20 and not m.readonly
            m[8:12] = b"abcd"
            assert bytes(memoryview(region)[8:12]) == b"abcd"
            m.release()

        def register_snapshot_restore():
            view = memoryview(region).cast("f")  # float32 view
            for i in range(1024, 2048):
                view[i] = float(i)
            reg = client.register_items("smoke", 0, 1, [("w", "F32", [1024], region, 4096),
                                                        ("head", "U8", [16], region, 0)])
            assert reg.item_count == 2 and reg.tensor_bytes == 4096 + 16, reg
            client.snapshot(1, {"meta": pickle.dumps({"step": 1}), "extra": bytearray(b"xy")})
            assert client.wait_snapshot(1) >= 0
            client.wait_durable(1, ckpt.Level.COMMITTED, timeout=30)
            for i in range(1024, 2048):
                view[i] = 0.0
            version, blobs = client.restore()
            assert version == 1 and pickle.loads(blobs["meta"]) == {"step": 1} and blobs["extra"] == b"xy"
            assert all(view[i] == float(i) for i in range(1024, 2048))
            view.release()

        def errors():
            fresh = ckpt.Client.connect(sock)  # a first registration is validated at once
            e = expect_raises(ckpt.Error, lambda: fresh.register_items("other", 0, 1, [("w", "F32", [1 << 20], region, 0)]),
                              "which is only")
            assert isinstance(e, RuntimeError) and e.code == 3, e.code  # INVALID_ARGUMENT
            expect_raises(ValueError, lambda: client.register_items("smoke", 0, 1, [("w", "F99", [1], region, 0)]),
                          "unknown dtype")
            expect_raises(TypeError, lambda: client.snapshot(2, {"x": "text"}), "bytes-like")
            expect_raises(ckpt.Error, lambda: client.wait_snapshot(99, timeout=0.05))
            bad = ckpt.Client.connect(str(work / "nowhere.sock"))
            expect_raises(ckpt.Error, bad.status)

        def gil_released_while_waiting():
            client.register_items("smoke", 0, 1, [("w", "F32", [1024], region, 4096)])
            version, _ = client.restore()  # continue after the restored version
            spins, stop = [0], [False]

            def spin():
                while not stop[0]:
                    spins[0] += 1

            t = threading.Thread(target=spin)
            t.start()
            time.sleep(0.01)
            before = spins[0]
            client.snapshot(version + 1)
            client.wait_durable(version + 1)
            stop[0] = True
            t.join()
            assert spins[0] > before

        def status_json():
            import json
            s = json.loads(client.status())
            assert "pool_bytes" in s, sorted(s)

        check("buffer_protocol", buffer_protocol)
        check("register_snapshot_restore", register_snapshot_restore)
        check("errors", errors)
        check("gil_released_while_waiting", gil_released_while_waiting)
        check("status_json", status_json)
        with client:
            pass
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    failed = sum(1 for _, e in results if e)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
