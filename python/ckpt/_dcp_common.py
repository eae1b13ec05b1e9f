"""What ckpt.dcp's Writer and Reader share: the torch.distributed.checkpoint API it needs
(torch >= 2), checkpoint_id -> version, item and blob names, share_memory() and its regions, and
the one registration per (socket, job, rank). See docs/pytorch.md, "torch.distributed.checkpoint"."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

import torch


# The DCP API the Writer and the Reader build on, imported here once for both, so that
# `import ckpt.dcp` on torch 1.x fails with one ImportError that says why.
try:  # noqa: F401 (re-exported to _dcp_writer and _dcp_reader)
    import torch.distributed as _dist
    from torch.distributed.checkpoint import state_dict_saver as _saver
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
    from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                      WriteItemType)
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
    from torch.futures import Future as _TorchFuture
except ImportError as e:  # torch 1.x: no DCP storage API of this shape
    raise ImportError(f"ckpt.dcp needs torch >= 2 with torch.distributed.checkpoint (this is torch "
                      f"{torch.__version__}: {e})") from e


from . import _ckpt
from . import Client, Error, SharedRegion, list_versions
from ._torch_launcher import _rank_and_world
from ._torch_tensors import _TORCH_TO_CODE

METADATA_BLOB = "dcp.metadata"  # pickled DCP Metadata, in every rank's shard
_BYTES_PREFIX = "dcp.bytes:"  # + fqn: a bytes item (torch.save'd value)
_ALIGN = 64
_HAS_RESPONSE = hasattr(_saver, "AsyncSaveResponse")  # torch >= 2.7: staging futures
# Parts of the client API an older ckpt module may lack (each use checks): item layouts, blobs
# for one rank, restore results.
_LAYOUT = getattr(_ckpt, "Layout", None)
_BLOB = getattr(_ckpt, "Blob", None)
_RESULT = hasattr(_ckpt, "RestoreResult")
_FAILED_PRECONDITION = 9

# ----------------------------------------------------------------------------------------
# checkpoint_id <-> version


_TRAILING = re.compile(r"(\d+)$")


def version_of(checkpoint_id: Union[int, str, os.PathLike, None]) -> Optional[int]:
    """The ckptd version a checkpoint_id names (None for None); ValueError if it names none."""
    if checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, bool):
        raise ValueError(f"checkpoint_id {checkpoint_id!r} is not a version")
    if isinstance(checkpoint_id, int):
        v = checkpoint_id
    else:
        text = os.fspath(checkpoint_id)
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        last = os.path.basename(text.rstrip("/"))
        m = _TRAILING.search(last)
        if m is None:
            raise ValueError(f"checkpoint_id {checkpoint_id!r} names no ckptd version: ckpt.dcp takes None, an "
                             f"int, a string of digits, or a name or path whose last component ends in digits "
                             f"(such as 'step-100')")
        v = int(m.group(1))
    if v < 1:
        raise ValueError(f"checkpoint_id {checkpoint_id!r}: ckptd versions start at 1")
    return v


# ----------------------------------------------------------------------------------------
# Names


def _safe(name: str) -> str:
    """`name` if ckptd takes it as an item name (printable ASCII, no '/', no '..'), else a
    digest of it (deterministic: writer and reader compute the same)."""
    if (name and len(name) <= 200 and name.isascii() and name.isprintable() and "/" not in name
            and ".." not in name and name != "__metadata__" and not name.startswith(_BYTES_PREFIX)
            and name != METADATA_BLOB):
        return name
    return "dcp#" + hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()


def _item_name(fqn: str, offsets) -> str:
    """The ckptd item of DCP chunk (fqn, offsets): fqn itself for the chunk at the origin."""
    base = _safe(fqn)
    offsets = [int(o) for o in offsets or ()]
    if not any(offsets):
        return base
    return f"{base}@{','.join(map(str, offsets))}"


def _blob_name(fqn: str) -> str:
    return _BYTES_PREFIX + _safe(fqn)


# ----------------------------------------------------------------------------------------
# Daemon-visible memory


class _Regions:
    """Shared regions whose memory tensors may live in: address ranges -> region."""

    def __init__(self):
        self._lock = threading.Lock()
        self._spans: List[Tuple[int, int, SharedRegion]] = []

    def add(self, region: SharedRegion) -> int:
        base = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
        with self._lock:
            self._spans.append((base, region.size, region))
        return base

    def find(self, t: torch.Tensor) -> Optional[Tuple[SharedRegion, int]]:
        """(region, offset) of a contiguous CPU tensor whose bytes lie in one region."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.layout != torch.strided:
            return None
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        with self._lock:
            for base, size, region in self._spans:
                if base <= ptr and ptr + n <= base + size:
                    return region, ptr - base
        return None


