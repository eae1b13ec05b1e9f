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
  one blob      pickled at every save (item "__blob__/ckpt.torch" of the shard): step, optimizer
                param groups and non-tensor per-parameter state, scheduler and other objects'
                state_dict(), extra_state (a dict of your own: data position...), RNG states
                (python random, torch, numpy if imported, CUDA if initialised) and the item map.

The wait: save(step) only asks the daemon to take the snapshot. The daemon copies the tensors
out of shared memory while the next forward and backward run; the Checkpointer waits for that
copy (wait_snapshot) right before the next optimizer step, through a step pre-hook (torch 2.x)
or a wrapper of optimizer.step (torch 1.x). Anything else that changes registered tensors in
between must wait too: a model whose forward updates buffers (BatchNorm running statistics)
gets the wait before every forward instead (wait_before="forward", chosen automatically when
the model has batch-norm layers); call wait_snapshot() yourself before any other in-place
change.

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

import json
import os
import pickle
import random
import sys
import types
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from . import Client, DaemonRestartedError, Error, Level, SharedRegion, VersionNotFoundError, load_version, read_header

__all__ = [
    "Checkpointer",
    "StateMismatchError",
    "UnsupportedTensorError",
    "VersionNotFoundError",
    "load_checkpoint",
]

BLOB = "ckpt.torch"  # name of the pickled non-tensor state blob
_FORMAT = 1
_ALIGN = 64  # byte alignment of tensors inside the shared regions
_NOT_FOUND, _FAILED_PRECONDITION = 5, 9  # gRPC status codes carried by ckpt.Error.code

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


class UnsupportedTensorError(ValueError):
    """A tensor cannot become a checkpoint item (layout, device, dtype, shared memory)."""


class StateMismatchError(ValueError):
    """The model / optimizer / objects do not match the checkpoint being loaded."""


# ----------------------------------------------------------------------------------------
# Small helpers


def _storage_ptr(t: torch.Tensor) -> int:
    s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return s.data_ptr()


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


