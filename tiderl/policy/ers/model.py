"""The rate model (``ers.policy: rate``): the supply, demand and goodput the window's rates predict for each
split of the ranks (:func:`estimate`, :func:`predict_tok_s`), and the trainer's step model it prices a split's
steps with (:func:`step_compute_s`). docs/ers.md, "The rate model", derives each term.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tiderl.policy.admission import inflight_bound
from tiderl.policy.ers.inputs import ErsLimits, ErsSignals, StepObservation
from tiderl.policy.ers.outputs import count
from tiderl.policy.ers.signals import MIN_WINDOW_STEPS, task_times
from tiderl.policy.ra2p import StageTimes, colocated_cost_s
from tiderl.roles import Role

__all__ = ["RateModel", "Split", "concurrency_share", "coordination_s", "describe", "estimate", "gen_latency_at",
           "gen_latency_curve", "host_factor", "latency_s", "predict_tok_s", "readiness", "ready_compute_s", "slot_tok_s",
           "split_of", "step_compute_s", "trainer_work_s"]

FIXED_SHARE_PRIOR = 0.5  # share of L_gen taken not to shrink with rollout ranks beyond the most measured


@dataclass(frozen=True, slots=True, order=True)
class Split:
    rollout: int
    actors: int
    refs: int
    idle: int = 0


def split_of(roles: Sequence[Role]) -> Split:
    return Split(count(roles, Role.ROLLOUT), count(roles, Role.ACTOR), count(roles, Role.REF), count(roles, Role.IDLE))


@dataclass(frozen=True, slots=True)
class RateModel:
    """The rates the window shows (tokens, seconds)."""

    limits: ErsLimits
    window: tuple[StepObservation, ...]
    stage_times: StageTimes | None
    supply_tok_s_per_rank: float  # tokens per busy rollout rank-second (the supply without a latency)
    little_tokens: float  # (F - B/2) x tokens per group, F the groups in flight
    tokens_per_group: float
    micro_batch_tokens: float  # one actor's share of a micro-batch
    group_latency_s: float | None  # a group's creation to completion (None: not measured)
    group_env_s: float  # the environment time of a group's slowest task, in that latency
    busy_rollout: float  # rollout ranks holding a task, on average
    trainer_busy_share: float  # share of the window each trainer rank computed
    consumed_tok_s_per_actor: float | None = None  # without stage times: per busy actor-second
    waits_s: tuple[float, ...] = ()  # per step, the trainer's wait beyond what its readiness shows
    residuals_s: tuple[float, ...] = ()  # per step, the rest (optimizer, publish) less its coordination
    task_slot_s: float | None = None  # mean seconds a task held a slot (None: not measured)
    task_env_s: float = 0.0  # the environment's part of it
    rank_groups: float = math.inf  # groups a rollout rank plays at once
    inflight_groups: float = math.inf
    window_supply_tok_s: float = 0.0  # the supply of the window's own split
    gen_curve: tuple[tuple[int, float], ...] = ()  # the measured (rollout ranks, L_gen), the window's split in

    @property
    def last(self) -> StepObservation:
        return self.window[-1]

    @property
    def overhead_s(self) -> float:
        return sum(self.residuals_s) / len(self.residuals_s) if self.residuals_s else 0.0


def estimate(signals: ErsSignals, limits: ErsLimits) -> RateModel | None:
    """The rates of the window, or None when it shows no supply or no demand (or no micro-batch size)."""
    window = signals.window
    if len(window) < MIN_WINDOW_STEPS or signals.micro_batch_tokens < 1:
        return None
    produced = sum(s.produced_tokens for s in window)
    held_rank_s = sum(max(0.0, s.rollout_ranks * s.duration_s - s.rollout_idle_rank_s) for s in window)
    busy_rank_s = sum(s.rollout_busy_rank_s for s in window) or held_rank_s  # engines' busy time not measured
    consumed = sum(s.consumed_tokens for s in window)
    trainer_busy = [trainer_work_s(s) for s in window]
    if produced <= 0 or busy_rank_s <= 0 or consumed <= 0 or sum(trainer_busy) <= 0:
        return None
    per_group = signals.tokens_per_group or consumed / max(1, limits.groups_ideal * len(window))
    times = signals.stage_times
    mb = float(signals.micro_batch_tokens)
    waits: tuple[float, ...] = ()
    residuals: tuple[float, ...] = ()
    per_actor = None
    if times is not None:  # each step's wait for arrivals beyond what its readiness shows, and its rest
        for s in window:
            end = ready_compute_s(s, s.actor_ranks, s.ref_ranks, times, mb)
            shown = end - _compute_s(s.consumed_tokens, s.actor_ranks, s.ref_ranks, times, mb)
            wait = min(max(0.0, s.trainer_wait_s - shown), max(0.0, s.duration_s - end))
            waits += (wait,)
            residuals += (max(0.0, s.duration_s - end - wait - coordination_s(s.ref_ranks, limits.decoupled_step_s)),)
    else:
        per_actor = consumed / sum(b * max(1, s.actor_ranks) for s, b in zip(window, trainer_busy))
    latency = signals.group_latency_s if signals.group_latency_s and signals.group_latency_s > 0 else None
    last = window[-1]
    total_s = sum(s.duration_s for s in window)
    env = min(signals.group_env_s or 0.0, latency or 0.0)
    slots = "slot_bound" not in limits.ablate
    slot = task_times(window)
    inflight = inflight_bound(limits.groups_ideal, limits.max_staleness, signals.inflight_cap)
    memory = signals.gen_latency_by_rollout if "latency_memory" not in limits.ablate else ()
    model = RateModel(
        limits=limits, window=window, stage_times=times, supply_tok_s_per_rank=produced / busy_rank_s,
        little_tokens=(inflight - limits.groups_ideal / 2) * per_group, tokens_per_group=per_group,
        micro_batch_tokens=mb, group_latency_s=latency, group_env_s=env,
        gen_curve=gen_latency_curve(memory, last.rollout_ranks,
                                    max(0.0, (latency or 0.0) - env - (signals.slot_wait_s if slots else 0.0))),
        busy_rollout=min(last.rollout_ranks, held_rank_s / total_s) if total_s > 0 else float(last.rollout_ranks),
        trainer_busy_share=min(1.0, sum(trainer_busy) / total_s) if total_s > 0 else 1.0,
        consumed_tok_s_per_actor=per_actor, waits_s=waits, residuals_s=residuals,
        task_slot_s=slot[0] if slot is not None else None, task_env_s=min(slot[1], slot[0]) if slot else 0.0,
        rank_groups=limits.rank_tasks / limits.group_size if limits.rank_tasks and slots else math.inf,
        inflight_groups=inflight)
    own = Split(last.rollout_ranks, last.actor_ranks, last.ref_ranks, 0)
    return replace(model, window_supply_tok_s=_supply_tok_s(own, model, host_factor(own, model)))


def trainer_work_s(step: StepObservation) -> float:
    """The seconds of a step the trainer did not wait for data."""
    return step.duration_s - min(step.trainer_wait_s, step.duration_s)


def gen_latency_curve(points: tuple[tuple[int, float], ...], rollout_now: int,
                      gen_now_s: float) -> tuple[tuple[int, float], ...]:
    """The measured (rollout ranks, L_gen) points with the current split's measurement in, ascending."""
    curve = {n: g for n, g in points if n >= 1}
    if rollout_now >= 1:
        curve[rollout_now] = gen_now_s
    return tuple(sorted(curve.items()))