_SHARED = _Regions()  # regions of share_memory()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a DTensor (its local shard), else t."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def share_memory(*objects: Any) -> int:
    """Moves the CPU tensors of modules (parameters, buffers) and optimizers (per-parameter
    state) into daemon-visible shared memory, in place (`t.data = view`: the objects stay the
    same), so that a ckpt.dcp save needs no copy on the trainer's side. DTensors move their
    local shard. Tensors that do not own their whole storage (views, FSDP2's flat shards),
    non-contiguous or GPU tensors are left alone (saves copy them). Returns the bytes moved.
    Call it again after optimizer state appeared (after the first step) to move that too."""
    todo: List[torch.Tensor] = []
    seen = set()

    def consider(t):
        if not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        if id(t) in seen or t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
            return
        if t.numel() == 0 or t.dtype not in _TORCH_TO_CODE or _SHARED.find(t) is not None:
            return
        storage = t.untyped_storage()
        if t.storage_offset() != 0 or storage.nbytes() != t.numel() * t.element_size():
            return  # a view of a larger storage: moving it would break the sharing
        seen.add(id(t))
        todo.append(t)

    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for t in obj.parameters():
                consider(t)
            for t in obj.buffers():
                consider(t)
        elif isinstance(obj, torch.optim.Optimizer):
            for st in obj.state.values():
                for v in st.values():
                    consider(v)
        elif isinstance(obj, torch.Tensor):
            consider(obj)
        else:
            raise TypeError(f"share_memory takes modules, optimizers and tensors, not {type(obj).__name__}")
    if not todo:
        return 0
    offsets, size = [], 0
    for t in todo:
        offsets.append(size)
        size += (t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
    region = SharedRegion.create(size)
    _SHARED.add(region)
    with torch.no_grad():
        for t, off in zip(todo, offsets):
            view = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape)
            view.copy_(t)
            t.data = view
    return size


# ----------------------------------------------------------------------------------------
# One registration per (socket, job, rank): the daemon takes one per rank, and a writer and
# a reader of the same job in one process share it.


class _Session:
    def __init__(self, client: Client, job: str, rank: int, world_size: int):
        self.client, self.job, self.rank, self.world_size = client, job, rank, world_size
        self.lock = threading.RLock()
        self.key: Any = None  # what is registered now
        self.registration = None
        self.keep: List[Any] = []  # regions the registration refers to
        self.last_version = 0
        self._root: Optional[str] = None

    def register(self, key, items, keep) -> None:
        with self.lock:
            if key == self.key and self.registration is not None:
                return
            # Callers hold no version in capture here: every save waits for its capture
            # before it returns the lock.
            self.registration = self.client.register_items(self.job, self.rank, self.world_size, items)
            self.key, self.keep = key, keep
            self.last_version = max(self.last_version, int(self.registration.latest_committed))

    def newest(self) -> int:
        """The newest version this job committed (files under the root) or this process saved."""
        root = self.root()
        versions = list_versions(root, self.job) if root else []
        return max([self.last_version] + versions[-1:])

    def root(self) -> str:
        if self._root is None:
            self._root = json.loads(self.client.status()).get("root", "")
        return self._root


_SESSIONS: Dict[Tuple[str, str, int], _Session] = {}
_SESSIONS_LOCK = threading.Lock()


def _session(client_or_socket, job: str, rank: Optional[int], world_size: Optional[int],
             reconnect_budget: Optional[float]) -> _Session:
    rank, world_size = _rank_and_world(rank, world_size)
    if isinstance(client_or_socket, Client):
        key = (f"client:{id(client_or_socket)}", job, rank)
    else:
        key = (os.fspath(client_or_socket) if client_or_socket is not None else "", job, rank)
    with _SESSIONS_LOCK:
        s = _SESSIONS.get(key)
        if s is not None:
            if s.world_size != world_size:
                raise ValueError(f"job '{job}' rank {rank} is open in this process with world size "
                                 f"{s.world_size}, not {world_size}")
            return s
        client = client_or_socket if isinstance(client_or_socket, Client) else Client.connect(key[0], reconnect_budget)
        s = _SESSIONS[key] = _Session(client, job, rank, world_size)
        return s


class _SessionOf:
    """What Reader and Writer share: their _Session (of `self._target`), made at first use."""

    _s: Optional[_Session] = None

    def _session(self) -> _Session:
        if self._s is None:
            self._s = _session(*self._target)
        return self._s


def close_all() -> None:
    """Ends every registration ckpt.dcp opened in this process (versions in flight complete)."""
    with _SESSIONS_LOCK:
        sessions = list(_SESSIONS.values())
        _SESSIONS.clear()
    for s in sessions:
        try:
            s.client.unregister()
        except Error:
            pass
