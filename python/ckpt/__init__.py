"""ckpt: Python client of ckptd, the node-local checkpoint daemon.

The trainer keeps its state in shared-memory regions the daemon can read, registers the
tensors that live there once, and then per iteration calls ``snapshot(v)`` after the
optimizer step and ``wait_snapshot(v)`` just before the next one. Bulk data never crosses
the socket: the daemon copies it out of the regions while forward and backward run.

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

Names:
  SharedRegion  POSIX shm owned by this process (buffer protocol: memoryview, numpy, torch)
  Client        connect / register_items / snapshot / wait_snapshot / wait_durable /
                restore / status / unregister
  Level         CAPTURED, DURABLE, COMMITTED (for wait_durable)
  Registration  what register_items returns
  Error         raised for every failure (RuntimeError subclass; ``code``: gRPC status code)
  DTYPES        accepted dtype names (safetensors spelling: "F32", "BF16", "I64", ...)

Blocking calls release the GIL.
"""

from ._ckpt import DTYPES, Client, Error, Level, Registration, SharedRegion

__all__ = ["Client", "DTYPES", "Error", "Level", "Registration", "SharedRegion"]