def gen_latency_at(rollout: int, curve: tuple[tuple[int, float], ...],
                   fixed_share: float = FIXED_SHARE_PRIOR) -> float:
    """L_gen with `rollout` ranks from the measured (ranks, L_gen): measured where measured, linear in 1 / n
    between two counts, fully 1 / n below the fewest; above the most, the slope of the two largest counts, or
    with one count `fixed_share` of it fixed."""
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
    if len(lower) >= 2:  # never rising with more ranks
        n_a, g_a = lower[-2]
        slope = max(0.0, (g_a - g0) / (1 / n_a - 1 / n0))
        return max(0.0, g0 - slope * (1 / n0 - 1 / rollout))
    return g0 * (fixed_share + (1 - fixed_share) * n0 / rollout)


def host_factor(split: Split, model: RateModel) -> float:
    """How much faster (> 1) or slower each busy rank of `split` runs than in the window, on a shared host."""
    host = model.limits.host
    if host is None:
        return 1.0
    last = model.last
    now = host.speed(model.busy_rollout, _busy_trainer_ranks(last.actor_ranks, last.ref_ranks, model))
    if split.rollout <= last.rollout_ranks:
        busy_rollout = min(float(split.rollout), model.busy_rollout)
    else:
        busy_rollout = model.busy_rollout * split.rollout / max(1, last.rollout_ranks)
    return host.speed(busy_rollout, _busy_trainer_ranks(split.actors, split.refs, model)) / now


def _busy_trainer_ranks(actors: int, refs: int, model: RateModel) -> float:
    """Trainer ranks computing on average over the window, had it run `actors` and `refs`: each step's compute
    with every micro-batch ready holds them (without stage times, the window's busy share of each)."""
    times = model.stage_times
    total = sum(o.duration_s for o in model.window)
    if times is None or total <= 0:
        return model.trainer_busy_share * (actors + refs)
    span = sum(_compute_s(o.consumed_tokens, actors, refs, times, model.micro_batch_tokens) for o in model.window)
    return min(1.0, span / total) * (actors + refs)


def latency_s(rollout: int, model: RateModel, factor: float = 1.0) -> float | None:
    """A group's predicted latency with `rollout` ranks at `factor` of the window's speed (None: not measured)."""
    if model.group_latency_s is None or rollout < 1:
        return None
    gen = gen_latency_at(rollout, model.gen_curve)
    if rollout not in dict(model.gen_curve):  # a count measured ran at its own speed
        gen /= factor
    return model.group_env_s + gen


