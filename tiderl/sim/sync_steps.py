"""The ``sync`` system's steps in the simulation (a part of :class:`tiderl.sim.simulator.Simulation`):
every GPU rolls out the version's evaluation round (if due) and the whole batch, switches to training
(offload/onload of states), trains on all GPUs, publishes, and switches back to rollout with the new
weights and an empty cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tiderl.policy.ra2p import Ra2pMode
from tiderl.sim.tasks import SimGroup

if TYPE_CHECKING:
    from tiderl.sim.costs import Costs
    from tiderl.sim.rollout import RolloutSide
    from tiderl.sim.spec import WorkloadSpec
    from tiderl.sim.trainer import SimStepStats, Trainer


class SyncSteps:
    """The synchronous system's phases: rollout, train, publish (a mixin of `Simulation`)."""

    workload: WorkloadSpec
    costs: Costs
    rollout: RolloutSide
    trainer: Trainer
    num_gpus: int
    b_ideal: int
    steps: int
    version: int
    phase: str
    phase_done: int
    eval_outstanding: int
    train_released: int
    step_stats: list[SimStepStats]
    twt_gpu_s: float
    ers_reason: str | None
    last_publish_s: float
    schedule: Callable[..., None]
    _eval_due: Callable[[int], bool]
    _new_groups: Callable[[int, bool], list[SimGroup]]
    _offer: Callable[[float], None]
    _record_roles: Callable[[float], None]
    _record_step: Callable[..., None]
    _end: Callable[[float], None]

    def _sync_start_version(self, t: float) -> None:
        self.rollout.off = False
        self.rollout.account_all(t)
        self._record_roles(t)
        if self._eval_due(self.version):
            self.phase = "eval"
            self.eval_outstanding = self.workload.eval_groups
            self.rollout.release(t, self._new_groups(self.workload.eval_groups, True), front=True)
        else:
            self._sync_rollout_phase(t)

    def _sync_rollout_phase(self, t: float) -> None:
        self.phase = "rollout"
        self.phase_done = 0
        self.train_released += self.b_ideal
        groups = self._new_groups(self.b_ideal, False)
        for group in groups:
            group.released_s = t
        self.rollout.release(t, groups)

    def _sync_train(self, t: float) -> None:
        self.phase = "train"
        self.trainer.begin_step(t, self.num_gpus, 0, Ra2pMode.COLOCATED, self.b_ideal)
        self._offer(t)

    def _sync_publish(self, t: float) -> None:
        stats = self.trainer.finish_step()
        self.step_stats.append(stats)
        self.twt_gpu_s += stats.twt_gpu_s
        self.ers_reason = None
        self._record_step(t, stats, 0.0)
        self.version += 1
        self.rollout.version = self.version
        self.last_publish_s = t
        if self.version >= self.steps:
            self._end(t)
            return
        # Back to rollout: the engines wake with the new weights and an empty cache.
        self.rollout.flush_all(t, self.costs.phase_switch_s)
        self.schedule(t + self.costs.phase_switch_s, self._sync_start_version)
