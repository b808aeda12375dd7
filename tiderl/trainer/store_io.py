"""The trainer's source and sink over the run store, and the leader-to-group broadcast of a step's input.

- :class:`StoreStepSource` (trainer leader only): claims complete groups
  (exactly-once claims in the store) until it holds at least ``B_min``, at
  most ``B_ideal``, and returns them as the step's samples.
- :class:`StoreVersionSink`: commits the version row of a published step
  (``RunStore.publish_version``, which also marks the trajectories consumed).
- :class:`BroadcastSource`: the leader's input, broadcast to every rank of
  the trainer process group (the other actor ranks and the ref ranks), so
  all of them plan the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from tiderl.policy.ra2p import Ra2pMode
from tiderl.store import ReadyTrajectory, RunStore, VersionRecord
from tiderl.trainer.batch import TrainSample
from tiderl.trainer.rank import PublishedStep, StepInput, StepSource


def sample_from_ready(t: ReadyTrajectory) -> TrainSample:
    return TrainSample(
        trajectory_id=t.id,
        group_id=t.group_id,
        token_ids=tuple(t.token_ids),
        loss_mask=tuple(t.loss_mask),
        rollout_logprobs=tuple(t.logprobs),
        token_versions=tuple(t.token_versions),
        advantage=t.advantage,
        reward=t.reward,
    )


class StoreStepSource:
    """Claims the elastic global batch ``[B_min, B_ideal]`` of complete groups for trainer rank ``owner``."""

    def __init__(
        self,
        store: RunStore,
        owner: int,
        groups_min: int,
        groups_ideal: int,
        choose_mode: Callable[[list[float]], Ra2pMode],
        *,
        poll_s: float = 0.2,
        should_stop: Callable[[], bool] = lambda: False,
        target_groups: Callable[[], int | None] = lambda: None,
    ) -> None:
        if not 1 <= groups_min <= groups_ideal:
            raise ValueError(f"StoreStepSource: need 1 <= groups_min <= groups_ideal, got {groups_min}, {groups_ideal}")
        self.store = store
        self.owner = owner
        self.groups_min = groups_min
        self.groups_ideal = groups_ideal
        self.choose_mode = choose_mode
        self.poll_s = poll_s
        self.should_stop = should_stop
        self.target_groups = target_groups

    def next_step(self, version: int) -> StepInput | None:
        # ERS may ask for fewer groups (adaptive data retention); never outside [B_min, B_ideal].
        target = self.target_groups() or self.groups_ideal
        want = min(max(target, self.groups_min), self.groups_ideal)
        held: list[ReadyTrajectory] = []
        groups: set[int] = set()
        while len(groups) < self.groups_min:
            if self.should_stop():
                # Claims not trained go back to the pool for whoever trains next.
                self.store.release_claims(self.owner)
                return None
            got = self.store.claim_ready_groups(self.owner, want - len(groups))
            held.extend(got)
            groups.update(t.group_id for t in got)
            if len(groups) < self.groups_min:
                time.sleep(self.poll_s)
        now = time.time()
        ready_s = [t.ready_at - now for t in held]
        return StepInput(version=version, samples=tuple(sample_from_ready(t) for t in held),
                         mode=self.choose_mode(ready_s))


class StoreVersionSink:
    """Commits each published version to the run store (version row + trajectories consumed)."""

    def __init__(self, store: RunStore, owner: int, ras: Callable[[], int | None] = lambda: None) -> None:
        self.store = store
        self.owner = owner
        self.ras = ras

    def publish(self, result: PublishedStep) -> None:
        stats = result.stats
        self.store.publish_version(
            VersionRecord(
                version=result.published.version,
                path=str(result.published.path),
                checksum=result.published.checksum,
                trajectory_ids=[int(t) for t in result.trajectory_ids],
                step_started_at=time.time() - stats.duration_s,
                duration_s=stats.duration_s,
                ras=self.ras(),
                ra2p_mode=result.mode,
                loss=stats.loss,
            ),
            owner=self.owner,
        )


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
