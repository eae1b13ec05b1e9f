"""Layouts of ckpt.torch: where a tensor item sits in a global tensor (Layout, given or taken
from a DTensor's or ShardedTensor's placements), how each item gets its layout, and whether a
restore reshards. See docs/pytorch.md, "Changing the world size"."""

from __future__ import annotations

import dataclasses
import operator
import sys
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from . import _ckpt
from ._torch_tensors import UnsupportedTensorError, _shape, _Slot


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


def _resolve_layouts(slots: List[_Slot], explicit: Tuple[Dict[int, Layout], Dict[str, Layout]],
                     explicit_refs: Mapping[int, torch.Tensor], params: List[torch.Tensor],
                     replicate_all: bool, check_unknown: bool) -> None:
    """Sets each slot's layout (see Checkpointer's `layouts` and `replicated`): an explicit one, else the
    DTensor's or ShardedTensor's, else for optimizer state its parameter's where the shapes
    match, else replicated where `replicated` (replicate_all) says so; None: rank-private.
    check_unknown: a key of `explicit` that names no item is a ValueError (at the first
    collect; optimizer state named there may appear only after the first step)."""
    by_id, by_name = explicit
    index_of = {id(p): i for i, p in enumerate(params)}
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
        layout = given or s.auto or (REPLICATED if replicate_all else None)
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
            layout = s.auto or (REPLICATED if replicate_all else None)
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
    if unknown and check_unknown:
        names = [repr(k) if isinstance(k, str) else f"a tensor of shape {_shape(explicit_refs[k])}"
                 for k in unknown]
        raise ValueError(f"layouts: {', '.join(map(str, names[:5]))} is not a tensor item of this Checkpointer "
                         f"(keys: tensors of the model or optimizer, or item names such as "
                         f"{', '.join(s.name for s in slots[:3])})")


def _reshards(index: Mapping[str, Any], slots: List[_Slot], rank: int, world_size: int) -> bool:
    """Whether restoring the version of `index` here reshards: another world size, or a
    laid-out model tensor or parameter of this rank (`slots`) whose box is not a chunk this rank
    wrote."""
    if int(index["world_size"]) != world_size:
        return True
    mine = {(g, tuple(c["offsets"]), tuple(c["shape"]))
            for g, t in index["tensors"].items() for c in t["chunks"] if int(c["rank"]) == rank}
    for s in slots:
        lay = s.layout
        if s.param is None and lay is not None and not lay.replicated:
            if (lay.global_name, lay.offsets, tuple(_shape(s.tensor))) not in mine:
                return True
    return False
