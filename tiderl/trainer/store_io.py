"""The trainer's side of the run store's trajectories, and the leader-to-group broadcast of a step's input.

- :func:`samples_from_ready`: a claimed trajectory as a training sample (tiderl.run.trainer_role).
- :class:`BroadcastSource`: the leader's input, broadcast to every rank of
  the trainer process group (the other actor ranks and the ref ranks), so
  all of them plan the same step (tiderl.trainer.local's benchmark groups).
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from tiderl.rollout.trajectory import segment_view, window_segments
from tiderl.store import ReadyTrajectory
from tiderl.store.types import CUT_FINISHES
from tiderl.trainer.batch import TrainSample
from tiderl.trainer.images import ImageInputs
from tiderl.trainer.rank import StepInput, StepSource


def samples_from_ready(t: ReadyTrajectory, images: ImageInputs | None = None) -> tuple[TrainSample, ...]:
    """A claimed trajectory as training samples: one, or one per part where the sliding image window split it
    (each the context the engine saw for its turns, with the trajectory's advantage:
    tiderl.rollout.trajectory.segment_view). One with images needs the model's `images` inputs (its
    placeholders expanded, its pixels prepared: tiderl.trainer.images)."""
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
        return (sample,)
    if images is None:
        raise ValueError(f"trajectory {t.id} carries {len(t.images)} image(s), and the model has no image processor")
    if not t.prunes:
        return (images.expand(sample, t.images),)
    spans = images.placeholder_spans(t.token_ids)
    if len(spans) != len(t.images):
        raise ValueError(f"trajectory {t.id}: {len(spans)} image placeholders for {len(t.images)} images")
    out = []
    for seg in window_segments(len(t.token_ids), t.prunes):
        v = segment_view(seg, spans, t.token_ids, t.loss_mask, t.logprobs, t.token_versions)
        part = replace(sample, token_ids=tuple(v.token_ids), loss_mask=tuple(v.loss_mask),
                       rollout_logprobs=tuple(v.logprobs), token_versions=tuple(v.versions))
        out.append(images.expand(part, [t.images[i] for i in v.images]))
    return tuple(out)


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
