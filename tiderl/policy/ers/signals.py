"""The inputs of the ERS planner, built from one snapshot of the run: the only
way the real control plane (:mod:`tiderl.run.control`) and the simulator
(:mod:`tiderl.sim.ers_boundary`) make :class:`~tiderl.policy.ers.ErsSignals` and
:class:`~tiderl.policy.ers.ErsLimits`.

Pure: no torch, no database, no HTTP, no processes. Each mechanism measures
the same few things (the buffer now, each finished step, the stage times) and
hands them over as an :class:`ErsSnapshot`; every definition (RAS, the
micro-batches of a step, idle rollout ranks, the rate window) lives here once.

Definitions
- A micro-batch is the global unit the actor group consumes:
  ``micro_batch_tokens`` x the actor ranks (as in :mod:`tiderl.policy.ra2p`).
  RAS counts the *full* micro-batches the ready trajectories make now:
  ``ready_tokens // (micro_batch_tokens x actors)``.
- The micro-batches of a full step: ``ceil(consumed_tokens / (micro_batch_tokens
  x actors of that step))`` of the last step.
- Idle rollout ranks: rollout rank-seconds with no task to play (the staleness
  bound or an empty pool) during the last step, over its duration.
- The rate window: the trailing steps that ran on the current split (the
  role map of the last step) since the last evaluation step, without the
  first of them (its groups were mostly generated on the split before, or
  delayed by the evaluation), at most ``history_steps``. A step during which
  an evaluation ran (``StepObservation.evaluation``) is in no window: its
  waits and latencies are the evaluation's. The rate
  planner (:mod:`tiderl.policy.ers.model`) estimates its rates from them, so a
  split is judged only once it has been measured (``MIN_WINDOW_STEPS``
  settled steps). Group latency, environment time and tokens are the means
  over the groups that completed in the window.
- Task slots: a rollout rank holds at most ``rank_tasks`` tasks. A group's
  latency counts from its creation, so where released tasks queued for a
  slot it holds that queueing: a measure of the slots, not of the engines.
  The slot wait (``slot_wait_s``) of a group is the mean wait of its tasks
  from the group's creation to their claim (``task_wait_sum_s``), at most its
  latency beyond its environment time less a task's own time in its slot
  beyond its environment time (the means over the completed tasks of their
  seconds in a slot and in their environment, :func:`task_times`); 0 where
  not measured.
- The latency memory (``gen_latency_by_rollout``): per rollout-rank count, the
  generation latency (a group's latency beyond its environment time and its
  slot wait) of the newest settled run of steps on that count, scaled by the tokens of a group
  in the window over the tokens of a group in that run (a group's generation
  time grows with its work; tasks that grow or shrink over the run must not
  make an earlier split look slower or faster than it is).
- The walk: while the current split's window is shorter than
  ``MIN_WINDOW_STEPS``, the signals of the snapshot cut after the newest
  earlier split with a full window (what the planner saw when it last
  measured): the rate planner may go on toward the split it predicted from
  them, one step at a time, without waiting for a measurement of each split
  on the way.

Invariants (tests/test_policy_ers_signals.py)
1. Equal snapshots give equal signals (the run and the simulator agree when
   they measured the same).
2. RAS, the micro-batches per step and the idle ranks follow the definitions
   above; with no actor rank RAS is 0.
3. No step history: cold start (empty ``step_history_s``), no TPRM.
4. The window holds at most ``history_steps`` steps, the newest last, all on
   the split of the last step, never the first step on that split or after
   an evaluation step, never a step of the pipeline fill or an evaluation
   step; the same holds for the runs of steps the latency memory
   (``gen_latency_by_rollout``) reads.
5. ``walk`` is None when the window has ``MIN_WINDOW_STEPS`` steps or more,
   or no earlier split of the steady steps had; otherwise it equals the
   signals of the snapshot whose steps end with that split's last step, and
   its own ``walk`` is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tiderl.policy.ers.inputs import ErsLimits, ErsSignals, StepObservation
from tiderl.policy.ers.outputs import ErsReason
from tiderl.policy.ra2p import StageTimes
from tiderl.roles import Role

HISTORY_FACTOR = 10  # steps a mechanism hands over: this many times history_steps (the latency memory)
MIN_WINDOW_STEPS = 2  # settled steps on a split before the rate planner judges it (one step is mostly noise)

__all__ = ["HISTORY_FACTOR", "MIN_WINDOW_STEPS", "ErsSnapshot", "EvaluationMemory", "StepObservation",
           "build_signals", "evaluation_steps", "gen_latency_by_rollout", "rate_window", "slot_wait_s", "task_times"]


@dataclass(frozen=True, slots=True)
class ErsSnapshot:
    """What a mechanism measured at a sync boundary, before planning the next version."""

    roles: tuple[Role, ...]
    """The role map in force during the step that just ended."""
    micro_batch_tokens: int
    """trainer.micro_batch_tokens: tokens of one actor rank's share of a micro-batch."""
    ready_tokens: int
    """Tokens of the trajectories ready for the trainer now."""
    ready_groups: int
    """Complete groups ready now."""
    oldest_ready_age_s: float | None
    """Age of the oldest ready trajectory now (None: nothing ready)."""
    steps: tuple[StepObservation, ...] = ()
    """The finished steps, oldest first (the last ``HISTORY_FACTOR`` x ``history_steps`` or more: the
    latency of earlier splits is read from them)."""
    is_eval_open: bool = False
    """An evaluation starts with the next version or is still running."""
    fetch_groups: int | None = None
    """The fetch size the last step used (None: groups_ideal)."""
    last_rollout_change: int = 0
    """Rollout ranks added (+) or removed (-) by the previous plan."""
    stage_times: StageTimes | None = None
    """Per-share RA2P stage times measured on the actor group (None: not measured yet)."""
    fill_steps: int = 0
    """The first steps of the run, while the pipeline fills ((staleness + 1) batches released at once):
    their rates and latencies say nothing of the steady state, and the rate window leaves them out."""
    pre_evaluation_roles: tuple[Role, ...] | None = None
    """The role map the running evaluation's preemptive plan replaced (:class:`EvaluationMemory`)."""
    engine_ranks: frozenset[int] | None = None
    """Ranks whose rollout engine is up now, in the role map's order (None: not tracked)."""
    inflight_cap: int | None = None
    """ERS's adaptive admission cap the feed keeps now (``admission.inflight_cap``, decided with the previous
    plan; None: no cap, the staleness bound's)."""


