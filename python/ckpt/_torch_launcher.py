"""This process's rank and world size for ckpt.torch and ckpt.dcp: torch.distributed's, the
values given, or the launcher's environment (torchrun, srun). See docs/pytorch.md."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch


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
