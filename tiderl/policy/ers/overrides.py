"""The ERS planner's override rules: the special cases applied around the choice
(:mod:`tiderl.policy.ers.choose`), each a named function so that an ablation can switch one off
(the order of :data:`BEFORE_CHOICE` and :data:`AFTER_CHOICE` is the order of application), and the
paper's threshold rules (``ers.policy: paper``, :func:`plan_paper`), taken in place of the rate choice.

Pure: no torch, no database, no HTTP, no processes. The invariants these rules keep are the package's
(:mod:`tiderl.policy.ers`, tests/test_policy_ers.py).

Before the choice (the first that applies replaces it):
- :func:`disabled`: ERS off, the role map unchanged.
- :func:`evaluation_split`: an evaluation step with ``elastic_actors``: the preemptive rule's moves and the
  actor ranks predicted to pay (below).
- :func:`preemptive_rollout`: cold start and evaluation steps (below).
- :func:`evaluation_end`: the evaluation is over, its preemptive moves undone (below).
After the choice (each in turn):
- :func:`await_engines`: engines on demand (invariant 14).
Shared-host rules: :func:`host_room` (the host's room for busy rollout ranks) and
:func:`max_rollout` (the preemptive rule's maximum rollout on a shared host).

Signals (:class:`ErsSignals`)
- Consumption deficit: the oldest ready micro-batch has waited longer than
  ``hol_tau`` x the mean recent step time, or RAS is at or above the RA2P
  break-even point (the smallest RAS for which the decoupled mode is cheaper,
  with later micro-batches every TPRM). -> one more trainer rank (a ref rank,
  or an actor rank, see above).
- Generation deficit: fewer complete groups ready than ``groups_ideal``
  (the next batch cannot be full). -> a trainer rank back to rollout (ref
  ranks first); colocated once no ref rank is left. Not when the rollout
  ranks already idled, for lack of admissible work (the staleness bound),
  at least one rank's worth of the last step: a further rollout rank would
  idle too. On a shared host, only while the host runs a further busy
  rollout rank at full speed (the preemptive rule's room, below): the
  paper's rules know no contention, and on hilo-bench x cpu, with the spare
  ref rank kept, they made it a second engine at a cost of 21%
  (docs/RESULTS.md). If the previous plan had
  scaled rollout down, the fetch size moves halfway toward ``groups_min``
  (adaptive data retention).
- Cold start (no step history) and evaluation steps: preemptive maximum
  rollout (every ref and idle rank to rollout, colocated), exempt from the
  move limit because it only adds rollout capacity; once the evaluation is
  over (``pre_evaluation_roles``), the ranks it sent from ref or idle to
  rollout go back to those roles in one plan (also exempt: it undoes the
  preemptive move, and the split before it was the planner's). On a shared host
  (``host``, tiderl.policy.host) rollout capacity is the host's, not the
  ranks': an idle rank returns to rollout only while the host runs every
  busy rollout rank at full speed (``host.speed(rollout + 1) == 1``, the
  trainer waiting); ref ranks beyond that become IDLE (a ref rank's
  decoupled step pays a coordination the colocated one does not: on this
  project's CPU host it costs more than the ref saves, docs/RESULTS.md).
- Evaluation steps with ``elastic_actors`` and ``evaluation_actors`` (not on a shared host): an evaluation round holds the
  step's publish until it is done, and its tasks go ahead of the training groups, so the step waits
  for the rollout side while the actors wait for data (on phase-change x h100x8 such a step took
  3.5x a normal one, the trainer waiting 2/3 of it). Actor ranks may join the rollout side for the
  evaluation, at most down to ``min_actor_ranks``. The evaluation steps measured
  (``evaluation_steps``, after the pipeline's fill) predict an evaluation step with n rollout and M
  actor ranks to take ``W(n) + (D - W) x M_e / M``: W(n) the trainer's wait for data, read off the
  newest evaluation step of each rollout count as the rate model reads generation latency
  (:func:`tiderl.policy.ers.model.gen_latency_at`: measured where measured, linear in 1 / n
  between, fully 1 / n below the fewest and above the most: the round's tasks, all released at
  once ahead of the batch's, keep every rollout rank busy, so the wait divides among them, where a
  normal step's generation latency keeps half of itself fixed beyond the counts measured), and the trainer's work
  D - W of the newest evaluation step (duration D, M_e actor ranks) following the actor ranks (in
  an evaluation step the trainer waits first, then trains). The count with the shortest prediction
  moves, if it beats the preemptive rule's split by more than ``rate_margin``; each evaluation
  step measured at a new count sharpens the next prediction. The evaluation's end puts the actors
  back with the ref and idle ranks (exempt from the move limits, as the preemptive plan). With no
  evaluation step measured the preemptive rule alone applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tiderl.policy.ers.inputs import ErsLimits, ErsSignals, StepObservation
from tiderl.policy.ers.model import gen_latency_at
from tiderl.policy.ers.outputs import ErsPlan, ErsReason, finish_plan, mode_of, move_roles
from tiderl.policy.host import HostShare
from tiderl.policy.ra2p import Ra2pMode, break_even_ras, choose_mode, refs_keep_up
from tiderl.roles import Role

__all__ = ["AFTER_CHOICE", "BEFORE_CHOICE", "after_choice", "await_engines", "before_choice", "consumption_deficit",
           "disabled", "evaluation_end", "evaluation_split", "evaluation_step_s", "host_room", "max_rollout",
           "plan_paper", "preemptive_rollout"]


def consumption_deficit(roles: Sequence[Role], signals: ErsSignals, limits: ErsLimits) -> bool:
    """HoL latency above tau x mean step time, or RAS at/above the decoupled break-even point."""
    history = signals.step_history_s
    if history and signals.hol_latency_s > limits.hol_tau * (sum(history) / len(history)):
        return True
    if signals.stage_times is None or signals.microbatches_per_step <= 0 or signals.ras_microbatches <= 0:
        return False
    actors = sum(1 for r in roles if r is Role.ACTOR)
    refs = max(1, sum(1 for r in roles if r is Role.REF))
    if actors == 0:
        return False
    n = max(signals.microbatches_per_step, signals.ras_microbatches)
    tprm = signals.tprm_s if signals.tprm_s is not None else 0.0
    even = break_even_ras(signals.stage_times, tprm, n, actors, refs)
    return even is not None and signals.ras_microbatches >= even


def disabled(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan | None:
    """ERS disabled: the role map unchanged, the mode following it (invariant 10)."""
    fetch = limits.groups_ideal
    if not limits.enabled:
        return ErsPlan(current, mode_of(current), fetch, (), ErsReason.DISABLED)
    return None


def preemptive_rollout(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan | None:
    """Cold start (no step history) or an evaluation step: preemptive maximum rollout (invariant 6)."""
    fetch = limits.groups_ideal
    cold = not signals.step_history_s
    if limits.preemptive_rollout and (cold or signals.is_eval_next):
        new = max_rollout(current, limits.host)
        reason = ErsReason.COLD_START if cold else ErsReason.EVALUATION
        return finish_plan(current, new, fetch, reason)
    return None


def evaluation_split(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan | None:
    """An evaluation step with ``elastic_actors``: the preemptive rule's split and the actor ranks the measured
    evaluation steps predict to pay, moved to rollout (invariant 15); None where no actor is worth moving
    (the preemptive rule then applies)."""
    seen = signals.evaluation_steps
    allowed = limits.preemptive_rollout and limits.elastic_actors and limits.evaluation_actors and limits.host is None
    if not (allowed and signals.is_eval_next and seen and signals.step_history_s):
        return None
    base = max_rollout(current, limits.host)
    actors = sum(1 for r in base if r is Role.ACTOR)
    options = [move_roles(base, Role.ACTOR, Role.ROLLOUT, k, lowest_first=True)
               for k in range(max(0, actors - limits.min_actor_ranks) + 1)]
    predicted = [evaluation_step_s(roles, seen) for roles in options]
    if predicted[0] is None:
        return None
    best = min(range(len(options)), key=lambda k: (predicted[k] if predicted[k] is not None else math.inf, k))
    if best == 0 or predicted[best] * (1 + limits.rate_margin) >= predicted[0]:  # type: ignore[operator]
        return None
    return finish_plan(current, options[best], limits.groups_ideal, ErsReason.EVALUATION)


def evaluation_step_s(roles: tuple[Role, ...], seen: tuple[StepObservation, ...]) -> float | None:
    """The predicted duration of an evaluation step on `roles` from the evaluation steps `seen` (newest last;
    the module docstring); None without actor or rollout ranks or a measurement."""
    rollout = sum(1 for r in roles if r is Role.ROLLOUT)
    actors = sum(1 for r in roles if r is Role.ACTOR)
    if rollout < 1 or actors < 1 or not seen:
        return None
    waits = tuple(sorted((s.rollout_ranks, min(s.trainer_wait_s, s.duration_s)) for s in seen if s.rollout_ranks >= 1))
    if not waits:
        return None
    newest = seen[-1]
    work = newest.duration_s - min(newest.trainer_wait_s, newest.duration_s)
    return gen_latency_at(rollout, waits, fixed_share=0.0) + work * max(1, newest.actor_ranks) / actors


def evaluation_end(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan | None:
    """The evaluation is over: the ranks its rules sent to rollout go back (invariant 13)."""
    fetch = limits.groups_ideal
    cold = not signals.step_history_s
    restore = signals.pre_evaluation_roles
    if limits.preemptive_rollout and not cold and restore is not None and len(restore) == len(current):
        back = (Role.REF, Role.IDLE, Role.ACTOR) if limits.elastic_actors else (Role.REF, Role.IDLE)
        new = tuple(old if now is Role.ROLLOUT and old in back else now for now, old in zip(current, restore))
        if new != current:
            return finish_plan(current, new, fetch, ErsReason.EVALUATION_END)
    return None


BEFORE_CHOICE: tuple[Callable[[tuple[Role, ...], ErsSignals, ErsLimits], ErsPlan | None], ...] = (
    disabled, evaluation_split, preemptive_rollout, evaluation_end)
"""The rules tried before the choice, in order: the first that returns a plan replaces the choice."""


def before_choice(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan | None:
    """The plan of the first rule of :data:`BEFORE_CHOICE` that applies (None: none does, the choice decides)."""
    for rule in BEFORE_CHOICE:
        ruled = rule(current, signals, limits)
        if ruled is not None:
            return ruled
    return None


def await_engines(current: tuple[Role, ...], planned: ErsPlan, signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    """Engines on demand (invariant 14): an idle rank without an engine up stays idle and starts one."""
    up = signals.engine_ranks
    if not limits.engines_on_demand or limits.host is None or up is None:
        return planned
    waiting = tuple(m.rank for m in planned.moves
                    if m.from_role is Role.IDLE and m.to_role is Role.ROLLOUT and m.rank not in up)
    if not waiting:
        return planned
    new = tuple(Role.IDLE if i in waiting else r for i, r in enumerate(planned.roles))
    done = finish_plan(current, new, planned.fetch_groups, planned.reason)
    reason = planned.reason if done.moves else ErsReason.ENGINE_START
    return ErsPlan(done.roles, done.mode, done.fetch_groups, done.moves, reason,
                   tuple(sorted(set(planned.warm) | set(waiting))))


AFTER_CHOICE: tuple[Callable[[tuple[Role, ...], ErsPlan, ErsSignals, ErsLimits], ErsPlan], ...] = (await_engines,)
"""The rules applied to the chosen (or overriding) plan, in order."""


def after_choice(current: tuple[Role, ...], planned: ErsPlan, signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    """`planned` after each rule of :data:`AFTER_CHOICE` in turn."""
    for rule in AFTER_CHOICE:
        planned = rule(current, planned, signals, limits)
    return planned


def plan_paper(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    """The paper's threshold rules (section 5.2), after the cold-start and evaluation rules."""
    fetch = limits.groups_ideal

    num_rollout = sum(1 for r in current if r is Role.ROLLOUT)
    num_ref = sum(1 for r in current if r is Role.REF)
    num_actor = sum(1 for r in current if r is Role.ACTOR)
    if consumption_deficit(current, signals, limits):
        budget = min(limits.max_moves_per_step, max(num_rollout - limits.min_rollout_ranks, 0))
        new = list(current)
        for _ in range(budget):
            ref_room = limits.max_ref_ranks is None or num_ref < limits.max_ref_ranks
            ref_room = ref_room and not refs_keep_up(num_actor, num_ref, signals.stage_times)
            if ref_room and (not limits.elastic_actors or _decoupled_pays(num_actor, num_ref + 1, signals)):
                target = Role.REF
                num_ref += 1
            elif limits.elastic_actors:
                target = Role.ACTOR
                num_actor += 1
            else:
                break
            new = list(move_roles(tuple(new), Role.ROLLOUT, target, 1))
        return finish_plan(current, tuple(new), fetch, ErsReason.CONSUMPTION_DEFICIT)

    if signals.ready_groups < limits.groups_ideal:
        budget = limits.rollout_moves if signals.rollout_idle_ranks < 1.0 else 0
        budget = min(budget, host_room(num_rollout, limits.host))
        from_ref = min(budget, num_ref)
        new = move_roles(current, Role.REF, Role.ROLLOUT, from_ref)
        if limits.elastic_actors:
            from_actor = min(budget - from_ref, max(num_actor - limits.min_actor_ranks, 0))
            new = move_roles(new, Role.ACTOR, Role.ROLLOUT, from_actor, lowest_first=True)
        if limits.adaptive_retention and signals.last_rollout_change < 0:
            previous = signals.fetch_groups if signals.fetch_groups is not None else limits.groups_ideal
            fetch = max(limits.groups_min, (previous + limits.groups_min) // 2)
        return finish_plan(current, new, fetch, ErsReason.GENERATION_DEFICIT)

    return finish_plan(current, current, fetch, ErsReason.STEADY)


def _decoupled_pays(num_actor: int, num_ref: int, signals: ErsSignals) -> bool:
    """Would the decoupled mode with `num_ref` ref ranks beat colocated on the observed readiness?"""
    if signals.stage_times is None or num_actor < 1 or signals.microbatches_per_step <= 0:
        return False
    n = max(signals.microbatches_per_step, signals.ras_microbatches)
    tprm = signals.tprm_s if signals.tprm_s is not None else 0.0
    ras = min(signals.ras_microbatches, n)
    ready = [0.0] * ras + [tprm * (i + 1) for i in range(n - ras)]
    return choose_mode(ready, signals.stage_times, num_actor, num_ref).mode is Ra2pMode.DECOUPLED


def host_room(rollout: int, host: HostShare | None) -> int:
    """Further rollout ranks the host runs with every busy rollout rank at full speed (without a shared
    host: no limit, a number larger than any role map)."""
    if host is None:
        return 1 << 30
    room = 0
    while host.speed(rollout + room + 1, 0.0) >= 1.0:
        room += 1
    return room


def max_rollout(roles: tuple[Role, ...], host: HostShare | None) -> tuple[Role, ...]:
    """Preemptive maximum rollout: ref and idle ranks to rollout, on a shared host only while it runs each
    busy rollout rank at full speed (the others idle)."""
    room = host_room(sum(1 for r in roles if r is Role.ROLLOUT), host)
    new = []
    for r in roles:
        if r in (Role.REF, Role.IDLE):
            r = Role.ROLLOUT if room > 0 else Role.IDLE
            room -= 1
        new.append(r)
    return tuple(new)