@dataclass(slots=True)
class EvaluationMemory:
    """The role map an evaluation's preemptive plan replaced, kept until the evaluation is over, so that
    its end can put the ranks back (the one piece of planning state a mechanism carries between
    boundaries; the control plane and the simulator each keep one and hand it over in the snapshot)."""

    roles: tuple[Role, ...] | None = None

    def note(self, before: tuple[Role, ...], reason: ErsReason) -> None:
        """After each plan: keep the map an evaluation plan replaced, forget it after any other plan."""
        if reason is ErsReason.EVALUATION:
            if self.roles is None:
                self.roles = before
        else:
            self.roles = None


def build_signals(snapshot: ErsSnapshot, history_steps: int) -> ErsSignals:
    """The ERS signals of one snapshot (see the module definitions)."""
    if history_steps < 1:
        raise ValueError(f"history_steps: must be >= 1, got {history_steps}")
    mb = snapshot.micro_batch_tokens
    if mb < 1:
        raise ValueError(f"micro_batch_tokens: must be >= 1, got {mb}")
    actors = sum(1 for r in snapshot.roles if r is Role.ACTOR)
    recent = snapshot.steps[-history_steps:]
    last = recent[-1] if recent else None
    steady = tuple(s for s in snapshot.steps if s.version > snapshot.fill_steps)
    window = rate_window(steady, history_steps)
    known = steady[-HISTORY_FACTOR * history_steps:]
    groups = sum(s.groups_completed for s in window)
    per_step = 0
    idle = 0.0
    if last is not None:
        per_step = max(1, math.ceil(last.consumed_tokens / (mb * max(1, last.actor_ranks))))
        idle = last.rollout_idle_rank_s / last.duration_s if last.duration_s > 0 else 0.0
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
        microbatches_per_step=per_step,
        rollout_idle_ranks=idle,
        window=window,
        group_latency_s=sum(s.group_latency_sum_s for s in window) / groups if groups else None,
        tokens_per_group=sum(s.produced_tokens for s in window) / groups if groups else None,
        group_env_s=sum(s.group_env_sum_s for s in window) / groups if groups else None,
        gen_latency_by_rollout=gen_latency_by_rollout(known, sum(s.produced_tokens for s in window) / groups
                                                      if groups else None),
        slot_wait_s=slot_wait_s(window),
        micro_batch_tokens=mb,
        pre_evaluation_roles=None if snapshot.is_eval_open else snapshot.pre_evaluation_roles,
        engine_ranks=snapshot.engine_ranks,
        evaluation_steps=evaluation_steps(steady),
        inflight_cap=snapshot.inflight_cap,
        walk=_walk(snapshot, steady, history_steps) if len(window) < MIN_WINDOW_STEPS else None,
    )


