"""CTB on the simulated rollout ranks (a part of :class:`tiderl.sim.rollout.RolloutSide`): a rank's
tasks and the pool's candidates seen as :func:`tiderl.policy.ctb.decide` sees them, the very function
the real rollout ranks call, under the rank's claim limit (:func:`tiderl.policy.ctb.claim_limit`);
its decisions applied (tasks paused, resumed, admitted); and the rank's KV budget judged on each
turn's prefix-cache hit, as the run's worker judges it, a new budget prompting a new decision.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tiderl.policy.ctb import (
    AdmissionLimits,
    CandidateGroup,
    CtbTask,
    PriorityWeights,
    RankView,
    TaskState,
    claim_limit,
    decide,
)
from tiderl.policy.ctb_budget import reprefill_cost
from tiderl.sim.costs import Costs
from tiderl.sim.rollout_ranks import RolloutRank, Schedule
from tiderl.sim.tasks import SimGroup, SimTask, Stage

_CTB_STATE = {
    Stage.STARTING: TaskState.WAITING_ENV,
    Stage.WAITING_ENV: TaskState.WAITING_ENV,
    Stage.ACTIVE: TaskState.ACTIVE,
    Stage.PAUSED: TaskState.PAUSED,
}


class CtbScheduling:
    """CTB's decisions on a rank, and its KV budget's judgement (a mixin of `RolloutSide`)."""

    costs: Costs
    schedule: Schedule
    block_tokens: int
    weights: PriorityWeights
    now: float
    ranks: dict[int, RolloutRank]
    tasks: dict[int, SimTask]
    candidates: deque[SimGroup]
    orphans: list[SimTask]
    env_active: int
    env_concurrency: int
    queued_tasks: Callable[[], int]
    _account: Callable[..., None]
    _pause: Callable[[float, SimTask], None]
    _place: Callable[[float, SimTask, RolloutRank], None]

    def _view(self, task: SimTask, is_home: bool) -> CtbTask:
        group = task.group
        completion = group.done / len(group.tasks)
        key = (task.stage, task.footprint, completion, is_home)
        if task.view is None or task.view_key != key:
            task.view = CtbTask(
                task_id=task.id,
                group_id=group.id,
                state=_CTB_STATE[task.stage],
                footprint_tokens=task.footprint,
                context_tokens=task.ctx,
                is_eval=task.is_eval,
                group_completion=completion,
                task_type=group.task_type,
                is_home=is_home,
            )
            task.view_key = key
        return task.view

    def _judge(self, rank: RolloutRank, task: SimTask, hit: float) -> None:
        """A turn starts on the engine: judge whether its context came back from the cache (the run's
        worker does the same with vLLM's cached-token count), once per turn."""
        if task.prefix > 0:
            before = rank.budget.budget_tokens
            engine = rank.engine  # what a re-prefilled token costs there now (the cost rule's input)
            n = engine.num_running
            cost = reprefill_cost(self.costs.prefill_s(1.0, task.prefix / 2),
                                  self.costs.decode_iteration_s(n, engine.pinned_tokens(), 0.0), n)
            rank.budget.judge(task.prefix, int(hit), self.block_tokens, task.gen_left, cost)
            task.prefix = 0
            if rank.budget.budget_tokens != before:  # a new budget: CTB decides again (the run's worker too)
                self.schedule(self.now, self._budget_changed, rank)

    def _budget_changed(self, t: float, rank: RolloutRank) -> None:
        if self.ranks.get(rank.index) is rank:
            self._ctb_pass(t, rank)
            self._account(rank, t)

    def _ctb_needs_pass(self, rank: RolloutRank) -> bool:
        """Whether :func:`decide` could change anything on `rank`. When only the budget holds the waiting
        work back, the pass is skipped, and the budget is told it held a task back (as the decision would)."""
        budget = rank.budget.budget_tokens
        if rank.used > budget:
            return True
        headroom = budget - rank.used
        if self.env_active >= self.env_concurrency:
            return False
        for task in rank.paused:
            if task.footprint <= headroom:
                return True
        if any(o.footprint <= headroom for o in self.orphans[:64]):
            return True
        if self.candidates and self.candidates[0].probe_tokens <= headroom:
            return True
        if rank.num_resident < self.costs.max_num_seqs and (
                any(task.footprint <= budget for task in rank.paused)
                or any(o.footprint <= budget for o in self.orphans[:64])
                or (self.candidates and self.candidates[0].probe_tokens <= budget)):
            rank.budget.held_back(True)
        return False

    def _ctb_pass(self, t: float, rank: RolloutRank) -> None:
        if not self._ctb_needs_pass(rank):
            return
        views = [self._view(task, True) for task in rank.tasks]
        orphans = self.orphans[:64]
        views += [self._view(task, False) for task in orphans]
        candidates = [
            CandidateGroup(g.id, tuple(x.id for x in g.remaining), g.probe_tokens, g.is_eval, g.task_type)
            for g in list(self.candidates)[:8]
        ]
        free_env = max(0, self.env_concurrency - self.env_active)
        # The rank's claim, as a rollout rank of the run claims from the store (claim_limit): its free
        # slots, at most its share of the tasks in flight (held by any rank, or waiting in the pool).
        held = rank.num_resident + len(rank.paused)
        in_flight = sum(r.num_resident + len(r.paused) for r in self.ranks.values()) + self.queued_tasks()
        claim = claim_limit(self.costs.max_num_seqs - held, held, in_flight, len(self.ranks))
        limits = AdmissionLimits(max_resident_tasks=min(self.costs.max_num_seqs, rank.num_resident + free_env,
                                                        held + claim))  # its own paused tasks are claimed
        decision = decide(RankView(rank.budget.budget_tokens, tuple(views)), candidates, limits, self.weights)
        rank.budget.held_back(decision.budget_bound)
        for tid in decision.pause:
            self._pause(t, self.tasks[tid])
        for tid in decision.resume:
            task = self.tasks[tid]
            if task.rank is None:
                self.orphans.remove(task)
            self._place(t, task, rank)
        for tid in decision.admit:
            task = self.tasks[tid]
            group = task.group
            if group.remaining[0] is not task:
                raise AssertionError("CTB admits the tasks of a group in order")
            group.remaining.popleft()
            if not group.remaining:
                self.candidates.remove(group)
            self._place(t, task, rank)
        self._account(rank, t)
