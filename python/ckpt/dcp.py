"""ckpt.dcp: torch.distributed.checkpoint (DCP) storage through ckptd, with the lazy path.

    ckpt.dcp.share_memory(model, optimizer)           # once: tensors into daemon-visible memory
    writer = ckpt.dcp.Writer(None, "my-job")          # StorageWriter and AsyncStager
    reader = ckpt.dcp.Reader(None, "my-job")          # StorageReader
    dcp.load(state, storage_reader=reader)            # newest committed version
    pending = dcp.async_save(state, checkpoint_id=step, storage_writer=writer)

A DCP save is one ckptd version (checkpoint_id names its number). docs/pytorch.md,
"torch.distributed.checkpoint", says what goes where, when the futures complete and how a
load at another world size is served. Needs torch >= 2.
"""

from __future__ import annotations

from . import (Client, Error, Level, SharedRegion, VersionNotFoundError, list_versions, load_file,  # noqa: F401
               read_header)  # noqa: F401 (importable from ckpt.dcp as before)
from ._dcp_common import METADATA_BLOB, close_all, share_memory, version_of  # noqa: F401
from ._dcp_reader import Reader
from ._dcp_writer import Writer

__all__ = ["Reader", "Writer", "share_memory", "version_of"]

# Defined in private modules, named here: reprs and help() say ckpt.dcp, as users import them.
for _public in (Reader, Writer, close_all, share_memory, version_of):
    _public.__module__ = __name__
del _public
