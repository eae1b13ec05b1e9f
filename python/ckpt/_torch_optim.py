"""Optimizer state on load: a fresh torch.optim optimizer has no per-parameter state until its
first step, so before a restore ckpt.torch gives it the state tensors the checkpoint holds
(zeros, which the daemon then fills) and drops the ones it does not hold. One installer serves
every restore (the same world size, another one). See docs/pytorch.md."""

from __future__ import annotations

import dataclasses
from typing import List, Mapping, Optional

import torch

from ._torch_tensors import _CODE_TO_TORCH, StateMismatchError, _shape


@dataclasses.dataclass(frozen=True)
class _StateWanted:
    """One state tensor of a parameter that the checkpoint holds. what: how an error names it;
    code: its dtype code; shape: its shape as this rank holds it. like_param: made as
    zeros_like(the parameter) (a DTensor for a DTensor), else a plain tensor on the device the
    optimizer keeps that state on; same_type: an existing tensor is kept only if it is of the
    parameter's type too."""

    what: str
    code: str
    shape: List[int]
    like_param: bool = False
    same_type: bool = False


def _state_device(optimizer: torch.optim.Optimizer, p: torch.Tensor, key: str) -> torch.device:
    """Where the optimizer keeps state `key` of parameter `p`: with the parameter, except a
    step counter of a group that is neither capturable nor fused (on the CPU), as
    Optimizer.load_state_dict places them."""
    if key == "step":
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        if not (group.get("capturable") or group.get("fused")):
            return torch.device("cpu")
    return p.device


def _install_state(optimizer: torch.optim.Optimizer, params: List[torch.Tensor],
                   wanted: Mapping[int, Mapping[str, _StateWanted]], where: str) -> bool:
    """Gives each parameter (params[i]) exactly the state tensors wanted[i] names: a tensor
    that matches (dtype, shape, type where asked) is kept, any other is replaced by zeros,
    tensors the checkpoint does not hold are dropped (non-tensor state stays: the blob restores
    it). Returns whether the optimizer's state changed. Raises StateMismatchError for a dtype
    this torch does not have."""
    changed = False
    state = optimizer.state
    for i, p in enumerate(params):
        want = wanted.get(i, {})
        st: Optional[dict] = state.get(p)
        have = {k: v for k, v in (st or {}).items() if isinstance(v, torch.Tensor) and v.numel() > 0}
        for k in have:
            if k not in want:
                del st[k]
                changed = True
        for k, w in want.items():
            dtype = _CODE_TO_TORCH.get(w.code)
            if dtype is None:
                raise StateMismatchError(f"{where}: {w.what} has dtype {w.code}, unknown to this torch")
            t = have.get(k)
            if t is not None and t.dtype == dtype and _shape(t) == list(w.shape) \
                    and (not w.same_type or type(t) is type(p.data)):
                continue
            if st is None:
                st = state[p] = {}
            if w.like_param:
                st[k] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
            else:
                st[k] = torch.zeros(w.shape, dtype=dtype, device=_state_device(optimizer, p, k))
            changed = True
        if st is not None and not st and not want:
            del state[p]
    return changed
