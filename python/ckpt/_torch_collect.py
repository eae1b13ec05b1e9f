"""What a Checkpointer checkpoints: the tensors of the model and the optimizer found, checked,
moved into shared memory (or staged), given their layouts and registered with the daemon, and
the cheap check at each save that they are still the trainer's. A part of the Checkpointer class
(_torch_checkpointer.py), in its own file. See docs/pytorch.md."""

from __future__ import annotations

import operator
from typing import Dict, List, Optional

import torch

from ._torch_blob import _dumps, _Pickled
from ._torch_layouts import _dtensor_type, _local_pieces, _native_layout, _resolve_layouts
from ._torch_tensors import (_DATA_PTR, _STAGE_BUDGET, _STAGE_MAX_BYTES, _TORCH_TO_CODE, UnsupportedTensorError,
                             _check_no_shared_storage, _check_tensor, _has_version, _mirror, _move_to_gpu_staging,
                             _move_to_shm, _move_to_staging, _shape, _Slot)


class _Collecting:
    """Checkpointer's collecting half: _collect, the staging decisions, _register,
    _tracking_current, _refresh. Uses the Checkpointer's attributes."""

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
        _check_no_shared_storage(slots)
        _resolve_layouts(slots, self._explicit, self._explicit_refs, self._params, self._replicate_all,
                         check_unknown=not self._layouts_checked)
        self._layouts_checked = True
        _move_to_shm([s for s in slots if s.ptr is None and not s.staged], self._regions)
        _move_to_staging([s for s in slots if s.ptr is None and s.staged and not s.mirror
                          and s.tensor.device.type == "cpu"], self._regions)
        _move_to_gpu_staging([s for s in slots if s.ptr is None and s.staged and s.tensor.device.type == "cuda"],
                             self._regions)
        _mirror([s for s in slots if s.ptr is None and s.mirror], self._regions)
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
