"""ckpt: Python client of ckptd, the node-local checkpoint daemon, and a reader of its files.

The trainer keeps its state in shared-memory regions the daemon can read (or in GPU memory),
registers the tensors that live there once, and then per iteration calls ``snapshot(v)``
after the optimizer step and ``wait_snapshot(v)`` just before the next one. Bulk data never
crosses the socket: the daemon copies it out while forward and backward run.

    import ckpt, torch
    region = ckpt.SharedRegion.create(n * 4)
    w = torch.frombuffer(region, dtype=torch.float32, count=n)   # no copy
    client = ckpt.Client.connect("/run/ckptd/ckptd.sock")
    client.register_items("job", rank, world, [("w", "F32", [n], region, 0)])
    for v in range(1, iters + 1):
        loss = forward_backward()
        if v > 1:
            client.wait_snapshot(v - 1)   # the stall: returns seconds blocked
        optimizer.step()
        client.snapshot(v, {"step": pickle.dumps(...)})

Items passed to register_items are tuples:
    (name, dtype, shape, region[, offset])      host tensor at `offset` bytes into a SharedRegion
    (name, dtype, shape, device_ptr[, offset])  GPU tensor at device_ptr + offset, an int such
                                                as t.data_ptr() of a contiguous CUDA tensor
                                                (needs a libckpt built with CUDA)
For GPU tensors, snapshot(v, blobs, stream=s) takes the version after the work queued on
CUDA stream s, and wait_snapshot_on_stream(v, s) makes s wait for the copies instead of
blocking the host; s is an int cudaStream_t (0: the legacy default stream) or a
torch.cuda.Stream.

Reading checkpoints without a daemon (ckpt.loader; checksums verified):
    shard = ckpt.load_file("ROOT/JOB/v0000000042/rank-00000.safetensors")
    shard.tensors["w"], shard.blobs["step"], shard.meta["version"]
    ckpt.load_version("ROOT", "JOB", "latest", rank=0)     -> Shard
    ckpt.load_version("ROOT", "JOB", 42)                   -> Checkpoint (.shards: rank -> Shard)
Tensors come back as torch tensors if torch imports, else numpy arrays, else RawTensor.

Names:
  SharedRegion  POSIX shm owned by this process (buffer protocol: memoryview, numpy, torch)
  Client        connect / register_items / snapshot / wait_snapshot / wait_snapshot_on_stream / abort_snapshot /
                wait_durable / restore / status / unregister / report_stall (the stall the next
                snapshot reports, for waits run on a thread of their own)
  Level         CAPTURED, LOCAL, PERSISTED (= DURABLE), COMMITTED (for wait_durable)
  Registration  what register_items returns
  Error         raised for every failure (RuntimeError subclass; ``code``: gRPC status code)
  DaemonRestartedError  versions lost to a restart of the daemon (a subclass of Error;
                ``versions``: their numbers). The client reconnects by itself (within
                Client.connect's reconnect_budget, default 120 s) and registers again.
  TornSnapshotError  a version aborted because registered memory changed during its copy
                (a subclass of Error; ``version``: its number): never committed
  VersionNotFoundError  a version or job that does not exist or is not committed (a subclass
                of Error and of FileNotFoundError)
  DTYPES        accepted dtype names (safetensors spelling: "F32", "BF16", "I64", ...)
  load_file, load_version, list_versions, read_header, Shard, Checkpoint, RawTensor
                the daemon-less reader (see ckpt.loader)

Every blocking call (connect, register_items, snapshot, the waits, restore, status,
unregister, and the file reads of the loader) releases the GIL.
"""

from ._ckpt import (DTYPES, Blob, Client, DaemonRestartedError, Error, Layout, Level, Registration, RestoreResult,
                    SharedRegion, TensorItem, TornSnapshotError)
from .loader import (Checkpoint, RawTensor, Shard, VersionNotFoundError, list_versions, load_file, load_version,
                     read_header)

__all__ = ["Blob", "Checkpoint", "Client", "DTYPES", "DaemonRestartedError", "Error", "Layout", "Level", "RawTensor",
           "Registration", "RestoreResult", "Shard", "SharedRegion", "TensorItem", "TornSnapshotError",
           "VersionNotFoundError",
           "list_versions", "load_file", "load_version", "read_header"]
