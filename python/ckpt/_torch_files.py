"""ckpt.torch without a daemon: load_checkpoint reads a checkpoint from its files into plain
state dicts. See docs/pytorch.md."""

from __future__ import annotations

import os
import pickle
from typing import Any, Dict, Union

import torch

from . import load_version
from ._torch_blob import BLOB
from ._torch_tensors import StateMismatchError, UnsupportedTensorError


def _version_dir(v: int) -> str:
    return f"v{v:010d}"


def _shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"



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
