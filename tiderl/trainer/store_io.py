"""The trainer's side of the run store's trajectories, and the leader-to-group broadcast of a step's input.

- :func:`sample_from_ready`: a claimed trajectory as a training sample (tiderl.run.trainer_role).
- :class:`BroadcastSource`: the leader's input, broadcast to every rank of
  the trainer process group (the other actor ranks and the ref ranks), so
  all of them plan the same step (tiderl.trainer.local's benchmark groups).
"""

from __future__ import annotations

import torch.distributed as dist

from tiderl.store import ReadyTrajectory
from tiderl.store.types import CUT_FINISHES
from tiderl.trainer.batch import TrainSample
from tiderl.trainer.images import ImageInputs
from tiderl.trainer.rank import StepInput, StepSource


def sample_from_ready(t: ReadyTrajectory, images: ImageInputs | None = None) -> TrainSample:
    """A claimed trajectory as a training sample; one with images needs the model's `images` inputs
    (its placeholders expanded, its pixels prepared: tiderl.trainer.images)."""
    sample = TrainSample(
        trajectory_id=t.id,
        group_id=t.group_id,
        token_ids=tuple(t.token_ids),
        loss_mask=tuple(t.loss_mask),
        rollout_logprobs=tuple(t.logprobs),
        token_versions=tuple(t.token_versions),
        advantage=t.advantage,
        reward=t.reward,
        truncated=t.finish in CUT_FINISHES,
    )
    if not t.images:
        return sample
    if images is None:
        raise ValueError(f"trajectory {t.id} carries {len(t.images)} image(s), and the model has no image processor")
    return images.expand(sample, t.images)


class BroadcastSource:
    """Every trainer rank gets the leader's (process-group rank 0) step input."""

    def __init__(self, leader_source: StepSource | None, rank: int) -> None:
        if rank == 0 and leader_source is None:
            raise ValueError("BroadcastSource: rank 0 (the leader) needs the real source")
        self.inner = leader_source
        self.rank = rank

    def next_step(self, version: int) -> StepInput | None:
        box: list[StepInput | None] = [self.inner.next_step(version) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
