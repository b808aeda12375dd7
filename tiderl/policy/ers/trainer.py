"""The trainer's side of ERS: the rate planner's trainer re-partition
(``ers.policy: rate`` with ``ers.elastic_actors``) and its step model. How many
ref ranks keep up with the actors is :func:`tiderl.policy.ra2p.refs_needed`.

Pure: no torch, no database, no HTTP, no processes.

Why a re-partition. The rate model (:mod:`tiderl.policy.ers.model`) prices
every candidate split's step as this module does (:func:`readiness` and
:func:`step_compute_s`, each window step in turn), so it tells the RA2P modes
apart where readiness decides, and it moves toward a better partition itself
when the goodput gains. It judges goodput, min(supply, demand), though: where
the supply binds every partition alike, a partition that shortens the
trainer's compute gains no goodput now but shortens the tail a group waits
for. When the rate planner finds no split worth a move, :func:`repartition`
divides the trainer's ranks (actors + refs) anew between actor and ref, the
rollout side as it is: each window step's micro-batches, regrouped for M
actors (:func:`readiness`: the same tokens ready at the start, the rest
arriving at the same token rate), cost :func:`step_compute_s` with M actors
and R refs; the R with the smallest sum over the window wins if it beats the
current one by more than ``rate_margin``. All its moves are made at once: a
path of one rank per step passes through splits whose few refs cannot feed
many actors, far slower than either end, and the actors regroup once either
way.

Invariants (tests/test_policy_ers_trainer.py)
1. No re-partition without ``elastic_actors``, stage times and a window.
2. It keeps the trainer's rank count; actors stay at or above
   ``min_actor_ranks``; refs stay within ``max_ref_ranks`` and at most
   :func:`tiderl.policy.ra2p.refs_needed` for the new actor count (a further ref would idle).
3. Only for a predicted compute saving above ``rate_margin`` over the
   current partition (ties go to the fewest moves); a partition with ref
   ranks pays ``limits.decoupled_step_s`` a step.
4. :func:`readiness` keeps a step's tokens and token rate: with M' actors the
   step has ceil(tokens / (M' x share)) micro-batches, the RAS tokens (up to
   that count) ready at the start, and TPRM scaled by M' / M.
5. :func:`step_compute_s` is the RA2P cost model's colocated cost with no
   ref rank; decoupled it never ends before the last arrival plus the fill
   and actor work of one micro-batch, nor before one period per micro-batch.
6. Pure: equal inputs give equal answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tiderl.policy.ers.inputs import ErsLimits, ErsSignals, StepObservation
from tiderl.policy.ra2p import StageTimes, colocated_cost_s, refs_needed

if TYPE_CHECKING:
    from tiderl.policy.ers.model import Split

__all__ = ["coordination_s", "readiness", "ready_compute_s", "repartition", "step_compute_s"]


def coordination_s(refs: int, decoupled_step_s: float) -> float:
    """A step's decoupled coordination: `decoupled_step_s` (``limits.decoupled_step_s``) with ref ranks, else 0."""
    return decoupled_step_s if refs > 0 else 0.0


def readiness(step: StepObservation, actors: int, per_actor_mb: float) -> list[float]:
    """The ready times of `step`'s micro-batches had `actors` actor ranks consumed it: its tokens in
    micro-batches of `actors` shares, as many ready at the start as the tokens of its measured RAS fill,
    the rest arriving at the rate its TPRM measured (the same tokens per second)."""
    per_mb = per_actor_mb * actors
    n = max(1, math.ceil(step.consumed_tokens / per_mb))
    measured_mb = per_actor_mb * max(1, step.actor_ranks)
    if step.tprm_s is None:
        return [0.0] * n
    ras = min(n, int(step.ras_microbatches * measured_mb // per_mb))
    gap = step.tprm_s * per_mb / measured_mb
    return [0.0] * ras + [gap * (i + 1) for i in range(n - ras)]


def ready_compute_s(step: StepObservation, actors: int, refs: int, times: StageTimes, per_actor_mb: float,
                    slower: float = 1.0) -> float:
    """:func:`step_compute_s` of `step`'s tokens on `actors` and `refs` with the readiness the step measured
    (:func:`readiness`), the arrivals after the start `slower` times later (the rate planner's supply ratio)."""
    return step_compute_s([a * slower for a in readiness(step, actors, per_actor_mb)], actors, refs, times)


def step_compute_s(ready: Sequence[float], actors: int, refs: int, times: StageTimes) -> float:
    """The trainer's compute for micro-batches ready at `ready` (seconds from the step's start): colocated
    (no ref rank), the RA2P cost model's aggregation loop; decoupled, a pipeline whose micro-batch i ends
    a period after the previous one, and no sooner than its own ref shares (ceil(M / R) per ref rank)
    and actor work after its arrival (the same fill and tail as the rate model's)."""
    if refs < 1:
        return colocated_cost_s(ready, times)
    work = times.t_act_f_s + times.t_act_b_s
    period = max(work, actors * times.t_ref_s / refs)
    latency = math.ceil(actors / refs) * times.t_ref_s + work
    end = 0.0
    for a in sorted(ready):
        end = max(end + period, max(a, 0.0) + latency)
    return end


def repartition(now: Split, signals: ErsSignals, limits: ErsLimits) -> int | None:
    """With ``elastic_actors``, the ref ranks the trainer's ranks (actors + refs, the rollout side as it
    is) should hold: the split of them whose compute, over the window's steps with their readiness as
    measured (:func:`readiness`), is the shortest, if it beats the current one by more than
    ``rate_margin``; None: keep it."""
    times = signals.stage_times
    if not limits.elastic_actors or times is None or signals.micro_batch_tokens < 1 or not signals.window:
        return None
    total = now.actors + now.refs
    mb = float(signals.micro_batch_tokens)
    top = total - limits.min_actor_ranks
    if limits.max_ref_ranks is not None:
        top = min(top, limits.max_ref_ranks)
    options = {r for r in range(0, top + 1) if r <= refs_needed(total - r, times)} | {now.refs}
    # Each partition priced once; one with ref ranks pays the decoupled step's coordination every step.
    cost = {refs: sum(ready_compute_s(s, total - refs, refs, times, mb) for s in signals.window)
            + coordination_s(refs, limits.decoupled_step_s) * len(signals.window) for refs in sorted(options)}
    best = min(cost, key=lambda r: (cost[r], abs(r - now.refs)))
    if best == now.refs or cost[best] * (1 + limits.rate_margin) >= cost[now.refs]:
        return None
    return best
