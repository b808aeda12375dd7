"""The rate planner's choice (``ers.policy: rate``): the split the rate model predicts best and the moves toward
it within the limits, or else the trainer's re-partition between actor and ref (:func:`plan_rate`). Its rules
and invariants: docs/ers.md, "The choice".
"""

from __future__ import annotations

from dataclasses import replace

from tiderl.policy.ers.inputs import ErsLimits, ErsSignals
from tiderl.policy.ers.model import (RateModel, Split, concurrency_share, coordination_s, estimate, predict_tok_s,
                                     ready_compute_s, split_of)
from tiderl.policy.ers.outputs import ErsPlan, ErsReason, finish_plan, move_roles
from tiderl.policy.ra2p import StageTimes, refs_keep_up, refs_needed
from tiderl.roles import Role

__all__ = ["candidates", "plan_rate", "regime", "repartition"]

IDLE_CAP_RANKS = 0.5  # rollout ranks idle on average below which the rollout side counts as fully used
IDLE_RANKS = 1.0  # rollout ranks idle on average from which a further rollout rank would idle too
SUPPLY_WAIT_SHARE = 0.1  # the trainer waited this share of the window or more: generation is short


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
    seen = regime(basis) if "regime" not in limits.ablate else "mixed"
    if seen == "supply":
        options = [s for s in options if s.rollout >= now.rollout]
    elif seen == "idle":
        options = [s for s in options if s.rollout <= now.rollout]
    if not options:
        return finish_plan(current, current, fetch, ErsReason.STEADY)
    goodput = {s: predict_tok_s(s, model)[2] for s in options}
    ranked = sorted(options, key=lambda s: (goodput[s], -_distance(s, now)), reverse=True)  # stable: first best
    now_g = _goodput(now, goodput, model)
    best, trial = ranked[0], None
    if walking:  # only the way the last plan moved, never toward more rollout ranks while one's worth idled
        way = best.rollout - now.rollout
        if way * signals.last_rollout_change <= 0 or (way > 0 and signals.rollout_idle_ranks >= IDLE_RANKS):
            return finish_plan(current, current, fetch, ErsReason.STEADY)
    else:
        trial = _host_trial(now, options, model, seen, limits)
    valley = "valley" not in limits.ablate
    targets = [trial] if trial is not None else ranked if valley and not walking else [best]
    chosen = None
    for target in targets:  # the best target whose moves this boundary reach a split predicted no slower (valley)
        if target != trial and goodput[target] <= now_g * (1 + limits.rate_margin):
            break
        spare = 0 if walking or "idle_moves" in limits.ablate else _idle_ranks(basis)
        new, split = _toward(current, now, target, limits, model.stage_times, spare)
        if split != now and (target == trial or not valley or _goodput(split, goodput, model) >= now_g):
            chosen = new, split
            break
    if chosen is None:
        no_gain = best == now or goodput[best] <= now_g * (1 + limits.rate_margin)
        refs = None
        if not walking and trial is None and (valley or no_gain) and "repartition" not in limits.ablate:
            refs = repartition(now, signals, limits)
        if refs is None:
            return finish_plan(current, current, fetch, ErsReason.STEADY)
        role, back = (Role.ACTOR, Role.REF) if refs > now.refs else (Role.REF, Role.ACTOR)
        return finish_plan(current, move_roles(current, role, back, abs(refs - now.refs)), fetch,
                           ErsReason.RATE_REPARTITION)
    new, split = chosen
    if split.idle > now.idle:
        reason = ErsReason.RATE_TO_IDLE
    elif split.rollout != now.rollout:
        reason = ErsReason.RATE_TO_ROLLOUT if split.rollout > now.rollout else ErsReason.RATE_TO_TRAINER
    else:
        reason = ErsReason.RATE_REBALANCE
    return finish_plan(current, new, fetch, reason)


