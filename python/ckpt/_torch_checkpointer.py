"""The Checkpointer of ckpt.torch: construction, save(), the waits and the guard against
in-place changes under a capture, close(). Collecting the tensors is in _torch_collect.py,
load() in _torch_restore.py. See docs/pytorch.md."""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import re
import sys
import threading
import time
import types
import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from . import Client, DaemonRestartedError, Error, Level, SharedRegion, TornSnapshotError
from . import _ckpt
from ._torch_blob import _FORMAT, BLOB, _dumps, _own_state, _Pickled, _rng_state, _size_report
from ._torch_collect import _Collecting
from ._torch_launcher import _rank_and_world
from ._torch_layouts import Layout, _as_layout
from ._torch_restore import _Restoring
from ._torch_tensors import _VERSION, _Slot

_DEADLINE_EXCEEDED = 4  # the gRPC status code carried by ckpt.Error.code


# model or optimizer -> the open Checkpointer that hooked it (weakly: neither is kept alive).
_OPEN: "weakref.WeakKeyDictionary[Any, weakref.ReferenceType]" = weakref.WeakKeyDictionary()


class Checkpointer(_Collecting, _Restoring):
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
      committed, and the wait moves as far as that tensor needs (docs/pytorch.md, "What keeps
      a version exact while it is copied"); `wait_before` then says where it is.
      wait_snapshot() can be called explicitly too.
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
        the version is aborted (docs/pytorch.md, "What keeps a version exact while it is
        copied").

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

    def close(self, finished: bool = False) -> None:
        """Removes the hooks and ends the registration (versions in flight still complete).
        The tensors stay where they are (in shared memory) and keep working. An error of the
        last save's snapshot call not yet raised is raised here, after all that.
        `finished=True`: the training run is over and will not restart, so the daemon lets go
        of the job's memory images and the replicas at its peers once no rank of it is left
        on the node (files stay). Leave it False when closing for any other reason: a crashed
        or interrupted run restores from them."""
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
        self._client.unregister(finished=finished)
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

    # -- the pickled state of a save ----------------------------------------------------------

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
