"""The rate-matching ERS planner: move ranks toward the split where the
generation rate of the rollout ranks meets the consumption rate of the
trainer ranks (``ers.policy: rate``).

Pure: no torch, no database, no HTTP, no processes. :func:`tiderl.policy.ers.plan`
calls :func:`plan_rate` after its cold-start and evaluation rules. (Over 450 lines: the model, the
candidate splits and the moves are one planner whose parts only make sense together, and a third
of the file is this statement of its model and invariants.)

Model (every rate from the signals' window of recent steps, as measured)
- Generation, by Little's law: at most F = (max_staleness + 1) x groups_ideal
  groups are in flight (released, not yet trained), fewer where ERS's adaptive
  admission caps them (``signals.inflight_cap``, the cap the feed keeps:
  :func:`tiderl.policy.admission.inflight_bound`, as the control plane's feed and
  the simulator's apply it); a group resides its
  generation latency ``L``, then on average half a step in the buffer, then
  the trainer's tail after the step's last arrival (the last micro-batch's
  work, :func:`_tail_s`) and its overhead (optimizer, publish) until the
  step ends and frees its place. With the trainer keeping up,
  ``G = F tok / (L + T / 2 + tail + overhead)`` and ``T = B tok / G`` give
  ``G_gen(n, M, R) = (F - B/2) tok / (L(n) + tail(M, R) + overhead)``, which is
  ``(s + 1/2) B tok / (...)`` without a cap:
  while the staleness bound binds, a faster trainer still raises goodput.
- Task slots: a rollout rank plays at most ``limits.rank_tasks`` tasks at
  once. A split's supply is at most what its slots play with every slot
  held (:func:`slot_tok_s`): ``n x rank_tasks`` tasks, each for its measured
  time in a slot (its environment's part as measured, the rest at the
  split's host speed), in tokens. A group's measured latency counts from its
  release, so it holds its tasks' wait for a slot: that wait (measured from
  the group's creation to the tasks' claims, ``signals.slot_wait_s``, the
  latency memory likewise, :mod:`tiderl.policy.ers_signals`) is taken out of
  the generation latency ``L_gen``, which is the engines', and the slot bound
  prices the slots instead: a further rollout rank then adds slots, where
  before it looked like an engine that a queue for slots did not need
  (bench-latency on the 3-rank CPU host: the planner kept 1 rollout rank of
  16 slots for 64 tasks in flight, 0.77x of the best fixed split;
  docs/RESULTS.md). The shared-host trial below never leaves ranks idle
  that the groups in flight need.
- Latency against rollout ranks: ``L = L_env + L_gen``, where ``L_env`` is
  the environment time of a group's slowest task (start and steps, measured)
  and ``L_gen`` the rest (generation, prefill, queueing for engine time).
  ``L_gen`` is read off the recent splits' measurements
  (``gen_latency_by_rollout``, :func:`gen_latency_at`; each scaled to a group's
  work in the window, :mod:`tiderl.policy.ers_signals`): measured counts as
  measured, linear in ``1 / n`` between them (an engine iteration costs a
  fixed part plus a part per running sequence), and beyond them cautiously:
  fewer ranks than any measured scale ``L_gen`` fully with ``1 / n``
  (saturated engines); more ranks than any measured follow the slope (in
  ``1 / n``) of the two largest counts measured, or with one count measured
  keep ``FIXED_SHARE_PRIOR`` of it fixed.
  A split the planner tried and found slow is remembered for the window of
  steps the mechanisms hand over, so the planner does not flap.
- Without a latency measurement, supply is linear: ``r`` = tokens of the
  completed groups / rollout rank-seconds with the engine generating
  (or with any task), ``G_gen(n) = n r``.
- Consumption, step by step over the window (with stage times): each window
  step's micro-batches, regrouped for the split's M actors with the readiness
  the step measured (its RAS ready at the start, the rest at its TPRM,
  :func:`tiderl.policy.ers_trainer.readiness`; the arrivals after the start
  ``G_gen(window's split) / G_gen(n)`` times later), cost
  :func:`tiderl.policy.ers_trainer.step_compute_s` with M actors and R refs:
  colocated, the RA2P cost model's aggregation loop, a swap pair for every
  burst the arrivals make; decoupled, the pipeline's fill and a period per
  micro-batch (the trainer re-partition's step model). To that each step adds
  what its own split measured beyond the same model of itself: the trainer's
  wait beyond the waits its readiness shows (a first arrival later than TPRM
  says: arrivals, so scaled as they are) and the rest (optimizer, publish:
  ``overhead``, the same for every split), less its decoupled coordination
  (``limits.decoupled_step_s``, a step with ref ranks); a split with ref ranks
  pays that coordination again, once a step (on the project's CPU host it
  outweighed the ref's work: docs/RESULTS.md). The window's own split is priced
  at its measured step times; a colocated split pays the swap pairs of the
  bursts that trickling arrivals make, a decoupled one does not (the old
  ``overhead``, busy time beyond an all-ready step, held those swap pairs and
  charged them to every split: at 32 GPUs the planner left 18/11/3 for
  19/13/0 colocated and stayed, 9% slower; docs/RESULTS.md). ``D`` is the
  window's tokens over the sum of the priced steps. Without stage times the
  measured consumption rate per actor rank scales with M.
- Goodput of a split: ``min(G_gen(n), D(M, R))``.
- A shared host (``limits.host``, :mod:`tiderl.policy.host`): the window's
  rates were measured at the speed its busy ranks left each other; a split
  with other busy ranks runs at ``speed(split) / speed(window)`` of them (its
  generation latency beyond the environment's, the trainer's compute, tail
  and overhead). Busy ranks of a split: the window's busy trainer share of
  each trainer rank; the window's busy rollout ranks (ranks holding tasks: a
  rank's processes handle turns and environment calls as well as engine
  iterations, as the simulator's shared host counts them), at most the split's
  rollout ranks (the same tasks in flight on fewer engines), or spread at the
  window's busy share per rank over more. Rollout ranks may then be left
  ``IDLE`` (their engines kept, claiming nothing): a split may hold idle
  ranks only with a shared host.

Trainer re-partition (``elastic_actors``): when no split is worth a move,
the trainer's ranks may still be divided anew between actor and ref, the
rollout side as it is, by the RA2P cost model on the window's measured
readiness (:mod:`tiderl.policy.ers_trainer`, with its reasons and invariants).

Decision: the best split over every split the limits allow (rollout ranks
>= min_rollout_ranks, actors fixed unless ``elastic_actors``, ref ranks only
up to the count that keeps up with the actors, and within max_ref_ranks,
idle ranks only with a shared host);
ties go to the current split, then to fewer moves. The plan moves toward it (or, where its way ends in
a valley, toward the next best split above the margin whose way does not and was measured: invariants 3
and 9),
at most ``max_moves_per_step`` ranks (with ``max_rollout_moves_per_step`` set: at most that many
moves to rollout, and ``max_moves_per_step`` others: the paper bounds only the trainer's scale-up),
and only if the predicted gain of the best split over the current one exceeds ``rate_margin``
(hysteresis).

Invariants (each has a test in tests/test_policy_ers_rate.py)
1. Invariants 1-5 and 11 of tiderl.policy.ers hold for rate plans too.
2. No move without a predicted gain above ``rate_margin``; no move at all
   while the window has fewer than MIN_WINDOW_STEPS steps or no measured
   supply or demand, except a walk's (invariant 10).
3. Every move goes toward the target: the best split, or where the way to it
   ends in a valley (invariant 9), the best of the splits predicted above the
   margin whose way does not and whose way the window measured (fewer rollout
   ranks only where they idled, more only where the trainer waited for data:
   :func:`regime`). Rollout ranks move the same way as the target's
   rollout count (or, at an equal count, a rank passes through rollout on its
   way between ref and actor).
4. Supply-bound (the trainer waited at least 10% of the window, the rollout
   ranks idled less than half a rank): rollout ranks never decrease. Rollout
   ranks idle (one rank or more on average, for lack of admissible work):
   rollout ranks never increase. What the window measured overrides the
   model's extrapolation (:func:`regime`).
5. Ref ranks are added only while the refs do not keep up with the actors
   (M t_ref / R > t_act_f + t_act_b with the ref ranks before the move: :func:`tiderl.policy.ra2p.refs_keep_up`).
6. The fetch size is always groups_ideal.
7. Without a shared host no rank is moved to IDLE; idle ranks only return
   to rollout. Host speed factors are 1 without a shared host.
8. The trainer re-partition's invariants hold (tiderl.policy.ers_trainer), and it is tried only where
   no split move is planned.
9. No valley: a plan never lands on a split predicted slower than the current one. Where the first
   ``max_moves_per_step`` moves toward the best split would (a path through a valley, such as a first
   ref rank feeding many actors in the decoupled mode), it moves on toward the best split until the
   prediction is back at the current one's or better (at most all the way), if the best split's
   rollout count was measured (an extrapolated target is not worth a plan past the limit: on
   mix-shift one such plan went to a rollout count never measured and ran at 0.6x); otherwise it
   stays. (The shared host's trial split is exempt: it is a measurement.) A rank may then
   pass through rollout on its way between ref and actor: its plan shows ACTOR <-> REF.
10. A walk: while the current split is not measured (its window is shorter than MIN_WINDOW_STEPS) and the
   previous plan moved rollout ranks, the plan is judged on the newest measured split's signals
   (``signals.walk``, tiderl.policy.ers_signals). It moves only the way the previous plan moved the
   rollout ranks, only for a predicted gain above ``rate_margin``, within the move limit (or out of a
   valley, invariant 9), never toward more rollout ranks once the last step idled a rollout rank's worth
   (``rollout_idle_ranks`` >= IDLE_RANKS); no shared-host trial, no trainer re-partition; otherwise it
   waits for the measurement (STEADY). So the planner moves a rank every step toward the split it
   predicted, as the paper's bound allows (one rank per step), instead of one every MIN_WINDOW_STEPS + 1
   steps, and judges the split it arrives at once measured.
11. A split's supply is at most what its task slots play (:func:`slot_tok_s`; no bound without
   ``rank_tasks`` or a measurement of the tasks' time in a slot).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tiderl.policy.admission import inflight_bound
from tiderl.policy.ers import (ErsLimits, ErsPlan, ErsReason, ErsSignals, Role, StepObservation, finish_plan,
                               move_roles)
from tiderl.policy.ers_signals import MIN_WINDOW_STEPS, task_times
from tiderl.policy.ers_trainer import coordination_s, ready_compute_s, repartition, step_compute_s
from tiderl.policy.host import HostShare
from tiderl.policy.ra2p import StageTimes, refs_keep_up, refs_needed

__all__ = ["RateModel", "Split", "busy_trainer_ranks", "candidates", "describe", "estimate", "gen_latency_at", "gen_latency_curve",
           "host_factor", "latency_s", "plan_rate", "predict_tok_s", "regime", "slot_tok_s", "split_of"]

FIXED_SHARE_PRIOR = 0.5  # share of L_gen taken not to shrink with rollout ranks beyond the most measured
IDLE_CAP_RANKS = 0.5  # rollout ranks idle on average below which the rollout side counts as fully used
IDLE_RANKS = 1.0  # rollout ranks idle on average from which a further rollout rank would idle too
SUPPLY_WAIT_SHARE = 0.1  # the trainer waited this share of the window or more: generation is short


@dataclass(frozen=True, slots=True, order=True)
class Split:
    rollout: int
    actors: int
    refs: int
    idle: int = 0


def split_of(roles: Sequence[Role]) -> Split:
    return Split(sum(1 for r in roles if r is Role.ROLLOUT), sum(1 for r in roles if r is Role.ACTOR),
                 sum(1 for r in roles if r is Role.REF), sum(1 for r in roles if r is Role.IDLE))


@dataclass(frozen=True, slots=True)
class RateModel:
    """The rates the window shows (tokens per second)."""

    supply_tok_s_per_rank: float
    """Tokens generated per busy rollout rank-second."""
    step_tokens: float
    """Tokens of a full step (groups_ideal groups)."""
    overhead_s: float
    """Per step, the time beyond the trainer's compute with the readiness measured and the waits for arrivals
    (optimizer, publish); without stage times, the busy time of the whole step."""
    stage_times: StageTimes | None
    micro_batch_tokens_per_actor: float
    """Tokens of one actor's share of a micro-batch (for the cost model)."""
    consumed_tok_s_per_actor: float | None
    """Without stage times: tokens consumed per busy actor-second."""
    rollout_ranks: int
    """Rollout ranks of the split the latency was measured on."""
    little_tokens: float
    """(F - B/2) x tokens per group, F the groups in flight ((s + 1/2) x B without an admission cap; Little's
    law, see the module docstring)."""
    group_latency_s: float | None
    """Measured latency of a group from its creation to its completion (None: not measured)."""
    group_env_s: float
    """Environment time of a group's slowest task, in that latency."""
    gen_curve: tuple[tuple[int, float], ...] = ()
    """Measured (rollout ranks, L_gen seconds), the current split's included (see gen_latency_at)."""
    inflight_groups: float = math.inf
    """Groups the feed keeps in flight, F: (s + 1) x B, or the admission cap where smaller
    (``admission.inflight_bound``)."""
    rank_groups: float = math.inf
    """Groups one rollout rank plays at once (rank_tasks / group_size; inf: no bound)."""
    host: HostShare | None = None
    """The shared host (None: an accelerator per rank)."""
    busy_rollout: float = 0.0
    """Rollout ranks busy on the host on average over the window (holding a task, see :func:`estimate`)."""
    trainer_busy_share: float = 1.0
    """Share of the window each trainer rank computed (not waiting for data; used without stage times)."""
    trainer_split: tuple[int, int] = (1, 0)
    """Actor and ref ranks of the window's last step (with stage times, the busy trainer ranks of a split
    are priced by :func:`busy_trainer_ranks`)."""
    decoupled_step_s: float = 0.0
    """A decoupled step's coordination, once a step (limits.decoupled_step_s): a split with ref ranks pays it."""
    window: tuple[StepObservation, ...] = ()
    """The window's steps (each step's wait and duration price a split's step, :func:`predict_tok_s`)."""
    residuals_s: tuple[float, ...] = ()
    """Per window step, its duration beyond its compute with the readiness it measured, `waits_s` and its
    decoupled coordination."""
    waits_s: tuple[float, ...] = ()
    """Per window step, the trainer's measured wait for data beyond the waits its readiness shows."""
    window_supply_tok_s: float = 0.0
    """The supply of the window's own split (:func:`predict_tok_s` scales the window's arrival-bound steps
    by it over a split's; 0: not computed)."""
    task_slot_s: float | None = None
    """Mean seconds a task held a task slot, over the window's completed tasks (None: not measured)."""
    task_env_s: float = 0.0
    """Mean environment seconds of those tasks (a part of task_slot_s no rank speeds up)."""
    tokens_per_group: float = 0.0
    """Tokens of a completed training group in the window."""


