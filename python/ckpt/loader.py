"""Reading checkpoints without a daemon: shard files and committed versions.

A checkpoint tree (format/paths.h) looks like

    ROOT/JOB/v0000000042/rank-00003.safetensors   one shard per (version, rank)
    ROOT/JOB/v0000000042/COMMITTED                written once every rank's shard is durable
    ROOT/JOB/latest                               text: the newest committed version

A differential shard (written by ckptd --persistent-base-every: only the items that changed
since a base version, format/shard_format.h) is read whole: its other items come from the
base version's shard beside it, which must hold them with the same checksums.

The bytes are read and every item's xxh3 checksum verified in C++ (ckpt._ckpt.read_shard,
over the project's format library), with the GIL released. Every item arrives in its own
buffer, so a tensor returned here owns its memory: nothing else aliases it, and it is
writable.

Tensors are returned as the first of these that can represent their dtype:
  backend="auto"   torch.Tensor if torch imports, else numpy.ndarray if numpy imports,
                   else RawTensor
  backend="torch" / "numpy" / "raw"   that type only, RawTensor where it cannot hold the
                   dtype (torch 1.13 has no U16/U32/U64 nor F8; numpy has no BF16 nor F8)
RawTensor is (dtype, shape, data) with dtype the safetensors name ("BF16") and data the
item's bytes (little-endian, packed).

Blobs (pickled optimizer groups, RNG states, user data; whatever the saver put there) are
returned as bytes, never unpickled here: ckpt.torch knows how its own blobs were made.

Errors:
  ckpt.Error                a checksum mismatch (the message names the item and the file;
                            code 15, DATA_LOSS), a malformed shard, or a shard or COMMITTED
                            marker that is not a regular file (a FIFO, a device, a directory,
                            a symbolic link: "... is a FIFO, not a regular file", code 15);
                            nothing blocks on a FIFO nor follows a link
  ckpt.VersionNotFoundError the version (or job) does not exist or is not committed; a
                            subclass of both ckpt.Error (code 5, NOT_FOUND) and
                            FileNotFoundError
  FileNotFoundError / OSError   load_file of a path that cannot be opened
"""

import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from . import _ckpt
from ._ckpt import Error

__all__ = ["Checkpoint", "RawTensor", "Shard", "VersionNotFoundError", "list_versions", "load_file",
           "load_version", "read_header"]

_NOT_FOUND = 5  # gRPC NOT_FOUND, what ckptd reports for a missing version
_FAILED_PRECONDITION = 9
_DATA_LOSS = 15
_MAX_MARKER_BYTES = 1 << 20
_BACKENDS = ("auto", "torch", "numpy", "raw")


class VersionNotFoundError(Error, FileNotFoundError):
    """A checkpoint version (or its job) that does not exist, or exists but is not committed."""

    def __init__(self, message):
        super().__init__(message)
        self.code = _NOT_FOUND


@dataclass(frozen=True)
class RawTensor:
    """A tensor no available array type can hold: safetensors dtype name, shape, packed bytes."""

    dtype: str
    shape: Tuple[int, ...]
    data: bytes


@dataclass
class Shard:
    """One shard file: one rank of one version.

    meta: job, version, rank, world_size, path
    tensors: name -> tensor (see the module docstring for its type), in file order
    blobs: name -> bytes, in file order
    items: the header's entries in file order: dicts with name, kind ('tensor' or 'blob'),
        dtype, shape, offset, length, checksum (16 hex digits), in_base (True for an item
        of a differential shard that is read from its base version's shard; such items
        come after the stored ones, in name order)
    """

    meta: Dict[str, Any]
    tensors: Dict[str, Any] = field(default_factory=dict)
    blobs: Dict[str, bytes] = field(default_factory=dict)
    items: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def job(self) -> str:
        return self.meta["job"]

    @property
    def version(self) -> int:
        return self.meta["version"]

    @property
    def rank(self) -> int:
        return self.meta["rank"]

    @property
    def world_size(self) -> int:
        return self.meta["world_size"]

    @property
    def path(self) -> str:
        return self.meta["path"]

    def __repr__(self):
        return (f"<ckpt.Shard job={self.job!r} version={self.version} rank={self.rank}/{self.world_size} "
                f"tensors={len(self.tensors)} blobs={len(self.blobs)}>")


