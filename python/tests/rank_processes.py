"""Runs a script as the ranks of a gloo group, each rank a process of its own (its rank,
the world size and a free tcp://127.0.0.1 port come first in its argv, then `args`), and
returns each rank's RESULT line, parsed as JSON. A script ends with LEAVE."""

import json
import socket
import subprocess
import sys

# The end of a rank's script, once it printed its RESULT: every rank is past every collective
# before gloo is torn down, and the process leaves without the interpreter's finalization,
# where torch 2's gloo workers can still hold tensors and abort it ("terminate called without
# an active exception") after the work is done. Skipping finalization skips the destructors
# that remove the rank's shared memory too, so it removes its own names first (the names
# libckpt gives them: ckpt-UID-PID-N, ckpt-release-PID-N; still mapped, they stay valid
# until the exit).
LEAVE = """
import glob as _glob, os as _os, torch.distributed as _dist
_dist.barrier()
_dist.destroy_process_group()
for _name in (_glob.glob(f"/dev/shm/ckpt-{_os.getuid()}-{_os.getpid()}-*") +
              _glob.glob(f"/dev/shm/ckpt-release-{_os.getpid()}-*")):
    _os.unlink(_name)
_os._exit(0)
"""


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