def estimate(signals: ErsSignals, limits: ErsLimits) -> RateModel | None:
    """The rates of the window, or None when it shows no supply or no demand (or no micro-batch size)."""
    window = signals.window
    if len(window) < MIN_WINDOW_STEPS or signals.micro_batch_tokens < 1:
        return None
    produced = sum(s.produced_tokens for s in window)
    # Rank-seconds holding a task: busy on a shared host (turns and environment calls as well as engine
    # iterations); idle only with no task at all.
    held_rank_s = sum(max(0.0, s.rollout_ranks * s.duration_s - s.rollout_idle_rank_s) for s in window)
    busy_rank_s = sum(s.rollout_busy_rank_s for s in window)
    if busy_rank_s <= 0:  # the engines' busy time was not measured: count every rank-second with work
        busy_rank_s = held_rank_s
    consumed = sum(s.consumed_tokens for s in window)
    trainer_busy = [max(0.0, s.duration_s - s.trainer_wait_s) for s in window]
    if produced <= 0 or busy_rank_s <= 0 or consumed <= 0 or sum(trainer_busy) <= 0:
        return None
    per_group = signals.tokens_per_group or consumed / max(1, limits.groups_ideal * len(window))
    step_tokens = limits.groups_ideal * per_group
    times = signals.stage_times
    per_actor_mb = float(signals.micro_batch_tokens)
    overhead = 0.0
    per_actor_rate = None
    waits: tuple[float, ...] = ()
    residuals: tuple[float, ...] = ()
    if times is not None:
        # Each step: its compute with the readiness it measured ends at `end`, which holds the waits for
        # arrivals that readiness shows; the trainer's measured wait beyond those is arrivals' too (a
        # first arrival later than TPRM says), and the rest of the step (optimizer, publish) the same for
        # every candidate split.
        for s in window:
            end = ready_compute_s(s, s.actor_ranks, s.ref_ranks, times, per_actor_mb)
            shown = end - _compute_s(s.consumed_tokens, s.actor_ranks, s.ref_ranks, times, per_actor_mb)
            wait = min(max(0.0, s.trainer_wait_s - shown), max(0.0, s.duration_s - end))
            waits += (wait,)
            # Net of the step's decoupled coordination: a split pays its own (`coordination_s`).
            residuals += (max(0.0, s.duration_s - end - wait - coordination_s(s.ref_ranks, limits.decoupled_step_s)),)
        overhead = sum(residuals) / len(residuals)
    else:
        actor_s = sum(b * max(1, s.actor_ranks) for s, b in zip(window, trainer_busy))
        per_actor_rate = consumed / actor_s
    latency = signals.group_latency_s if signals.group_latency_s and signals.group_latency_s > 0 else None
    last = window[-1]
    total_s = sum(s.duration_s for s in window)
    env = min(signals.group_env_s or 0.0, latency or 0.0)
    # The current split's generation latency, without the wait for task slots (ers_signals): that wait is
    # the slots' (the slot bound of _supply_tok_s), not the engines'.
    curve = gen_latency_curve(signals.gen_latency_by_rollout, last.rollout_ranks,
                              max(0.0, (latency or 0.0) - env - signals.slot_wait_s))
    slot = task_times(window)
    # The groups in flight: the staleness bound's, or the admission cap the feed keeps where smaller.
    inflight = inflight_bound(limits.groups_ideal, limits.max_staleness, signals.inflight_cap)
    model = RateModel(
        supply_tok_s_per_rank=produced / busy_rank_s,
        step_tokens=step_tokens,
        overhead_s=overhead,
        stage_times=times,
        micro_batch_tokens_per_actor=per_actor_mb,
        consumed_tok_s_per_actor=per_actor_rate,
        rollout_ranks=last.rollout_ranks,
        little_tokens=(inflight - limits.groups_ideal / 2) * per_group,
        group_latency_s=latency,
        group_env_s=env,
        gen_curve=curve,
        inflight_groups=inflight,
        rank_groups=limits.rank_tasks / limits.group_size if limits.rank_tasks else math.inf,
        host=limits.host,
        busy_rollout=min(last.rollout_ranks, held_rank_s / total_s) if total_s > 0 else float(last.rollout_ranks),
        trainer_busy_share=min(1.0, sum(trainer_busy) / total_s) if total_s > 0 else 1.0,
        trainer_split=(last.actor_ranks, last.ref_ranks),
        decoupled_step_s=limits.decoupled_step_s,
        window=tuple(window),
        residuals_s=residuals,
        waits_s=waits,
        task_slot_s=slot[0] if slot is not None else None,
        task_env_s=min(slot[1], slot[0]) if slot is not None else 0.0,
        tokens_per_group=per_group,
    )
    own_split = Split(last.rollout_ranks, last.actor_ranks, last.ref_ranks, 0)
    own = _supply_tok_s(own_split, model, host_factor(own_split, model))
    return replace(model, window_supply_tok_s=own)


