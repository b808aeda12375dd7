"""The trainer's process group: actor ranks (data parallel) and ref ranks, over torch.distributed.

Process-group ranks are numbered actors first, then refs. Gloo on CPU, NCCL
where the device is CUDA. The group lives for one version's layout; when
ERS changes the roles, the ranks tear it down at the sync boundary and form
the next one (a fresh rendezvous file per version).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from tiderl.trainer.modes import TrainerComm


def init_trainer_group(
    rank: int,
    num_actors: int,
    num_refs: int,
    rendezvous_file: Path,
    *,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> TrainerComm:
    """Join the trainer process group as ``rank`` and build the actors' data-parallel subgroup."""
    world = num_actors + num_refs
    if num_actors < 1 or num_refs < 0 or not 0 <= rank < world:
        raise ValueError(f"init_trainer_group: rank {rank} outside {num_actors} actors + {num_refs} refs")
    rendezvous_file.parent.mkdir(parents=True, exist_ok=True)
    # init_process_group wraps sys.excepthook to prefix tracebacks with the group rank; a rank
    # joins a fresh group every decoupled version, and the wrappers would pile up (and the
    # group rank is not the run's rank). Keep the process's own hook.
    hook = sys.excepthook
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{rendezvous_file.resolve()}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    finally:
        sys.excepthook = hook
    actors = tuple(range(num_actors))
    refs = tuple(range(num_actors, world))
    if num_refs == 0:
        dp_group = dist.group.WORLD if num_actors > 1 else None
    else:
        # new_group is collective over the whole world, ref ranks included.
        sub = dist.new_group(list(actors))
        dp_group = sub if num_actors > 1 else None
    return TrainerComm(rank=rank, actor_ranks=actors, ref_ranks=refs, dp_group=dp_group)


def leave_trainer_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
