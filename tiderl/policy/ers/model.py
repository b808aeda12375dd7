"""The ERS planner's rate model (``ers.policy: rate``): the rollout supply, the trainer's demand and the
goodput it predicts for each split of the ranks (:func:`estimate` from the signals' window,
:func:`predict_tok_s` per split). :mod:`tiderl.policy.ers.choose` picks the split from it.

Pure: no torch, no database, no HTTP, no processes.

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
  latency memory likewise, :mod:`tiderl.policy.ers.signals`) is taken out of
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
  work in the window, :mod:`tiderl.policy.ers.signals`): measured counts as
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
  :func:`tiderl.policy.ers.trainer.readiness`; the arrivals after the start
  ``G_gen(window's split) / G_gen(n)`` times later), cost
  :func:`tiderl.policy.ers.trainer.step_compute_s` with M actors and R refs:
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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tiderl.policy.admission import inflight_bound
from tiderl.policy.ers.inputs import ErsLimits, ErsSignals, StepObservation
from tiderl.policy.ers.signals import MIN_WINDOW_STEPS, task_times
from tiderl.policy.ers.trainer import coordination_s, ready_compute_s, step_compute_s
from tiderl.policy.host import HostShare
from tiderl.policy.ra2p import StageTimes
from tiderl.roles import Role

__all__ = ["RateModel", "Split", "busy_trainer_ranks", "concurrency_share", "describe", "estimate", "gen_latency_at",
           "gen_latency_curve", "host_factor", "latency_s", "predict_tok_s", "slot_tok_s", "split_of"]

FIXED_SHARE_PRIOR = 0.5  # share of L_gen taken not to shrink with rollout ranks beyond the most measured


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
    # The current split's generation latency, without the wait for task slots (tiderl.policy.ers.signals): that wait is
    # the slots' (the slot bound of _supply_tok_s), not the engines'.
    slots = "slot_bound" not in limits.ablate
    memory = signals.gen_latency_by_rollout if "latency_memory" not in limits.ablate else ()
    curve = gen_latency_curve(memory, last.rollout_ranks,
                              max(0.0, (latency or 0.0) - env - (signals.slot_wait_s if slots else 0.0)))
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
        rank_groups=limits.rank_tasks / limits.group_size if limits.rank_tasks and slots else math.inf,
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


def gen_latency_at(rollout: int, curve: tuple[tuple[int, float], ...],
                   fixed_share: float = FIXED_SHARE_PRIOR) -> float:
    """L_gen with `rollout` ranks: measured where measured; between two measured counts, linear in
    1 / n (iteration cost = fixed part + part per sequence); below the fewest measured, scaling fully
    with 1 / n (saturated engines: a pessimistic view of taking rollout ranks away); above the most
    measured, with `fixed_share` of it fixed (FIXED_SHARE_PRIOR: a modest view of adding them)."""
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
    return g0 * (fixed_share + (1 - fixed_share) * n0 / rollout)


def _compute_s(tokens: float, actors: int, refs: int, times: StageTimes, per_actor_mb: float) -> float:
    """The compute time of a step of `tokens`, every micro-batch ready at the start: the trainer
    re-partition's step model (:func:`tiderl.policy.ers.trainer.step_compute_s`), so that the split
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


def describe(signals: ErsSignals, limits: ErsLimits, roles: Sequence[Role]) -> dict[str, float] | None:
    """The model's view of the split `roles` (for logs and metrics): supply, demand and their minimum, the
    trained rate, in the model's unit: trajectory tokens (prompt, observations and generated) per second, not
    the generated tokens that goodput counts."""
    model = estimate(signals, limits)
    if model is None:
        return None
    supply, demand, trained = predict_tok_s(split_of(roles), model)
    return {"supply_tok_s": supply, "demand_tok_s": demand, "predicted_trained_tok_s": trained}
