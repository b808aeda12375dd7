"""The step's execution mode from ``trainer.ra2p_mode`` and the cost model, fed by measured stage times.

``auto`` asks ``tiderl.policy.ra2p.choose_mode`` with the ready times of the
step's micro-batches and the stage times the trainer measured in earlier
steps (an exponential moving average); any other value is a fixed mode.
Until every stage has been measured, ``auto`` picks colocated (it needs no
ref rank and measures all four stage times in its first step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tiderl.policy import ra2p
from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.step import StepStats


@dataclass(slots=True)
class StageTimeTracker:
    """Moving averages of the per-share stage times reported in StepStats."""

    alpha: float = 0.5
    _values: dict[str, float] = field(default_factory=dict)

    def observe(self, stats: StepStats) -> None:
        for name in ("t_ref_s", "t_act_f_s", "t_act_b_s", "t_swap_s"):
            value = getattr(stats, name)
            if value <= 0:
                continue  # this mode did not run that stage (e.g. no swap in decoupled mode)
            old = self._values.get(name)
            self._values[name] = value if old is None else (1 - self.alpha) * old + self.alpha * value

    def stage_times(self) -> ra2p.StageTimes | None:
        names = ("t_ref_s", "t_act_f_s", "t_act_b_s", "t_swap_s")
        if not all(n in self._values for n in names):
            return None
        return ra2p.StageTimes(**{n: self._values[n] for n in names})


def choose_step_mode(
    configured: str,
    ready_times_s: Sequence[float],
    tracker: StageTimeTracker,
    num_actors: int,
    num_refs: int,
    max_aggregate: int | None = None,
) -> Ra2pMode:
    """The mode of the next step (``configured`` is ``trainer.ra2p_mode``)."""
    if configured != "auto":
        return Ra2pMode.parse(configured)
    times = tracker.stage_times()
    if times is None or num_refs < 1:
        return Ra2pMode.COLOCATED
    return ra2p.choose_mode(ready_times_s, times, num_actors, num_refs, max_aggregate).mode
