"""The rules around the choice (docs/ers.md, "Overrides"): before it, the first of :func:`before_choice`'s that
applies replaces it (ERS disabled, evaluation steps that take actor ranks, cold start and evaluation steps,
an evaluation's end); after it, engines on demand (:func:`await_engines`). And the paper's threshold rules
(``ers.policy: paper``, :func:`plan_paper`), taken in place of the rate choice.
"""

from __future__ import annotations

import math

from tiderl.policy.ers.inputs import ErsLimits, ErsSignals, StepObservation
from tiderl.policy.ers.model import gen_latency_at, trainer_work_s
from tiderl.policy.ers.outputs import ErsPlan, ErsReason, count, finish_plan, mode_of, move_roles
from tiderl.policy.host import HostShare
from tiderl.policy.ra2p import Ra2pMode, break_even_ras, choose_mode, refs_keep_up
from tiderl.roles import Role

__all__ = ["await_engines", "before_choice", "consumption_deficit", "evaluation_step_s", "max_rollout", "plan_paper"]


def before_choice(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan | None:
    """The plan of the first rule before the choice that applies (None: the choice decides)."""
    fetch = limits.groups_ideal
    if not limits.enabled:
        return ErsPlan(current, mode_of(current), fetch, (), ErsReason.DISABLED)
    cold = not signals.step_history_s
    if limits.preemptive_rollout and (cold or signals.is_eval_next):
        base = max_rollout(current, limits.host)
        if signals.is_eval_next and limits.elastic_actors and limits.evaluation_actors and limits.host is None:
            # Actor ranks join rollout for the evaluation where the evaluation model predicts a gain.
            options = [move_roles(base, Role.ACTOR, Role.ROLLOUT, k, lowest_first=True)
                       for k in range(max(0, count(base, Role.ACTOR) - limits.min_actor_ranks) + 1)]
            predicted = [evaluation_step_s(roles, signals, limits, current if cold else None) for roles in options]
            best = min(range(len(options)), key=lambda k: (predicted[k] if predicted[k] is not None else math.inf, k))
            now, then = predicted[0], predicted[best]
            if now is not None and then is not None and then * (1 + limits.rate_margin) < now:
                base = options[best]
        # A cold start that plays an evaluation round is that round's plan (remembered, and undone at its end).
        reason = ErsReason.COLD_START if cold and not signals.is_eval_next else ErsReason.EVALUATION
        return finish_plan(current, base, fetch, reason)
    restore = signals.pre_evaluation_roles
    if limits.preemptive_rollout and not cold and restore is not None and len(restore) == len(current):
        back = (Role.REF, Role.IDLE, Role.ACTOR) if limits.elastic_actors else (Role.REF, Role.IDLE)
        new = tuple(old if now is Role.ROLLOUT and old in back else now for now, old in zip(current, restore))
        if new != current:
            return finish_plan(current, new, fetch, ErsReason.EVALUATION_END)
    return None


def evaluation_step_s(roles: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits,
                      start: tuple[Role, ...] | None = None) -> float | None:
    """The predicted duration of an evaluation step on `roles`: the rollout ranks' generation span and the
    trainer's work overlap, max(span, work) + the rest. The evaluation steps measured give the span by rollout
    count (busy rank-seconds over ranks; :func:`gen_latency_at`, fully 1 / n beyond the counts measured) and the
    newest one's work and rest; before any is measured, the rate window (the walk's, where a move left the
    current split unmeasured) prices the round's `limits.evaluation_tasks` beside a step's own generation; at a
    cold start (`start`: the run's first map), with nothing measured, in units of a step of `start` taken as
    balanced: the round's tasks go first and nothing is ready before them, so the trainer's work overlaps only
    the step's own generation. None: no actor or rollout rank, or nothing measured."""
    rollout, actors = count(roles, Role.ROLLOUT), count(roles, Role.ACTOR)
    if rollout < 1 or actors < 1:
        return None
    seen = signals.evaluation_steps
    if seen:
        newest = seen[-1]
        spans = tuple(sorted((s.rollout_ranks, _span_s(s)) for s in seen if s.rollout_ranks >= 1))
        span = gen_latency_at(rollout, spans, fixed_share=0.0) if spans else 0.0
        return max(span, trainer_work_s(newest) * max(1, newest.actor_ranks) / actors) + _rest_s(newest)
    # The window of the current split, or where a move just made it unmeasured, of the newest measured one.
    window = signals.window or (signals.walk.window if signals.walk is not None else ())
    if not window and start is not None:  # nothing ready yet: the trainer overlaps the step's generation only
        step = count(start, Role.ROLLOUT) / rollout  # `start`'s step generated as long as its trainer trains it
        train = (count(start, Role.ACTOR) + count(start, Role.REF)) / actors
        rounds = limits.evaluation_tasks / (limits.groups_ideal * limits.group_size)
        return rounds * step + max(step, train) if limits.evaluation_tasks >= 1 and step > 0 else None
    tasks = sum(s.tasks_completed for s in window)
    produced = sum(s.produced_tokens for s in window)
    busy_rank_s = sum(map(_busy_rank_s, window))
    if limits.evaluation_tasks < 1 or tasks < 1 or produced <= 0 or busy_rank_s <= 0:
        return None
    n = len(window)
    generate = limits.evaluation_tasks * produced / tasks + produced / n  # the round's tokens and a step's
    actor_s = sum(trainer_work_s(s) * max(1, s.actor_ranks) for s in window) / n
    return max(generate * busy_rank_s / produced / rollout, actor_s / actors) + sum(map(_rest_s, window)) / n


def _busy_rank_s(step: StepObservation) -> float:
    """A step's rollout rank-seconds with the engine busy (held, where busy is not measured)."""
    return step.rollout_busy_rank_s or max(0.0, step.rollout_ranks * step.duration_s - step.rollout_idle_rank_s)


def _span_s(step: StepObservation) -> float:
    """A step's generation span: its rollout ranks' busy seconds each."""
    return _busy_rank_s(step) / step.rollout_ranks if step.rollout_ranks >= 1 else 0.0


def _rest_s(step: StepObservation) -> float:
    """A step beyond the longer of its generation span and its trainer work."""
    return max(0.0, step.duration_s - max(_span_s(step), trainer_work_s(step)))


def await_engines(current: tuple[Role, ...], planned: ErsPlan, signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    """Engines on demand: an idle rank the plan sends to rollout without an engine up stays idle and starts one."""
    up = signals.engine_ranks
    if not limits.engines_on_demand or limits.host is None or up is None:
        return planned
    waiting = tuple(m.rank for m in planned.moves
                    if m.from_role is Role.IDLE and m.to_role is Role.ROLLOUT and m.rank not in up)
    if not waiting:
        return planned
    new = tuple(Role.IDLE if i in waiting else r for i, r in enumerate(planned.roles))
    done = finish_plan(current, new, planned.fetch_groups, planned.reason)
    return ErsPlan(done.roles, done.mode, done.fetch_groups, done.moves,
                   planned.reason if done.moves else ErsReason.ENGINE_START, tuple(sorted({*planned.warm, *waiting})))


def plan_paper(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    """The paper's threshold rules (section 5.2): a consumption deficit adds a trainer rank, a generation deficit
    gives one back to rollout (not while a rollout rank's worth idled, nor beyond the host's room)."""
    fetch = limits.groups_ideal
    num_rollout, num_ref, num_actor = (count(current, r) for r in (Role.ROLLOUT, Role.REF, Role.ACTOR))
    if consumption_deficit(current, signals, limits):
        new = current
        for _ in range(min(limits.max_moves_per_step, max(num_rollout - limits.min_rollout_ranks, 0))):
            ref_room = limits.max_ref_ranks is None or num_ref < limits.max_ref_ranks
            ref_room = ref_room and not refs_keep_up(num_actor, num_ref, signals.stage_times)
            if ref_room and (not limits.elastic_actors or _decoupled_pays(num_actor, num_ref + 1, signals)):
                new, num_ref = move_roles(new, Role.ROLLOUT, Role.REF, 1), num_ref + 1
            elif limits.elastic_actors:
                new, num_actor = move_roles(new, Role.ROLLOUT, Role.ACTOR, 1), num_actor + 1
            else:
                break
        return finish_plan(current, new, fetch, ErsReason.CONSUMPTION_DEFICIT)
    if signals.ready_groups < limits.groups_ideal:
        budget = limits.rollout_moves if signals.rollout_idle_ranks < 1.0 else 0
        budget = min(budget, _host_room(num_rollout, limits.host))
        from_ref = min(budget, num_ref)
        new = move_roles(current, Role.REF, Role.ROLLOUT, from_ref)
        if limits.elastic_actors:
            from_actor = min(budget - from_ref, max(num_actor - limits.min_actor_ranks, 0))
            new = move_roles(new, Role.ACTOR, Role.ROLLOUT, from_actor, lowest_first=True)
        if limits.adaptive_retention and signals.last_rollout_change < 0:  # adaptive data retention
            previous = signals.fetch_groups if signals.fetch_groups is not None else limits.groups_ideal
            fetch = max(limits.groups_min, (previous + limits.groups_min) // 2)
        return finish_plan(current, new, fetch, ErsReason.GENERATION_DEFICIT)
    return finish_plan(current, current, fetch, ErsReason.STEADY)


def consumption_deficit(roles: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> bool:
    """HoL latency above tau x the mean recent step time, or RAS at or above the decoupled break-even point."""
    history = signals.step_history_s
    if history and signals.hol_latency_s > limits.hol_tau * (sum(history) / len(history)):
        return True
    actors = count(roles, Role.ACTOR)
    if signals.stage_times is None or signals.microbatches_per_step <= 0 or signals.ras_microbatches <= 0 or not actors:
        return False
    n = max(signals.microbatches_per_step, signals.ras_microbatches)
    tprm = signals.tprm_s if signals.tprm_s is not None else 0.0
    even = break_even_ras(signals.stage_times, tprm, n, actors, max(1, count(roles, Role.REF)))
    return even is not None and signals.ras_microbatches >= even


def _decoupled_pays(num_actor: int, num_ref: int, signals: ErsSignals) -> bool:
    """Would the decoupled mode with `num_ref` ref ranks beat colocated on the observed readiness?"""
    if signals.stage_times is None or num_actor < 1 or signals.microbatches_per_step <= 0:
        return False
    n = max(signals.microbatches_per_step, signals.ras_microbatches)
    tprm = signals.tprm_s if signals.tprm_s is not None else 0.0
    ras = min(signals.ras_microbatches, n)
    ready = [0.0] * ras + [tprm * (i + 1) for i in range(n - ras)]
    return choose_mode(ready, signals.stage_times, num_actor, num_ref).mode is Ra2pMode.DECOUPLED


def _host_room(rollout: int, host: HostShare | None) -> int:
    """Further rollout ranks the host runs with every busy rollout rank at full speed (no host: no limit)."""
    if host is None:
        return 1 << 30
    room = 0
    while host.speed(rollout + room + 1, 0.0) >= 1.0:
        room += 1
    return room


def max_rollout(roles: tuple[Role, ...], host: HostShare | None) -> tuple[Role, ...]:
    """Preemptive maximum rollout: ref and idle ranks to rollout, on a shared host only while it runs each busy
    rollout rank at full speed (the others idle)."""
    room = _host_room(count(roles, Role.ROLLOUT), host)
    new = []
    for r in roles:
        if r in (Role.REF, Role.IDLE):
            r = Role.ROLLOUT if room > 0 else Role.IDLE
            room -= 1
        new.append(r)
    return tuple(new)
