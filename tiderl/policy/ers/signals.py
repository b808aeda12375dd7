"""The planner's signals, built from one snapshot of the run: the only way the control plane
(tiderl.run.control) and the simulator (tiderl.sim.ers_boundary) make :class:`ErsSignals`. The definitions
(RAS, the rate window, the slot wait, the walk) are in docs/ers.md, "Signals".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tiderl.policy.ers.inputs import ErsSignals, StepObservation
from tiderl.policy.ers.outputs import ErsReason, count
from tiderl.policy.ra2p import StageTimes
from tiderl.roles import Role

HISTORY_FACTOR = 10  # steps a mechanism hands over: this many times history_steps
MIN_WINDOW_STEPS = 2  # settled steps on a split before the rate planner judges it (one step is mostly noise)

__all__ = ["HISTORY_FACTOR", "MIN_WINDOW_STEPS", "ErsSnapshot", "EvaluationMemory", "build_signals",
           "evaluation_steps", "gen_latency_by_rollout", "rate_window", "slot_wait_s", "task_times"]


@dataclass(frozen=True, slots=True)
class ErsSnapshot:
    """What a mechanism measured at a sync boundary, before planning the next version."""

    roles: tuple[Role, ...]  # the role map of the step that just ended
    micro_batch_tokens: int  # trainer.micro_batch_tokens: one actor rank's share of a micro-batch
    ready_tokens: int  # tokens of the trajectories ready for the trainer now
    ready_groups: int
    oldest_ready_age_s: float | None  # None: nothing ready
    steps: tuple[StepObservation, ...] = ()  # the finished steps, oldest first (HISTORY_FACTOR x history_steps)
    is_eval_open: bool = False  # an evaluation starts with the next version or is still running
    fetch_groups: int | None = None
    last_rollout_change: int = 0
    stage_times: StageTimes | None = None
    fill_steps: int = 0  # the first steps, while the pipeline fills: no window reads them
    pre_evaluation_roles: tuple[Role, ...] | None = None  # held by an EvaluationMemory
    engine_ranks: frozenset[int] | None = None
    inflight_cap: int | None = None


@dataclass(slots=True)
class EvaluationMemory:
    """The role map an evaluation's plan replaced, kept until the evaluation is over (the one piece of
    planning state a mechanism carries between boundaries)."""

    roles: tuple[Role, ...] | None = None

    def note(self, before: tuple[Role, ...], reason: ErsReason) -> None:
        """After each plan: keep the map an evaluation plan replaced, forget it after any other plan."""
        if reason is not ErsReason.EVALUATION:
            self.roles = None
        elif self.roles is None:
            self.roles = before


def build_signals(snapshot: ErsSnapshot, history_steps: int) -> ErsSignals:
    """The signals of one snapshot."""
    if history_steps < 1:
        raise ValueError(f"history_steps: must be >= 1, got {history_steps}")
    mb = snapshot.micro_batch_tokens
    if mb < 1:
        raise ValueError(f"micro_batch_tokens: must be >= 1, got {mb}")
    actors = count(snapshot.roles, Role.ACTOR)
    recent = snapshot.steps[-history_steps:]
    last = recent[-1] if recent else None
    steady = tuple(s for s in snapshot.steps if s.version > snapshot.fill_steps)
    fill = tuple(s for s in snapshot.steps if s.version <= snapshot.fill_steps)
    window = rate_window(steady, history_steps, fill[-1] if fill else None)
    groups = sum(s.groups_completed for s in window)
    tokens = sum(s.produced_tokens for s in window) / groups if groups else None

    def per_group(total: float) -> float | None:
        return total / groups if groups else None

    return ErsSignals(
        ras_microbatches=snapshot.ready_tokens // (mb * actors) if actors else 0,
        ready_groups=snapshot.ready_groups,
        hol_latency_s=max(0.0, snapshot.oldest_ready_age_s or 0.0),
        tprm_s=last.tprm_s if last is not None else None,
        step_history_s=tuple(s.duration_s for s in recent if s.duration_s > 0),
        is_eval_next=snapshot.is_eval_open,
        fetch_groups=snapshot.fetch_groups,
        last_rollout_change=snapshot.last_rollout_change,
        stage_times=snapshot.stage_times,
        microbatches_per_step=max(1, math.ceil(last.consumed_tokens / (mb * max(1, last.actor_ranks)))) if last else 0,
        rollout_idle_ranks=last.rollout_idle_rank_s / last.duration_s if last and last.duration_s > 0 else 0.0,
        window=window,
        group_latency_s=per_group(sum(s.group_latency_sum_s for s in window)),
        tokens_per_group=tokens,
        group_env_s=per_group(sum(s.group_env_sum_s for s in window)),
        slot_wait_s=slot_wait_s(window),
        gen_latency_by_rollout=gen_latency_by_rollout(steady[-HISTORY_FACTOR * history_steps:], tokens),
        micro_batch_tokens=mb,
        pre_evaluation_roles=None if snapshot.is_eval_open else snapshot.pre_evaluation_roles,
        engine_ranks=snapshot.engine_ranks,
        evaluation_steps=evaluation_steps(steady),
        inflight_cap=snapshot.inflight_cap,
        walk=_walk(snapshot, steady, history_steps) if len(window) < MIN_WINDOW_STEPS else None,
    )


def _walk(snapshot: ErsSnapshot, steady: tuple[StepObservation, ...], history_steps: int) -> ErsSignals | None:
    """The signals of the snapshot cut after the newest earlier split of `steady` with a full rate window (as
    :func:`rate_window` counts it: a run right after the fill keeps its first step)."""
    i = len(steady)
    while i > 0:
        j = _run_start(steady, i)
        if i < len(steady) and not steady[i - 1].evaluation and i - j >= MIN_WINDOW_STEPS:
            cut = len(snapshot.steps) - (len(steady) - i)  # steady is a suffix of the snapshot's steps
            measured = build_signals(replace(snapshot, steps=snapshot.steps[:cut]), history_steps)
            if len(measured.window) >= MIN_WINDOW_STEPS:
                return measured
        i = j
    return None


def evaluation_steps(steps: tuple[StepObservation, ...]) -> tuple[StepObservation, ...]:
    """The newest evaluation step of each rollout-rank count in `steps`, newest last."""
    newest: dict[int, StepObservation] = {}
    for s in steps:
        if s.evaluation:
            newest.pop(s.rollout_ranks, None)
            newest[s.rollout_ranks] = s
    return tuple(newest.values())


def task_times(steps: tuple[StepObservation, ...]) -> tuple[float, float] | None:
    """Means over the tasks completed in `steps`: (seconds in a task slot, environment seconds); None: not
    measured."""
    tasks = sum(s.tasks_completed for s in steps)
    held = sum(s.task_slot_sum_s for s in steps)
    if tasks < 1 or held <= 0:
        return None
    return held / tasks, sum(s.task_env_sum_s for s in steps) / tasks


def slot_wait_s(steps: tuple[StepObservation, ...]) -> float:
    """The mean seconds a group completed in `steps` waited for task slots: its tasks' mean wait, at most its
    latency beyond the environment's less a task's own time in its slot beyond the environment's."""
    groups = sum(s.groups_completed for s in steps)
    tasks = sum(s.tasks_completed for s in steps)
    times = task_times(steps)
    if not groups or times is None:
        return 0.0
    gen = sum(s.group_latency_sum_s - s.group_env_sum_s for s in steps) / groups
    wait = sum(s.task_wait_sum_s for s in steps) / tasks
    return max(0.0, min(wait, gen - max(0.0, times[0] - times[1])))


