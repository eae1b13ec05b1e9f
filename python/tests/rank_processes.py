"""Runs a script as the ranks of a gloo group, each rank a process of its own (its rank,
the world size and a free tcp://127.0.0.1 port come first in its argv, then `args`), and
returns each rank's RESULT line, parsed as JSON. A script ends with LEAVE."""

import inspect
import json
import socket
import subprocess
import sys

def leave():
    """The end of a rank's process, once it printed what it reports: every rank is past every
    collective before gloo is torn down, and the process leaves without the interpreter's
    finalization. There torch 2's gloo worker threads can still hold work objects with tensors
    (a barrier keeps the collectives before it), and the thread that drops the last one takes
    the GIL of an interpreter being finalized and aborts the process ("terminate called
    without an active exception"), after all its work is done. Skipping finalization skips the
    destructors that remove the rank's shared memory too, so it removes its own names first
    (the names libckpt gives them: ckpt-UID-PID-N, ckpt-release-PID-N; still mapped, they stay
    valid until the exit), and flushes what it printed."""
    import glob
    import os

    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
    for name in (glob.glob(f"/dev/shm/ckpt-{os.getuid()}-{os.getpid()}-*") +
                 glob.glob(f"/dev/shm/ckpt-release-{os.getpid()}-*")):
        os.unlink(name)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# leave() as the last lines of a script (run_script_ranks' scripts, torchrun workers): its
# source, so that the script needs nothing on its path.
LEAVE = "\nimport sys\n" + inspect.getsource(leave) + "\nleave()\n"


def run_script_ranks(daemon, world, script, *args, timeout=180):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world), port, *map(str, args)],
                              env=daemon.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    results = []
    for r, p in enumerate(procs):
        out = p.communicate(timeout=timeout)[0]
        assert p.returncode == 0, f"rank {r}: {out}"
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    return results
