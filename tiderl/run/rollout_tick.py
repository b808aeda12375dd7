"""What a rollout rank decides each tick, apart from doing it: which weights to hold, what to claim,
how to count the tick. Pure (no engine, no store, no asyncio): `run_rollout` in
:mod:`tiderl.run.rollout_role` observes, asks these functions, then acts.

Three versions are in play on a rollout rank:
- ``held``: the weights its engine holds (newer than planned where the planned ones were pruned,
  older where they were rejected or kept for an evaluation);
- ``planned``: the newest version whose boundary the rank has reached;
- the evaluation it holds tasks of, which runs on the weights it evaluates: a rank holding evaluation
  tasks of ``held`` keeps those weights past boundaries (claiming only evaluation tasks of that
  version) until they finish, then reloads. An evaluation is a fixed number of bounded tasks, so the
  rank is back within one evaluation's time.

Invariants (tests in tests/test_run_rollout_tick.py)
1. The rank reloads only toward ``planned``, only while it holds older weights, never a version
   rejected before (damaged files: it rolls out on the weights it has until a newer version loads),
   and never while it holds evaluation tasks of the weights it has.
2. Keeping weights for an evaluation is announced once per planned version.
3. Behind ``planned`` and not for a rejected version, the rank claims only evaluation tasks (a
   training task would start on weights older than the plan); otherwise every kind.
4. A tick counts as idle when the rank had no task at all, as busy when the engine had work, and as
   a wait (RWT) when it asked for tasks and got none.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from tiderl.store.types import TaskKind

__all__ = ["TickMetric", "Versions", "WeightsStep", "claim_kinds", "tick_metric"]


class WeightsStep(enum.Enum):
    HOLD = "hold"  # keep the weights held, nothing to say
    KEEP = "keep"  # start keeping the weights held past `planned` for their evaluation tasks (announce)
    RELOAD = "reload"  # load the weights of `planned`


@dataclass(frozen=True, slots=True)
class Versions:
    held: int
    planned: int
    kept_for: int = -1
    """The planned version for which keeping `held` was announced."""
    rejected: frozenset[int] = frozenset()
    """Planned versions whose weights failed their checksums."""

    def at_boundary(self, version: int) -> Versions:
        return replace(self, planned=max(self.planned, version))

    def weights_step(self, holds_evaluation: bool) -> tuple[WeightsStep, Versions]:
        """What to do with the weights this tick; `holds_evaluation`: unfinished evaluation tasks of
        `held` are on this rank."""
        if self.held >= self.planned:
            return WeightsStep.HOLD, self
        if holds_evaluation:
            if self.kept_for == self.planned:
                return WeightsStep.HOLD, self
            return WeightsStep.KEEP, replace(self, kept_for=self.planned)
        if self.planned in self.rejected:
            return WeightsStep.HOLD, self
        return WeightsStep.RELOAD, self

    def reloaded(self, loaded: int | None) -> Versions:
        """After a reload toward `planned`: the version loaded, or None where `planned` was rejected."""
        if loaded is None:
            return replace(self, rejected=self.rejected | {self.planned})
        return replace(self, held=loaded)

    def stale_bound(self, max_staleness: int) -> int:
        """Training tasks first generated before this version can no longer be trained."""
        return self.planned - max_staleness


def claim_kinds(v: Versions) -> tuple[TaskKind, ...]:
    if v.held < v.planned and v.planned not in v.rejected:
        return (TaskKind.EVAL,)
    return tuple(TaskKind)


class TickMetric(enum.Enum):
    IDLE = "rollout_idle_s"  # no task at all: the rank (its accelerator) idled
    BUSY = "rollout_busy_s"  # the engine had work (sampled once a tick): ERS's supply rate


def tick_metric(unfinished: int, generating: int) -> TickMetric | None:
    if unfinished == 0:
        return TickMetric.IDLE
    if generating:
        return TickMetric.BUSY
    return None