def gen_latency_curve(points: tuple[tuple[int, float], ...], rollout_now: int,
                      gen_now_s: float) -> tuple[tuple[int, float], ...]:
    """The measured (rollout ranks, L_gen) points with the current split's measurement in, ascending."""
    curve = {n: g for n, g in points if n >= 1}
    if rollout_now >= 1:
        curve[rollout_now] = gen_now_s
    return tuple(sorted(curve.items()))


def gen_latency_at(rollout: int, curve: tuple[tuple[int, float], ...]) -> float:
    """L_gen with `rollout` ranks: measured where measured; between two measured counts, linear in
    1 / n (iteration cost = fixed part + part per sequence); below the fewest measured, scaling fully
    with 1 / n (saturated engines: a pessimistic view of taking rollout ranks away); above the most
    measured, with FIXED_SHARE_PRIOR of it fixed (a modest view of adding them)."""
    known = dict(curve)
    if rollout in known:
        return known[rollout]
    lower = [(n, g) for n, g in curve if n < rollout]
    upper = [(n, g) for n, g in curve if n > rollout]
    if lower and upper:
        (n0, g0), (n1, g1) = lower[-1], upper[0]
        w = (1 / rollout - 1 / n1) / (1 / n0 - 1 / n1)
        return g1 + w * (g0 - g1)
    if upper:
        n1, g1 = upper[0]
        return g1 * n1 / rollout
    n0, g0 = lower[-1]
    if len(lower) >= 2:  # the slope of the two largest counts measured, never rising with more ranks
        n_a, g_a = lower[-2]
        slope = max(0.0, (g_a - g0) / (1 / n_a - 1 / n0))
        return max(0.0, g0 - slope * (1 / n0 - 1 / rollout))
    return g0 * (FIXED_SHARE_PRIOR + (1 - FIXED_SHARE_PRIOR) * n0 / rollout)


