"""ckpt.torch: checkpoint a PyTorch trainer through ckptd, every iteration if you like.

    import ckpt.torch
    model, opt = GPT(...), torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    data = {"epoch": 0, "position": 0}                   # your own state: saved and restored
    ck = ckpt.torch.Checkpointer(socket, "my-job", model=model, optimizer=opt, scheduler=sched,
                                 extra_state=data)
    step = ck.load("latest") if resume else 0          # everything restored in place
    while step < steps:
        opt.zero_grad()
        loss_fn(model(batch())).backward()              # the daemon copies the last save meanwhile
        opt.step()                                      # waits first for that copy (the stall)
        sched.step()
        step += 1
        ck.save(step)                                   # returns at once
    ck.wait_durable()

What goes where:
  tensor items  every tensor of model.state_dict() and of the optimizer's per-parameter state
                (AdamW's exp_avg, exp_avg_sq, step). At setup each CPU tensor is copied once into
                daemon-visible shared memory (ckpt.SharedRegion) and the tensor is pointed at it
                (`t.data = view`): the objects stay the same (`param is param`), so the
                optimizer, hooks and user references keep working; nothing is copied per save.
                (Views of those tensors taken before the move keep the old memory: build the
                Checkpointer before taking views.)
                Item names: "model.<state_dict key>", "optim.state.<i>.<key>" (i: the
                parameter's index in the optimizer, as in Optimizer.state_dict()),
                "optim.param.<i>" (an optimizer parameter that is not in the model).
                CUDA tensors (if the ckpt module takes GPU items) stay where they are and
                are registered by address (the daemon imports them through CUDA IPC); the
                snapshot is then ordered on the current CUDA stream, and the wait before the
                update makes that stream wait for the copies instead of blocking the host.
                (That path follows the binding's documented API but has not yet run on a GPU.)
                Small model buffers (any dtype) and small parameters no optimizer updates are
                registered through a staging copy (shared memory; on a GPU, GPU memory),
                which save() refreshes with one copy of the whole block (load copies them
                back): see "Torn snapshots" below.
  one blob      pickled at every save (item "__blob__/ckpt.torch" of the shard): step, optimizer
                param groups and non-tensor per-parameter state, scheduler and other objects'
                state_dict(), torch.Generator states of the objects that are generators,
                extra_state (a dict of your own: data position...), RNG states (python
                random, torch, numpy if imported, CUDA if initialised) and the item map.
                What the trainer may change is pickled at save(), each part on its own
                (the item map once per registration); a part larger than warn_blob_bytes
                gets a warning, once, naming it.

The wait: save(step) takes the non-tensor state and returns; a worker thread asks the daemon
for the snapshot and waits until it is captured (background=True, the default, for host
tensors; the first save after a registration asks on the calling thread). The daemon copies
the tensors out of shared memory while the next forward and backward run; the Checkpointer
waits for that copy right before the next optimizer step, through a step pre-hook (torch 2.x)
or a wrapper of optimizer.step (torch 1.x), and before the next save(): normally it is long
done, and the wait is a check.

Torn snapshots: a committed version is exactly the state of its step, or it is never
committed. The registration is sealed: the daemon commits a version only once the wait has
sealed it. Between save() and that wait, each registered tensor is either
  staged     copied at save(), the daemon reads the copy: every model buffer (any dtype, 0-dim
             too) and every parameter no optimizer updates (EMA copies, frozen layers) of at
             most 1 MiB (4 MiB on a GPU), up to 4 MiB in all (64 MiB on a GPU);
  guarded    read in place, its version counter (tensor._version, which every in-place op
             moves) recorded at save() and compared at the wait (on the training thread). A
             buffer too large to stage moves the wait before every forward of the model.
If a guarded counter moved, the version is aborted in the daemon (client.abort_snapshot: never
committed nor restorable), recorded in `aborted_versions` as (step, reason), and a
RuntimeWarning names the item, its module path and state_dict key, and the step; the tensor is
protected from the next save on: staged if small enough, else the wait moves before the
forward, and if it still changes with the wait there, save() waits for each capture before
returning (each step said once). Writes the counter cannot see (through t.data, numpy views,
other threads) are caught by the daemon with verify=True when they come after its copy of the
item (it compares memory with its copy at the seal; a write before the copy goes into it
unseen); such an abort (TornSnapshotError from the seal) is recorded and acted on the same way.
Nothing is left for the trainer to call.

Optimizer state that appears lazily (Adam's exp_avg after the first step) is handled by
re-registration, not by materialising it: every save checks, cheaply (identity and address of
each tracked tensor, number of state entries per parameter), whether tensors appeared or were
replaced; if so it moves the new ones into a new shared region and registers again (once,
typically at the first save after the first step). The optimizer thus runs exactly as it would
without checkpointing (a dry step to materialise the state would change the first update of
optimizers whose lazy initialisation is not zeros, e.g. SGD's momentum buffer). On load, the
state the checkpoint has is created in place before the restore: the shard's header (read from
the daemon's root, which `status()` names) says which tensors it holds, so a fresh optimizer is
given zero tensors of the right shapes, the daemon fills them, and the optimizer continues from
the restored state.

Another world size: an item with a layout (Checkpointer's `layouts` and `replicated`, or the
placements of a DTensor / ShardedTensor; optimizer state follows its parameter) is a box of a
global tensor, recorded in the version's index.json. load() of a version written by another
world size (or with other boxes) checks the items against that index, gives the optimizer its
state in this rank's boxes, and lets the daemon fill them from the old ranks' overlapping
chunks. Job state (step, param groups, scheduler, extra_state) comes from old rank 0's blob,
per-rank state (RNG states, generators, keyword objects) from old rank r's (old rank 0's for a
new rank): rank 0's blob is sent for every rank, the others' for their own rank only.

Without a daemon: load_checkpoint(root, job, step) reads a checkpoint into plain state dicts
(model, optimizer in Optimizer.state_dict() format, scheduler, objects, extra_state), checksums
verified.

A daemon restart (a crash and systemd's Restart=on-failure) does not stop training: the client
underneath reconnects (within reconnect_budget seconds, default $CKPT_RECONNECT_BUDGET_S or 120)
and registers the same shared memory again. Versions in flight at the restart are lost: the
automatic wait before the update and save() do not raise for them but record them in
`lost_versions` (and their messages in `restart_errors`) and issue a RuntimeWarning; save() then
takes its version from the restarted daemon. Explicit wait_snapshot() and wait_durable() calls on
a lost version raise ckpt.DaemonRestartedError at once. A daemon still down after the budget makes
the call raise ckpt.Error (code 14, UNAVAILABLE); the next call tries again.

Errors: UnsupportedTensorError (non-contiguous, unsupported device, dtype or layout, tensors
sharing memory), StateMismatchError (the objects do not match the checkpoint: names, shapes,
dtypes), VersionNotFoundError (no such committed version), ckpt.Error (whatever else the daemon
reports). Pickled state is loaded with pickle: load only checkpoints you trust.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import json
import operator
import os
import pickle
import random
import re
import sys
import threading
import time
import types
import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from . import (Client, DaemonRestartedError, Error, Level, SharedRegion, TornSnapshotError, VersionNotFoundError,
               load_version, read_header)
from . import _ckpt

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

BLOB = "ckpt.torch"  # name of the pickled non-tensor state blob
# Parts of the blob that are each rank's own: at another world size, rank r takes them from old
# rank r (old rank 0 for a rank the old run did not have); the rest comes from old rank 0.
_PER_RANK = ("rng", "generators", "objects")
_FORMAT = 1
_ALIGN = 64  # byte alignment of tensors inside the shared regions
_DEADLINE_EXCEEDED, _NOT_FOUND, _FAILED_PRECONDITION = 4, 5, 9  # gRPC status codes carried by ckpt.Error.code

# Staging (a copy taken at save(), so the trainer may change the tensor while the daemon reads
# the copy): decided by size and device only. A host copy is one memcpy on the training thread
# per save (4 MiB: about 0.4 ms at 10 GB/s, around 1 % of a 30 ms step at worst; the buffers
# it is meant for, normalisation statistics, step counters, are KBs). A GPU copy is a
# device-to-device copy queued on the trainer's stream (hundreds of GB/s: 64 MiB costs a
# fraction of a millisecond of GPU time) and doubles only that memory.
_STAGE_MAX_BYTES = {"cpu": 1 << 20, "cuda": 4 << 20}  # per tensor
_STAGE_BUDGET = {"cpu": 4 << 20, "cuda": 64 << 20}  # all staged tensors of a Checkpointer, per device type
# A tensor's in-place version counter (moves with every in-place op: autograd's, no_grad code,
# optimizers, load_state_dict; not with writes through t.data). Read for hundreds of tensors by
# one C-level map() (an attrgetter measured faster than the descriptor's __get__).
_VERSION = operator.attrgetter("_version")

_TORCH_TO_CODE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):  # newer torch only
        _TORCH_TO_CODE[getattr(torch, _name)] = _code
_CODE_TO_TORCH = {c: t for t, c in _TORCH_TO_CODE.items()}


# model or optimizer -> the open Checkpointer that hooked it (weakly: neither is kept alive).
_OPEN: "weakref.WeakKeyDictionary[Any, weakref.ReferenceType]" = weakref.WeakKeyDictionary()


class UnsupportedTensorError(ValueError):
    """A tensor cannot become a checkpoint item (layout, device, dtype, shared memory)."""


class StateMismatchError(ValueError):
    """The model / optimizer / objects do not match the checkpoint being loaded."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a tensor item sits in a global tensor, so that a restore at another world size
    can reshard it (the fields of ckpt.Layout, the client's):

      Layout(global_shape=[1024, 512], offsets=[256, 0])   the box [256, 256 + rows) x [0, 512)
                                                            of a 1024 x 512 tensor
      flat_shard(start, global_numel)                       elements [start, start + numel) of a
                                                            flat 1-D tensor (ZeRO-1 partitions)
      REPLICATED                                            the whole tensor, the same on every rank

    global_name: the global tensor's name; None: the item's name (for optimizer state: the rule
    of Checkpointer's `layouts`). The box's extent is the item's shape."""

    global_shape: Tuple[int, ...] = ()
    offsets: Tuple[int, ...] = ()
    global_name: Optional[str] = None
    replicated: bool = False

    def __post_init__(self):
        for field in ("global_shape", "offsets"):
            value = getattr(self, field)
            try:
                value = tuple(operator.index(v) for v in value)
            except TypeError:
                raise TypeError(f"Layout.{field} must be a sequence of ints, not {value!r}") from None
            if any(v < 0 for v in value):
                raise ValueError(f"Layout.{field} {list(value)} has a negative value")
            object.__setattr__(self, field, value)
        if self.replicated and self.offsets:
            raise ValueError("a replicated Layout has no offsets (every rank holds the whole tensor)")
        if not self.replicated and len(self.global_shape) != len(self.offsets):
            raise ValueError(f"Layout: global_shape {list(self.global_shape)} and offsets {list(self.offsets)} "
                             f"must have one value per dimension")
        if self.global_name is not None and (not isinstance(self.global_name, str) or not self.global_name):
            raise ValueError(f"Layout.global_name must be a non-empty string or None, not {self.global_name!r}")


REPLICATED = Layout(replicated=True)


def flat_shard(start: int, global_numel: int, global_name: Optional[str] = None) -> Layout:
    """The layout of a flat 1-D tensor that is elements [start, start + its numel) of a flat
    global tensor of global_numel elements: a ZeRO-1/2 optimizer partition. With the global
    name of the flat tensor (the same on every rank), a restore at another world size gives
    each rank its new range, whatever the old ranks' ranges were."""
    return Layout(global_shape=(global_numel,), offsets=(start,), global_name=global_name)


# ----------------------------------------------------------------------------------------
# Small helpers


def _storage_ptr(t: torch.Tensor) -> int:
    s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return s.data_ptr()


_DATA_PTR = torch.Tensor.data_ptr

# Whether the binding takes GPU items ((name, dtype, shape, device_ptr) tuples) and streams.
_GPU_ITEMS = hasattr(Client, "wait_snapshot_on_stream")


def _check_tensor(name: str, t: torch.Tensor) -> None:
    """Raises UnsupportedTensorError if `t` cannot be a tensor item."""
    if t.device.type == "cuda" and not _GPU_ITEMS:
        raise UnsupportedTensorError(
            f"{name}: CUDA tensors need a ckpt module with GPU items, and this one has none; "
            f"move the state to the CPU")
    if t.device.type not in ("cpu", "cuda"):
        raise UnsupportedTensorError(
            f"{name}: tensor on device '{t.device}' is not supported (CPU and CUDA tensors only)")
    if t.layout != torch.strided:
        raise UnsupportedTensorError(f"{name}: {t.layout} tensors are not supported (dense tensors only)")
    if t.is_quantized:
        raise UnsupportedTensorError(f"{name}: quantized tensors are not supported")
    if t.dtype not in _TORCH_TO_CODE:
        raise UnsupportedTensorError(
            f"{name}: dtype {t.dtype} is not supported (supported: "
            f"{', '.join(str(d) for d in _TORCH_TO_CODE)})")
    if not t.is_contiguous():
        raise UnsupportedTensorError(
            f"{name}: tensor is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
            f"make it contiguous (t.data = t.contiguous()) before checkpointing")


def _has_version(t: torch.Tensor) -> bool:
    try:
        _VERSION(t)
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):  # a wrapper without one
        return False
    return True


def _shape(t) -> List[int]:
    return [int(d) for d in t.shape]


class _Pickled:
    """State pickled already (on the training thread, at save): pickles as a call of
    pickle.loads on its bytes, so that the blob unpickles to the state itself (plain pickle, as
    if pickled in one piece) while the worker thread that pickles the blob only copies bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return (pickle.loads, (self.data,))


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _own_state(obj: Any) -> Tuple[Any, Dict[str, str]]:
    """obj.state_dict() without the values that are bound methods of obj itself, and
    {key: method name} of those. torch 1.x's OneCycleLR keeps `anneal_func =
    self._annealing_cos` in its state dict: pickling it pickles the scheduler with its
    optimizer and every parameter (hundreds of KB per save), and loading it would bind the
    live scheduler's anneal_func to an unpickled copy. Such a method is not state: the load
    binds the key to the live object's method of that name again."""
    sd = obj.state_dict()
    if not isinstance(sd, dict):
        return sd, {}
    bound = {}
    for k, v in sd.items():
        if isinstance(v, types.MethodType) and v.__self__ is obj:
            name = v.__func__.__name__
            if getattr(getattr(obj, name, None), "__func__", None) is v.__func__:
                bound[k] = name
    if bound:
        sd = {k: v for k, v in sd.items() if k not in bound}
    return sd, bound


class _Finder(pickle.Pickler):
    """Pickles to nowhere, counting the objects that make a pickled state large."""

    def __init__(self):
        super().__init__(_NullFile(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: Dict[str, int] = {}

    def reducer_override(self, obj):
        kind = None
        if isinstance(obj, torch.Tensor):
            kind = "tensor"
        elif isinstance(obj, torch.nn.Module):
            kind = f"module {type(obj).__name__}"
        elif isinstance(obj, torch.optim.Optimizer):
            kind = f"optimizer {type(obj).__name__}"
        elif isinstance(obj, types.MethodType):
            kind = f"bound method {type(obj.__self__).__name__}.{obj.__func__.__name__}"
        if kind is not None:
            self.found[kind] = self.found.get(kind, 0) + 1
        return NotImplemented


class _NullFile:
    def write(self, b):
        return len(b)


def _size_report(state: Any) -> str:
    """What makes `state` pickle large: its largest keys (for a dict) and what they hold."""
    def holds(obj) -> str:
        f = _Finder()
        try:
            f.dump(obj)
        except Exception:  # noqa: BLE001 (only a diagnosis: it pickled fine a moment ago)
            return ""
        kinds = sorted(f.found.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{n} {k}{'s' if n > 1 and k == 'tensor' else ''}" for k, n in kinds[:4])

    parts = []
    if isinstance(state, dict):
        sizes = sorted(((len(_dumps(v)), k) for k, v in state.items()), reverse=True)[:3]
        for size, k in sizes:
            h = holds(state[k])
            parts.append(f"[{k!r}] {size / 1024:.0f} KiB" + (f" (holds {h})" if h else ""))
    else:
        h = holds(state)
        if h:
            parts.append(f"holds {h}")
    return "; ".join(parts)


def _rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state().numpy().tobytes()}
    np = sys.modules.get("numpy")  # only if the trainer uses it
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _version_dir(v: int) -> str:
    return f"v{v:010d}"


def _shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


class _Slot:
    """One tensor item: the tensor object the trainer uses, where its bytes live, and how to
    tell whether it is still the tensor the trainer uses (owner[key] is holder, same address;
    holder is the tensor itself, or the DTensor / ShardedTensor whose local piece it is).
    A staged slot is registered at region/offset of a staging copy that save() refreshes
    (`block`: the trainer's memory, the copy; on a GPU, target is the copy's device address);
    ptr is then the address of the trainer's tensor. layout: where it sits in its global tensor
    (a Layout with global_name set), None: private; auto: the layout a DTensor or ShardedTensor
    gave; param: for optimizer state, the index of its parameter."""

    __slots__ = ("name", "tensor", "owner", "key", "ptr", "region", "offset", "staged", "block", "holder",
                 "layout", "auto", "param", "mirror", "target")

    def __init__(self, name, tensor, owner, key, staged=False, holder=None, auto=None, param=None, mirror=False):
        self.name, self.tensor, self.owner, self.key, self.staged = name, tensor, owner, key, staged
        self.mirror = mirror  # a staged copy of a tensor left where it is (block: the tensor, its copy)
        self.holder = tensor if holder is None else holder
        self.auto, self.param, self.layout = auto, param, None
        self.ptr = self.region = self.offset = self.block = self.target = None

    def current(self) -> bool:
        t = self.tensor
        return (self.owner is None or self.owner.get(self.key) is self.holder) and t.data_ptr() == self.ptr


def _sharded_tensor_type():
    """torch.distributed._shard's ShardedTensor class if that module was imported (no
    ShardedTensor exists otherwise; importing it here would fail on torch 1.13 under Python
    3.11, whose dataclasses refuse its metadata class), else None."""
    module = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    return getattr(module, "ShardedTensor", None)


def _dtensor_type():
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):  # torch >= 2.4, older 2.x
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if cls is not None:
            return cls
    return None


def _dtensor_box(name: str, t) -> Layout:
    """The layout of this rank's local tensor of DTensor `t` (Shard and Replicate placements)."""
    kinds = {type(p).__name__ for p in t.placements}
    if kinds <= {"Replicate"}:
        return REPLICATED
    if not kinds <= {"Shard", "Replicate"}:
        raise UnsupportedTensorError(f"{name}: DTensor placements {list(t.placements)} are not supported "
                                     f"(Shard and Replicate only; a Partial one must be reduced first)")
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch < 2.4
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    mesh = t.device_mesh
    copies = [mesh.size(d) for d, p in enumerate(t.placements) if type(p).__name__ == "Replicate" and mesh.size(d) > 1]
    if copies:
        raise UnsupportedTensorError(
            f"{name}: a DTensor sharded over some mesh dimensions and replicated over others (placements "
            f"{list(t.placements)}, mesh {tuple(mesh.shape)}, as in HSDP) is not supported: each piece of a "
            f"global tensor must be held by one rank")
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    if list(shape) != _shape(t._local_tensor):
        raise UnsupportedTensorError(f"{name}: the DTensor's local tensor is {_shape(t._local_tensor)}, not the "
                                     f"{list(shape)} its placements {list(t.placements)} give (padded?)")
    return Layout(global_shape=_shape(t), offsets=[int(o) for o in offsets])


def _local_pieces(name: str, t: torch.Tensor) -> List[Tuple[str, torch.Tensor, Optional[Layout]]]:
    """(item name, local tensor, layout) of each piece of `t` this rank holds: `t` itself for a
    plain tensor; the local tensor of a DTensor; each local shard of a ShardedTensor (named
    NAME[j] when there are several)."""
    sharded = _sharded_tensor_type()
    if sharded is not None and isinstance(t, sharded):
        shards = t.local_shards()
        size = [int(d) for d in t.metadata().size]
        return [(name if len(shards) == 1 else f"{name}[{j}]", sh.tensor,
                 Layout(global_shape=size, offsets=list(sh.metadata.shard_offsets), global_name=name))
                for j, sh in enumerate(shards)]
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return [(name, t._local_tensor, dataclasses.replace(_dtensor_box(name, t), global_name=name))]
    return [(name, t, None)]


def _native_layout(layout: Layout):
    """The ckpt.Layout (the client's) of `layout`."""
    return _ckpt.Layout(global_name=layout.global_name or "", global_shape=list(layout.global_shape),
                        offsets=list(layout.offsets), replicated=layout.replicated)


def _as_layout(layout: Any) -> Layout:
    """A Layout from a Layout or anything with its fields (a ckpt.Layout)."""
    if isinstance(layout, Layout):
        return layout
    if not all(hasattr(layout, f) for f in ("global_shape", "offsets", "replicated")):
        raise TypeError(f"layouts: a value must be a ckpt.torch.Layout (or ckpt.Layout), not "
                        f"{type(layout).__name__}")
    return Layout(global_shape=layout.global_shape, offsets=layout.offsets,
                  global_name=getattr(layout, "global_name", None) or None, replicated=layout.replicated)


def _check_box(name: str, t: torch.Tensor, layout: Layout) -> None:
    """Raises ValueError unless `layout` fits item `name` (the daemon checks it too)."""
    shape = _shape(t)
    if layout.replicated:
        if layout.global_shape and list(layout.global_shape) != shape:
            raise ValueError(f"{name}: a replicated layout's global_shape {list(layout.global_shape)} is not the "
                             f"tensor's shape {shape}")
        return
    if len(layout.global_shape) != len(shape):
        raise ValueError(f"{name}: the layout has {len(layout.global_shape)} dimensions (global_shape "
                         f"{list(layout.global_shape)}), the tensor {len(shape)} (shape {shape})")
    for d, (off, n, g) in enumerate(zip(layout.offsets, shape, layout.global_shape)):
        if off + n > g:
            raise ValueError(f"{name}: the box at offsets {list(layout.offsets)} with shape {shape} does not fit "
                             f"in global_shape {list(layout.global_shape)} (dimension {d}: {off} + {n} > {g})")


# ----------------------------------------------------------------------------------------


# The launchers whose environment says which process of how many this is, in the order they
# are asked: torchrun's (RANK of WORLD_SIZE), then srun's (SLURM_PROCID of the step's
# SLURM_STEP_NUM_TASKS). The first whose world size is set decides: under torchrun started by
# srun, torchrun's are the trainer's ranks (srun's count the torchruns). Not SLURM_NTASKS:
# the batch script of `sbatch -n2` has SLURM_NTASKS=2 and SLURM_PROCID=0 too (seen on Slurm
# 22.05), and a trainer started there without srun would take itself for rank 0 of 2 and
# never commit; SLURM_STEP_NUM_TASKS is set only inside an srun step.
_LAUNCHERS = (("torchrun", "RANK", ("WORLD_SIZE",)),
              ("srun", "SLURM_PROCID", ("SLURM_STEP_NUM_TASKS",)))


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name, "")
    if value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None


def _env_rank_and_world() -> Optional[Tuple[int, int]]:
    """(rank, world size) from the first launcher whose world size is set, if it says this
    process is one of several; else None."""
    for launcher, rank_var, world_vars in _LAUNCHERS:
        world_var = next((v for v in world_vars if os.environ.get(v, "") != ""), None)
        if world_var is None:
            continue
        world = _env_int(world_var)
        if world <= 1:
            return None
        rank = _env_int(rank_var)
        if rank is None:
            raise ValueError(f"${world_var}={world} says this process is one of {world} ({launcher}), but "
                             f"${rank_var} is not set: initialise torch.distributed or pass rank= and "
                             f"world_size=")
        if not 0 <= rank < world:
            raise ValueError(f"${rank_var}={rank} is not a rank of ${world_var}={world} ({launcher})")
        return rank, world
    return None


def _rank_and_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """This process's (rank, world size): torch.distributed's when it is initialised (an
    explicit value must then agree with it: a checkpoint written under the wrong rank would
    restore another rank's state); else each explicit value, else the launcher's environment
    (so that the ranks of a job started by torchrun or srun before init_process_group do not
    all register as rank 0 of 1 and overwrite each other's shard), else (0, 1)."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        env = None if rank is not None and world_size is not None else _env_rank_and_world()
        e_rank, e_world = (0, 1) if env is None else env
        return (e_rank if rank is None else int(rank)), (e_world if world_size is None else int(world_size))
    d_rank, d_world = dist.get_rank(), dist.get_world_size()
    for what, given, actual in (("rank", rank, d_rank), ("world_size", world_size, d_world)):
        if given is not None and int(given) != actual:
            raise ValueError(f"{what}={given} was given, but torch.distributed is initialised with rank "
                             f"{d_rank} of world size {d_world}: leave {what} out, or pass {actual}")
    return d_rank, d_world


class Checkpointer:
    """Checkpoints a trainer's model, optimizer, scheduler and other state through ckptd.

    client_or_socket: a ckpt.Client, or the daemon's socket path (None: the default socket,
      found as the C++ client finds it: $CKPTD_SOCKET, else /run/ckptd/ckptd.sock).
    job, rank, world_size: the checkpoint namespace and this process's place in it. rank and
      world_size default to torch.distributed's when it is available and initialised; one
      given explicitly that disagrees with it is a ValueError saying both. When it is not
      initialised, each value given explicitly is used, and one left out comes from the
      launcher's environment when that says this process is one of several: torchrun's
      $RANK of $WORLD_SIZE first, then srun's $SLURM_PROCID of $SLURM_STEP_NUM_TASKS (set
      only inside an srun step, unlike $SLURM_NTASKS); else 0 and 1. A world size above 1
      without its rank variable, a rank
      outside the world or a value that is not an integer is a ValueError naming the
      variables.
    model: a torch.nn.Module; optimizer: a torch.optim.Optimizer; scheduler: anything with
      state_dict()/load_state_dict() (an LR scheduler).
    extra_state: a dict of your own (data-loader position, counters): pickled at each save,
      updated in place by load.
    rng: also save and restore the RNG states (python, torch, numpy, CUDA). Default True.
    wait_before: where the wait for each version starts: "step" (before optimizer.step and the
      next save()), "forward" (before every model forward too), "save" (save() waits for the
      capture before returning: no overlap), or None (automatic, the default: "step", or
      "forward" if a model buffer is too large to stage). Small buffers (batch norm's and any
      other) are staged, so the forward may change them during the capture. Whatever the
      choice, a version whose registered memory changed in place is aborted, never
      committed, and the wait moves as far as that tensor needs (see "Torn snapshots" in the
      module's documentation); `wait_before` then says where it is. wait_snapshot() can be
      called explicitly too.
    verify: the daemon also compares host memory with its copy at each version's sealing
      wait and aborts the version if it changed: catches writes the version counters do not
      see (through t.data, numpy views, other threads or processes) made after its copy of the
      item. Costs one more read of the host state per version, and the seal is then made on
      the training thread (the re-read must end before the update).
    reconnect_budget: seconds a call waits for a daemon that went away (restarting) before it
      raises; None: $CKPT_RECONNECT_BUDGET_S, else 120 (only when the Checkpointer connects
      the client itself; give a Client its own budget in Client.connect).
    background: True (default): for host tensors, save() hands the snapshot call and the wait
      for its capture to a worker thread and returns (see save()); a trainer killed within
      that moment (about a millisecond) loses that version, and its restart resumes from the
      one before. False: save() makes the snapshot call itself and returns once the daemon
      has the version (which then completes even if the trainer is killed right after), and
      the wait before the update asks the daemon too: about 1-2 ms more per step on a busy
      2-core machine. (GPU tensors: always False.)
    warn_blob_bytes: a part of the pickled state (the scheduler's, an object's, extra_state,
      the optimizer's groups) that pickles to more than this many bytes gets a RuntimeWarning,
      once, naming it and what makes it large (tensors, a module, an optimizer, a bound
      method): such state is pickled on the training thread at every save. Default 64 KiB;
      None: no check.
    layouts: {tensor or item name: Layout}: where tensors of this rank sit in global tensors,
      so that load() at another world size reshards them. Keys: a parameter or buffer of the
      model (or of the optimizer), or an item name ("model.<key>", "optim.param.<i>",
      "optim.state.<i>.<key>"). Values: Layout(global_shape, offsets) (a box), flat_shard(start,
      global_numel) (a flat ZeRO-1 partition) or REPLICATED. DTensors and ShardedTensors need no
      entry: their placements give their layout. Each item's global tensor is named by the
      layout's global_name, default the item name; the optimizer state of a parameter with a
      layout follows it: a state tensor of the parameter's shape gets its box (Adam's exp_avg),
      a one-element one is replicated (a step counter), another shape stays rank-private; its
      global name is "optim.state.<the parameter's global name>.<key>". A box that does not fit
      its global shape, or a key that is not a tensor item here, is a ValueError naming it.
    replicated: True: every other tensor item (of the model, of its parameters' optimizer
      state) is the same on every rank (DDP): the version keeps one copy for other world
      sizes, and any world size restores it. Without a layout an item is rank-private: only
      the rank that wrote it restores it, at the same world size. `ck.layouts` lists the
      layouts of the registered items.
    **objects: more objects with state_dict()/load_state_dict() (grad scalers, samplers with
      state...), pickled at each save under their keyword, and torch.Generator objects (the
      generator of a RandomSampler or DataLoader, of random augmentations...): their
      get_state() is saved and set_state() restores it, so a resumed run draws the same
      numbers. The global RNGs are saved by `rng`; a generator of your own only this way.
      Bound methods of an object in its own state_dict() (torch 1.x OneCycleLR's anneal_func)
      are not pickled: load binds them to the live object's method of that name again.

    aborted_versions: (version, reason) of every version aborted because registered memory
      changed during its capture (found by the version counters, or by the daemon's verify).

    Construction moves the model's and the optimizer's CPU tensors into shared memory and
    registers them with the daemon (waiting for versions of this rank still in flight from a
    previous process). Not thread-safe: use one Checkpointer from the training thread.
    """

    def __init__(self, client_or_socket: Union[Client, str, os.PathLike, None], job: str, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, scheduler: Any = None,
                 extra_state: Optional[Dict[str, Any]] = None, rng: bool = True,
                 wait_before: Optional[str] = None, reconnect_budget: Optional[float] = None,
                 background: bool = True, warn_blob_bytes: Optional[int] = 64 * 1024,
                 layouts: Optional[Mapping[Union[str, torch.Tensor], Layout]] = None, replicated: bool = False,
                 verify: bool = False, **objects: Any):
        rank, world_size = _rank_and_world(rank, world_size)
        explicit: Tuple[Dict[int, Layout], Dict[str, Layout]] = ({}, {})
        self._explicit_refs: Dict[int, torch.Tensor] = {}  # keeps the tensors keyed by id alive
        for key, layout in (layouts or {}).items():
            layout = _as_layout(layout)
            if isinstance(key, torch.Tensor):
                explicit[0][id(key)] = layout
                self._explicit_refs[id(key)] = key
            elif isinstance(key, str):
                explicit[1][key] = layout
            else:
                raise TypeError(f"layouts: a key must be a tensor or an item name, not {type(key).__name__}")
        self._explicit, self._replicate_all, self._layouts_checked = explicit, bool(replicated), False
        if isinstance(client_or_socket, Client):
            if reconnect_budget is not None:
                raise ValueError("reconnect_budget applies to a client the Checkpointer connects: pass it to "
                                 "Client.connect instead")
            self._client = client_or_socket
        else:
            self._client = Client.connect("" if client_or_socket is None else os.fspath(client_or_socket),
                                          reconnect_budget)
        if extra_state is not None and not isinstance(extra_state, dict):
            raise TypeError(f"extra_state must be a dict, not {type(extra_state).__name__}")
        for key, obj in [("scheduler", scheduler)] + list(objects.items()):
            if key != "scheduler" and isinstance(obj, torch.Generator):
                continue
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{key}: {type(obj).__name__} has no state_dict()/load_state_dict() "
                                f"(and is not a torch.Generator)")
        if wait_before not in (None, "step", "forward", "save"):
            raise ValueError(f"wait_before must be 'step', 'forward', 'save' or None, not {wait_before!r}")
        if wait_before == "forward" and model is None:
            raise ValueError("wait_before='forward' needs a model")
        # A second Checkpointer on the same model or optimizer would leave the first one's hooks
        # waiting on its (possibly dead) registration at every forward or step.
        for what, obj in (("model", model), ("optimizer", optimizer)):
            other = _OPEN.get(obj)() if obj is not None and obj in _OPEN else None
            if other is not None and not other._closed:
                raise ValueError(f"this {what} is already checkpointed by an open Checkpointer (job "
                                 f"'{other.job}', rank {other.rank}): close() it first, or use "
                                 f"'with Checkpointer(...) as ck:'")
        self.job, self.rank, self.world_size = job, int(rank), int(world_size)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.extra_state, self.rng = extra_state, rng
        self.generators = {k: g for k, g in objects.items() if isinstance(g, torch.Generator)}
        self.objects = {k: o for k, o in objects.items() if k not in self.generators}
        self.warn_blob_bytes, self.background, self.verify = warn_blob_bytes, bool(background), bool(verify)
        self._warned: set = set()  # parts of the blob warned about as large
        self.last_stall_s = 0.0  # seconds the last automatic or explicit wait blocked
        self.total_stall_s = 0.0
        self.lost_versions: List[int] = []  # versions lost to daemon restarts, reported by save or a wait
        self.restart_errors: List[str] = []  # their messages
        self._pending: Optional[int] = None  # saved, not yet known to be captured
        # The pending version's send (snapshot, then wait_snapshot) on the worker thread; None
        # when save() called snapshot itself (then the wait calls wait_snapshot).
        self._job: Optional[concurrent.futures.Future] = None
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._send_inline = True  # the first save after a registration sends on this thread
        self._last_saved: Optional[int] = None
        self._closed = False
        self._slots: List[_Slot] = []
        self._watch: List[Tuple[Any, Any, torch.Tensor, int]] = []  # what _tracking_current checks
        self._items_meta: List[Tuple[str, str, List[int]]] = []  # (name, dtype, shape) per slot
        self._regions: List[SharedRegion] = []  # every region made (views keep them alive too)
        self._model_aliases: Dict[str, str] = {}  # state_dict key -> item of the same tensor
        self._model_other: List[str] = []  # state_dict keys pickled (non-tensors, empty tensors)
        self._optim_other: Dict[int, List[str]] = {}  # param index -> non-tensor state keys
        self._optim_lengths: Tuple[List[dict], List[int]] = ([], [])  # per-param state dicts, their lengths
        self._optim_state_len = 0
        self._with_state: List[int] = []  # indices of the parameters that have optimizer state
        self._static = _Pickled(_dumps([]))  # _items_meta, pickled
        self._stage_blocks: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (trainer's, registered)
        # The guard against in-place changes under a capture (see _moved, _escalate).
        self.aborted_versions: List[Tuple[int, str]] = []  # (version, why): never committed
        self._protect: Dict[int, Tuple[torch.Tensor, str]] = {}  # id(tensor) -> (it, "stage" / "guard")
        self._protect_seen: Dict[int, Tuple[torch.Tensor, str]] = {}
        self._staged_bytes: Dict[str, int] = {}  # per device type
        self._large_buffers: List[str] = []  # buffers too large to stage (registered in place)
        self._guard: List[torch.Tensor] = []  # the tensors whose version counters are compared
        self._guard_slots: List[_Slot] = []  # their slots
        self._recorded: Optional[List[int]] = None  # their counters at the pending version's save()
        self._restage = False  # a tensor was escalated to staging: the next save() registers again
        self._seal: Optional[Tuple[int, concurrent.futures.Future]] = None  # a seal on the worker thread
        self._forward_hook = None
        self._verified = False  # the daemon verifies each version at its seal (verify, or its flag)
        self._auto_wait = True  # wait_before=None: a large buffer moves the wait before the forward
        self._exiting = False  # the interpreter exits: _seal_at_exit seals the last version
        self.wait_before = "step"
        self._root: Optional[str] = None
        # Set by load(): the world size that wrote the restored version, and whether the
        # restore resharded it (another world size, or other boxes).
        self.restored_world_size: Optional[int] = None
        self.resharded = False
        self._cuda_device: Optional[torch.device] = None  # of the GPU items, if any
        self._params: List[torch.Tensor] = []
        if optimizer is not None:
            self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._hooks: List[Any] = []
        self._step_wrapper = None
        self._collect()
        self.registration = self._register()
        self._install_wait(wait_before)
        for obj in (model, optimizer):
            if obj is not None:
                _OPEN[obj] = weakref.ref(self)
        _LIVE.add(self)

    # -- public API --------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """Checkpoints the current state as version `step` and returns at once. Call it after
        the optimizer step (and scheduler step) of iteration `step`; steps must increase. What
        the trainer changes in place afterwards cannot reach the version: staged tensors are
        copied here, the others are waited for or, if they change under the capture anyway,
        the version is aborted (see "Torn snapshots" in the module's documentation).

        The non-tensor state (scheduler, objects, extra_state, RNG states, optimizer groups)
        is taken here, on the calling thread; the staged tensors (small buffers...) are copied
        to their registered staging memory and the version counters of the others recorded
        (compared at the wait, which seals the version or aborts it). For host
        tensors, the snapshot call to the daemon and the wait for its capture then run on a
        worker thread (the first save after a registration runs them here, so that a
        refusal such as "version N is not higher than M" is raised by that save): an error
        of that call is raised by the next wait (the one before the update), save(),
        wait_snapshot(), wait_durable() or close()."""
        self._check_open()
        step = int(step)
        self._wait_noting_restart()  # the previous version's memory (staging too) is free
        if self._restage or not self._tracking_current():
            self._refresh()
        parts = self._blob_state(step)
        with torch.no_grad():
            for trainer, registered in self._stage_blocks:
                registered.copy_(trainer)
        self._recorded = list(map(_VERSION, self._guard))
        if self._cuda_device is not None or self._send_inline or not self.background:
            blob = _dumps(parts)
            try:
                self._snapshot(step, blob)
            except DaemonRestartedError as e:
                # Earlier versions lost to a daemon restart, reported instead of taking this
                # one: noted, and this one is taken now.
                self._note_restart(e)
                self._snapshot(step, blob)
            self._send_inline = False
        else:
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt.torch-save")
            self._job = self._worker.submit(self._send, step, parts)
        self._pending = self._last_saved = step
        if self.wait_before == "save":
            self._wait_noting_restart()

    def _snapshot(self, step: int, blob: bytes) -> None:
        if self._cuda_device is None:
            self._client.snapshot(step, self._blobs(blob))
        else:  # the version is the state once the work queued so far on the stream has run
            self._client.snapshot(step, self._blobs(blob), stream=torch.cuda.current_stream(self._cuda_device))

    def _blobs(self, blob: bytes) -> Dict[str, Any]:
        """The snapshot's blobs: rank 0's for every rank of a restore at another world size (the
        job's state comes from it), any other rank's for the rank of its number only."""
        return {BLOB: _ckpt.Blob(blob, for_rank=None if self.rank == 0 else self.rank)}

    def _send(self, step: int, parts: Dict[str, Any]) -> List[DaemonRestartedError]:
        """On the worker thread: pickles the blob (parts pickled already, RNG states), asks
        for the snapshot and waits until it is captured. Returns the restart reports the
        snapshot call gave, for the training thread to note (warnings belong there)."""
        blobs = self._blobs(_dumps(parts))
        restarts = []
        try:
            self._client.snapshot(step, blobs)
        except DaemonRestartedError as e:
            restarts.append(e)
            self._client.snapshot(step, blobs)
        try:
            self._client.wait_snapshot(step, seal=False)  # the training thread's wait seals it
        except DaemonRestartedError as e:
            e.ckpt_earlier = restarts  # reported by the snapshot call: noted with this one
            raise
        return restarts

    def _seal_version(self, step: int, stall: float) -> None:
        """On the worker thread: seals captured version `step` (the counters did not move),
        then sets the stall the next snapshot reports: the trainer's, not this wait's."""
        self._client.wait_snapshot(step)
        self._client.report_stall(stall)

    def _note_restart(self, e: DaemonRestartedError) -> None:
        self.lost_versions.extend(v for v in e.versions if v not in self.lost_versions)
        self.restart_errors.append(str(e))
        warnings.warn(f"ckpt.torch: {e}", RuntimeWarning, stacklevel=3)

    def wait_snapshot(self, timeout: Optional[float] = None) -> float:
        """Blocks until the last saved version is out of trainer memory (the tensors may change
        again); returns the seconds blocked (0 if nothing was pending). Then the version is
        sealed (it may commit), or, if a registered tensor changed in place since its save(),
        aborted (recorded in aborted_versions, with a RuntimeWarning; never committed).
        Raises ckpt.DaemonRestartedError if a daemon restart lost that version (the tensors
        may change then too: nothing reads them any more)."""
        self._check_open()
        self._collect_seal(block=False)
        if self._pending is None:
            return 0.0
        step = self._pending
        job = self._job
        start = time.perf_counter()
        if job is None:  # save() asked for the snapshot itself: this wait waits for it and seals it
            moved = self._moved()
            if moved:
                self._pending = None  # never sealed, whatever the abort call says
                self._abort(step, moved)
                stall = time.perf_counter() - start
            else:
                try:
                    stall = self._client.wait_snapshot(step, timeout)
                except DaemonRestartedError:
                    self._pending = None
                    raise
                except TornSnapshotError as e:  # the daemon's own check (verify)
                    self._note_torn(e)
                    stall = time.perf_counter() - start
        else:
            try:
                restarts = job.result(timeout)
            except concurrent.futures.TimeoutError:
                e = Error(f"wait_snapshot {self._pending}: not captured within {timeout} s")
                e.code = _DEADLINE_EXCEEDED
                raise e from None
            except BaseException as e:
                self._pending = self._job = None  # that version is lost or was not taken
                for earlier in getattr(e, "ckpt_earlier", ()):
                    self._note_restart(earlier)
                raise
            self._job = None
            self._collect_seal(block=True)  # the worker sealed the one before first
            for e in restarts:
                self._note_restart(e)
            # Compared here, on the training thread, rather than on the worker when the capture
            # ends: an in-place op of the training thread may be writing then (torch ops run
            # without the GIL) and moves the counter only when it is done.
            moved = self._moved()
            stall = time.perf_counter() - start
            if moved:
                self._pending = None  # never sealed, whatever the abort call says
                self._client.report_stall(stall)  # the trainer's stall, not the worker's wait
                self._abort(step, moved)
            elif self._exiting or self._verified:
                # Here, when the worker thread is gone; and when the daemon verifies: it reads the
                # memory again at the seal, which must be over before the update changes it.
                try:
                    self._seal_version(step, stall)
                except TornSnapshotError as e:
                    self._note_torn(e)
            else:
                self._seal = (step, self._worker.submit(self._seal_version, step, stall))
        self._pending = None
        self.last_stall_s = stall
        self.total_stall_s += stall
        return stall

    def _collect_seal(self, block: bool) -> None:
        """Takes the result of the seal the worker thread ran (if done, or waiting for it)."""
        if self._seal is None or not (block or self._seal[1].done()):
            return
        _, future = self._seal
        self._seal = None
        try:
            future.result()
        except DaemonRestartedError as e:
            self._note_restart(e)
        except TornSnapshotError as e:
            self._note_torn(e)

    # -- the guard against in-place changes under a capture ----------------------------------

    def _moved(self) -> List[_Slot]:
        """The slots whose tensors changed in place since the pending version's save()."""
        recorded = self._recorded
        if recorded is None:
            return []
        now = list(map(_VERSION, self._guard))
        if now == recorded:
            return []
        moved: List[_Slot] = []
        for slot, a, b in zip(self._guard_slots, now, recorded):
            if a != b and slot not in moved:
                moved.append(slot)
        return moved

    def _describe(self, s: _Slot) -> str:
        """Item `s` as the trainer knows it: its module path and state_dict key, or its
        parameter."""
        if s.name.startswith("model."):
            key = s.name[len("model."):]
            module = key.rpartition(".")[0]
            return f"{s.name} (state_dict key '{key}', module '{module or '(the model itself)'}')"
        if s.param is not None:
            param = next((o.name for o in self._slots if o.param is None and o.holder is self._params[s.param]), None)
            of = f" of {param}" if param else ""
            return f"{s.name} (optimizer state '{s.key}' of parameter {s.param}{of})"
        return s.name

    def _abort(self, step: int, moved: List[_Slot]) -> None:
        """Aborts version `step` in the daemon (its memory changed under the capture), says so
        and protects the tensors that changed from now on."""
        what = "; ".join(self._describe(s) for s in moved[:4]) + (f" and {len(moved) - 4} more"
                                                                    if len(moved) > 4 else "")
        reason = f"{what} changed in place between save({step}) and the end of its capture"
        try:
            self._client.abort_snapshot(step, f"ckpt.torch: {reason}"[:1000])  # the daemon keeps 1 KiB
        except DaemonRestartedError as e:
            self._note_restart(e)  # lost with the daemon: not committed either
        self.aborted_versions.append((step, reason))
        changes = [c for c in (self._escalate(s) for s in moved) if c]
        warnings.warn(f"ckpt.torch: version {step} aborted (never committed; the newest committed version "
                      f"stays the one to restore): {reason}." + "".join(f" {c}." for c in changes),
                      RuntimeWarning, stacklevel=4)

    def _note_torn(self, e: Error) -> None:
        """A version the daemon aborted (verify mode saw its memory change): recorded, said, and
        the item it names protected from now on."""
        version = getattr(e, "version", None)
        self.aborted_versions.append((version, str(e)))
        named = [s for s in self._slots if re.search(rf"(?<![\w.]){re.escape(s.name)}(?![\w.])", str(e))]
        changes = [c for c in (self._escalate(s) for s in named[:1]) if c]
        warnings.warn(f"ckpt.torch: version {version} aborted by the daemon (never committed): {e}."
                      + "".join(f" {c}." for c in changes), RuntimeWarning, stacklevel=4)

    def _escalate(self, s: _Slot) -> Optional[str]:
        """Protects the tensor of slot `s`, seen changing in place under a capture, from the next
        save on: staged if small enough (and not a DTensor's piece); else the wait moves before
        the forward; if it already was there (the change comes at the start of an iteration),
        into save() itself. Returns what changed, once per step of that ladder, else None."""
        if s.staged:
            return None
        t = s.holder
        if t is s.tensor and self._stage_fits(t):
            self._protect[id(t)] = (t, "stage")
            self._restage = True
            return f"From now on {s.name} is staged (copied at save())"
        if self.wait_before == "step" and self.model is not None:
            self._set_wait("forward")
            return (f"From now on the wait for each version is before the model's forward ({s.name}, "
                    f"{s.tensor.numel() * s.tensor.element_size()} bytes, is too large to stage)")
        if self.wait_before in ("step", "forward"):
            self._set_wait("save")
            return (f"From now on save() waits for the capture of each version before it returns ({s.name} "
                    f"changes before the wait{' before the forward' if self.model is not None else ''})")
        return None

    def wait_durable(self, step: Optional[int] = None, level: Level = Level.COMMITTED,
                     timeout: Optional[float] = None) -> None:
        """Blocks until version `step` (default: the last saved) reaches `level` (default:
        committed on all ranks)."""
        self._check_open()
        step = self._last_saved if step is None else int(step)
        if step is None:
            raise ValueError("nothing was saved yet")
        self._wait_noting_restart()  # sealed (or aborted) first: only a sealed version commits
        self._collect_seal(block=True)
        self._client.wait_durable(step, level, timeout)

    def load(self, step: Union[str, int] = "latest") -> int:
        """Restores version `step` ("latest": the newest committed) into the model, optimizer,
        scheduler, objects, extra_state and RNG states, in place, and returns its step.
        Restoring an older version than the newest rolls the job back: the daemon sets newer
        versions aside, and saving continues from step + 1.

        A version written at another world size (or with other boxes) is resharded: every
        tensor item must have a layout (see `layouts`, `replicated`) whose global tensor the
        version has, with the same dtype and global shape (else StateMismatchError, naming
        them); the daemon fills each box from the chunks that overlap it. The step, param
        groups, scheduler and extra_state come from old rank 0; RNG states, generators and
        keyword objects from old rank r, or old rank 0 for a rank r the old run did not have
        (docs/pytorch.md, "Changing the world size"). Afterwards restored_world_size is the
        world size that wrote the version and resharded says whether it was resharded."""
        self._check_open()
        if step != "latest":
            if isinstance(step, bool) or not hasattr(step, "__index__") or step.__index__() <= 0:
                raise ValueError(f"step must be 'latest' or a positive int, not {step!r}")
            step = step.__index__()
        self._wait_noting_restart()
        self._collect_seal(block=True)
        latest = self._register().latest_committed  # the same items: just asks for latest
        if step == "latest":
            if latest == 0:
                raise VersionNotFoundError(f"job '{self.job}' has no committed version")
            version = latest
        else:
            version = step
        index = self._version_index(version, latest)
        if index is not None and self._reshards(index):
            self._prepare_resharded(index, version)
        else:
            header = self._shard_header(version, latest)
            if header is not None:
                self._prepare_for(header, version)
        try:
            restored, by_rank, written_by, resharded = self._restore(version)
        except Error as e:
            raise _mapped(e) from e
        with torch.no_grad():  # the daemon filled the staging copies
            for trainer, registered in self._stage_blocks:
                trainer.copy_(registered)
        state = self._restored_state(by_rank, restored, written_by, resharded)
        self._apply(state, restored)
        self._last_saved = restored
        self.restored_world_size, self.resharded = written_by, resharded
        return int(state["step"])

    def _restore(self, version: int) -> Tuple[int, Dict[int, Dict[str, bytes]], int, bool]:
        """The daemon's restore: (version, {writer's rank: {blob name: bytes}}, the world size
        that wrote it, whether it was resharded)."""
        r = self._client.restore(version, result=True)
        by_rank: Dict[int, Dict[str, bytes]] = {}
        for b in r.blobs:
            by_rank.setdefault(int(b.from_rank), {})[b.name] = b.data
        return int(r.version), by_rank, int(r.world_size), bool(r.resharded)

    def _restored_state(self, by_rank: Mapping[int, Mapping[str, bytes]], version: int, written_by: int,
                        resharded: bool) -> Dict[str, Any]:
        """The blob state to apply. Restored by the ranks that wrote it: this rank's own. At
        another world size (see docs/pytorch.md, "Changing the world size"): the state of the
        job (step, param groups, scheduler, model entries that are not tensors, extra_state)
        from old rank 0's blob; the per-rank state (RNG states, generators, keyword objects)
        from old rank r's for a rank r the old run had, else from old rank 0's."""
        def state_of(rank: int) -> Optional[Dict[str, Any]]:
            data = by_rank.get(rank, {}).get(BLOB)
            return None if data is None else pickle.loads(data)

        if not resharded:  # this rank's own blobs only
            state = next((pickle.loads(b[BLOB]) for b in by_rank.values() if BLOB in b), None)
            if state is None:
                raise StateMismatchError(f"version {version} of job '{self.job}' was not written by ckpt.torch "
                                         f"(it has no '{BLOB}' blob)")
            return state
        job = state_of(0)
        if job is None:
            raise StateMismatchError(f"version {version} of job '{self.job}' (world size {written_by}) has no "
                                     f"'{BLOB}' blob of rank 0: it was not written by ckpt.torch, or by a version "
                                     f"of it that kept no blob for other world sizes")
        own = state_of(self.rank) if self.rank < written_by else None
        own = job if own is None else own
        state = {k: v for k, v in job.items() if k not in _PER_RANK}
        state.update({k: own[k] for k in _PER_RANK if k in own})
        rebind = {k: v for k, v in job.get("rebind", {}).items() if not k.startswith("objects.")}
        rebind.update({k: v for k, v in own.get("rebind", {}).items() if k.startswith("objects.")})
        state["rebind"] = rebind
        return state

    def _version_index(self, version: int, latest: int) -> Optional[Dict[str, Any]]:
        """The version's index.json (its global tensors, their chunks, the world size that
        wrote it); None if the root cannot be read from here or the version has none
        (written before indexes existed)."""
        vdir = self._version_path(version, latest)
        if vdir is None:
            return None
        try:
            with open(os.path.join(vdir, "index.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def _reshards(self, index: Mapping[str, Any]) -> bool:
        """Whether restoring the version of `index` here reshards: another world size, or a
        laid-out model tensor or parameter of this rank whose box is not a chunk this rank
        wrote."""
        if int(index["world_size"]) != self.world_size:
            return True
        mine = {(g, tuple(c["offsets"]), tuple(c["shape"]))
                for g, t in index["tensors"].items() for c in t["chunks"] if int(c["rank"]) == self.rank}
        for s in self._slots:
            lay = s.layout
            if s.param is None and lay is not None and not lay.replicated:
                if (lay.global_name, lay.offsets, tuple(_shape(s.tensor))) not in mine:
                    return True
        return False

    def _prepare_resharded(self, index: Mapping[str, Any], version: int) -> None:
        """The resharding counterpart of _prepare_for: checks the laid-out items against the
        version's global tensors and gives the optimizer the state tensors the checkpoint
        has, in this rank's boxes (zeros, filled by the restore)."""
        written_by = int(index["world_size"])
        where = (f"version {version} of job '{self.job}' (written by {written_by} ranks; this is rank "
                 f"{self.rank} of {self.world_size})")
        tensors = index["tensors"]
        problems = []
        private = [s.name for s in self._slots if s.layout is None]
        if private:
            problems.append(f"{', '.join(private[:5])}{' ...' if len(private) > 5 else ''} "
                            f"{'is' if len(private) == 1 else 'are'} rank-private (no layout), which only the "
                            f"rank that wrote it restores, at the same world size: declare "
                            f"{'its' if len(private) == 1 else 'their'} layout (layouts=, or replicated=True "
                            f"for state that is the same on every rank)")
        theirs = [f"{item['name']} of rank {r}" for r, items in sorted(index.get("private", {}).items())
                  for item in items]
        if theirs:
            problems.append(f"the checkpoint has rank-private items ({', '.join(theirs[:5])}"
                            f"{' ...' if len(theirs) > 5 else ''}), which a restore at another world size "
                            f"cannot place")
        covered = set()
        params: Dict[int, Tuple[Layout, _Slot]] = {}
        index_of = {id(p): i for i, p in enumerate(self._params)}
        for s in self._slots:
            if s.param is not None or s.layout is None:
                continue
            g_name = s.layout.global_name
            if id(s.holder) in index_of:
                params[index_of[id(s.holder)]] = (s.layout, s)
            g = tensors.get(g_name)
            if g is None:
                problems.append(f"{s.name} is part of {g_name}, which the checkpoint does not have")
                continue
            covered.add(g_name)
            dtype = _TORCH_TO_CODE[s.tensor.dtype]
            shape = _shape(s.tensor) if s.layout.replicated else list(s.layout.global_shape)
            if (g["dtype"], list(g["shape"])) != (dtype, shape):
                problems.append(f"{g_name} is {dtype} {shape} here but {g['dtype']} {list(g['shape'])} in the "
                                f"checkpoint")
        wanted: Dict[int, Dict[str, Mapping[str, Any]]] = {}
        prefixes = {f"optim.state.{lay.global_name}.": i for i, (lay, _) in params.items()}
        orphans = []  # optimizer state of no parameter here
        for g_name, g in tensors.items():
            if not g_name.startswith("optim.state."):
                if g_name not in covered:
                    problems.append(f"the checkpoint has {g_name} ({g['dtype']} {list(g['shape'])}), which no item "
                                    f"here is part of")
                continue
            owner = next(((i, g_name[len(pre):]) for pre, i in prefixes.items()
                          if g_name.startswith(pre) and "." not in g_name[len(pre):]), None)
            if owner is None:
                orphans.append(g_name)
                continue
            wanted.setdefault(owner[0], {})[owner[1]] = g
        if self.optimizer is None and (wanted or orphans):
            problems.append("the checkpoint has optimizer state but this Checkpointer has no optimizer")
        elif orphans:
            problems.append(f"the checkpoint has optimizer state of no parameter with a layout here: "
                            f"{', '.join(orphans[:5])}{' ...' if len(orphans) > 5 else ''}")
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise StateMismatchError(f"the state does not match {where}: " + "; ".join(problems[:8]) + more)
        if self.optimizer is None:
            return
        changed = False
        state = self.optimizer.state
        for i, p in enumerate(self._params):
            want = wanted.get(i, {})
            st = state.get(p)
            have = {k: v for k, v in (st or {}).items() if isinstance(v, torch.Tensor) and v.numel() > 0}
            for k in have:
                if k not in want:
                    del st[k]
                    changed = True
            for k, g in want.items():
                dtype = _CODE_TO_TORCH.get(g["dtype"])
                if dtype is None:
                    raise StateMismatchError(f"{where}: {k} of parameter {i} has dtype {g['dtype']}, unknown to "
                                             f"this torch")
                t = have.get(k)
                if g.get("replicated"):
                    make = lambda: torch.zeros(g["shape"], dtype=dtype, device=self._state_device(p, k))  # noqa: E731
                    fits = t is not None and _shape(t) == list(g["shape"])
                else:
                    make = lambda: torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)  # noqa: E731
                    fits = t is not None and _shape(t) == _shape(p) and type(t) is type(p.data)
                if fits and t.dtype == dtype:
                    continue
                if st is None:
                    st = state[p] = {}
                st[k] = make()
                changed = True
            if st is not None and not st and not want:
                del state[p]
        if (changed or not self._tracking_current()) and self._collect():
            self.registration = self._register()

    def close(self) -> None:
        """Removes the hooks and ends the registration (versions in flight still complete).
        The tensors stay where they are (in shared memory) and keep working. An error of the
        last save's snapshot call not yet raised is raised here, after all that."""
        if self._closed:
            return
        error = None
        try:  # the last version is sealed (or aborted): unsealed, the unregistration would drop it
            self._wait_noting_restart()
            self._collect_seal(block=True)
        except Exception as e:  # noqa: BLE001 (raised below, once the rest is undone)
            error = e
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        opt = self.optimizer
        if self._step_wrapper is not None and opt is not None and opt.__dict__.get("step") is self._step_wrapper[0]:
            original = self._step_wrapper[1]
            if getattr(original, "__self__", None) is opt and getattr(original, "__func__", None) is type(opt).step:
                del opt.step  # it was the class's method
            else:
                opt.step = original
        for obj in (self.model, self.optimizer):
            if obj is not None and obj in _OPEN and _OPEN[obj]() is self:
                del _OPEN[obj]
        _LIVE.discard(self)
        self._client.unregister()
        if error is not None:
            raise error

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return
        try:  # the exception under way is the one to see
            self.close()
        except Exception:  # noqa: BLE001
            pass

    @property
    def client(self) -> Client:
        return self._client

    @property
    def pending(self) -> Optional[int]:
        """The last saved step while it may still be copied out of trainer memory (None once
        a wait returned)."""
        return self._pending

    @property
    def items(self) -> List[Tuple[str, str, List[int]]]:
        """(name, dtype, shape) of every registered tensor item."""
        return list(self._items_meta)

    @property
    def layouts(self) -> Dict[str, Layout]:
        """Item name -> its Layout (global_name set) for every tensor item that has one: what
        a restore at another world size can reshard. Items not listed are rank-private."""
        return {s.name: s.layout for s in self._slots if s.layout is not None}

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The registered tensors (the trainer's own objects) by item name."""
        return {s.name: s.tensor for s in self._slots}

    # -- what is checkpointed ----------------------------------------------------------------

    def _collect(self) -> bool:
        """Finds every tensor to register and moves new ones into shared memory; returns
        whether the items changed (then they must be registered again)."""
        slots: List[_Slot] = []
        seen: Dict[int, str] = {}  # id(tensor) -> item name (tied weights, shared state)
        previous = {id(s.tensor): s for s in self._slots}
        self._model_aliases, self._model_other, self._optim_other = {}, [], {}

        # Protection decisions are kept for the tensors still in use; the staging budget counts
        # their bytes again.
        self._protect_seen, self._staged_bytes, self._large_buffers = {}, {}, []
        buffers: set = set()  # id() of the model's buffers
        free: set = set()  # id() of model parameters no optimizer updates (an EMA copy, frozen layers)
        dtensor_type = _dtensor_type()

        def add(name, t, owner, key, param=None) -> Optional[str]:
            if id(t) in seen:
                return seen[id(t)]
            pieces = _local_pieces(name, t)
            wrapped = pieces[0][1] is not t  # a DTensor or ShardedTensor: its local pieces are the items
            for piece, local, _ in pieces:
                _check_tensor(piece, local)
            if not wrapped and t.numel() == 0:
                return None  # no bytes: goes into the blob
            for piece, local, auto in pieces:
                if local.numel() == 0:
                    continue  # this rank holds none of it
                old = previous.get(id(local))
                # A staged tensor is registered through a copy that save() refreshes: the
                # trainer may change it while the version is being captured.
                staged = not wrapped and self._protection(t, name, id(t) in buffers, id(t) in free) == "stage"
                # A DTensor's local tensor on the CPU may alias a buffer of its owner (FSDP2's
                # padded shard, which the all-gather reads): it stays where it is, and a copy in
                # shared memory, refreshed by save(), is registered instead.
                mirror = wrapped and dtensor_type is not None and isinstance(t, dtensor_type) \
                    and local.device.type == "cpu"
                slot = _Slot(piece, local, owner, key, staged or mirror, holder=t, auto=auto, param=param,
                             mirror=mirror)
                if old is not None and old.current() and (old.staged, old.mirror) == (slot.staged, mirror):
                    slot.ptr, slot.region, slot.offset, slot.block = old.ptr, old.region, old.offset, old.block
                    slot.target = old.target
                elif local.device.type == "cuda" and not slot.staged:
                    slot.ptr = local.data_ptr()  # registered where it is (CUDA IPC), never moved
                slots.append(slot)
            seen[id(t)] = name
            return name

        model_tensors = set()
        if self.model is not None:
            owners = {}
            trained = {id(p) for p in self._params}
            for _, mod in self.model.named_modules(remove_duplicate=False):
                buffers.update(id(t) for t in mod._buffers.values() if t is not None)
                free.update(id(t) for t in mod._parameters.values() if t is not None and id(t) not in trained)
                for d in (mod._parameters, mod._buffers):
                    for k, t in d.items():
                        if t is not None:
                            owners.setdefault(id(t), (d, k))
            for key, t in self.model.state_dict(keep_vars=True).items():
                if not isinstance(t, torch.Tensor):
                    self._model_other.append(key)
                    continue
                owner, okey = owners.get(id(t), (None, None))
                first = id(t) not in seen
                item = add("model." + key, t, owner, okey)
                if item is None:
                    self._model_other.append(key)
                elif not first:
                    self._model_aliases[key] = item
                model_tensors.add(id(t))
        self._optim_lengths, self._with_state = ([], []), []
        if self.optimizer is not None:
            state = self.optimizer.state
            self._optim_state_len = len(state)
            for i, p in enumerate(self._params):
                if id(p) not in model_tensors:
                    add(f"optim.param.{i}", p, None, None)
                st = state.get(p)
                if st is not None:
                    self._optim_lengths[0].append(st)
                    self._optim_lengths[1].append(len(st))
                if p in state:
                    self._with_state.append(i)
                for k, v in (st or {}).items():
                    if isinstance(v, torch.Tensor):
                        name = f"optim.state.{i}.{k}"
                        if id(v) in seen:
                            raise UnsupportedTensorError(
                                f"{name} is the same tensor as {seen[id(v)]}; shared optimizer state "
                                f"tensors are not supported")
                        if add(name, v, st, k, param=i) is not None:
                            continue
                    self._optim_other.setdefault(i, []).append(k)
        self._check_no_shared_storage(slots)
        self._resolve_layouts(slots)
        self._move_to_shm([s for s in slots if s.ptr is None and not s.staged])
        self._move_to_staging([s for s in slots if s.ptr is None and s.staged and not s.mirror
                               and s.tensor.device.type == "cpu"])
        self._move_to_gpu_staging([s for s in slots if s.ptr is None and s.staged and s.tensor.device.type == "cuda"])
        self._mirror([s for s in slots if s.ptr is None and s.mirror])
        before = [(s.name, s.ptr, id(s.region), s.offset, s.layout) for s in self._slots]
        self._slots = slots
        owned = [s for s in slots if s.owner is not None]
        # What _tracking_current compares, as parallel lists (compared by C-level map()s).
        wrapped = [s for s in slots if s.holder is not s.tensor and hasattr(s.holder, "_local_tensor")]
        self._watch = ([s.owner for s in owned], [s.key for s in owned], [s.holder for s in owned],
                       [s.tensor for s in slots], [s.ptr for s in slots],
                       [s.holder for s in wrapped], [s.tensor for s in wrapped])
        self._items_meta = [(s.name, _TORCH_TO_CODE[s.tensor.dtype], _shape(s.tensor)) for s in slots]
        self._cuda_device = next((s.tensor.device for s in slots if s.tensor.device.type == "cuda"), None)
        blocks = {id(s.block): s.block for s in slots if s.block is not None}
        self._stage_blocks = list(blocks.values())
        # What the version counters guard: every tensor the daemon reads in place (the
        # trainer's own object; a DTensor's too, where in-place ops may count on it).
        guard = [(t, s) for s in slots if not s.staged for t in (s.tensor, s.holder)
                 if t is s.tensor or (isinstance(t, torch.Tensor) and _has_version(t))]
        self._guard = [t for t, _ in guard]
        self._guard_slots = [s for _, s in guard]
        self._recorded = None
        self._protect = self._protect_seen
        self._static = _Pickled(_dumps(self._items_meta))
        return before != [(s.name, s.ptr, id(s.region), s.offset, s.layout) for s in slots]

    def _protection(self, t: torch.Tensor, name: str, buffer: bool, free: bool) -> str:
        """How tensor `t` (a plain tensor, not a DTensor's piece) is kept from changing under a
        capture, decided once per tensor, by bytes and device only: "stage" (a copy taken at
        save(): a buffer or a parameter no optimizer updates, small enough; or a tensor seen
        changing in place under a capture, see _escalate), else "guard" (read in place, its
        version counter compared at the wait); a buffer too large to stage is noted in
        _large_buffers (the automatic wait moves before the forward)."""
        known = self._protect.get(id(t))
        if known is not None and known[0] is t:
            decision = known[1]
            if decision == "stage":
                kind = t.device.type
                self._staged_bytes[kind] = self._staged_bytes.get(kind, 0) + t.numel() * t.element_size()
        elif buffer or free:
            decision = "stage" if self._stage_fits(t) else "guard"
        else:
            return "guard"
        self._protect_seen[id(t)] = (t, decision)
        if buffer and decision != "stage":
            self._large_buffers.append(name)
        return decision

    def _stage_fits(self, t: torch.Tensor) -> bool:
        """Whether `t` may be staged (if so, it counts against the staging budget)."""
        kind = t.device.type
        nbytes = t.numel() * t.element_size()
        if kind not in _STAGE_MAX_BYTES or nbytes > _STAGE_MAX_BYTES[kind] \
                or self._staged_bytes.get(kind, 0) + nbytes > _STAGE_BUDGET[kind]:
            return False
        self._staged_bytes[kind] = self._staged_bytes.get(kind, 0) + nbytes
        return True

    def _resolve_layouts(self, slots: List[_Slot]) -> None:
        """Sets each slot's layout (see the class's `layouts`): an explicit one, else the
        DTensor's or ShardedTensor's, else for optimizer state its parameter's where the shapes
        match, else replicated where `replicated` says so; None: rank-private."""
        by_id, by_name = self._explicit
        index_of = {id(p): i for i, p in enumerate(self._params)}
        param_layout: Dict[int, Tuple[Layout, List[int]]] = {}  # param index -> (its layout, local shape)
        used = set()
        for s in slots:
            if s.param is not None:
                continue
            key = id(s.holder) if id(s.holder) in by_id else s.name if s.name in by_name else None
            given = None if key is None else (by_id[key] if isinstance(key, int) else by_name[key])
            if given is not None:
                used.add(key)
                if s.auto is not None:
                    raise ValueError(f"{s.name}: a {type(s.holder).__name__} has its own layout (from its "
                                     f"placements); leave it out of `layouts`")
            layout = given or s.auto or (REPLICATED if self._replicate_all else None)
            if layout is not None:
                _check_box(s.name, s.tensor, layout)
                layout = dataclasses.replace(layout, global_name=layout.global_name or s.name)
            s.layout = layout
            i = index_of.get(id(s.holder))
            if i is not None and layout is not None:
                param_layout[i] = (layout, _shape(s.tensor))
        for s in slots:
            if s.param is None:
                continue
            if s.name in by_name:
                used.add(s.name)
                layout = by_name[s.name]
                _check_box(s.name, s.tensor, layout)
                s.layout = dataclasses.replace(layout, global_name=layout.global_name or s.name)
                continue
            owner = param_layout.get(s.param)
            if owner is None:  # its parameter is rank-private (or holds no bytes here)
                layout = s.auto or (REPLICATED if self._replicate_all else None)
                s.layout = None if layout is None else dataclasses.replace(layout, global_name=s.name)
                continue
            p_layout, p_shape = owner
            name = f"optim.state.{p_layout.global_name}.{s.key}"
            if s.auto is not None:
                layout = s.auto
            elif p_layout.replicated or (_shape(s.tensor) != p_shape and s.tensor.numel() == 1):
                layout = REPLICATED  # replicated, or a sharded parameter's step counter
            elif _shape(s.tensor) == p_shape:
                layout = p_layout
            else:
                layout = None  # another shape (factored statistics...): rank-private
            s.layout = None if layout is None else dataclasses.replace(layout, global_name=name)
        # Optimizer state named in `layouts` may appear later (after the first step).
        unknown = [k for k in list(by_id) + list(by_name)
                   if k not in used and not (isinstance(k, str) and k.startswith("optim.state."))]
        if unknown and not self._layouts_checked:
            names = [repr(k) if isinstance(k, str) else f"a tensor of shape {_shape(self._explicit_refs[k])}"
                     for k in unknown]
            raise ValueError(f"layouts: {', '.join(map(str, names[:5]))} is not a tensor item of this Checkpointer "
                             f"(keys: tensors of the model or optimizer, or item names such as "
                             f"{', '.join(s.name for s in slots[:3])})")
        self._layouts_checked = True

    @staticmethod
    def _check_no_shared_storage(slots: List[_Slot]) -> None:
        owners: Dict[int, str] = {}
        for s in slots:
            if s.ptr is not None:
                continue  # already in our shared memory (its own storage), or on a GPU
            ptr = _storage_ptr(s.tensor)
            if ptr in owners:
                raise UnsupportedTensorError(
                    f"{owners[ptr]} and {s.name} share memory (views of one storage); ckpt.torch moves "
                    f"each tensor into its own shared memory, which would break that sharing")
            owners[ptr] = s.name

    def _move_to_shm(self, slots: List[_Slot]) -> None:
        """Copies the tensors of `slots` into one new shared region and points them at it."""
        if not slots:
            return
        offsets, size = [], 0
        for s in slots:
            offsets.append(size)
            size += (s.tensor.numel() * s.tensor.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        region = SharedRegion.create(size)
        self._regions.append(region)
        for s, off in zip(slots, offsets):
            t = s.tensor
            view = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape)
            with torch.no_grad():
                view.copy_(t)
            t.data = view  # same object, now backed by shared memory
            s.ptr, s.region, s.offset = t.data_ptr(), region, off

    def _move_to_staging(self, slots: List[_Slot]) -> None:
        """Moves the tensors of `slots` into one new block of memory (the trainer's) and
        registers them at the same offsets of a new shared region (the staging copy, which
        save() refreshes with one copy of the whole block)."""
        if not slots:
            return
        self._move_to_shm(slots)  # the trainer's block (its region is not registered)
        trainer = slots[0].region
        staging = SharedRegion.create(trainer.size)
        self._regions.append(staging)
        block = (torch.frombuffer(trainer, dtype=torch.uint8), torch.frombuffer(staging, dtype=torch.uint8))
        block[1].copy_(block[0])
        for s in slots:
            s.region, s.block = staging, block

    def _move_to_gpu_staging(self, slots: List[_Slot]) -> None:
        """The GPU counterpart of _move_to_staging: per device, the tensors of `slots` move into
        one new block of GPU memory (the trainer's), and a second block of the same size is
        registered; save() refreshes it with one device-side copy queued on the current stream
        before the snapshot's event."""
        by_device: Dict[torch.device, List[_Slot]] = {}
        for s in slots:
            by_device.setdefault(s.tensor.device, []).append(s)
        for device, group in by_device.items():
            offsets, size = [], 0
            for s in group:
                offsets.append(size)
                size += (s.tensor.numel() * s.tensor.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
            trainer = torch.empty(size, dtype=torch.uint8, device=device)
            staging = torch.empty(size, dtype=torch.uint8, device=device)
            for s, off in zip(group, offsets):
                t = s.tensor
                n = t.numel() * t.element_size()
                view = trainer[off:off + n].view(t.dtype).view(t.shape)
                with torch.no_grad():
                    view.copy_(t)
                t.data = view  # same object, now in the block
                s.ptr, s.target, s.offset, s.block = t.data_ptr(), staging.data_ptr(), off, (trainer, staging)
            staging.copy_(trainer)

    def _mirror(self, slots: List[_Slot]) -> None:
        """Registers a copy of each tensor of `slots` in one new shared region, leaving the
        tensors where they are; save() refreshes the copies, load() copies them back."""
        if not slots:
            return
        offsets, size = [], 0
        for s in slots:
            offsets.append(size)
            size += (s.tensor.numel() * s.tensor.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        region = SharedRegion.create(size)
        self._regions.append(region)
        for s, off in zip(slots, offsets):
            t = s.tensor
            copy = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape)
            copy.copy_(t.detach())
            s.ptr, s.region, s.offset, s.block = t.data_ptr(), region, off, (t, copy)

    def _register(self):
        items = [(s.name, _TORCH_TO_CODE[s.tensor.dtype], _shape(s.tensor),
                  s.region if s.region is not None else s.target if s.target is not None else s.ptr,
                  s.offset or 0) for s in self._slots]
        items = [item if s.layout is None else item + (_native_layout(s.layout),)
                 for item, s in zip(items, self._slots)]
        # Sealed: a version commits only once this Checkpointer has checked the version
        # counters and sealed it (the wait), or never (aborted; or its trainer died first).
        registration = self._client.register_items(self.job, self.rank, self.world_size, items, sealed=True,
                                                   verify=self.verify)
        self._verified = self.verify or bool(getattr(registration, "verify", False))  # ckptd --verify-snapshots
        self._send_inline = True
        return registration

    def _tracking_current(self) -> bool:
        """Cheap check that the registered tensors are still the trainer's (run per save):
        each is still in its owner's dict and at its address, and no optimizer state
        appeared. C-level loops (map), no Python code per tensor."""
        owners, keys, owned, tensors, ptrs, dtensors, locals_ = self._watch
        if not all(map(operator.is_, map(dict.get, owners, keys), owned)):
            return False
        if not all(map(operator.is_, map(operator.attrgetter("_local_tensor"), dtensors), locals_)):
            return False  # FSDP2 gave a DTensor another local tensor
        if list(map(_DATA_PTR, tensors)) != ptrs:
            return False
        if self.optimizer is not None:
            if len(self.optimizer.state) != self._optim_state_len:
                return False
            sts, lengths = self._optim_lengths
            if list(map(len, sts)) != lengths:
                return False
        return True

    def _refresh(self) -> None:
        """Re-collects the tensors (new optimizer state, replaced tensors) and registers again."""
        self.wait_snapshot()  # the daemon may still read the previous version's memory
        self._collect_seal(block=True)  # a seal of the old registration goes first
        self._restage = False
        if self._collect():
            self.registration = self._register()
        self._wait_for_large_buffers()

    def _blob_state(self, step: int) -> Dict[str, Any]:
        """The blob's content as of now, made of values nothing changes later: state the
        trainer may change is pickled here (_Pickled, also checked for size); the item table,
        fixed since the last collect, was pickled then (self._static); the other parts are
        the Checkpointer's own (a collect replaces them, never changes them) or copies (RNG
        states): the worker thread can pickle the whole without a race."""
        state: Dict[str, Any] = {"format": _FORMAT, "step": step, "items": self._static}
        if self.model is not None:
            other = {}
            if self._model_other:
                sd = self.model.state_dict()
                other = self._pickled("model (state_dict entries that are not tensors)",
                                      {k: sd[k] for k in self._model_other})
            state["model"] = {"aliases": self._model_aliases, "other": other}
        if self.optimizer is not None:
            groups, index = [], 0
            for g in self.optimizer.param_groups:
                saved = {k: v for k, v in g.items() if k != "params"}
                saved["params"] = list(range(index, index + len(g["params"])))
                index += len(g["params"])
                groups.append(saved)
            st = self.optimizer.state
            other = {i: {k: st[self._params[i]][k] for k in keys} for i, keys in self._optim_other.items()}
            state["optimizer"] = self._pickled(
                f"optimizer ({type(self.optimizer).__name__}: param_groups and non-tensor state)",
                {"param_groups": groups, "other": other, "with_state": self._with_state})
        rebind = {}
        if self.scheduler is not None:
            sd, rebind["scheduler"] = _own_state(self.scheduler)
            state["scheduler"] = self._pickled(f"scheduler ({type(self.scheduler).__name__})", sd)
        objects = {}
        for k, o in self.objects.items():
            if o is not None:
                sd, rebind[f"objects.{k}"] = _own_state(o)
                objects[k] = self._pickled(f"object '{k}' ({type(o).__name__})", sd)
        state["objects"] = objects
        rebind = {k: v for k, v in rebind.items() if v}
        if rebind:
            state["rebind"] = rebind
        if self.generators:
            state["generators"] = {k: g.get_state().numpy().tobytes() for k, g in self.generators.items()}
        if self.extra_state is not None:
            state["extra_state"] = self._pickled("extra_state", self.extra_state)
        if self.rng:
            state["rng"] = _rng_state()
        return state

    def _pickled(self, what: str, value: Any) -> _Pickled:
        data = _dumps(value)
        limit = self.warn_blob_bytes
        if limit is not None and len(data) > limit and what not in self._warned:
            self._warned.add(what)
            report = _size_report(value)
            warnings.warn(
                f"ckpt.torch: the state of {what} pickles to {len(data) / 1024:.0f} KiB at every save "
                f"(warn_blob_bytes={limit}){': ' + report if report else ''}. Pickled state is copied and "
                f"sent with every version; keep tensors in the model or the optimizer (registered, copied by "
                f"the daemon off the training thread) or return less from state_dict()",
                RuntimeWarning, stacklevel=4)
        return _Pickled(data)

    # -- loading -----------------------------------------------------------------------------

    def _version_path(self, version: int, latest: int) -> Optional[str]:
        """The directory of committed `version` in the daemon's root; None if the root cannot
        be read from here (then the daemon's own checks apply). Raises VersionNotFoundError if
        the version is not committed."""
        if self._root is None:
            self._root = json.loads(self._client.status()).get("root", "")
        job_dir = os.path.join(self._root, self.job)
        if not self._root or not os.access(job_dir, os.R_OK | os.X_OK):
            return None
        vdir = os.path.join(job_dir, _version_dir(version))
        if not os.path.exists(os.path.join(vdir, "COMMITTED")):
            newest = f" (newest committed: {latest})" if latest else " (it has none)"
            raise VersionNotFoundError(f"version {version} of job '{self.job}' does not exist or is not "
                                       f"committed under {self._root}{newest}")
        return vdir

    def _shard_header(self, version: int, latest: int) -> Optional[Dict[str, Tuple[str, List[int]]]]:
        """name -> (dtype, shape) of the tensor items of this rank's shard of `version`, from
        the shard's header in the daemon's root; None if the root cannot be read from here
        (then the daemon's own checks apply)."""
        vdir = self._version_path(version, latest)
        if vdir is None:
            return None
        try:
            shard = read_header(os.path.join(vdir, _shard_name(self.rank)))
        except OSError:
            return None
        return {i["name"]: (i["dtype"], list(i["shape"])) for i in shard.items if i["kind"] == "tensor"}

    def _prepare_for(self, stored: Mapping[str, Tuple[str, List[int]]], version: int) -> None:
        """Checks the model against the checkpoint's tensor items and gives the optimizer the
        per-parameter state tensors the checkpoint has (zeros, filled by the restore), dropping
        the ones it does not have; registers again if that changed anything."""
        where = f"version {version} of job '{self.job}'"
        problems = []
        mine = {s.name: (_TORCH_TO_CODE[s.tensor.dtype], _shape(s.tensor)) for s in self._slots}
        for name, (dtype, shape) in mine.items():
            if name.startswith("optim.state."):
                continue
            if name not in stored:
                problems.append(f"{name} ({dtype} {shape}) is not in the checkpoint")
            elif stored[name] != (dtype, shape):
                problems.append(f"{name} is {dtype} {shape} here but {stored[name][0]} {stored[name][1]} "
                                f"in the checkpoint")
        for name, (dtype, shape) in stored.items():
            if not name.startswith("optim.state.") and name not in mine:
                problems.append(f"the checkpoint has {name} ({dtype} {shape}), which is not here")
        wanted: Dict[int, Dict[str, Tuple[str, List[int]]]] = {}
        for name, spec in stored.items():
            if name.startswith("optim.state."):
                index, _, key = name[len("optim.state."):].partition(".")
                wanted.setdefault(int(index), {})[key] = spec
        if wanted and self.optimizer is None:
            problems.append("the checkpoint has optimizer state but this Checkpointer has no optimizer")
        elif wanted and max(wanted) >= len(self._params):
            problems.append(f"the checkpoint's optimizer has state for parameter {max(wanted)} but this "
                            f"optimizer has {len(self._params)} parameters")
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise StateMismatchError(f"the state does not match {where}: " + "; ".join(problems[:8]) + more)
        if self.optimizer is None:
            return
        changed = False
        state = self.optimizer.state
        for i, p in enumerate(self._params):
            want = wanted.get(i, {})
            st = state.get(p)
            have = {k: v for k, v in (st or {}).items() if isinstance(v, torch.Tensor) and v.numel() > 0}
            for k in have:
                if k not in want:
                    del st[k]
                    changed = True
            for k, (dtype, shape) in want.items():
                t = have.get(k)
                if t is not None and (_TORCH_TO_CODE.get(t.dtype), _shape(t)) == (dtype, shape):
                    continue
                if dtype not in _CODE_TO_TORCH:
                    raise StateMismatchError(f"{where}: optim.state.{i}.{k} has dtype {dtype}, unknown to this torch")
                if st is None:
                    st = state[p] = {}
                local = getattr(p, "_local_tensor", None)  # a DTensor's state is a DTensor like it
                if local is not None and _shape(local) == shape:
                    st[k] = torch.zeros_like(p, dtype=_CODE_TO_TORCH[dtype], memory_format=torch.contiguous_format)
                else:
                    st[k] = torch.zeros(shape, dtype=_CODE_TO_TORCH[dtype], device=self._state_device(p, k))
                changed = True
            if st is not None and not st and not want:
                del state[p]
        if (changed or not self._tracking_current()) and self._collect():
            self.registration = self._register()

    def _state_device(self, p: torch.Tensor, key: str) -> torch.device:
        """Where the optimizer keeps state `key` of parameter `p`: with the parameter, except a
        step counter of a group that is neither capturable nor fused (on the CPU), as
        Optimizer.load_state_dict places them."""
        if key == "step":
            group = next(g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))
            if not (group.get("capturable") or group.get("fused")):
                return torch.device("cpu")
        return p.device

    def _apply(self, state: Mapping[str, Any], version: int) -> None:
        """Puts the blob's non-tensor state back (the tensors are restored already)."""
        if state.get("format") != _FORMAT:
            raise StateMismatchError(f"version {version}: unknown ckpt.torch format {state.get('format')!r}")
        if self.model is not None and state.get("model", {}).get("other"):
            self.model.load_state_dict(state["model"]["other"], strict=False)
        if self.optimizer is not None and "optimizer" in state:
            saved = state["optimizer"]
            groups = self.optimizer.param_groups
            sizes = [len(g["params"]) for g in groups]
            saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
            if sizes != saved_sizes:
                raise StateMismatchError(f"version {version}: the optimizer has parameter groups of sizes "
                                         f"{sizes}, the checkpoint {saved_sizes}")
            for g, sg in zip(groups, saved["param_groups"]):
                # Keys the checkpoint lacks (options of a newer torch) keep their values.
                g.update({k: v for k, v in sg.items() if k != "params"})
            st = self.optimizer.state
            with_state = set(saved.get("with_state", []))
            for i, p in enumerate(self._params):
                if i not in with_state:
                    st.pop(p, None)
                    continue
                s = st.setdefault(p, {})
                values = saved["other"].get(i, {})
                for k in [k for k, v in s.items() if not isinstance(v, torch.Tensor) and k not in values]:
                    del s[k]
                s.update(values)
        rebind = state.get("rebind", {})
        if self.scheduler is not None and "scheduler" in state:
            _load_own_state(self.scheduler, state["scheduler"], rebind.get("scheduler", {}))
        for k, obj in self.objects.items():
            if obj is not None and k in state.get("objects", {}):
                _load_own_state(obj, state["objects"][k], rebind.get(f"objects.{k}", {}))
        for k, g in self.generators.items():
            if k in state.get("generators", {}):
                g.set_state(torch.frombuffer(bytearray(state["generators"][k]), dtype=torch.uint8))
        if self.extra_state is not None and "extra_state" in state:
            self.extra_state.clear()
            self.extra_state.update(state["extra_state"])
        if self.rng and "rng" in state:
            _set_rng_state(state["rng"])
        if self._collect():  # only bookkeeping of non-tensor state changes, normally
            self.registration = self._register()

    # -- the wait before the update ----------------------------------------------------------

    def _install_wait(self, wait_before: Optional[str]) -> None:
        self._auto_wait = wait_before is None
        self._set_wait("step" if wait_before is None else wait_before)
        self._wait_for_large_buffers()
        opt = self.optimizer
        if opt is None:
            return
        if hasattr(opt, "register_step_pre_hook"):  # torch >= 2.0
            self._hooks.append(opt.register_step_pre_hook(lambda *_: self._before_update()))
            return
        # torch 1.x: wrap the instance's step. It must stay a bound method: LR schedulers
        # created later re-wrap optimizer.step through its __func__/__self__.
        original = opt.step
        before = self._before_update

        def step(_opt, *args, **kwargs):
            before()
            return original(*args, **kwargs)

        if getattr(original, "_with_counter", False):
            step._with_counter = True  # torch 1.x LR schedulers look for it (else they warn)
        wrapper = types.MethodType(step, opt)
        opt.step = wrapper
        self._step_wrapper = (wrapper, original)

    def _wait_for_large_buffers(self) -> None:
        """Small buffers are staged (save() copies them): ones too large to stage make the
        automatic wait move before the forward, which may change them (batch norm's kernels
        do so without moving their version counters)."""
        if self._auto_wait and self._large_buffers and self.model is not None and self.wait_before == "step":
            self._set_wait("forward")

    def _set_wait(self, wait_before: str) -> None:
        """Where the wait for each version is: before optimizer.step ("step", always there too),
        before the model's forward ("forward": a forward pre-hook) or in save() ("save")."""
        self.wait_before = wait_before
        if wait_before == "forward" and self._forward_hook is None:
            self._forward_hook = self.model.register_forward_pre_hook(lambda *_: self._before_forward())
            self._hooks.append(self._forward_hook)

    def _before_forward(self) -> None:
        if self.wait_before == "forward":
            self._before_update()

    def _wait_noting_restart(self) -> None:
        try:
            self.wait_snapshot()
        except DaemonRestartedError as e:
            self._note_restart(e)

    def _before_update(self) -> None:
        if self._closed or self._pending is None:
            return
        if self._cuda_device is None:
            self._wait_noting_restart()
            return
        # GPU state: the update's stream waits for the daemon's copies (and that seals the
        # version: work queued on the stream later runs after the copies); the host goes on.
        # A change queued before, since save(), may run during the copies: the version is
        # aborted instead.
        step = self._pending
        moved = self._moved()
        if moved:
            self._pending = None
            self._abort(step, moved)
            return
        try:
            stall = self._client.wait_snapshot_on_stream(step, torch.cuda.current_stream(self._cuda_device))
        except DaemonRestartedError as e:
            self._pending = None
            self._note_restart(e)
            return
        except TornSnapshotError as e:
            self._pending = None
            self._note_torn(e)
            return
        self._pending = None
        self.last_stall_s = stall
        self.total_stall_s += stall

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")


# The open Checkpointers, whose last versions _seal_at_exit seals (within _EXIT_SEAL_S seconds).
_LIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()
_EXIT_SEAL_S = 10.0


@atexit.register
def _seal_at_exit() -> None:
    """At interpreter exit (after the worker threads finished their work), the last version of
    each Checkpointer left open is compared and sealed (or aborted) as close() would:
    unsealed, the daemon drops it when the process goes. (A trainer killed loses it: never
    sealed, so never committed half-changed.)"""
    live = [ck for ck in list(_LIVE) if not ck._closed and (ck._pending is not None or ck._seal is not None)]
    if not live:
        return

    def seal_all():
        for ck in live:
            ck._exiting = True
            try:
                ck._wait_noting_restart()
                ck._collect_seal(block=True)
            except Exception as e:  # noqa: BLE001 (the interpreter is exiting: said, not raised)
                print(f"ckpt.torch: the last version of job '{ck.job}' could not be sealed at exit: {e}",
                      file=sys.stderr)

    # On a thread, waited for a bounded time: a daemon gone would make the client try to
    # reconnect for its whole budget, and the exit must not hang on that.
    try:
        t = threading.Thread(target=seal_all, name="ckpt.torch-seal-at-exit", daemon=True)
        t.start()
    except RuntimeError:  # no new threads at this stage of the exit (newer Pythons)
        return
    t.join(_EXIT_SEAL_S)


def _load_own_state(obj: Any, sd: Any, rebind: Mapping[str, str]) -> None:
    """obj.load_state_dict(sd), then the keys _own_state left out bound to obj's methods."""
    obj.load_state_dict(sd)
    for key, name in rebind.items():
        setattr(obj, key, getattr(obj, name))


def _mapped(e: Error) -> Exception:
    """A daemon error on restore, as the Python exception that says what kind it is."""
    msg = str(e)
    if e.code == _NOT_FOUND and not isinstance(e, VersionNotFoundError):
        return VersionNotFoundError(msg)
    if e.code == _FAILED_PRECONDITION and ("shape" in msg or "register" in msg or "registered" in msg):
        return StateMismatchError(msg)
    return e


# ----------------------------------------------------------------------------------------
# Without a daemon


def load_checkpoint(root: Union[str, os.PathLike], job: str, step: Union[str, int] = "latest", *,
                    rank: int = 0) -> Dict[str, Any]:
    """Reads one rank of a ckpt.torch checkpoint from the files (no daemon), checksums verified.

    Returns a dict: "step"; "model" (a state dict: model.load_state_dict(d["model"]) works);
    "optimizer" (in Optimizer.state_dict() format: optimizer.load_state_dict works); where
    saved, "scheduler", "objects", "extra_state", "rng", "generators" (name -> the uint8
    state tensor: generator.set_state(d["generators"][name])); and "tensors" (every tensor
    item by its item name). A scheduler's or object's bound methods of itself (torch 1.x
    OneCycleLR's anneal_func) are not in its state dict: load_state_dict keeps the live
    object's. Tensors are CPU tensors owning their memory. Raises
    VersionNotFoundError if the version is not committed under `root`."""
    shard = load_version(root, job, step, rank=rank, backend="torch")
    if BLOB not in shard.blobs:
        raise StateMismatchError(f"version {shard.version} of job '{job}' was not written by ckpt.torch "
                                 f"(it has no '{BLOB}' blob)")
    tensors = {name: t for name, t in shard.tensors.items() if isinstance(t, torch.Tensor)}
    if len(tensors) != len(shard.tensors):
        odd = sorted(set(shard.tensors) - set(tensors))
        raise UnsupportedTensorError(f"torch {torch.__version__} cannot hold {', '.join(odd[:5])} "
                                     f"({shard.tensors[odd[0]].dtype})")
    state = pickle.loads(shard.blobs[BLOB])
    out: Dict[str, Any] = {"step": int(state["step"]), "tensors": tensors}
    if "model" in state:
        sd = {name[len("model."):]: t for name, t in tensors.items() if name.startswith("model.")}
        for key, item in state["model"]["aliases"].items():
            sd[key] = tensors[item]
        sd.update(state["model"]["other"])
        out["model"] = sd
    if "optimizer" in state:
        opt = state["optimizer"]
        per_param: Dict[int, Dict[str, Any]] = {i: {} for i in opt["with_state"]}
        for name, t in tensors.items():
            if name.startswith("optim.state."):
                index, _, key = name[len("optim.state."):].partition(".")
                per_param.setdefault(int(index), {})[key] = t
        for i, values in opt["other"].items():
            per_param.setdefault(i, {}).update(values)
        out["optimizer"] = {"state": per_param, "param_groups": opt["param_groups"]}
        params = {int(n[len("optim.param."):]): t for n, t in tensors.items() if n.startswith("optim.param.")}
        if params:
            out["optimizer_params"] = params
    for key in ("scheduler", "objects", "extra_state", "rng"):
        if key in state:
            out[key] = state[key]
    if "generators" in state:
        out["generators"] = {k: torch.frombuffer(bytearray(b), dtype=torch.uint8)
                             for k, b in state["generators"].items()}
    return out
