"""The rollout side of the simulation: the task pool, the feeder's queue, a task's life and the
vanilla scheduler. Its ranks (engines, weight syncs, the shared host, the accounting) are in
:mod:`tiderl.sim.rollout_ranks`, CTB's scheduling in :mod:`tiderl.sim.rollout_ctb`, the tasks and
groups in :mod:`tiderl.sim.tasks`.

Two task schedulers:

- ``vanilla`` (request level): a task goes to the rollout rank with the
  fewest tasks, up to the engine's ``max_num_seqs``; the engine's own cache
  policy decides what stays resident.
- ``ctb``: on the triggers of Algorithm 1 (a turn starts, a task ends, new
  groups or orphaned tasks appear, a sync boundary) the rank's state goes
  through :func:`tiderl.policy.ctb.decide`, the very function the real
  rollout ranks call, and its decisions are applied (requests aborted,
  contexts marked kept or evictable, tasks started).

A task's life: assigned -> environment `/start` -> turns of (prefill +
decode on the engine, then an environment step) -> done. A group whose
tasks are all done becomes ready for the trainer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tiderl.policy.ctb import PriorityWeights
from tiderl.policy.ctb_budget import BudgetLimits
from tiderl.sim.costs import Costs
from tiderl.sim.rollout_ctb import CtbScheduling
from tiderl.sim.rollout_ranks import RankEngines, RolloutRank, Schedule
from tiderl.sim.tasks import SimGroup, SimTask, Stage


class RolloutSide(RankEngines, CtbScheduling):
    """Rollout ranks plus the task pool. The simulator drives it through
    `release_*`, `dispatch`, `flush_all`, `add_rank`/`remove_rank`."""

    def __init__(
        self,
        costs: Costs,
        schedule: Schedule,
        on_group_done: Callable[[float, SimGroup], None],
        *,
        ctb: bool,
        env_concurrency: int,
        weights: PriorityWeights,
        budget_limits: BudgetLimits | None = None,
        block_tokens: int = 16,
    ) -> None:
        """``budget_limits``: CTB's adaptive budget (None: fixed at the engine's KV capacity), its floor
        the capacity; ``block_tokens``: the engine's KV block size (turns are judged in whole blocks)."""
        self.costs = costs
        self.schedule = schedule
        self.on_group_done = on_group_done
        self.ctb = ctb
        self.env_concurrency = env_concurrency
        self.weights = weights
        self.budget_limits = budget_limits
        self.block_tokens = block_tokens
        self.ranks: dict[int, RolloutRank] = {}
        self.candidates: deque[SimGroup] = deque()
        self.orphans: list[SimTask] = []
        self.tasks: dict[int, SimTask] = {}
        self.env_active = 0
        self.version = 0
        self.accounts = {"busy": 0.0, "rwt": 0.0, "rwt_held": 0.0, "idle": 0.0, "idle_held": 0.0, "stall": 0.0,
                         "off": 0.0}
        self.off = False  # sync systems: the rollout ranks are training
        self.retired = {"query": 0.0, "hit": 0.0, "prefill": 0.0, "decode": 0.0, "preempt": 0}
        self.allowance_left = 0  # groups the staleness bound still lets the feeder release
        self.now = 0.0  # the event loop's clock (set by the simulation before each event)
        self.trainer_busy = 0  # trainer ranks computing now (shared host)
        # Engines starting on a shared host (each a busy rollout rank's load on it): rank -> [work left at full
        # speed (s), as of (s), epoch, on_up].
        self.builds: dict[int, list] = {}
        self._engines_busy = 0
        self._speed = 1.0
        self.on_speed: Callable[[float, float], None] | None = None  # the trainer's re-timing

    # -- feeder ------------------------------------------------------------------------------
    def release(self, t: float, groups: list[SimGroup], front: bool = False) -> None:
        for g in groups:
            for task in g.tasks:
                self.tasks[task.id] = task
        if front:
            self.candidates.extendleft(reversed(groups))
        else:
            self.candidates.extend(groups)
        self.account_all(t)
        self.dispatch(t)

    def queued_tasks(self) -> int:
        """Tasks waiting to be claimed: released and not started, or orphaned by a rank that left."""
        return sum(len(g.remaining) for g in self.candidates) + len(self.orphans)

    def blocked(self) -> bool:
        """Nothing left that a rollout rank could start or resume."""
        return not self.candidates and not self.orphans

    def drop_doomed(self, oldest_version: int) -> list[SimGroup]:
        """Never finish the open training groups that hold a finished task placed before `oldest_version`
        (the coming step's staleness bound), as the control plane drops them at each new version
        (RunStore.drop_doomed_groups): their tasks not yet started never start, the ones running finish
        and join no group. Returns the groups dropped, in release order."""
        doomed: dict[tuple, SimGroup] = {}
        for task in self.tasks.values():
            g = task.group
            if g.id in doomed or g.is_eval or g.dropped:
                continue
            if any(x.stage is Stage.DONE and x.version_start < oldest_version for x in g.tasks):
                doomed[g.id] = g
        for g in doomed.values():
            g.dropped = True
            for task in g.remaining:
                del self.tasks[task.id]
            g.remaining.clear()
            if g in self.candidates:
                self.candidates.remove(g)
        return list(doomed.values())

    def dispatch(self, t: float) -> None:
        if self.ctb:
            for rank in sorted(self.ranks.values(), key=lambda r: r.used):
                self._ctb_pass(t, rank)
        else:
            self._vanilla_fill(t)
        self.account_all(t)

    # -- a task's turns ----------------------------------------------------------------------
    def _tick(self, t: float, rank: RolloutRank, epoch: int) -> None:
        if epoch != rank.epoch or self.ranks.get(rank.index) is not rank:
            return
        rank.next_t = float("inf")
        for task in rank.engine.pop_finished(t):
            task.ctx += task.gen_left
            task.gen_left = 0
            task.prefix = task.ctx
            task.stage = Stage.WAITING_ENV
            task.env_pending = True
            # The turn's answer reaches the agent loop, which calls the environment.
            # On a shared host the turn's own work runs at the rank's share of it.
            overhead = self.costs.turn_overhead_s / rank.engine.speed
            self.schedule(t + overhead + task.plan.env_latency_s[task.turn], self._env_return, task)
        self._reschedule(rank)
        self._account(rank, t)

    def _submit(self, t: float, task: SimTask) -> None:
        rank = task.rank
        rank.engine.submit(t, task, task.ctx, task.gen_left, self.ctb)
        task.stage = Stage.ACTIVE
        self._reschedule(rank)
        self._account(rank, t)

    def _env_start(self, t: float, task: SimTask) -> None:
        task.env_pending = False
        task.env_started = True
        if task.stage is Stage.STARTING:
            self._submit(t, task)

    def _env_return(self, t: float, task: SimTask) -> None:
        task.env_pending = False
        plan = task.plan
        if task.turn == plan.num_turns - 1:
            self._finish(t, task)
            return
        task.ctx += plan.obs_tokens[task.turn]
        cut = plan.prune_tokens[task.turn] if task.turn < len(plan.prune_tokens) else 0
        if cut:  # the image window pruned the oldest images: the cache matches up to the oldest of them
            task.ctx -= cut
            task.prefix = 0
            if task.rank is not None:
                task.rank.engine.truncate_cache(task, plan.prune_kept[task.turn])
        task.turn += 1
        task.gen_left = plan.gen_tokens[task.turn]
        self._set_footprint(task, task.ctx + task.reserve)
        if task.stage is not Stage.WAITING_ENV:
            return  # paused: the turn starts when CTB resumes it
        rank = task.rank
        if self.ctb:
            self._ctb_pass(t, rank)
        if task.stage is Stage.WAITING_ENV:
            self._submit(t, task)

    def _set_footprint(self, task: SimTask, footprint: int) -> None:
        if task.rank is not None and task.stage is not Stage.PAUSED:
            task.rank.used += footprint - task.footprint
        task.footprint = footprint

    def _finish(self, t: float, task: SimTask) -> None:
        rank = task.rank
        group = task.group
        paused = task.stage is Stage.PAUSED
        if rank is not None:
            rank.tasks.discard(task)
            rank.paused.discard(task)
            rank.engine.set_kept(task, False)
            if not paused:
                rank.used -= task.footprint
                rank.num_resident -= 1
        elif task in self.orphans:
            self.orphans.remove(task)
        if not paused:
            self.env_active -= 1
        task.stage = Stage.DONE
        task.rank = None
        task.finished_s = t
        del self.tasks[task.id]
        group.done += 1
        for sibling in group.tasks:
            sibling.view = None
        if group.done == len(group.tasks) and not group.dropped:  # a dropped group's late trajectory joins none
            group.ready_s = t
            self.on_group_done(t, group)
        if rank is not None and self.ranks.get(rank.index) is rank:
            if self.ctb:
                self._ctb_pass(t, rank)
            else:
                self._vanilla_fill(t)
            self._account(rank, t)

    # -- placement ---------------------------------------------------------------------------
    def _place(self, t: float, task: SimTask, rank: RolloutRank) -> None:
        """Make `task` resident on `rank`: a new task starts its environment, a paused one resumes."""
        if task.rank is None:  # new, or an orphan of a rank that left rollout: a slot taken anew
            task.placed_s = t
        task.rank = rank
        task.view = None
        rank.tasks.add(task)
        rank.paused.discard(task)
        rank.used += task.footprint
        rank.num_resident += 1
        self.env_active += 1
        if task.stage is Stage.QUEUED:
            task.stage = Stage.STARTING
            task.version_start = self.version
            task.env_pending = True
            self.schedule(t + task.plan.start_latency_s, self._env_start, task)
            return
        rank.engine.set_kept(task, self.ctb)
        if task.env_pending:
            task.stage = Stage.WAITING_ENV if task.env_started else Stage.STARTING
        else:
            task.stage = Stage.WAITING_ENV
            self._submit(t, task)

    def _pause(self, t: float, task: SimTask) -> None:
        rank = task.rank
        if task.stage is Stage.ACTIVE:
            state = rank.engine.abort(task)
            if state is not None:
                task.ctx, task.gen_left = state
            self._reschedule(rank)
        rank.engine.set_kept(task, False)
        rank.used -= task.footprint
        rank.num_resident -= 1
        self.env_active -= 1
        task.prefix = 0
        task.stage = Stage.PAUSED
        task.view = None
        rank.paused.add(task)

    def _take_new(self) -> SimTask | None:
        while self.candidates:
            group = self.candidates[0]
            if group.remaining:
                task = group.remaining.popleft()
                if not group.remaining:
                    self.candidates.popleft()
                return task
            self.candidates.popleft()
        return None

    def _vanilla_fill(self, t: float) -> None:
        if not self.ranks:
            return
        cap = self.costs.max_num_seqs
        while (self.orphans or self.candidates) and self.env_active < self.env_concurrency:
            rank = min(self.ranks.values(), key=lambda r: (r.num_resident, r.index))
            if rank.num_resident >= cap:
                return
            task = self.orphans.pop(0) if self.orphans else self._take_new()
            if task is None:
                return
            self._place(t, task, rank)