def _walk(snapshot: ErsSnapshot, steady: tuple[StepObservation, ...], history_steps: int) -> ErsSignals | None:
    """The signals of the snapshot cut after the newest earlier split of `steady` with a full rate window."""
    i = len(steady)
    while i > 0:
        j = _run_start(steady, i)
        if i < len(steady) and not steady[i - 1].evaluation and i - j - 1 >= MIN_WINDOW_STEPS:
            cut = len(snapshot.steps) - (len(steady) - i)  # steady is a suffix of the snapshot's steps
            # That split's window is full, so these signals carry no walk of their own (invariant 5).
            return build_signals(replace(snapshot, steps=snapshot.steps[:cut]), history_steps)
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
    """(seconds in a task slot, environment seconds) of a task completed in `steps`, means (None: not
    measured)."""
    tasks = sum(s.tasks_completed for s in steps)
    held = sum(s.task_slot_sum_s for s in steps)
    if tasks < 1 or held <= 0:
        return None
    return held / tasks, sum(s.task_env_sum_s for s in steps) / tasks


def slot_wait_s(steps: tuple[StepObservation, ...]) -> float:
    """The mean seconds a group completed in `steps` waited for task slots (see the module definitions)."""
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
    """Per rollout-rank count, the mean group latency beyond the environment's and the slot wait
    (:func:`slot_wait_s`) over the newest settled run of steps with that count (a run of steps on one
    split, less its first step), ascending by count.

    With `tokens_per_group` (the current window's), each run's latency is scaled by the work of a group
    now over the work of a group then (tokens per completed group): a group's generation time grows
    with its turns and tokens, and a workload whose tasks grow or shrink over the run would otherwise make
    the split measured earlier look slower or faster for the workload's sake, not the split's."""
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


def _split(step: StepObservation) -> tuple[int, int, int] | None:
    """The run a step belongs to: its split; None for an evaluation step (a run of its own)."""
    return None if step.evaluation else (step.rollout_ranks, step.actor_ranks, step.ref_ranks)


def _run_start(steps: tuple[StepObservation, ...], end: int) -> int:
    """The index of the first step of the run that ends at steps[end - 1]: the steps before it on the same
    split with no evaluation step between (an evaluation step is a run by itself)."""
    j = end - 1
    if steps[j].evaluation:
        return j
    while j > 0 and _split(steps[j - 1]) == _split(steps[end - 1]):
        j -= 1
    return j


def rate_window(steps: tuple[StepObservation, ...], history_steps: int) -> tuple[StepObservation, ...]:
    """The trailing steps on the last step's split since the last evaluation step, less the first of them, at
    most `history_steps` (none when the last step is an evaluation step)."""
    if not steps or steps[-1].evaluation:
        return ()
    settled = steps[_run_start(steps, len(steps)) + 1:]
    return tuple(settled[-history_steps:])
