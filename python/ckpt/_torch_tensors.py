"""Tensor items of ckpt.torch: the dtypes a checkpoint holds, the checks a tensor item passes,
the slot that ties an item to the trainer's tensor, and the shared memory items move into or
are staged through. Shared by ckpt.torch, ckpt.dcp and ckpt.deepspeed; see docs/pytorch.md."""

from __future__ import annotations

import operator
from typing import Dict, List, Tuple

import torch

from . import Client, SharedRegion


class UnsupportedTensorError(ValueError):
    """A tensor cannot become a checkpoint item (layout, device, dtype, shared memory)."""


class StateMismatchError(ValueError):
    """The model / optimizer / objects do not match the checkpoint being loaded."""


_ALIGN = 64  # byte alignment of tensors inside the shared regions

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



# ----------------------------------------------------------------------------------------
# Shared memory: where tensor items move once, and the staging copies save() refreshes


def _check_no_shared_storage(slots: List[_Slot]) -> None:
    """Raises UnsupportedTensorError if two tensors to move share a storage."""
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

def _packed(slots: List[_Slot]) -> Tuple[List[int], int]:
    """The offsets of the tensors of `slots` packed one after the other in one block, each
    at an _ALIGN boundary, and the size of the block."""
    offsets, size = [], 0
    for s in slots:
        offsets.append(size)
        size += (s.tensor.numel() * s.tensor.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, size


def _move_to_shm(slots: List[_Slot], regions: List[SharedRegion]) -> None:
    """Copies the tensors of `slots` into one new shared region (added to
    `regions`) and points them at it."""
    if not slots:
        return
    offsets, size = _packed(slots)
    region = SharedRegion.create(size)
    regions.append(region)
    for s, off in zip(slots, offsets):
        t = s.tensor
        view = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape)
        with torch.no_grad():
            view.copy_(t)
        t.data = view  # same object, now backed by shared memory
        s.ptr, s.region, s.offset = t.data_ptr(), region, off

def _move_to_staging(slots: List[_Slot], regions: List[SharedRegion]) -> None:
    """Moves the tensors of `slots` into one new block of memory (the trainer's) and
    registers them at the same offsets of a new shared region (the staging copy, which
    save() refreshes with one copy of the whole block)."""
    if not slots:
        return
    _move_to_shm(slots, regions)  # the trainer's block (its region is not registered)
    trainer = slots[0].region
    staging = SharedRegion.create(trainer.size)
    regions.append(staging)
    block = (torch.frombuffer(trainer, dtype=torch.uint8), torch.frombuffer(staging, dtype=torch.uint8))
    block[1].copy_(block[0])
    for s in slots:
        s.region, s.block = staging, block

def _move_to_gpu_staging(slots: List[_Slot], regions: List[SharedRegion]) -> None:
    """The GPU counterpart of _move_to_staging: per device, the tensors of `slots` move into
    one new block of GPU memory (the trainer's), and a second block of the same size is
    registered; save() refreshes it with one device-side copy queued on the current stream
    before the snapshot's event."""
    by_device: Dict[torch.device, List[_Slot]] = {}
    for s in slots:
        by_device.setdefault(s.tensor.device, []).append(s)
    for device, group in by_device.items():
        offsets, size = _packed(group)
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

def _mirror(slots: List[_Slot], regions: List[SharedRegion]) -> None:
    """Registers a copy of each tensor of `slots` in one new shared region, leaving the
    tensors where they are; save() refreshes the copies, load() copies them back."""
    if not slots:
        return
    offsets, size = _packed(slots)
    region = SharedRegion.create(size)
    regions.append(region)
    for s, off in zip(slots, offsets):
        t = s.tensor
        copy = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape)
        copy.copy_(t.detach())
        s.ptr, s.region, s.offset, s.block = t.data_ptr(), region, off, (t, copy)
