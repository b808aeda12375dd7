"""Continuous Task Batching (CTB): task-level admission, pausing and resumption
on one rollout rank (paper section 4, Algorithm 1, Table 1).

Pure: no torch, no database, no HTTP, no processes. The rollout rank (and the
simulator) describes its state as a :class:`RankView` plus the candidate new
groups and the admission limits; :func:`decide` returns which tasks to pause,
resume and admit. The caller acts (aborts/parks requests, calls the env's
``/pause`` and ``/resume``, starts tasks) and calls again on the next turn.

Vocabulary
- A task is *resident* when its state is ``ACTIVE`` (generating) or
  ``WAITING_ENV`` (parked on an environment call with its KV context kept).
  Resident tasks count against the rank's token budget with their
  ``footprint_tokens`` (current context plus the room of the next generation).
- A ``PAUSED`` task holds no budget; its KV context may be evicted.
- Priority (Table 1): ``P = w_eval * is_eval + w_group * group_completion
  + w_active * is_active + w_context * context_tokens / context_scale_tokens``.
  The default weights make the terms tiers: evaluation > group completion
  > actively generating > context length.
- *Affinity*: a paused task is resumed first on the rank it was paused on
  (``is_home``), or on a rank where tasks of its group are resident (their
  shared prompt prefix is likely cached there).

Invariants (each has a test in tests/test_policy_ctb.py)
1. Budget: after the decision the resident footprint is <= ``budget_tokens``.
2. Lowest priority first: no task left resident has a lower priority than a
   task this decision pauses.
3. Exclusive phases: a decision that pauses anything resumes and admits
   nothing (no pause/resume thrash inside one decision).
4. Resume before admit: a decision admits a new task only if every paused task
   that could ever fit this rank (footprint <= budget) is resumed by it.
5. Resume order: resumed tasks are a prefix of the paused tasks sorted by
   (affinity, priority); resumption stops at the first one that does not fit.
6. Admission limits: resident tasks after the decision never exceed
   ``max_resident_tasks`` (environment concurrency) through resumes or admits,
   and admitted training tasks never exceed ``staleness_task_allowance``;
   evaluation tasks are exempt from the staleness allowance.
7. Fit: every admitted task's probed footprint fitted the headroom left when
   it was admitted.
8. Candidate order: evaluation groups first; training groups by task-type
   diversity (the type least resident on the rank), then input order; the
   admitted tasks are a prefix of that order (a group that does not fit
   blocks later ones, so big groups are not starved).
9. Disjoint: no task id appears in more than one output list, and each id
   names a task in the matching input state.
10. Pure: equal inputs give equal outputs; inputs are frozen and unchanged.
11. ``budget_bound`` is set iff the decision pauses tasks, or a resume or an admission stopped because
    the next task would not fit the budget (not the cap, not the staleness allowance). The adaptive
    budget (tiderl.policy.ctb_budget) grows only while it binds.
12. Spread (:func:`claim_limit`): a rank never claims beyond its free slots, nor past its share
    ceil(in_flight / ranks) of the tasks in flight; ranks that claim up to their limits in turn
    claim every task in flight (the shares add up to at least ``in_flight``).

Claims. Which rank holds which task is decided before CTB's pass, when a rank claims tasks
(from the run store, or the simulator's pool): :func:`claim_limit`. Without it the first rank to
claim after a release takes every task its free slots allow (hundreds where ``max_concurrency``
is the paper's 1024) while the others idle; the per-rank budget then never binds and the tasks
queue on one engine.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = [
    "AdmissionLimits",
    "CandidateGroup",
    "CtbDecision",
    "CtbTask",
    "PriorityWeights",
    "RankView",
    "TaskState",
    "claim_limit",
    "decide",
    "priority",
]


class TaskState(enum.Enum):
    ACTIVE = "active"
    """Generating on the engine (prefill or decode); resident."""
    WAITING_ENV = "waiting_env"
    """Waiting for the environment's observation; resident (context kept)."""
    PAUSED = "paused"
    """Parked by CTB; holds no budget; its context may be evicted."""


@dataclass(frozen=True, slots=True)
class PriorityWeights:
    """Weights of the priority score (Table 1). Defaults make the terms tiers
    for groups of up to 8 tasks: one task of group progress (>= 1/8 * 100)
    outweighs being active (10) plus any context (<= 1)."""

    eval: float = 1000.0
    group_completion: float = 100.0
    active: float = 10.0
    context: float = 1.0
    context_scale_tokens: int = 8192
    """Context length that scores ``context`` (the task's context limit)."""

    def __post_init__(self) -> None:
        if self.context_scale_tokens <= 0:
            raise ValueError(f"context_scale_tokens: must be > 0, got {self.context_scale_tokens}")


@dataclass(frozen=True, slots=True)
class CtbTask:
    """A task the rank owns (resident or paused) or may resume (an orphan)."""

    task_id: Hashable
    group_id: Hashable
    state: TaskState
    footprint_tokens: int
    """KV tokens the task holds when resident: context + room for the next generation."""
    context_tokens: int
    """Current context length (prompt + all turns so far)."""
    is_eval: bool = False
    group_completion: float = 0.0
    """Finished tasks of its GRPO group / group size, in [0, 1]."""
    task_type: str = ""
    is_home: bool = True
    """Paused tasks: True if paused on this rank; False for an orphan whose rank left rollout."""