def _tail_s(actors: int, refs: int, times: StageTimes | None) -> float:
    """The trainer's work on the step's last micro-batch once it arrives."""
    if times is None or actors < 1:
        return 0.0
    if refs >= 1:
        return math.ceil(actors / refs) * times.t_ref_s + times.t_act_f_s + times.t_act_b_s
    return 2 * times.t_swap_s + times.t_ref_s + times.t_act_f_s + times.t_act_b_s


def concurrency_share(rollout: int, model: RateModel) -> float:
    """Share of the groups in flight that `rollout` ranks can play at once (at most 1)."""
    if model.inflight_groups <= 0 or math.isinf(model.rank_groups):
        return 1.0
    return min(1.0, rollout * model.rank_groups / model.inflight_groups)


def _supply_tok_s(split: Split, model: RateModel, f: float) -> float:
    """The split's supply at `f` of the window's speed: Little's law over the groups in flight, each holding its
    place for its latency, the trainer's tail and overhead; at most what its task slots play."""
    latency = latency_s(split.rollout, model, f)
    if latency is not None and latency > 0:
        held = (latency + (model.overhead_s + _tail_s(split.actors, split.refs, model.stage_times)) / f
                + coordination_s(split.refs, model.limits.decoupled_step_s))
        return min(model.little_tokens / held, slot_tok_s(split.rollout, model, f))
    return split.rollout * model.supply_tok_s_per_rank * f


def slot_tok_s(rollout: int, model: RateModel, f: float = 1.0) -> float:
    """The most `rollout` ranks' task slots play, each held for a task's measured time in one (inf: no bound)."""
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
    if times is not None:  # each window step priced on the split, its arrivals `slower` times later
        slower = model.window_supply_tok_s / supply if model.window_supply_tok_s > 0 and supply > 0 else 1.0
        at_f = StageTimes(t_ref_s=times.t_ref_s / f, t_act_f_s=times.t_act_f_s / f, t_act_b_s=times.t_act_b_s / f,
                          t_swap_s=times.t_swap_s / f)
        coordination = coordination_s(split.refs, model.limits.decoupled_step_s)
        total = sum(ready_compute_s(o, split.actors, split.refs, at_f, model.micro_batch_tokens, slower)
                    + wait * slower + rest / f + coordination
                    for o, wait, rest in zip(model.window, model.waits_s, model.residuals_s))
        demand = sum(o.consumed_tokens for o in model.window) / total if total > 0 else math.inf
        return supply, demand, min(supply, demand)
    step_tokens = model.limits.groups_ideal * model.tokens_per_group
    step_s = step_tokens / (model.consumed_tok_s_per_actor * split.actors * f)  # type: ignore[operator]
    demand = step_tokens / step_s if step_s > 0 else math.inf
    return supply, demand, min(supply, demand)


def describe(signals: ErsSignals, limits: ErsLimits, roles: Sequence[Role]) -> dict[str, float] | None:
    """The model's view of the split `roles`, for logs and metrics (trajectory tokens per second)."""
    model = estimate(signals, limits)
    if model is None:
        return None
    supply, demand, trained = predict_tok_s(split_of(roles), model)
    return {"supply_tok_s": supply, "demand_tok_s": demand, "predicted_trained_tok_s": trained}


def coordination_s(refs: int, decoupled_step_s: float) -> float:
    """A step's decoupled coordination: `decoupled_step_s` with ref ranks, else 0."""
    return decoupled_step_s if refs > 0 else 0.0


def readiness(step: StepObservation, actors: int, per_actor_mb: float) -> list[float]:
    """The ready times of `step`'s micro-batches had `actors` actor ranks consumed it: as many ready at the start
    as the tokens of its RAS fill, the rest at the token rate its TPRM measured."""
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
    """:func:`step_compute_s` of `step` on `actors` and `refs` with its measured readiness, arrivals `slower`."""
    return step_compute_s([a * slower for a in readiness(step, actors, per_actor_mb)], actors, refs, times)


def _compute_s(tokens: float, actors: int, refs: int, times: StageTimes, per_actor_mb: float) -> float:
    """The compute of a step of `tokens` with every micro-batch ready at the start."""
    if tokens <= 0 or actors < 1:
        return 0.0
    return step_compute_s([0.0] * max(1, math.ceil(tokens / (per_actor_mb * actors))), actors, refs, times)


def step_compute_s(ready: Sequence[float], actors: int, refs: int, times: StageTimes) -> float:
    """The trainer's compute for micro-batches ready at `ready`: colocated, the RA2P cost model's aggregation;
    decoupled, each micro-batch a period after the previous, and no sooner than its ref shares and actor work
    after its arrival."""
    if refs < 1:
        return colocated_cost_s(ready, times)
    work = times.t_act_f_s + times.t_act_b_s
    period = max(work, actors * times.t_ref_s / refs)
    latency = math.ceil(actors / refs) * times.t_ref_s + work
    end = 0.0
    for a in sorted(ready):
        end = max(end + period, max(a, 0.0) + latency)
    return end
