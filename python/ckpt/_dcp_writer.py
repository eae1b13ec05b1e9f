"""ckpt.dcp's Writer: a DCP StorageWriter and AsyncStager that saves each checkpoint as one
ckptd version. See docs/pytorch.md, "torch.distributed.checkpoint"."""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import io
import os
import pickle
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import Client, Level, SharedRegion
from ._dcp_common import (_ALIGN, _BLOB, _HAS_RESPONSE, _LAYOUT, _SHARED, METADATA_BLOB, Metadata, MetadataIndex,
                          SavePlan, SavePlanner, StorageMeta, StorageWriter, WriteItemType, WriteResult, _blob_name,
                          _item_name, _local, _safe, _Session, _session, _SessionOf, _TorchFuture,
                          create_default_global_save_plan, version_of)
from ._torch_tensors import _TORCH_TO_CODE

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


class Writer(_SessionOf, StorageWriter):
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