@dataclass(frozen=True, slots=True)
class CandidateGroup:
    """A new group (or the rest of one) the rank may admit tasks from."""

    group_id: Hashable
    task_ids: tuple[Hashable, ...]
    probed_footprint_tokens: int
    """First-turn footprint of one task of the group, measured by a probe task."""
    is_eval: bool = False
    task_type: str = ""


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_resident_tasks: int | None = None
    """Resident tasks this rank may hold (its share of the environment concurrency cap). None: no cap."""
    staleness_task_allowance: int | None = None
    """Training tasks that may still start without exceeding the staleness bound. None: unbounded."""


@dataclass(frozen=True, slots=True)
class RankView:
    budget_tokens: int
    """The rank's KV token budget."""
    tasks: tuple[CtbTask, ...]


@dataclass(frozen=True, slots=True)
class CtbDecision:
    pause: tuple[Hashable, ...] = ()
    resume: tuple[Hashable, ...] = ()
    admit: tuple[Hashable, ...] = ()
    resident_tokens: int = 0
    """Resident footprint after the decision (admitted tasks at their probed footprint)."""
    budget_bound: bool = False
    """The budget held a task back: tasks were paused, or a resume or admission waited for room."""


def priority(task: CtbTask, weights: PriorityWeights) -> float:
    """The Table 1 priority score of ``task``; higher stays resident longer."""
    return (
        weights.eval * task.is_eval
        + weights.group_completion * task.group_completion
        + weights.active * (task.state is TaskState.ACTIVE)
        + weights.context * min(1.0, task.context_tokens / weights.context_scale_tokens)
    )


def decide(
    rank: RankView,
    candidates: Sequence[CandidateGroup] = (),
    limits: AdmissionLimits = AdmissionLimits(),
    weights: PriorityWeights = PriorityWeights(),
) -> CtbDecision:
    """One CTB scheduling pass on one rank: pause when over budget, otherwise
    resume paused tasks, then admit new ones. See the module invariants."""
    resident = [t for t in rank.tasks if t.state is not TaskState.PAUSED]
    used = sum(t.footprint_tokens for t in resident)

    if used > rank.budget_tokens:
        # Pause the lowest-priority resident tasks until the rest fit.
        order = sorted(range(len(resident)), key=lambda i: (priority(resident[i], weights), -i))
        paused: list[Hashable] = []
        for i in order:
            if used <= rank.budget_tokens:
                break
            paused.append(resident[i].task_id)
            used -= resident[i].footprint_tokens
        return CtbDecision(pause=tuple(paused), resident_tokens=used, budget_bound=True)

    cap = limits.max_resident_tasks
    num_resident = len(resident)
    resident_groups = {t.group_id for t in resident}

    # Resume: home tasks and tasks whose group is resident here first, then priority.
    waiting = [t for t in rank.tasks if t.state is TaskState.PAUSED]
    waiting.sort(
        key=lambda t: (not (t.is_home or t.group_id in resident_groups), -priority(t, weights))
    )
    resumed: list[Hashable] = []
    blocked = False
    for t in waiting:
        if t.footprint_tokens > rank.budget_tokens:
            continue  # can never fit this rank; must not block it forever
        if (cap is not None and num_resident >= cap) or used + t.footprint_tokens > rank.budget_tokens:
            blocked = True
            by_budget = used + t.footprint_tokens > rank.budget_tokens
            break
        resumed.append(t.task_id)
        used += t.footprint_tokens
        num_resident += 1
    if blocked:
        return CtbDecision(resume=tuple(resumed), resident_tokens=used, budget_bound=by_budget)

    # Admit: evaluation first, then the task type least resident here, then input order.
    resumed_ids = set(resumed)
    type_counts = Counter(t.task_type for t in resident)
    type_counts.update(t.task_type for t in waiting if t.task_id in resumed_ids)
    ordered = sorted(
        range(len(candidates)),
        key=lambda i: (
            not candidates[i].is_eval,
            0 if candidates[i].is_eval else type_counts[candidates[i].task_type],
            i,
        ),
    )
    allowance = limits.staleness_task_allowance
    admitted: list[Hashable] = []
    by_budget = False
    for i in ordered:
        group = candidates[i]
        stop = False
        for task_id in group.task_ids:
            if cap is not None and num_resident >= cap:
                stop = True
            elif not group.is_eval and allowance is not None and allowance <= 0:
                stop = True
            elif used + group.probed_footprint_tokens > rank.budget_tokens:
                stop = by_budget = True
            if stop:
                break
            admitted.append(task_id)
            used += group.probed_footprint_tokens
            num_resident += 1
            if not group.is_eval and allowance is not None:
                allowance -= 1
        if stop:
            break
    return CtbDecision(resume=tuple(resumed), admit=tuple(admitted), resident_tokens=used, budget_bound=by_budget)


def claim_limit(free_slots: int, held: int, in_flight: int, ranks: int) -> int:
    """Tasks a rollout rank may claim now: up to its `free_slots`, and up to its share of the tasks in
    flight, ceil(`in_flight` / `ranks`) less the `held` tasks it has (in flight: held by any rollout rank
    or waiting to be claimed; `ranks`: the rollout ranks alive). Without a rank count, the free slots."""
    if ranks < 1:
        return max(0, free_slots)
    share = -(-max(0, in_flight) // ranks)
    return max(0, min(free_slots, share - held))
