"""ckpt.torch: checkpoint a PyTorch trainer through ckptd, every iteration if you like.

    ck = ckpt.torch.Checkpointer(socket, "my-job", model=model, optimizer=opt, scheduler=sched)
    step = ck.load("latest") if resume else 0      # everything restored in place
    ...; opt.step(); ck.save(step)                 # returns at once; the daemon copies meanwhile

The public names of the PyTorch integration; docs/pytorch.md says what goes where, when the
trainer waits, how torn snapshots are kept out and how a restore reshards.
"""

from __future__ import annotations

# The annotations of the classes named here resolve in this module (typing.get_type_hints).
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union  # noqa: F401

import torch  # noqa: F401

from . import (Client, DaemonRestartedError, Error, Level, SharedRegion, TornSnapshotError,  # noqa: F401
               VersionNotFoundError, load_version, read_header)  # noqa: F401 (importable from ckpt.torch as before)
from ._torch_blob import BLOB  # noqa: F401 (the blob's name, for readers of the files)
from ._torch_checkpointer import Checkpointer
from ._torch_files import load_checkpoint
from ._torch_layouts import REPLICATED, Layout, flat_shard
from ._torch_tensors import StateMismatchError, UnsupportedTensorError

__all__ = [
    "Checkpointer",
    "Layout",
    "REPLICATED",
    "StateMismatchError",
    "UnsupportedTensorError",
    "VersionNotFoundError",
    "flat_shard",
    "load_checkpoint",
]

# Defined in private modules, named here: reprs, help() and pickles say ckpt.torch, as users
# import them.
for _public in (Checkpointer, Layout, StateMismatchError, UnsupportedTensorError, flat_shard, load_checkpoint):
    _public.__module__ = __name__
del _public

