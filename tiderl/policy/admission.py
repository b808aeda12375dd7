"""How many training groups may be in flight: the staleness bound's admission, adapted to what the
trainer drops (ERS's `adaptive_admission`).

AReaL's rule keeps at most (staleness + 1) x B groups released and not yet trained
(:func:`inflight_bound`, the one computation of that bound: the feed's :func:`tiderl.systems.feed_allowance`,
the rate planner's Little's law and the simulator's latency bound call it, with this module's cap where
ERS sets one). The trainer's bound is strict (step v trains nothing started before v - staleness,
:func:`tiderl.systems.oldest_trainable_version`) and it takes the B groups that finish first: the groups
of a feed that finish after the last step that may train them are dropped,
generation that is never trained (`tiderl sim` counts the dropped groups of a workload). Fewer groups in flight leave fewer stragglers to drop, and more trainer waits.

The rule, at each sync boundary, over the newest ``WINDOW_STEPS`` finished steps that ran no
evaluation (:class:`StepObservation`; an evaluation step's waits are the evaluation's):
- the trainer dropped more than ``DROP_TOLERANCE`` of the tokens that completed, at least as large a
  share as the share of the time it waited for data, and the engines were busy (generating) at least
  ``BUSY_SHARE`` of the rollout rank-seconds: one ``step`` down. A dropped group's engine time was
  then taken from groups that could be trained; where the engines wait on the environment instead,
  fewer groups in flight would only generate less;
- the trainer waited more than ``WAIT_TOLERANCE`` of the time, and more than the dropped share or with
  the engines not that busy: one step up;
- otherwise (or right after an evaluation step, or before any step): keep.
``step`` is an eighth of a batch (at least one group). The tolerances, the busy share and the window
are design choices (a twentieth of the generation, a tenth of the time, four fifths of the engine
time, three steps), not fitted to any figure.

Invariants (tests/test_policy_admission.py)
1. The cap stays in [B, (staleness + 1) x B]: never less than one batch, never above AReaL's bound.
2. It moves at most one step a boundary: down only where the window dropped more than the tolerance
   and no less than it waited, on busy engines; up only where the window waited more than the tolerance.
3. Without a previous cap it starts at AReaL's bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner's model imports this module
    from tiderl.policy.ers.inputs import StepObservation

DROP_TOLERANCE = 0.05
WAIT_TOLERANCE = 0.10
WINDOW_STEPS = 3
BUSY_SHARE = 0.8


def inflight_bound(batch: int, max_staleness: int, cap: int | None = None) -> int:
    """The most training groups released and not yet trained (or dropped): (staleness + 1) x `batch`, the
    staleness bound's (AReaL's rule), or `cap` where smaller (ERS's adaptive admission, :func:`inflight_cap`;
    None: no cap)."""
    full = (max_staleness + 1) * batch
    return full if cap is None else min(full, cap)


def inflight_cap(previous: int | None, steps: Sequence[StepObservation], batch: int, max_staleness: int) -> int:
    """The most training groups released and not yet trained (or dropped) for the next step, from the
    finished steps (oldest first; the newest ``WINDOW_STEPS`` that ran no evaluation count)."""
    full = inflight_bound(batch, max_staleness)
    cap = full if previous is None else min(full, max(batch, previous))
    if not steps or steps[-1].evaluation:
        return cap
    window = [s for s in steps if not s.evaluation][-WINDOW_STEPS:]
    step = max(1, batch // 8)
    dropped = sum(s.stale_dropped_tokens for s in window) / max(1, sum(s.produced_tokens for s in window))
    duration = sum(s.duration_s for s in window)
    waited = sum(s.trainer_wait_s for s in window) / duration if duration > 0 else 0.0
    rollout_s = sum(s.rollout_ranks * s.duration_s for s in window)
    busy = sum(s.rollout_busy_rank_s for s in window) / rollout_s if rollout_s > 0 else 0.0
    engine_bound = busy >= BUSY_SHARE
    if dropped > DROP_TOLERANCE and dropped >= waited and engine_bound:
        return max(batch, cap - step)
    if waited > WAIT_TOLERANCE and (waited > dropped or not engine_bound):
        return min(full, cap + step)
    return cap
