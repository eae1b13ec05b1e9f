"""ckpt.deepspeed: a DeepSpeed checkpoint engine that saves through ckptd.

    engine, *_ = deepspeed.initialize(model=model, config=config, ...)
    engine.checkpoint_engine = ckpt.deepspeed.CkptdCheckpointEngine(socket, "my-job")
    engine.save_checkpoint(save_dir)            # returns once the state is staged
    engine.load_checkpoint(save_dir)            # reads it back (the newest tag in save_dir/latest)

docs/pytorch.md, "DeepSpeed", says what each engine call does and what the trainer waits for.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import Client, Level, SharedRegion, load_version
from .loader import _open_regular
from ._torch_tensors import _TORCH_TO_CODE, UnsupportedTensorError

try:  # DeepSpeed's base class where DeepSpeed is installed
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine as _Base

    HAVE_DEEPSPEED = True
except Exception:  # not installed, or fails to import (no accelerator support...)
    HAVE_DEEPSPEED = False

    class _Base:  # the methods of DeepSpeed's CheckpointEngine that have a default
        def __init__(self, config_params=None):
            self.name = None

        def makedirs(self, path, exist_ok=False):
            os.makedirs(path, exist_ok=exist_ok)

        def is_data_parallel_writer(self, dp_rank):
            return dp_rank == 0

        def is_decoupled(self):
            return False

        def set_commit_info(self, info):
            pass

        def get_commit_info(self):
            return None

        def cleanup(self):
            pass

        def preserves_storage_sharing(self):
            return True


__all__ = ["CkptdCheckpointEngine", "HAVE_DEEPSPEED"]

BLOB = "ckpt.deepspeed"
_FORMAT = 1
_ALIGN = 64
_PLACEHOLDER_KEY = "ckptd"


class _Ref:
    """Where a tensor stood in a saved structure: the tensor item that holds it."""

    __slots__ = ("item",)

    def __init__(self, item: str):
        self.item = item

    def __reduce__(self):
        return (_Ref, (self.item,))


class _Staged:
    """One file's tensors in a staging region: (item, dtype, shape) layout, region, views."""

    def __init__(self, layout: List[Tuple[str, torch.dtype, Tuple[int, ...]]]):
        self.layout = layout
        self.offsets, size = [], 0
        for _, dtype, shape in layout:
            self.offsets.append(size)
            n = 1
            for d in shape:
                n *= d
            size += (n * torch.empty((), dtype=dtype).element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        self.region = SharedRegion.create(max(size, 1))
        self.views = []
        for (_, dtype, shape), off in zip(layout, self.offsets):
            n = 1
            for d in shape:
                n *= d
            view = torch.frombuffer(self.region, dtype=dtype, count=n, offset=off) if n else torch.empty(0, dtype=dtype)
            self.views.append(view.view(shape))

    def items(self):
        return [(name, _TORCH_TO_CODE[dtype], list(shape), self.region, off)
                for (name, dtype, shape), off in zip(self.layout, self.offsets) if _numel(shape)]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tag_of(info: Any) -> str:
    return str(info.tag if hasattr(info, "tag") else info)


def _valid_name(name: str) -> bool:
    return (0 < len(name) <= 255 and name.isascii() and name.isprintable() and "/" not in name
            and ".." not in name and name != "__metadata__")


class CkptdCheckpointEngine(_Base):
    """DeepSpeed checkpoint engine backed by ckptd (see the module docstring).

    client_or_socket: a ckpt.Client or the daemon's socket path (None: default socket).
    job: the ckptd job id (one per training run). rank, world_size: default to
    torch.distributed's when it is initialised, else 0 and 1. Every rank must call create and
    commit for every tag (DeepSpeed does), even a rank that saves no file: a version commits
    when all ranks have their shard. root: the daemon's checkpoint root, for load (default:
    what the daemon's status says). config_params: DeepSpeed's config (unused).
    """

    def __init__(self, client_or_socket: Union[Client, str, os.PathLike, None] = None, job: str = "deepspeed", *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 root: Optional[Union[str, os.PathLike]] = None, config_params: Any = None):
        super().__init__(config_params)
        self.name = "CkptdCheckpointEngine"
        if isinstance(client_or_socket, Client):
            self._client = client_or_socket
        else:
            self._client = Client.connect("" if client_or_socket is None else os.fspath(client_or_socket))
        dist = torch.distributed
        initialised = dist.is_available() and dist.is_initialized()
        self.job = job
        self.rank = int(rank if rank is not None else (dist.get_rank() if initialised else 0))
        self.world_size = int(world_size if world_size is not None else (dist.get_world_size() if initialised else 1))
        self._root = os.fspath(root) if root is not None else None
        self._staging: Dict[str, _Staged] = {}  # file name -> its staging memory (reused)
        self._tag: Optional[str] = None
        self._version: Optional[int] = None
        self._files: Dict[str, Any] = {}  # file name -> structure with _Ref for tensors
        self._registered: Optional[List[Tuple[str, int]]] = None
        self._pending: Optional[int] = None
        self._last: Optional[int] = None
        self._cache: Optional[Tuple[int, Dict[str, torch.Tensor], Dict[str, Any]]] = None
        # Registering (with no items yet) waits for this rank's versions still in flight
        # from an earlier process, so that load() then sees them committed.
        self._latest = self._client.register_items(self.job, self.rank, self.world_size, []).latest_committed

    # -- DeepSpeed's interface ---------------------------------------------------------------

    def create(self, info: Any) -> None:
        """Starts the checkpoint of tag `info` (CheckpointCommitInfo or a tag string)."""
        self.wait_snapshot()  # the staging memory is the previous version's until captured
        tag = _tag_of(info)
        m = re.search(r"(\d+)$", tag)
        version = int(m.group(1)) if m else max(self._last or 0, self._latest) + 1
        if version <= 0:
            raise ValueError(f"tag {tag!r} gives version {version}; ckptd versions start at 1")
        self._tag, self._version, self._files = tag, version, {}

    def save(self, state_dict: Any, path: str) -> None:
        """Stages `state_dict` as the file `path` of the current tag."""
        if self._tag is None:  # a caller that skips create(): the tag is the directory name
            self.create(os.path.basename(os.path.dirname(os.path.abspath(path))))
        fname = os.path.basename(path)
        if fname in self._files:
            raise ValueError(f"{path}: file {fname!r} was already saved in tag {self._tag!r}")
        tensors: List[Tuple[str, torch.Tensor]] = []
        structure = self._flatten(state_dict, fname, [], tensors, ({}, set()))
        layout = [(name, t.dtype, tuple(t.shape)) for name, t in tensors]
        staged = self._staging.get(fname)
        if staged is None or staged.layout != layout:
            staged = self._staging[fname] = _Staged(layout)
        with torch.no_grad():
            for view, (_, t) in zip(staged.views, tensors):
                view.copy_(t)
        self._files[fname] = structure
        fd = _open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w") as f:  # DeepSpeed's loader globs the tag directory for files
            json.dump({_PLACEHOLDER_KEY: {"job": self.job, "version": self._version, "rank": self.rank,
                                          "file": fname, "tag": self._tag}}, f)
            f.write("\n")

    def commit(self, info: Any) -> bool:
        """Snapshots the current tag as its version; returns at once (True)."""
        tag = _tag_of(info)
        if self._tag is None:
            self.create(tag)
        elif tag != self._tag:
            raise ValueError(f"commit of tag {tag!r} but the tag being saved is {self._tag!r}")
        staged = [self._staging[f] for f in self._files]
        items = [it for s in staged for it in s.items()]
        key = [(name, region.address + off) for name, _, _, region, off in items]
        if key != self._registered:
            self._client.register_items(self.job, self.rank, self.world_size, items)
            self._registered = key
        blob = pickle.dumps({"format": _FORMAT, "tag": self._tag, "files": self._files},
                            protocol=pickle.HIGHEST_PROTOCOL)
        self._client.snapshot(self._version, {BLOB: blob})
        self._pending = self._last = self._version
        self._tag, self._version, self._files = None, None, {}
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state dict saved as file `path`: from the placeholder there (or the tag
        directory's name), the committed version's shard of this rank is read and checked."""
        fname = os.path.basename(path)
        version = None
        try:
            with os.fdopen(_open_regular(path)) as f:
                version = int(json.load(f)[_PLACEHOLDER_KEY]["version"])
        except (OSError, ValueError, KeyError, TypeError):
            m = re.search(r"(\d+)$", os.path.basename(os.path.dirname(os.path.abspath(path))))
            if m is None:
                raise FileNotFoundError(f"{path}: no ckptd placeholder there and no version in the tag") from None
            version = int(m.group(1))
        if self._pending is not None or (self._last is not None and version == self._last):
            self.wait()  # our own version: committed first
        tensors, files = self._read(version)
        if fname not in files:
            raise FileNotFoundError(f"{path}: version {version} of job '{self.job}' has no file {fname!r} "
                                    f"(it has {', '.join(sorted(files)) or 'none'})")
        device = None
        if isinstance(map_location, (str, torch.device)):
            device = torch.device(map_location)
        return self._unflatten(files[fname], tensors, device)

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    def preserves_storage_sharing(self):
        return False  # tensors are copied into staging memory anyway: no need to clone first

    def is_decoupled(self):
        return False

    # -- beyond DeepSpeed's interface --------------------------------------------------------

    def wait(self, level: Level = Level.COMMITTED, timeout: Optional[float] = None) -> None:
        """Blocks until the last committed tag's version reaches `level` (default: committed)."""
        if self._last is not None:
            self._client.wait_durable(self._last, level, timeout)

    def wait_snapshot(self) -> float:
        """Blocks until the last committed tag is out of the staging memory; returns seconds."""
        if self._pending is None:
            return 0.0
        stall = self._client.wait_snapshot(self._pending)
        self._pending = None
        return stall

    def cleanup(self):
        self.wait()

    def close(self) -> None:
        """Waits for the last version and ends the registration."""
        self.wait()
        self._client.unregister()

    @property
    def client(self) -> Client:
        return self._client

    # -- helpers -----------------------------------------------------------------------------

    def _flatten(self, obj, fname, path, tensors, seen):
        """`obj` with every tensor replaced by a _Ref to its item; the tensors go to `tensors`
        (seen: id(tensor) -> item, so that a tensor saved twice is one item; and the names)."""
        if isinstance(obj, torch.Tensor):
            items, names = seen
            if id(obj) in items:
                return _Ref(items[id(obj)])
            where = f"{fname}:{'.'.join(path)}"
            if obj.layout != torch.strided or obj.is_quantized or obj.device.type not in ("cpu", "cuda"):
                raise UnsupportedTensorError(f"{where}: {obj.layout} tensor on '{obj.device}' cannot be staged "
                                             f"(dense CPU or CUDA tensors only)")
            if obj.dtype not in _TORCH_TO_CODE:
                raise UnsupportedTensorError(f"{where}: dtype {obj.dtype} is not supported")
            if obj.numel() == 0:
                return obj.detach().cpu().clone()  # no bytes: pickled with the structure
            name = where if _valid_name(where) and where not in names else f"{fname}:#{len(tensors)}"
            items[id(obj)] = name
            names.add(name)
            tensors.append((name, obj.detach()))
            return _Ref(name)
        if isinstance(obj, dict):
            try:
                out = type(obj)()
            except TypeError:  # a dict subclass that needs arguments
                out = {}
            for k, v in obj.items():
                out[k] = self._flatten(v, fname, path + [str(k)], tensors, seen)
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self._flatten(v, fname, path + [str(i)], tensors, seen) for i, v in enumerate(obj))
        return obj

    def _unflatten(self, obj, tensors, device):
        if isinstance(obj, _Ref):
            t = tensors[obj.item]
            return t.to(device) if device is not None else t
        if isinstance(obj, dict):
            out = type(obj)()
            for k, v in obj.items():
                out[k] = self._unflatten(v, tensors, device)
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self._unflatten(v, tensors, device) for v in obj)
        return obj

    def _read(self, version: int):
        if self._cache is not None and self._cache[0] == version:
            return self._cache[1], self._cache[2]
        if self._root is None:
            self._root = json.loads(self._client.status())["root"]
        shard = load_version(self._root, self.job, version, rank=self.rank, backend="torch")
        if BLOB not in shard.blobs:
            raise ValueError(f"version {version} of job '{self.job}' was not written by ckpt.deepspeed")
        saved = pickle.loads(shard.blobs[BLOB])
        self._cache = (version, dict(shard.tensors), saved["files"])
        return self._cache[1], self._cache[2]