def gen_latency_by_rollout(steps: tuple[StepObservation, ...],
                           tokens_per_group: float | None = None) -> tuple[tuple[int, float], ...]:
    """The latency memory: per rollout-rank count, the mean group latency beyond the environment's and the slot
    wait over the newest settled run of steps on it, ascending; with `tokens_per_group` (the window's), scaled
    by a group's work now over its work then."""
    out: dict[int, float] = {}
    i = len(steps)
    while i > 0:
        j = _run_start(steps, i)
        settled = steps[j + 1:i] if not steps[i - 1].evaluation else ()
        groups = sum(s.groups_completed for s in settled)
        n = steps[i - 1].rollout_ranks
        if groups and n not in out:
            gen = max(0.0, sum(s.group_latency_sum_s - s.group_env_sum_s for s in settled) / groups
                      - slot_wait_s(settled))
            then = sum(s.produced_tokens for s in settled) / groups
            if tokens_per_group and then > 0:
                gen *= tokens_per_group / then
            out[n] = gen
        i = j
    return tuple(sorted(out.items()))


def _run_start(steps: tuple[StepObservation, ...], end: int) -> int:
    """The index of the first step of the run that ends at steps[end - 1]: the steps before it on the same
    split with no evaluation step between (an evaluation step is a run by itself)."""
    j = end - 1
    if steps[j].evaluation:
        return j
    split = (steps[j].rollout_ranks, steps[j].actor_ranks, steps[j].ref_ranks)
    while j > 0 and not steps[j - 1].evaluation and (
            steps[j - 1].rollout_ranks, steps[j - 1].actor_ranks, steps[j - 1].ref_ranks) == split:
        j -= 1
    return j


def rate_window(steps: tuple[StepObservation, ...], history_steps: int,
                before: StepObservation | None = None) -> tuple[StepObservation, ...]:
    """The trailing steps on the last step's split since the last evaluation step, less the first of them
    unless `before` (the step before `steps`: the fill's last) ran on that split without an evaluation, at most
    `history_steps` (none when the last step is an evaluation step)."""
    if not steps or steps[-1].evaluation:
        return ()
    j = _run_start(steps, len(steps))
    settled = j == 0 and before is not None and not before.evaluation and not steps[0].evaluation and (
        before.rollout_ranks, before.actor_ranks, before.ref_ranks) == (
        steps[0].rollout_ranks, steps[0].actor_ranks, steps[0].ref_ranks)
    return steps[j if settled else j + 1:][-history_steps:]
