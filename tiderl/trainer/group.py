"""The trainer's process group: actor ranks (data parallel) and ref ranks, over torch.distributed.

Process-group ranks are numbered actors first, then refs. Gloo on CPU, NCCL
where the device is CUDA. A group lives while the layout does: the run's
ranks keep it from one version's step to the next while the actors, the refs
and the restart generation stay the same (:class:`HeldGroup`), and tear it
down and form the next one (a fresh rendezvous file, named by the version)
when ERS changes the layout, a restart moves the generation on, or a rank
skipped a version's step. Forming a group costs a file rendezvous and a
communicator init on every member; kept, a run pays it only where the layout
changes (gloo on a 2-core host: a few hundredths of a second a step,
docs/RESULTS.md; NCCL's communicator init, not measured here, is heavier).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
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


Layout = tuple[tuple[int, ...], tuple[int, ...], int]
"""A trainer group's members: the actor ranks and the ref ranks (the run's rank numbers, in group order)
and the restart generation they meet in."""


@dataclass(slots=True)
class HeldGroup:
    """The trainer group a rank is in, and the last version whose step it ran in it."""

    layout: Layout
    version: int
    comm: TrainerComm

    def continues(self, layout: Layout, version: int) -> bool:
        """Whether the step of `version` with `layout` runs in this group. Every member decides alike from
        the plan alone: the layout of `version - 1` is the same for all of them, and a member of it ran
        that step in it (a member that failed has left the run and moved the generation on)."""
        return layout == self.layout and version == self.version + 1