def _compute_s(tokens: float, actors: int, refs: int, times: StageTimes, per_actor_mb: float) -> float:
    """The compute time of a step of `tokens`, every micro-batch ready at the start: the trainer
    re-partition's step model (:func:`tiderl.policy.ers_trainer.step_compute_s`), so that the split
    planner and the re-partition price a partition alike. Colocated, the RA2P cost model's aggregation
    loop; decoupled, the pipeline's fill (the last actor waits for ceil(M / R) reference shares, then
    its own work) plus a period per further micro-batch, max(t_act_f + t_act_b, M t_ref / R).
    (Appendix A's fill term sums the M actors' waits, rank-seconds growing with M squared: right for
    comparing the modes' costs, too slow as the step time of a large actor group.)"""
    if tokens <= 0 or actors < 1:
        return 0.0
    n = max(1, math.ceil(tokens / (per_actor_mb * actors)))
    return step_compute_s([0.0] * n, actors, refs, times)


def host_factor(split: Split, model: RateModel) -> float:
    """How much faster (> 1) or slower each busy rank of `split` runs than in the window, on a shared host
    (1 without one); see the module docstring for the busy ranks of a split."""
    host = model.host
    if host is None:
        return 1.0
    now = host.speed(model.busy_rollout, busy_trainer_ranks(*model.trainer_split, model))
    if split.rollout <= model.rollout_ranks:
        busy_rollout = min(float(split.rollout), model.busy_rollout)
    else:
        busy_rollout = model.busy_rollout * split.rollout / max(1, model.rollout_ranks)
    then = host.speed(busy_rollout, busy_trainer_ranks(split.actors, split.refs, model))
    return then / now


