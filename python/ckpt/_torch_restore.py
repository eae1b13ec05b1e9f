"""Checkpointer.load: which version, whether it reshards, the optimizer state it needs first,
the daemon's restore, and the pickled state put back. A part of the Checkpointer class
(_torch_checkpointer.py), in its own file. See docs/pytorch.md."""

from __future__ import annotations

import json
import os
import pickle
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from . import Error, VersionNotFoundError, read_header
from ._torch_blob import _FORMAT, _PER_RANK, BLOB, _load_own_state, _set_rng_state
from ._torch_files import _shard_name, _version_dir
from ._torch_layouts import Layout, _reshards
from ._torch_optim import _install_state, _StateWanted
from ._torch_tensors import _TORCH_TO_CODE, StateMismatchError, _shape, _Slot

_NOT_FOUND, _FAILED_PRECONDITION = 5, 9  # gRPC status codes carried by ckpt.Error.code


def _raise_mismatch(problems: List[str], where: str) -> None:
    """StateMismatchError listing the first 8 of `problems` (and how many more), if any."""
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise StateMismatchError(f"the state does not match {where}: " + "; ".join(problems[:8]) + more)


class _Restoring:
    """Checkpointer's restore half: load() and what it needs. Uses the Checkpointer's
    attributes and its _collect / _register / _tracking_current (_torch_collect.py)."""

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
        if index is not None and _reshards(index, self._slots, self.rank, self.world_size):
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
        _raise_mismatch(problems, where)
        if self.optimizer is None:
            return
        specs = {i: {k: _StateWanted(f"{k} of parameter {i}", g["dtype"], list(g["shape"])) if g.get("replicated")
                     else _StateWanted(f"{k} of parameter {i}", g["dtype"], _shape(self._params[i]), like_param=True,
                                       same_type=True)
                     for k, g in want.items()}
                 for i, want in wanted.items()}
        changed = _install_state(self.optimizer, self._params, specs, where)
        if (changed or not self._tracking_current()) and self._collect():
            self.registration = self._register()

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
        _raise_mismatch(problems, where)
        if self.optimizer is None:
            return
        specs = {}
        for i, want in wanted.items():
            local = getattr(self._params[i], "_local_tensor", None)  # a DTensor's state is a DTensor like it
            specs[i] = {k: _StateWanted(f"optim.state.{i}.{k}", dtype, shape,
                                        like_param=local is not None and _shape(local) == shape)
                        for k, (dtype, shape) in want.items()}
        changed = _install_state(self.optimizer, self._params, specs, where)
        if (changed or not self._tracking_current()) and self._collect():
            self.registration = self._register()

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


def _mapped(e: Error) -> Exception:
    """A daemon error on restore, as the Python exception that says what kind it is."""
    msg = str(e)
    if e.code == _NOT_FOUND and not isinstance(e, VersionNotFoundError):
        return VersionNotFoundError(msg)
    if e.code == _FAILED_PRECONDITION and ("shape" in msg or "register" in msg or "registered" in msg):
        return StateMismatchError(msg)
    return e