def _toward(current: tuple[Role, ...], now: Split, target: Split, limits: ErsLimits,
            times: StageTimes | None, spare: int = 0) -> tuple[tuple[Role, ...], Split]:
    """The role map and split after the moves toward `target` this boundary allows (`spare`: rollout ranks
    the window measured idle, which may all leave rollout at once)."""
    new, split = current, now
    moves = {True: 0, False: 0}  # moves to rollout and the others, each within its limit
    limit = {True: limits.rollout_moves, False: max(limits.max_moves_per_step, spare)}
    while split != target and (step := _one_move(new, split, target, limits, times)) is not None:
        grows = step[1].rollout > split.rollout
        if moves[grows] >= limit[grows]:
            break
        new, split = step
        moves[grows] += 1
    return new, split


def _goodput(split: Split, known: dict[Split, float], model: RateModel) -> float:
    return known[split] if split in known else predict_tok_s(split, model)[2]


def candidates(current: Split, limits: ErsLimits, times: StageTimes | None) -> list[Split]:
    """Every split the limits allow from `current` (the same movable ranks)."""
    movable = current.rollout + current.refs + current.idle + (current.actors if limits.elastic_actors else 0)
    actor_counts = range(limits.min_actor_ranks, movable - limits.min_rollout_ranks + 1) \
        if limits.elastic_actors else [current.actors]
    out = []
    for actors in actor_counts:
        free = movable - (actors if limits.elastic_actors else 0)
        max_refs = refs_needed(actors, times)
        if limits.max_ref_ranks is not None:
            max_refs = min(max_refs, limits.max_ref_ranks)
        for refs in range(0, max(max_refs, current.refs if actors == current.actors else 0) + 1):
            for idle in range(0, free - refs - limits.min_rollout_ranks + 1 if limits.host is not None else 1):
                if free - refs - idle >= limits.min_rollout_ranks:
                    out.append(Split(free - refs - idle, actors, refs, idle))
    return out


def _distance(a: Split, b: Split) -> int:
    return abs(a.rollout - b.rollout) + abs(a.actors - b.actors) + abs(a.refs - b.refs) + abs(a.idle - b.idle)


def _host_trial(now: Split, options: list[Split], model: RateModel, seen: str, limits: ErsLimits) -> Split | None:
    """On a shared host with a rollout rank's worth idling: one rollout rank fewer (left idle), as long as the
    fewer could hold the groups in flight; measured like any split, then the model judges both."""
    if limits.host is None or seen != "idle" or now.rollout - 1 < limits.min_rollout_ranks:
        return None
    trial = replace(now, rollout=now.rollout - 1, idle=now.idle + 1)
    if trial not in options or trial.rollout in dict(model.gen_curve) or concurrency_share(trial.rollout, model) < 1:
        return None
    return trial


def _idle_ranks(signals: ErsSignals) -> int:
    """Whole rollout ranks the window shows idle on average (holding no task)."""
    total = sum(s.duration_s for s in signals.window)
    return int(sum(s.rollout_idle_rank_s for s in signals.window) / total) if total > 0 else 0


def regime(signals: ErsSignals) -> str:
    """What the window shows, whatever the model says: `supply` (the trainer waited SUPPLY_WAIT_SHARE of the time
    or more, the rollout ranks idled less than IDLE_CAP_RANKS), `idle` (IDLE_RANKS or more idled) or `mixed`."""
    total = sum(s.duration_s for s in signals.window)
    if total <= 0:
        return "mixed"
    wait = sum(s.trainer_wait_s for s in signals.window) / total
    idle = sum(s.rollout_idle_rank_s for s in signals.window) / total
    if wait >= SUPPLY_WAIT_SHARE and idle < IDLE_CAP_RANKS:
        return "supply"
    return "idle" if idle >= IDLE_RANKS else "mixed"


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


def repartition(now: Split, signals: ErsSignals, limits: ErsLimits) -> int | None:
    """With ``elastic_actors``, the ref ranks the trainer's ranks should hold (the rollout side as it is): the
    partition with the shortest compute over the window's steps, if it beats the current one by more than
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
    cost = {refs: sum(ready_compute_s(s, total - refs, refs, times, mb) for s in signals.window)
            + coordination_s(refs, limits.decoupled_step_s) * len(signals.window) for refs in sorted(options)}
    best = min(cost, key=lambda r: (cost[r], abs(r - now.refs)))
    if best == now.refs or cost[best] * (1 + limits.rate_margin) >= cost[now.refs]:
        return None
    return best