def busy_trainer_ranks(actors: int, refs: int, model: RateModel) -> float:
    """Trainer ranks computing on average over the window, had it run `actors` and `refs`: each step's
    compute span with every micro-batch ready (:func:`_compute_s`, at the window's measured stage times)
    holds the split's trainer ranks. The rest of a step (waiting for data, the optimizer's and publish's
    share beyond the compute, the wait for the next plan) leaves the host to the others. Without stage
    times, the window's busy share of each trainer rank."""
    times = model.stage_times
    total = sum(o.duration_s for o in model.window)
    if times is None or total <= 0:
        return model.trainer_busy_share * (actors + refs)
    span = sum(_compute_s(o.consumed_tokens, actors, refs, times, model.micro_batch_tokens_per_actor)
               for o in model.window)
    return min(1.0, span / total) * (actors + refs)


def latency_s(rollout: int, model: RateModel, factor: float = 1.0) -> float | None:
    """The predicted group latency with `rollout` ranks running at `factor` of the window's speed (None:
    no latency measured). A count measured before keeps its measurement: it ran at its own speed."""
    if model.group_latency_s is None or rollout < 1:
        return None
    gen = gen_latency_at(rollout, model.gen_curve)
    if rollout not in dict(model.gen_curve):
        gen /= factor
    return model.group_env_s + gen