@dataclass
class Checkpoint:
    """Every rank of one committed version: shards is rank -> Shard, for ranks 0..world_size-1."""

    job: str
    version: int
    world_size: int
    path: str
    shards: Dict[int, Shard]

    def __repr__(self):
        return (f"<ckpt.Checkpoint job={self.job!r} version={self.version} world_size={self.world_size} "
                f"path={self.path!r}>")


# -- opening files -------------------------------------------------------------------------

_FILE_TYPES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def _not_regular(path, mode, code):
    kind = next((name for test, name in _FILE_TYPES if test(mode)), "a file of unknown type")
    e = Error(f"{os.fspath(path)} is {kind}, not a regular file")
    e.code = code
    return e


def _open_regular(path, flags=os.O_RDONLY, mode=0o600):
    """os.open of a regular file that a FIFO, device or symbolic link at `path` cannot block
    or redirect (as common/safe_file.h does in C++): lstat refuses one before the open,
    O_NOFOLLOW | O_NONBLOCK make the open itself safe, and fstat checks what was opened.
    Returns a blocking descriptor; anything but a regular file raises ckpt.Error (DATA_LOSS
    for reads, FAILED_PRECONDITION for writes), a missing file FileNotFoundError."""
    code = _FAILED_PRECONDITION if flags & (os.O_WRONLY | os.O_RDWR) else _DATA_LOSS

    def check(path_mode):
        if path_mode is not None and not stat.S_ISREG(path_mode):
            raise _not_regular(path, path_mode, code)

    def mode_at():
        try:
            return os.lstat(path).st_mode
        except OSError:
            return None

    check(mode_at())
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode)
    except OSError:
        check(mode_at())  # swapped in after the lstat (ELOOP, ENXIO)
        raise
    try:
        check(os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_small(path):
    """The text of a small regular file (a marker), opened with _open_regular."""
    with os.fdopen(_open_regular(path), "rb") as f:
        data = f.read(_MAX_MARKER_BYTES + 1)
    if len(data) > _MAX_MARKER_BYTES:
        raise ValueError(f"{path} is larger than a marker can be")
    return data.decode()


# -- tensor conversion ---------------------------------------------------------------------

# safetensors name -> attribute of torch / numpy dtype string; an attribute missing from the
# installed torch (uint16 before 2.3, float8 before 2.1) means "cannot hold".
_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}
_NUMPY_NAMES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}


def _import(name):
    try:
        return __import__(name)
    except ImportError:
        return None


def _to_torch(torch, dtype, shape, data):
    tdtype = getattr(torch, _TORCH_NAMES.get(dtype, ""), None)
    if not isinstance(tdtype, torch.dtype):
        return None
    if len(data) == 0:
        return torch.empty(shape, dtype=tdtype)
    return torch.frombuffer(data, dtype=tdtype).reshape(shape)


def _to_numpy(numpy, dtype, shape, data):
    ndtype = _NUMPY_NAMES.get(dtype)
    if ndtype is None:
        return None
    return numpy.frombuffer(data, dtype=ndtype).reshape(shape)


def _converters(backend):
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, not {backend!r}")
    out = []
    if backend in ("auto", "torch"):
        torch = _import("torch")
        if torch is None and backend == "torch":
            raise ImportError("backend='torch' but torch does not import")
        if torch is not None:
            out.append(lambda d, s, b: _to_torch(torch, d, s, b))
    if backend in ("auto", "numpy"):
        numpy = _import("numpy")
        if numpy is None and backend == "numpy":
            raise ImportError("backend='numpy' but numpy does not import")
        if numpy is not None:
            out.append(lambda d, s, b: _to_numpy(numpy, d, s, b))
    return out


def _tensor(converters, dtype, shape, data):
    for convert in converters:
        t = convert(dtype, shape, data)
        if t is not None:
            return t
    return RawTensor(dtype, tuple(shape), bytes(data))


def _shard_from(raw, backend):
    converters = _converters(backend)
    meta = {k: raw[k] for k in ("job", "version", "rank", "world_size", "path")}
    shard = Shard(meta)
    for item in raw["items"]:
        data = item.pop("data", None)
        shard.items.append(item)
        if data is None:
            continue
        if item["kind"] == "blob":
            shard.blobs[item["name"]] = bytes(data)
        else:
            shard.tensors[item["name"]] = _tensor(converters, item["dtype"], item["shape"], data)
    return shard


# -- public functions ----------------------------------------------------------------------

def read_header(path: Union[str, os.PathLike]) -> Shard:
    """The shard's metadata and item list (Shard with empty tensors and blobs); reads no data."""
    return _shard_from(_ckpt.read_shard_header(os.fspath(path)), "raw")


