"""The ERS planner's choice (``ers.policy: rate``): the split the rate model
(:mod:`tiderl.policy.ers.model`) predicts best, and the moves toward it within the limits
(:func:`plan_rate`), or else the trainer's re-partition (:mod:`tiderl.policy.ers.trainer`).
:func:`tiderl.policy.ers.plan` calls :func:`plan_rate` when no rule before the choice applied
(:mod:`tiderl.policy.ers.overrides`: cold start, evaluation).

Pure: no torch, no database, no HTTP, no processes.

Trainer re-partition (``elastic_actors``): when no split is worth a move,
the trainer's ranks may still be divided anew between actor and ref, the
rollout side as it is, by the RA2P cost model on the window's measured
readiness (:mod:`tiderl.policy.ers.trainer`, with its reasons and invariants).

Decision: the best split over every split the limits allow (rollout ranks
>= min_rollout_ranks, actors fixed unless ``elastic_actors``, ref ranks only
up to the count that keeps up with the actors, and within max_ref_ranks,
idle ranks only with a shared host);
ties go to the current split, then to fewer moves. The plan moves toward it,
at most ``max_moves_per_step`` ranks (with ``max_rollout_moves_per_step`` set: at most that many
moves to rollout, and ``max_moves_per_step`` others: the paper bounds only the trainer's scale-up),
and only if the predicted gain of the best split over the current one exceeds ``rate_margin``
(hysteresis).

Invariants (each has a test in tests/test_policy_ers_rate.py)
1. Invariants 1-5 and 11 of tiderl.policy.ers hold for rate plans too.
2. No move without a predicted gain above ``rate_margin``; no move at all
   while the window has fewer than MIN_WINDOW_STEPS steps or no measured
   supply or demand, except a walk's (invariant 10).
3. Every move goes toward the best split, within the move limits. Rollout ranks move the same way as
   its rollout count (or, at an equal count, a rank passes through rollout on its way between ref and
   actor: the plan shows ACTOR <-> REF).
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
8. The trainer re-partition's invariants hold (tiderl.policy.ers.trainer), and it is tried only where
   no split move is planned.
9. (Removed: a rule that kept plans out of splits predicted slower on the way to the best one, crossing
   them past the move limit or taking a stand-in target, bought nothing beyond the seeds' spread on any
   shipped pair and start: docs/RESULTS.md, "Which of the planner's rules pay".)
10. A walk: while the current split is not measured (its window is shorter than MIN_WINDOW_STEPS) and the
   previous plan moved rollout ranks, the plan is judged on the newest measured split's signals
   (``signals.walk``, tiderl.policy.ers.signals). It moves only the way the previous plan moved the
   rollout ranks, only for a predicted gain above ``rate_margin``, within the move limit, never toward more rollout ranks once the last step idled a rollout rank's worth
   (``rollout_idle_ranks`` >= IDLE_RANKS); no shared-host trial, no trainer re-partition; otherwise it
   waits for the measurement (STEADY). So the planner moves a rank every step toward the split it
   predicted, as the paper's bound allows (one rank per step), instead of one every MIN_WINDOW_STEPS + 1
   steps, and judges the split it arrives at once measured.
11. A split's supply is at most what its task slots play (:func:`slot_tok_s`; no bound without
   ``rank_tasks`` or a measurement of the tasks' time in a slot).
"""

from __future__ import annotations

from dataclasses import replace

from tiderl.policy.ers.inputs import ErsLimits, ErsSignals
from tiderl.policy.ers.model import RateModel, Split, concurrency_share, estimate, predict_tok_s, split_of
from tiderl.policy.ers.outputs import ErsPlan, ErsReason, finish_plan, move_roles
from tiderl.policy.ers.trainer import repartition
from tiderl.policy.ra2p import StageTimes, refs_keep_up, refs_needed
from tiderl.roles import Role

__all__ = ["candidates", "plan_rate", "regime"]

IDLE_CAP_RANKS = 0.5  # rollout ranks idle on average below which the rollout side counts as fully used
IDLE_RANKS = 1.0  # rollout ranks idle on average from which a further rollout rank would idle too
SUPPLY_WAIT_SHARE = 0.1  # the trainer waited this share of the window or more: generation is short


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
    walking = (model is None and signals.walk is not None and signals.last_rollout_change != 0
               and "walk" not in limits.ablate)
    if walking:  # the current split is not measured yet: go on toward what the last measurement predicted
        basis = signals.walk  # type: ignore[assignment]
        model = estimate(basis, limits)
    if model is None or now.actors < 1:
        return finish_plan(current, current, fetch, ErsReason.STEADY)
    options = candidates(now, limits, model.stage_times)
    # What the window measured overrides the model's extrapolation in the clear cases.
    seen = regime(basis) if "regime" not in limits.ablate else "mixed"
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
        target = trial
    elif walking and best_g <= now_g * (1 + limits.rate_margin):
        return finish_plan(current, current, fetch, ErsReason.STEADY)
    elif best == now or best_g <= now_g * (1 + limits.rate_margin):
        refs = repartition(now, signals, limits) if "repartition" not in limits.ablate else None
        if refs is None:
            return finish_plan(current, current, fetch, ErsReason.STEADY)
        if refs > now.refs:
            new = move_roles(current, Role.ACTOR, Role.REF, refs - now.refs)
        else:
            new = move_roles(current, Role.REF, Role.ACTOR, now.refs - refs)
        return finish_plan(current, new, fetch, ErsReason.RATE_REPARTITION)
    else:
        target = best
    moved = _toward(current, now, target, limits, model.stage_times)
    if moved is None:
        return finish_plan(current, current, fetch, ErsReason.STEADY)
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


def _toward(current: tuple[Role, ...], now: Split, target: Split, limits: ErsLimits,
            times: StageTimes | None) -> tuple[tuple[Role, ...], Split] | None:
    """The role map and split after the moves toward `target` within the limits, or None where no move is made."""
    new = current
    split = now
    moves = {True: 0, False: 0}  # moves to rollout, other moves: each kind within its limit
    limit = {True: limits.rollout_moves, False: limits.max_moves_per_step}
    while split != target:
        step = _one_move(new, split, target, limits, times)
        if step is None:
            break
        grows = step[1].rollout > split.rollout
        if moves[grows] >= limit[grows]:
            break
        new, split = step
        moves[grows] += 1
    return None if split == now else (new, split)


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