def _tail_s(actors: int, refs: int, times: StageTimes | None) -> float:
    """The trainer's work on the step's last micro-batch once it arrives: colocated, a swap pair and the
    ref, forward and backward of one share; decoupled, ceil(M / R) reference shares, then the actor."""
    if times is None or actors < 1:
        return 0.0
    if refs >= 1:
        return math.ceil(actors / refs) * times.t_ref_s + times.t_act_f_s + times.t_act_b_s
    return 2 * times.t_swap_s + times.t_ref_s + times.t_act_f_s + times.t_act_b_s


def concurrency_share(rollout: int, model: RateModel) -> float:
    """Share of the groups the feed keeps in flight (the staleness bound's, or the admission cap) that
    `rollout` ranks can play at once (at most 1)."""
    if model.inflight_groups <= 0 or math.isinf(model.rank_groups):
        return 1.0
    return min(1.0, rollout * model.rank_groups / model.inflight_groups)


def _supply_tok_s(split: Split, model: RateModel, f: float) -> float:
    """The split's supply, its busy ranks running at `f` (:func:`host_factor`) of the window's speed: the
    staleness bound's (Little's law), at most what the split's task slots play (:func:`slot_tok_s`)."""
    latency = latency_s(split.rollout, model, f)
    if latency is not None and latency > 0:
        # A group holds its place until its step ends: the trainer's tail and overhead after its arrival.
        held = (latency + (model.overhead_s + _tail_s(split.actors, split.refs, model.stage_times)) / f
                + coordination_s(split.refs, model.decoupled_step_s))
        return min(model.little_tokens / held, slot_tok_s(split.rollout, model, f))
    return split.rollout * model.supply_tok_s_per_rank * f


def slot_tok_s(rollout: int, model: RateModel, f: float = 1.0) -> float:
    """The most `rollout` ranks' task slots play, their ranks at `f` of the window's speed: every slot held,
    each task for its measured time in a slot (its environment's part as measured, the rest / f), in tokens
    per second (inf: no slot bound or no measurement)."""
    if model.task_slot_s is None or math.isinf(model.rank_groups):
        return math.inf
    held = model.task_env_s + (model.task_slot_s - model.task_env_s) / f
    return rollout * model.rank_groups * model.tokens_per_group / held if held > 0 else math.inf


def predict_tok_s(split: Split, model: RateModel) -> tuple[float, float, float]:
    """(supply, demand, goodput) of a split, tokens per second."""
    f = host_factor(split, model)
    supply = _supply_tok_s(split, model, f)
    if split.actors < 1:
        return supply, 0.0, 0.0
    times = model.stage_times
    if times is not None:
        # Step by step (the module docstring): the arrivals after each step's start come `slower` times later.
        slower = model.window_supply_tok_s / supply if model.window_supply_tok_s > 0 and supply > 0 else 1.0
        at_f = StageTimes(t_ref_s=times.t_ref_s / f, t_act_f_s=times.t_act_f_s / f, t_act_b_s=times.t_act_b_s / f,
                          t_swap_s=times.t_swap_s / f)
        coordination = coordination_s(split.refs, model.decoupled_step_s)
        total = sum(ready_compute_s(o, split.actors, split.refs, at_f, model.micro_batch_tokens_per_actor, slower)
                    + wait * slower + rest / f + coordination
                    for o, wait, rest in zip(model.window, model.waits_s, model.residuals_s))
        demand = sum(o.consumed_tokens for o in model.window) / total if total > 0 else math.inf
        return supply, demand, min(supply, demand)
    step_s = model.step_tokens / (model.consumed_tok_s_per_actor * split.actors * f)  # type: ignore[operator]
    demand = model.step_tokens / step_s if step_s > 0 else math.inf
    return supply, demand, min(supply, demand)


def candidates(current: Split, limits: ErsLimits, times: StageTimes | None) -> list[Split]:
    """Every split the limits allow from `current` (same number of movable ranks)."""
    movable = current.rollout + current.refs + current.idle + (current.actors if limits.elastic_actors else 0)
    actor_counts = range(limits.min_actor_ranks, movable - limits.min_rollout_ranks + 1) \
        if limits.elastic_actors else [current.actors]
    out = []
    for actors in actor_counts:
        free = movable - (actors if limits.elastic_actors else 0)
        max_refs = refs_needed(actors, times)
        if limits.max_ref_ranks is not None:
            max_refs = min(max_refs, limits.max_ref_ranks)
        # Refs already present stay candidates: the planner may keep them rather than move at once.
        for refs in range(0, max(max_refs, current.refs if actors == current.actors else 0) + 1):
            for idle in range(0, free - refs - limits.min_rollout_ranks + 1 if limits.host is not None else 1):
                rollout = free - refs - idle
                if rollout >= limits.min_rollout_ranks:
                    out.append(Split(rollout, actors, refs, idle))
    return out


def _distance(a: Split, b: Split) -> int:
    return abs(a.rollout - b.rollout) + abs(a.actors - b.actors) + abs(a.refs - b.refs) + abs(a.idle - b.idle)


