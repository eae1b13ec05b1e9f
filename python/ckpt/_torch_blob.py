"""The pickled part of a ckpt.torch version (blob "ckpt.torch"): what pickles the non-tensor
state at save() and puts it back at load(), the size report of a part that pickles large, and
the RNG states. See docs/pytorch.md."""

from __future__ import annotations

import pickle
import random
import sys
import types
from typing import Any, Dict, Mapping, Tuple

import torch

BLOB = "ckpt.torch"  # name of the pickled non-tensor state blob
# Parts of the blob that are each rank's own: at another world size, rank r takes them from old
# rank r (old rank 0 for a rank the old run did not have); the rest comes from old rank 0.
_PER_RANK = ("rng", "generators", "objects")
_FORMAT = 1


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


def _load_own_state(obj: Any, sd: Any, rebind: Mapping[str, str]) -> None:
    """obj.load_state_dict(sd), then the keys _own_state left out bound to obj's methods."""
    obj.load_state_dict(sd)
    for key, name in rebind.items():
        setattr(obj, key, getattr(obj, name))
