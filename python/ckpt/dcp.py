"""ckpt.dcp: torch.distributed.checkpoint (DCP) storage through ckptd, with the lazy path.

    import torch.distributed.checkpoint as dcp
    import ckpt.dcp
    ckpt.dcp.share_memory(model, optimizer)           # once: tensors into daemon-visible memory
    writer = ckpt.dcp.Writer(None, "my-job")          # StorageWriter and AsyncStager
    reader = ckpt.dcp.Reader(None, "my-job")          # StorageReader
    dcp.load(state, storage_reader=reader)            # newest committed version (checkpoint_id=None)
    for step in ...:
        if pending is not None:
            pending.staging_completion.result()       # before the update: the daemon has the bytes
        opt.step()
        pending = dcp.async_save(state, checkpoint_id=step, storage_writer=writer)
    pending.upload_completion.result()                # committed

A DCP save is one ckptd version (its number is the checkpoint_id, see below). Every tensor
WriteItem of the plan becomes a tensor item of this rank's shard; bytes items (torch.save'd
non-tensor values) become blobs; DCP's Metadata is pickled into a blob of every rank's shard.
The daemon copies the tensors out of the trainer's memory itself: tensors that live in
daemon-visible shared memory (share_memory() puts a module's and an optimizer's CPU tensors
there, in place, as ckpt.torch does) are never copied by the trainer; any other tensor (GPU,
strided, views of memory that is not shared, optimizer state created after share_memory) is
copied into a staging region of the writer at each save, on the saving thread.

checkpoint_id: None (save: the newest version this job has committed, or this writer saved,
plus one; load: the newest committed version), an int, a string of digits, or a string or
path whose last component ends in digits ("step-100", "/ckpt/run1/step_100"): that number is
the version. Anything else is a ValueError naming the accepted forms. A version must be higher
than every version the job committed (ckptd's rule): resume with dcp.load() first, or use a new
job name.

When futures complete: dcp.save returns once the version reached `level` (default COMMITTED:
every rank's shard persisted and the commit marker written). dcp.async_save with this writer
as its storage_writer (it is its own stager) returns an AsyncSaveResponse at once:
staging_completion completes when the daemon has copied every byte out of the trainer's memory
(captured; wait for it before the next optimizer step, or pass optimizer= to the Writer, which
waits in a step pre-hook), upload_completion when the version reached `level`.

Load: at the world size that wrote the version, each rank restores its own shard through the
daemon (its fastest tier, checksums verified) into a staging region and copies the planner's
boxes out of it (ReadItem offsets and lengths). Boxes of chunks other ranks wrote (another world
size or sharding: DCP's resharding) are restored through the daemon too, each registered with
its box as layout (issue 16's restore by layout: the daemon assembles it from the overlapping
chunks of any rank); a daemon or ckpt module without that makes the reader read them from the
shard files under the daemon's root (ckpt.load_file, verified), with a RuntimeWarning.
Restoring an older version than the newest rolls the job back (ckptd sets the newer versions
aside); Reader(read_only=True) reads from the files and leaves the job alone. See
docs/pytorch.md, "torch.distributed.checkpoint".

Not thread-safe beyond what DCP does itself (one save's upload thread at a time). A ckpt.Client
passed in serves one job: the daemon takes one registration per client.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

try:
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
from . import Client, Error, Level, SharedRegion, VersionNotFoundError, list_versions, load_file, read_header
from ._torch_launcher import _rank_and_world
from ._torch_tensors import _CODE_TO_TORCH, _TORCH_TO_CODE

__all__ = ["Reader", "Writer", "share_memory", "version_of"]

METADATA_BLOB = "dcp.metadata"  # pickled DCP Metadata, in every rank's shard
_BYTES_PREFIX = "dcp.bytes:"  # + fqn: a bytes item (torch.save'd value)
_ALIGN = 64
_HAS_RESPONSE = hasattr(_saver, "AsyncSaveResponse")  # torch >= 2.7: staging futures
# The client API of issue 16 (h16fmt): item layouts, blobs for one rank, restore results.
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


# ----------------------------------------------------------------------------------------
# Writer


@dataclasses.dataclass
class _PlanData:
    """What the coordinator hands every rank in SavePlan.storage_data."""

    version: int
    metadata: bytes  # pickled Metadata, stored by every rank


def _stored(kind: str, name: str, rank: int, replicated: bool = False) -> Dict[str, Any]:
    """Where an item went in a version (WriteResult.storage_data, Metadata.storage_data):
    a plain dict, so that the pickled Metadata unpickles without ckpt. replicated: a plain
    tensor, which every rank holding it stored whole (see _layout_of)."""
    return {"kind": kind, "name": name, "rank": rank, "replicated": replicated}


class _StagedFuture(concurrent.futures.Future):
    """The future async_save gets from Writer.stage(). DCP's upload thread calls result() to
    get the state dict before it saves: that returns at once (the tensors need no copy before
    planning). The future itself completes when the daemon has captured the version, which is
    what async_save's staging_completion then reports; if the upload thread ends without
    taking the snapshot (an error in planning), it fails instead of hanging the trainer."""

    def __init__(self, state_dict):
        super().__init__()
        self._state_dict = state_dict
        self._watched = False

    def result(self, timeout=None):
        if self.done():
            return super().result(timeout)
        if not self._watched:
            self._watched = True
            upload = threading.current_thread()

            def watch():
                upload.join()
                if not self.done():
                    self.set_exception(RuntimeError(
                        "ckpt.dcp: async_save ended before the daemon took the snapshot (see the error of "
                        "its upload_completion future)"))

            threading.Thread(target=watch, name="ckpt.dcp-watch", daemon=True).start()
        return self._state_dict


def _freeze(obj):
    """A copy of a state dict's structure whose non-tensor leaves are deep copies (the
    trainer may change them after async_save returns: param groups' lr...) and whose
    tensors are the same objects (the daemon copies them; the trainer waits for that)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        return {k: _freeze(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_freeze(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_freeze(v) for v in obj)
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):  # Stateful: DCP calls state_dict()
        return obj
    return copy.deepcopy(obj)


def _layout_of(wi):
    """The ckpt.Layout of a tensor WriteItem: a plain tensor (DCP's TENSOR: the same on every
    rank that holds it, which DCP assumes and deduplicates) is replicated; a chunk (SHARD: a
    DTensor's or ShardedTensor's local piece) is the box at its offsets of the global tensor."""
    if _LAYOUT is None:
        return None
    if wi.type == WriteItemType.TENSOR:
        return _LAYOUT(global_name=_safe(wi.index.fqn), replicated=True)
    return _LAYOUT(global_name=_safe(wi.index.fqn), global_shape=[int(d) for d in wi.tensor_data.size],
                   offsets=[int(o) for o in wi.tensor_data.chunk.offsets])


def _copy_tensors(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_tensors(v) for v in obj]
    return obj


class Writer(StorageWriter):
    """A DCP StorageWriter (and AsyncStager) that stores through ckptd.

    client_or_socket: a ckpt.Client or the daemon's socket (None: $CKPTD_SOCKET, else the
      default socket). job: the ckptd job. rank, world_size: default torch.distributed's (see
      ckpt.torch.Checkpointer). level: what dcp.save and async_save's upload_completion wait
      for (ckpt.Level; default COMMITTED). timeout: seconds for that wait (None: forever).
    optimizer: if given, a step pre-hook waits for the capture of the last async_save before
      every optimizer.step() (then staging_completion need not be waited for by hand).
    """

    _synchronize_after_execute = False  # async_save must not block for staging (old torch)

    def __init__(self, client_or_socket: Union[Client, str, os.PathLike, None] = None, job: str = "", *,
                 rank: Optional[int] = None, world_size: Optional[int] = None, level: Level = Level.COMMITTED,
                 timeout: Optional[float] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 reconnect_budget: Optional[float] = None):
        super().__init__()
        if not job:
            raise ValueError("ckpt.dcp.Writer needs a job name")
        self._target = (client_or_socket, job, rank, world_size, reconnect_budget)
        self.job, self.level, self.timeout = job, level, timeout
        self._s: Optional[_Session] = None
        self.checkpoint_id: Optional[Union[str, os.PathLike]] = None
        self._version: Optional[int] = None
        self._local_items: List[Any] = []
        self._staged: Optional[_StagedFuture] = None  # the async_save whose snapshot is to come
        self._staging_key = None
        self._staging: Dict[str, torch.Tensor] = {}  # item name -> its view in the staging region
        self._hook = optimizer.register_step_pre_hook(lambda *_: self.wait_captured()) if optimizer else None
        self.last_version: Optional[int] = None  # of the last save whose snapshot was taken
        self.last_staged_bytes = 0  # bytes the last save copied (tensors not in shared memory)

    # -- StorageWriter ------------------------------------------------------------------------

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        try:
            self._version = version_of(checkpoint_id)
        except ValueError as e:
            self._fail_staged(e)
            raise
        self.checkpoint_id = checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        try:
            return version_of(checkpoint_id) is not None
        except ValueError:
            return False

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        try:
            self._session()
        except Exception as e:
            self._fail_staged(e)
            raise
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # DCP deduplicates what several ranks hold (bytes items, replicated plain tensors) to
        # one rank. This rank stores its own copy too, so that a restore at the same world size
        # (each rank gets its own shard only) has everything its load asks for.
        self._local_items = [wi for wi in plan.items if wi.type in (WriteItemType.BYTE_IO, WriteItemType.TENSOR)]
        return dataclasses.replace(plan, storage_data={"rank": self._session().rank})

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        try:
            if not all(isinstance(p.storage_data, dict) and "rank" in p.storage_data for p in plans):
                raise RuntimeError("ckpt.dcp.Writer: a plan lost the writer's data between prepare_local_plan and "
                                   "prepare_global_plan (DCP's plan caching, enable_plan_caching=True, replays "
                                   "old plans): use a planner without plan caching")
            _, md = create_default_global_save_plan(plans, rewrite_index_hints=False)
            mappings: Dict[Any, Any] = {}
            for p in reversed(plans):
                if isinstance(p.planner_data, dict):
                    mappings.update(p.planner_data)
            if mappings:
                md = dataclasses.replace(md, planner_data=mappings)
            where: Dict[MetadataIndex, Dict[str, Any]] = {}
            for p in plans:
                rank = int(p.storage_data["rank"])
                for wi in p.items:
                    if wi.type == WriteItemType.BYTE_IO:
                        where[wi.index] = _stored("blob", _blob_name(wi.index.fqn), rank)
                    else:
                        where[wi.index] = _stored("tensor", _item_name(wi.index.fqn, wi.tensor_data.chunk.offsets),
                                                  rank, wi.type == WriteItemType.TENSOR)
            md = dataclasses.replace(md, storage_meta=self.storage_meta(), storage_data=where)
            version = self._version
            if version is None:
                version = self._session().newest() + 1
            data = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            self._fail_staged(e)
            raise
        return [dataclasses.replace(p, storage_data=_PlanData(version, data)) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> _TorchFuture:
        fut: _TorchFuture = _TorchFuture()
        # The staged future stays in self._staged until it is done (wait_captured clears it):
        # the trainer's pre-step hook must find it and wait, however early this upload thread
        # gets here. Taking it out here let a step that came after this point run before the
        # capture, and the version held the step's values.
        staged = self._staged
        try:
            results, version = self._write(plan, planner, staged)
        except BaseException as e:
            if staged is not None and not staged.done():
                staged.set_exception(e)
            raise
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Nothing left to do: every rank's write_data waited for `level` already."""

    # -- AsyncStager --------------------------------------------------------------------------

    def stage(self, state_dict):
        """For async_save: no copy of the tensors (the daemon copies them; see _StagedFuture).
        Non-tensor values are deep-copied here, on the trainer's thread."""
        self.wait_captured()  # one async_save at a time up to its capture
        if not _HAS_RESPONSE:
            # torch < 2.7 has no staging future to report the capture with: copy (not lazy).
            return _freeze(_copy_tensors(state_dict))
        self._staged = _StagedFuture(_freeze(state_dict))
        return self._staged

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def synchronize_staging(self) -> None:
        self.wait_captured()

    def wait_captured(self, timeout: Optional[float] = None) -> None:
        """Blocks until the last async_save's version is out of the trainer's memory (raises
        its error if it failed before that)."""
        staged = self._staged
        if staged is not None:
            concurrent.futures.wait([staged], timeout)
            if staged.done():
                if self._staged is staged:
                    self._staged = None
                staged.result()

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # -- the save -----------------------------------------------------------------------------

    def _session(self) -> _Session:
        if self._s is None:
            self._s = _session(*self._target)
        return self._s

    def _fail_staged(self, e: BaseException) -> None:
        staged, self._staged = self._staged, None
        if staged is not None and not staged.done():
            staged.set_exception(e)

    def _write(self, plan: SavePlan, planner: SavePlanner, staged: Optional[_StagedFuture]):
        s = self._session()
        pdata = plan.storage_data
        if not isinstance(pdata, _PlanData):
            raise RuntimeError("ckpt.dcp.Writer: the plan carries no ckpt.dcp data (a planner with plan caching, "
                               "or a writer other than this one planned it); use DefaultSavePlanner without "
                               "enable_plan_caching")
        version = pdata.version
        blobs: Dict[str, bytes] = {METADATA_BLOB: pdata.metadata}
        results: List[WriteResult] = []
        tensors: List[Tuple[str, torch.Tensor, Any]] = []  # (name, tensor, write item)
        planned = {(wi.index.fqn, tuple(wi.index.offset or ())) for wi in plan.items}
        extra = [wi for wi in self._local_items if (wi.index.fqn, tuple(wi.index.offset or ())) not in planned]
        extra_ids = {id(wi) for wi in extra}
        for wi in list(plan.items) + extra:
            own_copy = id(wi) in extra_ids  # deduplicated to another rank: this rank's copy, no WriteResult
            if wi.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(wi)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
                name = _blob_name(wi.index.fqn)
                blobs[name] = raw
                if not own_copy:
                    results.append(WriteResult(index=wi.index, size_in_bytes=len(raw),
                                               storage_data=_stored("blob", name, s.rank)))
                continue
            t = planner.resolve_data(wi)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"ckpt.dcp: {wi.index.fqn} resolved to {type(t).__name__}, not a tensor")
            t = _local(t).detach()
            if t.dtype not in _TORCH_TO_CODE:
                raise TypeError(f"ckpt.dcp: {wi.index.fqn}: dtype {t.dtype} is not supported by ckptd")
            if tuple(t.shape) != tuple(wi.tensor_data.chunk.sizes):
                raise ValueError(f"ckpt.dcp: {wi.index.fqn}: resolved tensor has shape {tuple(t.shape)}, the plan's "
                                 f"chunk {tuple(wi.tensor_data.chunk.sizes)}")
            name = _item_name(wi.index.fqn, wi.tensor_data.chunk.offsets)
            tensors.append((name, t, wi))
            if not own_copy:
                results.append(WriteResult(index=wi.index, size_in_bytes=t.numel() * t.element_size(),
                                           storage_data=_stored("tensor", name, s.rank)))
        with s.lock:  # the previous save of this process was captured before it let go of the lock
            items, copies, keep = self._items(tensors)
            key = ("write", tuple((i[0], i[1], tuple(i[2]), id(i[3]), i[4]) for i in items))  # layouts follow the names
            s.register(key, items, keep)
            with torch.no_grad():
                for dst, src in copies:
                    dst.copy_(src)
            self.last_staged_bytes = sum(d.numel() * d.element_size() for d, _ in copies)
            if _BLOB is not None and s.rank != 0:
                # At a restore by another world size, rank 0's copies go to every rank; the
                # others' only to the rank of the same number (each rank prefers its own).
                blobs = {k: _BLOB(v, for_rank=s.rank) for k, v in blobs.items()}
            s.client.snapshot(version, blobs)
            s.last_version = max(s.last_version, version)
            s.client.wait_snapshot(version)
        self.last_version = version
        if staged is not None and not staged.done():
            staged.set_result(None)  # captured: the trainer may change the tensors
        if self.level != Level.CAPTURED:
            s.client.wait_durable(version, self.level, self.timeout)
        return results, version

    def _items(self, tensors):
        """Register tuples for the tensors: in shared memory where they are, else in the
        staging region (made again when the set of staged items changes)."""
        items, copies, keep, staged = [], [], [], []
        layouts = {name: _layout_of(wi) for name, _, wi in tensors}
        for name, t, _ in tensors:
            where = _SHARED.find(t)
            if where is not None:
                items.append((name, _TORCH_TO_CODE[t.dtype], [int(d) for d in t.shape], where[0], where[1]))
                keep.append(where[0])
            else:
                staged.append((name, t))
                items.append(None)
        skey = tuple((n, t.dtype, tuple(t.shape)) for n, t in staged)
        if staged and skey != self._staging_key:
            size = sum((t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for _, t in staged)
            region = SharedRegion.create(max(size, 1))
            views, off = {}, 0
            for n, t in staged:
                views[n] = (torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape)
                            if t.numel() else torch.empty(t.shape, dtype=t.dtype), region, off)
                off += (t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
            self._staging, self._staging_key = views, skey
        it = iter(staged)
        for i, item in enumerate(items):
            if item is not None:
                continue
            name, t = next(it)
            view, region, off = self._staging[name]
            items[i] = (name, _TORCH_TO_CODE[t.dtype], [int(d) for d in t.shape], region, off)
            copies.append((view, t))
            keep.append(region)
        if _LAYOUT is not None:
            items = [item + (layouts[item[0]],) for item in items]
        return items, copies, keep


# ----------------------------------------------------------------------------------------
# Reader


class Reader(StorageReader):
    """A DCP StorageReader that restores through ckptd (arguments as for Writer).

    read_metadata() restores this rank's shard of the version through the daemon (its
    fastest tier, checksums verified) into a staging region and unpickles DCP's Metadata from
    it; read_data() copies the planner's boxes out of that region. A box of a chunk that
    another rank wrote (a load at another world size, or with another sharding) is read from
    that rank's shard file on the daemon's persistent tier (ckpt.load_file: whole shard,
    checksums verified), once per shard and load.

    A restore through the daemon is a resume: restoring a version older than the newest sets
    the newer ones aside (ckptd's roll back), so that saving continues from it.
    read_only=True reads every box from the shard files instead and leaves the job as it is
    (for evaluation, export, inspection)."""

    def __init__(self, client_or_socket: Union[Client, str, os.PathLike, None] = None, job: str = "", *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 reconnect_budget: Optional[float] = None, read_only: bool = False):
        super().__init__()
        if not job:
            raise ValueError("ckpt.dcp.Reader needs a job name")
        self.read_only = bool(read_only)
        self._target = (client_or_socket, job, rank, world_size, reconnect_budget)
        self.job = job
        self._s: Optional[_Session] = None
        self.checkpoint_id = None
        self._version: Optional[int] = None
        self._tensors: Dict[str, torch.Tensor] = {}  # this rank's restored items
        self._blobs: Dict[str, bytes] = {}
        self._files: Dict[int, Any] = {}  # rank -> Shard read from its file
        self._boxes: Dict[Any, torch.Tensor] = {}  # (fqn, box, shape) -> restored by the daemon
        self._elastic: Optional[bool] = None  # whether the daemon restores at another world size
        self._vdir = ""
        self.version: Optional[int] = None  # the version the last read_metadata read
        self.source = ""  # how the last load read: "daemon", "files" or "daemon+files"
        self.resharded = False  # the daemon assembled boxes from other ranks' chunks

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self._version = version_of(checkpoint_id)
        self.checkpoint_id = checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return Writer.validate_checkpoint_id(checkpoint_id)

    def _session(self) -> _Session:
        if self._s is None:
            self._s = _session(*self._target)
        return self._s

    def read_metadata(self) -> Metadata:
        # No **kwargs: DCP would then retry a failure as a 'rank local' read, with the same error.
        s = self._session()
        root = s.root()
        if not root or not os.access(os.path.join(root), os.R_OK | os.X_OK):
            raise PermissionError(f"ckpt.dcp: the daemon's root {root!r} cannot be read from this process "
                                  f"(ckpt.dcp.Reader reads shard headers there)")
        versions = list_versions(root, self.job)
        version = self._version
        if version is None:
            if not versions:
                raise VersionNotFoundError(f"ckpt.dcp: job '{self.job}' has no committed version under {root!r}")
            version = versions[-1]
        elif version not in versions:
            shown = ", ".join(map(str, versions[-10:])) or "none"
            raise VersionNotFoundError(f"ckpt.dcp: version {version} of job '{self.job}' (checkpoint_id "
                                       f"{self.checkpoint_id!r}) is not committed under {root!r} (committed "
                                       f"versions: {shown})")
        self._vdir = os.path.join(root, self.job, f"v{version:010d}")
        self._files, self._tensors, self._blobs, self.version = {}, {}, {}, version
        self._boxes, self.resharded = {}, False
        header0 = read_header(self._path(0))
        if header0.world_size == s.world_size and not self.read_only:
            self._restore_own(version)
            self.source = "daemon"
        elif not self.read_only and _RESULT and self._restore_blobs(version):
            self.source = "daemon"  # another world size: the daemon gave the blobs, read_data the boxes
        else:
            # Another world size with a daemon that restores same-size shards only, or read_only.
            self.source = "files"
            self._blobs = self._file(0).blobs
        if METADATA_BLOB not in self._blobs:
            raise ValueError(f"ckpt.dcp: version {version} of job '{self.job}' was not written by ckpt.dcp "
                             f"(its shard has no '{METADATA_BLOB}' blob)")
        return pickle.loads(self._blobs[METADATA_BLOB])

    def latest(self) -> Optional[int]:
        """The newest committed version of the job (None if it has none): whether there is
        anything to load, without DCP wrapping the answer in a CheckpointException."""
        root = self._session().root()
        versions = list_versions(root, self.job) if root else []
        return versions[-1] if versions else None

    def _path(self, rank: int) -> str:
        return os.path.join(self._vdir, f"rank-{rank:05d}.safetensors")

    def _file(self, rank: int):
        shard = self._files.get(rank)
        if shard is None:
            shard = self._files[rank] = load_file(self._path(rank), backend="torch")
            if (shard.job, shard.version, shard.rank) != (self.job, self.version, rank):
                raise Error(f"ckpt.dcp: {shard.path} holds job {shard.job!r} version {shard.version} rank "
                            f"{shard.rank}, not job {self.job!r} version {self.version} rank {rank}")
        return shard

    def _restore_own(self, version: int) -> None:
        """This rank's shard of `version`, restored by the daemon into a staging region."""
        s = self._s
        header = read_header(self._path(s.rank))
        tensor_items = [i for i in header.items if i["kind"] == "tensor"]
        size = sum((int(i["length"]) + _ALIGN - 1) // _ALIGN * _ALIGN for i in tensor_items)
        region = SharedRegion.create(max(size, 1))
        items, views, off = [], {}, 0
        for i in tensor_items:
            dtype = _CODE_TO_TORCH.get(i["dtype"])
            if dtype is None:
                raise TypeError(f"ckpt.dcp: item {i['name']} has dtype {i['dtype']}, unknown to torch "
                                f"{torch.__version__}")
            shape = [int(d) for d in i["shape"]]
            n = 1
            for d in shape:
                n *= d
            views[i["name"]] = torch.frombuffer(region, dtype=dtype, count=n, offset=off).view(shape) if n else \
                torch.empty(shape, dtype=dtype)
            items.append((i["name"], i["dtype"], shape, region, off))
            off += (int(i["length"]) + _ALIGN - 1) // _ALIGN * _ALIGN
        with s.lock:
            s.register(("read", version, id(region)), items, [region])
            try:
                restored, blobs = s.client.restore(version)
            except Error as e:
                if e.code == 5:
                    raise VersionNotFoundError(f"ckpt.dcp: {e}") from e
                raise
            s.last_version = max(s.last_version, restored)
        self._tensors, self._blobs = views, blobs

    def _restore_result(self, version: int):
        """restore(version) of what is registered now, as a RestoreResult; None if the daemon
        cannot restore this registration at another world size (then the files serve)."""
        s = self._s
        try:
            r = s.client.restore(version, result=True)
        except Error as e:
            if e.code == _FAILED_PRECONDITION:
                # A daemon that restores same-size shards only ("written by rank R of W ..., not
                # rank r of w"), or one that cannot serve these boxes: the files can.
                warnings.warn(f"ckpt.dcp: the daemon did not restore version {version} at world size "
                              f"{s.world_size} ({e}); reading the shard files instead", RuntimeWarning, stacklevel=3)
                return None
            if e.code == 5:
                raise VersionNotFoundError(f"ckpt.dcp: {e}") from e
            raise
        s.last_version = max(s.last_version, int(r.version))
        return r

    def _restore_blobs(self, version: int) -> bool:
        """At another world size: the version's blobs through the daemon (a registration of
        no items), each name from this rank's copy if it has one, else the lowest rank's."""
        s = self._s
        with s.lock:
            s.register(("blobs", version), [], [])
            r = self._restore_result(version)
        if r is None:
            return False
        chosen: Dict[str, Tuple[int, bytes]] = {}
        for b in r.blobs:
            rank = int(b.from_rank)
            old = chosen.get(b.name)
            if old is None or (rank == s.rank) or (old[0] != s.rank and rank < old[0]):
                chosen[b.name] = (rank, bytes(b.data))
        self._blobs = {name: data for name, (_, data) in chosen.items()}
        self._elastic = True
        return True

    def _restore_boxes(self, items) -> bool:
        """Restores the boxes the planner asks for that this rank's shard does not hold,
        through the daemon (h16restore: it assembles each box from whichever ranks wrote the
        overlapping chunks, from the fastest tier, verified). False: the daemon cannot."""
        s = self._s
        md = self.metadata.state_dict_metadata
        boxes, regs, size = {}, [], 0
        for ri in items:
            fqn = ri.storage_index.fqn
            tmd = md[fqn]
            where = (self.metadata.storage_data or {}).get(ri.storage_index) or {}
            start = [int(o) for o in (ri.storage_index.offset or [0] * len(tmd.size))]
            if where.get("replicated"):
                box, shape, layout = None, [int(d) for d in tmd.size], _LAYOUT(global_name=_safe(fqn), replicated=True)
            else:
                box = [a + int(b) for a, b in zip(start, ri.storage_offsets)]
                shape = [int(n) for n in ri.lengths]
                layout = _LAYOUT(global_name=_safe(fqn), global_shape=[int(d) for d in tmd.size], offsets=box)
            key = (fqn, tuple(box) if box is not None else None, tuple(shape))
            if key in boxes:
                continue
            dtype = tmd.properties.dtype
            n = 1
            for d in shape:
                n *= d
            boxes[key] = (f"dcp.read.{len(boxes)}", dtype, shape, n, size, layout)
            size += (n * torch.empty((), dtype=dtype).element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        region = SharedRegion.create(max(size, 1))
        views = {}
        for key, (name, dtype, shape, n, off, layout) in boxes.items():
            views[key] = torch.frombuffer(region, dtype=dtype, count=n, offset=off).view(shape) if n else \
                torch.empty(shape, dtype=dtype)
            regs.append((name, _TORCH_TO_CODE[dtype], shape, region, off, layout))
        with s.lock:
            s.register(("boxes", self.version, id(region)), regs, [region])
            r = self._restore_result(self.version)
        if r is None:
            return False
        self._boxes = views
        self.resharded = bool(getattr(r, "resharded", True))
        return True

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def _writer_of(self, index: MetadataIndex, what: str) -> int:
        where = (self.metadata.storage_data or {}).get(index) if isinstance(self.metadata.storage_data, dict) else None
        if not where:
            raise ValueError(f"ckpt.dcp: version {self.version} of job '{self.job}': the checkpoint does not say "
                             f"which rank wrote {what}")
        return int(where["rank"])

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> _TorchFuture:
        self._boxes = {}
        missing = [ri for ri in plan.items if ri.type == LoadItemType.TENSOR
                   and _item_name(ri.storage_index.fqn, ri.storage_index.offset) not in self._tensors]
        if missing and not self.read_only and _LAYOUT is not None and self._elastic is not False:
            if not self._restore_boxes(missing):
                self._elastic = False
        try:
            for ri in plan.items:
                self._read(ri, planner)
        finally:
            if self._files and self.source == "daemon":
                self.source = "daemon+files"
            self._files = {}  # what was read from files is not kept past the load
        fut: _TorchFuture = _TorchFuture()
        fut.set_result(None)
        return fut

    def _box(self, ri) -> Optional[torch.Tensor]:
        """The daemon-restored box of ReadItem ri (a replicated tensor restored whole is cut)."""
        fqn = ri.storage_index.fqn
        tmd = self.metadata.state_dict_metadata[fqn]
        start = [int(o) for o in (ri.storage_index.offset or [0] * len(tmd.size))]
        box = [a + int(b) for a, b in zip(start, ri.storage_offsets)]
        shape = tuple(int(n) for n in ri.lengths)
        t = self._boxes.get((fqn, tuple(box), shape))
        if t is not None:
            return t
        t = self._boxes.get((fqn, None, tuple(int(d) for d in tmd.size)))
        if t is None:
            return None
        for dim, (o, n) in enumerate(zip(box, shape)):
            t = t.narrow(dim, o, n)
        return t

    def _read(self, ri, planner: LoadPlanner) -> None:
        fqn = ri.storage_index.fqn
        if ri.type == LoadItemType.BYTE_IO:
            name = _blob_name(fqn)
            data = self._blobs.get(name)
            if data is None:
                data = self._file(self._writer_of(ri.storage_index, f"bytes item '{fqn}'")).blobs.get(name)
            if data is None:
                raise ValueError(f"ckpt.dcp: version {self.version}: no shard holds bytes item '{fqn}'")
            planner.load_bytes(ri, io.BytesIO(data))
            return
        offsets = list(ri.storage_index.offset or [])
        name = _item_name(fqn, offsets)
        src = self._tensors.get(name)
        box = self._box(ri) if src is None and self._boxes else None
        if box is not None:
            src = box  # restored by the daemon: already the box
        elif src is None:
            rank = self._writer_of(ri.storage_index, f"chunk {fqn} at offsets {offsets}")
            src = self._file(rank).tensors.get(name)
            if src is None:
                raise ValueError(f"ckpt.dcp: version {self.version}: rank {rank}'s shard has no item '{name}' "
                                 f"(chunk {fqn} at offsets {offsets})")
        if box is None:
            for dim, (o, n) in enumerate(zip(ri.storage_offsets, ri.lengths)):
                src = src.narrow(dim, int(o), int(n))
        target = planner.resolve_tensor(ri).detach()
        if tuple(target.shape) != tuple(src.shape):
            raise ValueError(f"ckpt.dcp: {fqn}: the planner's target has shape {tuple(target.shape)}, the "
                             f"box read {tuple(src.shape)}")
        with torch.no_grad():
            target.copy_(src)
        planner.commit_tensor(ri, target)
