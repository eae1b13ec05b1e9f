"""ckpt.dcp's Reader: a DCP StorageReader that restores through ckptd, or reads the shard
files. See docs/pytorch.md, "torch.distributed.checkpoint"."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import Client, Error, SharedRegion, VersionNotFoundError, list_versions, load_file, read_header
from ._dcp_common import (_ALIGN, _FAILED_PRECONDITION, _LAYOUT, _RESULT, METADATA_BLOB, LoadItemType, LoadPlan,
                          LoadPlanner, Metadata, MetadataIndex, StorageReader, _item_name, _safe, _Session, _session, _SessionOf,
                          _TorchFuture, _blob_name, version_of)
from ._dcp_writer import Writer
from ._torch_tensors import _CODE_TO_TORCH, _TORCH_TO_CODE

class Reader(_SessionOf, StorageReader):
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
        through the daemon (a restore by layout: it assembles each box from whichever ranks
        wrote the overlapping chunks, from the fastest tier, verified). False: the daemon
        cannot."""
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