def load_file(path: Union[str, os.PathLike], verify: bool = True, backend: str = "auto") -> Shard:
    """Reads one shard file (any rank, committed or not) into a Shard.

    verify: check every item's checksum (a mismatch raises ckpt.Error naming the item and the
    file). backend: see the module docstring. A missing file raises FileNotFoundError.
    """
    return _shard_from(_ckpt.read_shard(os.fspath(path), verify), backend)


def _version_dir(root, job, version):
    return os.path.join(os.fspath(root), job, "v%010d" % version)


def list_versions(root: Union[str, os.PathLike], job: str) -> List[int]:
    """The committed versions of `job` under `root`, ascending (empty if the job has none)."""
    try:
        names = os.listdir(os.path.join(os.fspath(root), job))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if len(name) > 1 and name[0] == "v" and name[1:].isdigit() and name[1:].isascii():
            version = int(name[1:])
            if name != os.path.basename(_version_dir(root, job, version)):
                continue  # only the canonical spelling (v0000000003, not v3) is a version
            if os.path.exists(os.path.join(_version_dir(root, job, version), "COMMITTED")):
                out.append(version)
    return sorted(out)


def _describe(versions):
    if not versions:
        return "it has no committed version"
    shown = ", ".join(map(str, versions[-10:]))
    return f"committed versions: {'..., ' if len(versions) > 10 else ''}{shown}"


def _resolve(root, job, version):
    """-> (version, world_size) of a committed version, or VersionNotFoundError."""
    if not os.path.isdir(os.path.join(os.fspath(root), job)):
        raise VersionNotFoundError(f"no checkpoints of job {job!r} under {os.fspath(root)}")
    versions = list_versions(root, job)
    if version == "latest":
        # The newest committed version, as the daemon's recovery determines it: the `latest`
        # file can lag one version behind after a crash between the two commit writes.
        if not versions:
            raise VersionNotFoundError(f"job {job!r} under {os.fspath(root)} has no committed version")
        version = versions[-1]
    elif isinstance(version, str) and version.isdigit():
        version = int(version)
    elif isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an int or 'latest', not {version!r}")
    vdir = _version_dir(root, job, version)
    if version not in versions:
        state = "is not committed" if os.path.isdir(vdir) else "does not exist"
        raise VersionNotFoundError(f"version {version} of job {job!r} under {os.fspath(root)} {state} "
                                   f"({_describe(versions)})")
    world_size = None
    try:
        marker = json.loads(_read_small(os.path.join(vdir, "COMMITTED")))
        # Only what the daemon writes (format/markers.h): anything else, such as Infinity or
        # a nesting too deep for json, must not escape as OverflowError or RecursionError.
        value = marker.get("world_size") if isinstance(marker, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            world_size = value
    except (OSError, ValueError, RecursionError):
        pass  # an older or unreadable marker: the shards say (not a regular file: ckpt.Error)
    return version, world_size


def load_version(root: Union[str, os.PathLike], job: str, version: Union[int, str] = "latest",
                 rank: Optional[int] = None, verify: bool = True, backend: str = "auto"):
    """Reads a committed version of `job` under the checkpoint root `root`.

    version: an int or "latest" (the newest committed version).
    rank: an int -> that rank's Shard; None -> a Checkpoint holding every rank's Shard
        (ranks are not merged: data-parallel ranks hold tensors of the same names).
    Raises VersionNotFoundError (a ckpt.Error and a FileNotFoundError) if the job or the
    version does not exist or is not committed, ValueError for a rank outside the world,
    ckpt.Error on a checksum mismatch or a shard that does not belong where it lies.
    """
    version, world_size = _resolve(root, job, version)
    vdir = _version_dir(root, job, version)

    def one(r):
        shard = load_file(os.path.join(vdir, "rank-%05d.safetensors" % r), verify=verify, backend=backend)
        if (shard.job, shard.version, shard.rank) != (job, version, r):
            e = Error(f"{shard.path} holds job {shard.job!r} version {shard.version} rank {shard.rank}, "
                      f"not job {job!r} version {version} rank {r}")
            e.code = _DATA_LOSS
            raise e
        return shard

    if rank is not None:
        if world_size is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside version {version} of job {job!r} (world size {world_size})")
        return one(rank)
    first = one(0)
    world_size = world_size or first.world_size
    shards = {0: first}
    for r in range(1, world_size):
        shards[r] = one(r)
    return Checkpoint(job=job, version=version, world_size=world_size, path=vdir, shards=shards)