def _shape(t) -> List[int]:
    return [int(d) for d in t.shape]


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
    tell whether it is still the tensor the trainer uses (owner[key] is tensor, same address)."""

    __slots__ = ("name", "tensor", "owner", "key", "ptr", "region", "offset")

    def __init__(self, name, tensor, owner, key):
        self.name, self.tensor, self.owner, self.key = name, tensor, owner, key
        self.ptr = self.region = self.offset = None

    def current(self) -> bool:
        t = self.tensor
        return (self.owner is None or self.owner.get(self.key) is t) and t.data_ptr() == self.ptr


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
    wait_before: "step" (wait for the previous snapshot before optimizer.step), "forward"
      (before every model forward: for models whose forward changes buffers), or None
      (automatic: "forward" if the model has batch-norm layers, else "step"). Either way
      wait_snapshot() can be called explicitly.
    reconnect_budget: seconds a call waits for a daemon that went away (restarting) before it
      raises; None: $CKPT_RECONNECT_BUDGET_S, else 120 (only when the Checkpointer connects
      the client itself; give a Client its own budget in Client.connect).
    **objects: more objects with state_dict()/load_state_dict() (samplers, grad scalers...),
      pickled at each save under their keyword.

    Construction moves the model's and the optimizer's CPU tensors into shared memory and
    registers them with the daemon (waiting for versions of this rank still in flight from a
    previous process). Not thread-safe: use one Checkpointer from the training thread.
    """

    def __init__(self, client_or_socket: Union[Client, str, os.PathLike, None], job: str, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, scheduler: Any = None,
                 extra_state: Optional[Dict[str, Any]] = None, rng: bool = True,
                 wait_before: Optional[str] = None, reconnect_budget: Optional[float] = None, **objects: Any):
        rank, world_size = _rank_and_world(rank, world_size)
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
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{key}: {type(obj).__name__} has no state_dict()/load_state_dict()")
        if wait_before not in (None, "step", "forward"):
            raise ValueError(f"wait_before must be 'step', 'forward' or None, not {wait_before!r}")
        self.job, self.rank, self.world_size = job, int(rank), int(world_size)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.extra_state, self.objects, self.rng = extra_state, objects, rng
        self.last_stall_s = 0.0  # seconds the last automatic or explicit wait blocked
        self.total_stall_s = 0.0
        self.lost_versions: List[int] = []  # versions lost to daemon restarts, reported by save or a wait
        self.restart_errors: List[str] = []  # their messages
        self._pending: Optional[int] = None  # saved, not yet known to be captured
        self._last_saved: Optional[int] = None
        self._closed = False
        self._slots: List[_Slot] = []
        self._watch: List[Tuple[Any, Any, torch.Tensor, int]] = []  # what _tracking_current checks
        self._items_meta: List[Tuple[str, str, List[int]]] = []  # (name, dtype, shape) per slot
        self._regions: List[SharedRegion] = []  # every region made (views keep them alive too)
        self._model_aliases: Dict[str, str] = {}  # state_dict key -> item of the same tensor
        self._model_other: List[str] = []  # state_dict keys pickled (non-tensors, empty tensors)
        self._optim_other: Dict[int, List[str]] = {}  # param index -> non-tensor state keys
        self._optim_lengths: List[Tuple[Optional[dict], int]] = []
        self._optim_state_len = 0
        self._root: Optional[str] = None
        self._cuda_device: Optional[torch.device] = None  # of the GPU items, if any
        self._params: List[torch.Tensor] = []
        if optimizer is not None:
            self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._hooks: List[Any] = []
        self._step_wrapper = None
        self._collect()
        self.registration = self._register()
        self._install_wait(wait_before)

    # -- public API --------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """Asks the daemon to checkpoint the current state as version `step` and returns at
        once. Call it after the optimizer step (and scheduler step) of iteration `step`; steps
        must increase. The tensors must not change until the snapshot is captured: the next
        optimizer.step() waits for that automatically."""
        self._check_open()
        step = int(step)
        if not self._tracking_current():
            self._refresh()
        blob = pickle.dumps(self._blob_state(step), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._snapshot(step, blob)
        except DaemonRestartedError as e:
            # Earlier versions lost to a daemon restart, reported instead of taking this one:
            # noted, and this one is taken now.
            self._note_restart(e)
            self._snapshot(step, blob)
        self._pending = self._last_saved = step

    def _snapshot(self, step: int, blob: bytes) -> None:
        if self._cuda_device is None:
            self._client.snapshot(step, {BLOB: blob})
        else:  # the version is the state once the work queued so far on the stream has run
            self._client.snapshot(step, {BLOB: blob}, stream=torch.cuda.current_stream(self._cuda_device))

    def _note_restart(self, e: DaemonRestartedError) -> None:
        self.lost_versions.extend(v for v in e.versions if v not in self.lost_versions)
        self.restart_errors.append(str(e))
        warnings.warn(f"ckpt.torch: {e}", RuntimeWarning, stacklevel=3)

    def wait_snapshot(self, timeout: Optional[float] = None) -> float:
        """Blocks until the last saved version is out of trainer memory (the tensors may change
        again); returns the seconds blocked (0 if nothing was pending). Raises
        ckpt.DaemonRestartedError if a daemon restart lost that version (the tensors may change
        then too: nothing reads them any more)."""
        self._check_open()
        if self._pending is None:
            return 0.0
        try:
            stall = self._client.wait_snapshot(self._pending, timeout)
        except DaemonRestartedError:
            self._pending = None
            raise
        self._pending = None
        self.last_stall_s = stall
        self.total_stall_s += stall
        return stall

    def wait_durable(self, step: Optional[int] = None, level: Level = Level.COMMITTED,
                     timeout: Optional[float] = None) -> None:
        """Blocks until version `step` (default: the last saved) reaches `level` (default:
        committed on all ranks)."""
        self._check_open()
        step = self._last_saved if step is None else int(step)
        if step is None:
            raise ValueError("nothing was saved yet")
        self._client.wait_durable(step, level, timeout)

    def load(self, step: Union[str, int] = "latest") -> int:
        """Restores version `step` ("latest": the newest committed) into the model, optimizer,
        scheduler, objects, extra_state and RNG states, in place, and returns its step.
        Restoring an older version than the newest rolls the job back: the daemon sets newer
        versions aside, and saving continues from step + 1."""
        self._check_open()
        if step != "latest":
            if isinstance(step, bool) or not hasattr(step, "__index__") or step.__index__() <= 0:
                raise ValueError(f"step must be 'latest' or a positive int, not {step!r}")
            step = step.__index__()
        self._wait_noting_restart()
        latest = self._register().latest_committed  # the same items: just asks for latest
        if step == "latest":
            if latest == 0:
                raise VersionNotFoundError(f"job '{self.job}' has no committed version")
            version = latest
        else:
            version = step
        header = self._shard_header(version, latest)
        if header is not None:
            self._prepare_for(header, version)
        try:
            restored, blobs = self._client.restore(version)
        except Error as e:
            raise _mapped(e) from e
        if BLOB not in blobs:
            raise StateMismatchError(f"version {restored} of job '{self.job}' was not written by ckpt.torch "
                                     f"(it has no '{BLOB}' blob)")
        state = pickle.loads(blobs[BLOB])
        self._apply(state, restored)
        self._last_saved = restored
        return int(state["step"])

    def close(self) -> None:
        """Removes the hooks and ends the registration (versions in flight still complete).
        The tensors stay where they are (in shared memory) and keep working."""
        if self._closed:
            return
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
        self._client.unregister()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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

        def add(name, t, owner, key) -> Optional[str]:
            if id(t) in seen:
                return seen[id(t)]
            _check_tensor(name, t)
            if t.numel() == 0:
                return None  # no bytes: goes into the blob
            old = previous.get(id(t))
            slot = _Slot(name, t, owner, key)
            if t.device.type == "cuda":
                slot.ptr = t.data_ptr()  # registered where it is (CUDA IPC), never moved
            elif old is not None and old.current():
                slot.ptr, slot.region, slot.offset = old.ptr, old.region, old.offset
            slots.append(slot)
            seen[id(t)] = name
            return name

        model_tensors = set()
        if self.model is not None:
            owners = {}
            for _, mod in self.model.named_modules(remove_duplicate=False):
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
        self._optim_lengths = []
        if self.optimizer is not None:
            state = self.optimizer.state
            self._optim_state_len = len(state)
            for i, p in enumerate(self._params):
                if id(p) not in model_tensors:
                    add(f"optim.param.{i}", p, None, None)
                st = state.get(p)
                self._optim_lengths.append((st, len(st) if st is not None else 0))
                for k, v in (st or {}).items():
                    if isinstance(v, torch.Tensor):
                        name = f"optim.state.{i}.{k}"
                        if id(v) in seen:
                            raise UnsupportedTensorError(
                                f"{name} is the same tensor as {seen[id(v)]}; shared optimizer state "
                                f"tensors are not supported")
                        if add(name, v, st, k) is not None:
                            continue
                    self._optim_other.setdefault(i, []).append(k)
        self._check_no_shared_storage(slots)
        self._move_to_shm([s for s in slots if s.ptr is None])
        before = [(s.name, s.ptr) for s in self._slots]
        self._slots = slots
        self._watch = [(s.owner, s.key, s.tensor, s.ptr) for s in slots]
        self._items_meta = [(s.name, _TORCH_TO_CODE[s.tensor.dtype], _shape(s.tensor)) for s in slots]
        self._cuda_device = next((s.tensor.device for s in slots if s.tensor.device.type == "cuda"), None)
        return before != [(s.name, s.ptr) for s in slots]

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

    def _register(self):
        items = [(s.name, _TORCH_TO_CODE[s.tensor.dtype], _shape(s.tensor),
                  s.region if s.region is not None else s.ptr, s.offset or 0) for s in self._slots]
        return self._client.register_items(self.job, self.rank, self.world_size, items)

    def _tracking_current(self) -> bool:
        """Cheap check that the registered tensors are still the trainer's (run per save)."""
        for owner, key, t, ptr in self._watch:
            if (owner is not None and owner.get(key) is not t) or t.data_ptr() != ptr:
                return False
        if self.optimizer is not None:
            if len(self.optimizer.state) != self._optim_state_len:
                return False
            for st, n in self._optim_lengths:
                if (len(st) if st is not None else 0) != n:
                    return False
        return True

    def _refresh(self) -> None:
        """Re-collects the tensors (new optimizer state, replaced tensors) and registers again."""
        self.wait_snapshot()  # the daemon may still read the previous version's memory
        if self._collect():
            self.registration = self._register()

    def _blob_state(self, step: int) -> Dict[str, Any]:
        state: Dict[str, Any] = {
            "format": _FORMAT,
            "step": step,
            "items": self._items_meta,
        }
        if self.model is not None:
            other = {}
            if self._model_other:
                sd = self.model.state_dict()
                other = {k: sd[k] for k in self._model_other}
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
            with_state = [i for i, p in enumerate(self._params) if p in st]
            state["optimizer"] = {"param_groups": groups, "other": other, "with_state": with_state}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        state["objects"] = {k: o.state_dict() for k, o in self.objects.items() if o is not None}
        if self.extra_state is not None:
            state["extra_state"] = self.extra_state
        if self.rng:
            state["rng"] = _rng_state()
        return state

    # -- loading -----------------------------------------------------------------------------

    def _shard_header(self, version: int, latest: int) -> Optional[Dict[str, Tuple[str, List[int]]]]:
        """name -> (dtype, shape) of the tensor items of this rank's shard of `version`, from
        the shard's header in the daemon's root; None if the root cannot be read from here
        (then the daemon's own checks apply)."""
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
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        for k, obj in self.objects.items():
            if obj is not None and k in state.get("objects", {}):
                obj.load_state_dict(state["objects"][k])
        if self.extra_state is not None and "extra_state" in state:
            self.extra_state.clear()
            self.extra_state.update(state["extra_state"])
        if self.rng and "rng" in state:
            _set_rng_state(state["rng"])
        if self._collect():  # only bookkeeping of non-tensor state changes, normally
            self.registration = self._register()

    # -- the wait before the update ----------------------------------------------------------

    def _install_wait(self, wait_before: Optional[str]) -> None:
        if wait_before is None:
            norm = torch.nn.modules.batchnorm._NormBase
            has_bn = self.model is not None and any(isinstance(m, norm) and m.track_running_stats
                                                    for m in self.model.modules())
            wait_before = "forward" if has_bn else "step"
        self.wait_before = wait_before
        if wait_before == "forward":
            if self.model is None:
                raise ValueError("wait_before='forward' needs a model")
            self._hooks.append(self.model.register_forward_pre_hook(lambda *_: self._before_update()))
            return
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
        # GPU state: the update's stream waits for the daemon's copies; the host goes on.
        try:
            stall = self._client.wait_snapshot_on_stream(self._pending,
                                                         torch.cuda.current_stream(self._cuda_device))
        except DaemonRestartedError as e:
            self._pending = None
            self._note_restart(e)
            return
        self._pending = None
        self.last_stall_s = stall
        self.total_stall_s += stall

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")


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
    saved, "scheduler", "objects", "extra_state", "rng"; and "tensors" (every tensor item by
    its item name). Tensors are CPU tensors owning their memory. Raises
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
    return out
