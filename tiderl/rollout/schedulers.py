"""Task schedulers of a rollout rank: one decision interface, two policies.

Both see the same rank state (`tiderl.policy.ctb.RankView`) and candidates and
return a `CtbDecision` (pause / resume / admit); the worker carries it out, so
`vanilla` and `ctb` run on the very same loop.

- `vanilla`: request-level, today's baseline. Admit tasks in arrival order up to
  a fixed concurrency; never pause; the engine's own cache policy decides what
  stays cached.
- `ctb`: Continuous Task Batching (paper section 4), the pure decision of
  `tiderl.policy.ctb.decide`: token-budget admission from probed footprints,
  priority pausing, resume before admit with affinity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence

from tiderl.policy.ctb import AdmissionLimits, CandidateGroup, CtbDecision, PriorityWeights, RankView, TaskState, decide


class UnknownSchedulerError(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown task scheduler {name!r} (known schedulers: {', '.join(SCHEDULER_NAMES)})")


class Scheduler(ABC):
    name: str = ""
    uses_probes: bool = False  # admit one probe task per group before the rest of it

    @abstractmethod
    def decide(self, rank: RankView, candidates: Sequence[CandidateGroup], limits: AdmissionLimits) -> CtbDecision:
        """What to pause, resume and admit now."""


class VanillaScheduler(Scheduler):
    name = "vanilla"

    def decide(self, rank: RankView, candidates: Sequence[CandidateGroup], limits: AdmissionLimits) -> CtbDecision:
        resident = sum(1 for t in rank.tasks if t.state is not TaskState.PAUSED)
        room = None if limits.max_resident_tasks is None else limits.max_resident_tasks - resident
        allowance = limits.staleness_task_allowance
        admitted: list[Hashable] = []
        for group in candidates:
            for task_id in group.task_ids:
                if room is not None and len(admitted) >= room:
                    return CtbDecision(admit=tuple(admitted))
                if not group.is_eval and allowance is not None:
                    if allowance <= 0:
                        return CtbDecision(admit=tuple(admitted))
                    allowance -= 1
                admitted.append(task_id)
        return CtbDecision(admit=tuple(admitted))


class CtbScheduler(Scheduler):
    name = "ctb"
    uses_probes = True

    def __init__(self, weights: PriorityWeights | None = None) -> None:
        self.weights = weights or PriorityWeights()

    def decide(self, rank: RankView, candidates: Sequence[CandidateGroup], limits: AdmissionLimits) -> CtbDecision:
        return decide(rank, candidates, limits, self.weights)


SCHEDULER_NAMES = ("vanilla", "ctb")


def make_scheduler(name: str, weights: PriorityWeights | None = None) -> Scheduler:
    if name == "vanilla":
        return VanillaScheduler()
    if name == "ctb":
        return CtbScheduler(weights)
    raise UnknownSchedulerError(name)