def plan_rate(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    fetch = limits.groups_ideal
    now = split_of(current)
    model = estimate(signals, limits)
    basis = signals  # the measurement the plan is judged on
    walking = model is None and signals.walk is not None and signals.last_rollout_change != 0
    if walking:  # the current split is not measured yet: go on toward what the last measurement predicted
        basis = signals.walk  # type: ignore[assignment]
        model = estimate(basis, limits)
    if model is None or now.actors < 1:
        return finish_plan(current, current, fetch, ErsReason.STEADY)
    options = candidates(now, limits, model.stage_times)
    # What the window measured overrides the model's extrapolation in the clear cases.
    seen = regime(basis)
    if seen == "supply":
        options = [s for s in options if s.rollout >= now.rollout]
    elif seen == "idle":
        options = [s for s in options if s.rollout <= now.rollout]
    if not options:  # e.g. idle ranks without a shared host, while rollout ranks idle: nothing to gain
        return finish_plan(current, current, fetch, ErsReason.STEADY)
    scored = [(predict_tok_s(s, model)[2], -_distance(s, now), s) for s in options]
    best_g, _, best = max(scored, key=lambda x: (x[0], x[1]))
    now_g = predict_tok_s(now, model)[2]
    if walking and not _walk_goes_on(now, best, signals):
        return finish_plan(current, current, fetch, ErsReason.STEADY)
    trial = None if walking else _host_trial(now, options, model, seen, limits)
    if trial is not None:
        targets = [trial]
    elif walking and best_g <= now_g * (1 + limits.rate_margin):
        return finish_plan(current, current, fetch, ErsReason.STEADY)
    elif best == now or best_g <= now_g * (1 + limits.rate_margin):
        refs = repartition(now, signals, limits)
        if refs is None:
            return finish_plan(current, current, fetch, ErsReason.STEADY)
        if refs > now.refs:
            new = move_roles(current, Role.ACTOR, Role.REF, refs - now.refs)
        else:
            new = move_roles(current, Role.REF, Role.ACTOR, now.refs - refs)
        return finish_plan(current, new, fetch, ErsReason.RATE_REPARTITION)
    else:
        # The best split first; where the way to it ends in a valley (invariant 9), the next best split
        # predicted above the margin whose way does not, if the window measured the way it goes (on
        # text-agentic x h100x32 from 24/8/0, 21/8/3's way passed through one ref rank feeding 8 actors,
        # and the planner stayed 22 steps at 0.8x with idle rollout ranks, where 21/11/0 was predicted
        # 0.05% below 21/8/3: docs/RESULTS.md).
        ranked = sorted(scored, key=lambda x: (x[0], x[1]), reverse=True)
        targets = [best] + [s for g, _, s in ranked if s not in (now, best) and g > now_g * (1 + limits.rate_margin)
                            and _measured_way(now, s, seen) and (not walking or _walk_goes_on(now, s, signals))]
    for target in targets:
        moved = _toward(current, now, target, limits, model, now_g, exempt=trial is not None)
        if moved is None:
            continue
        new, split = moved
        if split.idle > now.idle:
            reason = ErsReason.RATE_TO_IDLE
        elif split.rollout > now.rollout:
            reason = ErsReason.RATE_TO_ROLLOUT
        elif split.rollout < now.rollout:
            reason = ErsReason.RATE_TO_TRAINER
        else:
            reason = ErsReason.RATE_REBALANCE
        return finish_plan(current, new, fetch, reason)
    return finish_plan(current, current, fetch, ErsReason.STEADY)  # no way out of the valley: stay


def _measured_way(now: Split, target: Split, seen: str) -> bool:
    """Whether the window measured that the rollout side can go `target`'s way: fewer rollout ranks where
    they idled (regime "idle"), more where the trainer waited for data ("supply"). Only such a target stands
    in for a best split that no plan can reach: below a measured rollout count the model extrapolates, and
    on mix-shift x h100x8 a stand-in at one rollout rank (never measured) ran at 0.6x of its prediction."""
    if target.rollout < now.rollout:
        return seen == "idle"
    if target.rollout > now.rollout:
        return seen == "supply"
    return True


def _toward(current: tuple[Role, ...], now: Split, target: Split, limits: ErsLimits, model: RateModel,
            now_g: float, exempt: bool = False) -> tuple[tuple[Role, ...], Split] | None:
    """The role map and split after the moves toward `target` within the limits (beyond them only to leave a
    valley, toward a measured rollout count: invariant 9), or None where no move is made or the plan would
    land on a split predicted slower than the current one (`exempt`: the shared host's trial, a measurement)."""
    new = current
    split = now
    moves = {True: 0, False: 0}  # moves to rollout, other moves: each kind within its limit
    limit = {True: limits.rollout_moves, False: limits.max_moves_per_step}
    measured = dict(model.gen_curve)  # rollout counts measured: a valley is crossed only toward one
    while split != target:
        step = _one_move(new, split, target, limits, model.stage_times)
        if step is None:
            break
        grows = step[1].rollout > split.rollout
        # Within the move limit; beyond it only to leave a valley: a split on the way predicted slower than
        # the current one (e.g. a first ref rank that cannot feed the actors in the decoupled mode).
        if moves[grows] >= limit[grows] and (predict_tok_s(split, model)[2] >= now_g
                                             or target.rollout not in measured):
            break
        new, split = step
        moves[grows] += 1
    if split == now or (not exempt and predict_tok_s(split, model)[2] < now_g):
        return None
    return new, split


def _walk_goes_on(now: Split, best: Split, signals: ErsSignals) -> bool:
    """A walk goes on only the way the previous plan moved the rollout ranks (it never turns on a split
    not yet measured), and not toward more rollout ranks once the last step idled a rollout rank's worth."""
    way = best.rollout - now.rollout
    if way * signals.last_rollout_change <= 0:
        return False
    return not (way > 0 and signals.rollout_idle_ranks >= IDLE_RANKS)


def _host_trial(now: Split, options: list[Split], model: RateModel, seen: str, limits: ErsLimits) -> Split | None:
    """On a shared host, with a rollout rank's worth idling (`idle` regime), one rollout rank fewer (left
    idle) when that rollout count was never measured: how an engine's iteration cost divides between
    its fixed part and its sequences, and so what fewer engines each batching more would give, is not
    known from one split, and on a shared host it decides. The trial is measured like any split, then
    the model judges both (invariant 4 keeps it from growing rollout back while ranks idle)."""
    if limits.host is None or seen != "idle" or now.rollout - 1 < limits.min_rollout_ranks:
        return None
    trial = replace(now, rollout=now.rollout - 1, idle=now.idle + 1)
    if trial not in options or trial.rollout in dict(model.gen_curve):
        return None
    if concurrency_share(trial.rollout, model) < 1.0:  # fewer engines could not even hold the tasks in flight
        return None
    return trial


def regime(signals: ErsSignals) -> str:
    """What the window shows, independent of the model: `supply` (the trainer waited at least
    SUPPLY_WAIT_SHARE of the time and the rollout ranks idled less than IDLE_CAP_RANKS), `idle` (a rollout
    rank or more idled on average, for lack of work the staleness bound admits: a further one would idle
    too) or `mixed`."""
    window = signals.window
    total = sum(s.duration_s for s in window)
    if total <= 0:
        return "mixed"
    wait = sum(s.trainer_wait_s for s in window) / total
    idle = sum(s.rollout_idle_rank_s for s in window) / total
    if wait >= SUPPLY_WAIT_SHARE and idle < IDLE_CAP_RANKS:
        return "supply"
    if idle >= IDLE_RANKS:
        return "idle"
    return "mixed"


def _one_move(roles: tuple[Role, ...], now: Split, target: Split, limits: ErsLimits,
              times: StageTimes | None) -> tuple[tuple[Role, ...], Split] | None:
    """One rank moved toward `target`, or None when no allowed move gets closer."""
    if now.rollout < target.rollout or (now.rollout == target.rollout and now != target):
        if now.refs > target.refs:
            return move_roles(roles, Role.REF, Role.ROLLOUT, 1), replace(now, rollout=now.rollout + 1,
                                                                         refs=now.refs - 1)
        if now.idle > target.idle:
            return move_roles(roles, Role.IDLE, Role.ROLLOUT, 1), replace(now, rollout=now.rollout + 1,
                                                                          idle=now.idle - 1)
        if limits.elastic_actors and now.actors > target.actors and now.actors > limits.min_actor_ranks:
            return (move_roles(roles, Role.ACTOR, Role.ROLLOUT, 1, lowest_first=True),
                    replace(now, rollout=now.rollout + 1, actors=now.actors - 1))
        return None
    if now.rollout > target.rollout and now.rollout > limits.min_rollout_ranks:
        ref_room = limits.max_ref_ranks is None or now.refs < limits.max_ref_ranks
        if now.refs < target.refs and ref_room and not refs_keep_up(now.actors, now.refs, times):
            return move_roles(roles, Role.ROLLOUT, Role.REF, 1), replace(now, rollout=now.rollout - 1,
                                                                         refs=now.refs + 1)
        if limits.host is not None and now.idle < target.idle:
            return move_roles(roles, Role.ROLLOUT, Role.IDLE, 1), replace(now, rollout=now.rollout - 1,
                                                                          idle=now.idle + 1)
        if limits.elastic_actors and now.actors < target.actors:
            return move_roles(roles, Role.ROLLOUT, Role.ACTOR, 1), replace(now, rollout=now.rollout - 1,
                                                                           actors=now.actors + 1)
    return None


def describe(signals: ErsSignals, limits: ErsLimits, roles: Sequence[Role]) -> dict[str, float] | None:
    """The model's view of the split `roles` (for logs and metrics): supply, demand and their minimum, the
    trained rate, in the model's unit: trajectory tokens (prompt, observations and generated) per second, not
    the generated tokens that goodput counts."""
    model = estimate(signals, limits)
    if model is None:
        return None
    supply, demand, trained = predict_tok_s(split_of(roles), model)
    return {"supply_tok_s": supply, "demand_tok_s": demand, "predicted_trained_tok_s": trained}
