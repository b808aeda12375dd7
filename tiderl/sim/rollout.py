"""The rollout side of the simulation: tasks, groups, rollout ranks, the
feeder (staleness bound) and the two task schedulers.

(Over 450 lines: the task lifecycle events, placement and the two schedulers act on the same
per-rank accounting, which must stay consistent across every event.)

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

import enum
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
from tiderl.policy.ctb_budget import BudgetLimits, BudgetTracker, reprefill_cost
from tiderl.sim.costs import Costs
from tiderl.sim.engine import SimEngine
from tiderl.sim.workload import TaskPlan

Schedule = Callable[..., None]


class Stage(enum.Enum):
    QUEUED = 0
    STARTING = 1
    ACTIVE = 2
    WAITING_ENV = 3
    PAUSED = 4
    DONE = 5


_CTB_STATE = {
    Stage.STARTING: TaskState.WAITING_ENV,
    Stage.WAITING_ENV: TaskState.WAITING_ENV,
    Stage.ACTIVE: TaskState.ACTIVE,
    Stage.PAUSED: TaskState.PAUSED,
}


# A rank without engine work: [nothing left to claim][holding tasks (on their environment, paused)].
_NO_WORK = (("idle", "idle_held"), ("rwt", "rwt_held"))


class SimGroup:
    __slots__ = ("id", "tasks", "is_eval", "done", "ready_s", "remaining", "task_type", "probe_tokens", "version",
                 "dropped", "released_s", "seen_s", "claimed_s", "claim_version")

    def __init__(self, gid: int, tasks: list[SimTask], is_eval: bool, task_type: str, version: int) -> None:
        self.id = gid
        self.tasks = tasks
        self.is_eval = is_eval
        self.done = 0
        self.ready_s = 0.0
        self.remaining: deque[SimTask] = deque(tasks)
        self.task_type = task_type
        self.probe_tokens = tasks[0].footprint
        self.version = version
        self.dropped = False  # doomed by the staleness bound while open (RolloutSide.drop_doomed)
        # Its life in flight, for the result's `group_holding` (a training group's; None until then):
        self.released_s: float | None = None  # released by the feeder
        self.seen_s: float | None = None  # complete and seen by the trainer (in the buffer)
        self.claimed_s: float | None = None  # claimed by a step
        self.claim_version: int | None = None  # the version that step trained from

    @property
    def seq_tokens(self) -> list[int]:
        return [n for t in self.tasks for n in t.plan.segments]

    @property
    def gen_tokens(self) -> int:
        """Tokens the model generated in the group's trajectories."""
        return sum(sum(t.plan.gen_tokens) for t in self.tasks)

    @property
    def version_start(self) -> int:
        return min(t.version_start for t in self.tasks)


class SimTask:
    __slots__ = (
        "id", "group", "plan", "is_eval", "turn", "ctx", "gen_left", "stage", "rank", "env_pending",
        "footprint", "reserve", "version_start", "view", "view_key", "env_started", "prefix", "placed_s",
        "finished_s",
    )

    def __hash__(self) -> int:
        # Sets of tasks iterate in hash order: hashing by task id (not by memory address) makes
        # every run of one seed play out the same way.
        return self.id

    def __init__(self, tid: int, plan: TaskPlan, is_eval: bool, reserve: int) -> None:
        self.id = tid
        self.group: SimGroup = None  # type: ignore[assignment]
        self.plan = plan
        self.is_eval = is_eval
        self.turn = 0
        self.ctx = plan.prompt_tokens
        self.gen_left = plan.gen_tokens[0]
        self.stage = Stage.QUEUED
        self.rank: RolloutRank | None = None
        self.env_pending = False
        self.env_started = False
        self.reserve = reserve
        self.footprint = self.ctx + reserve
        self.version_start = -1
        self.view: CtbTask | None = None
        self.view_key: tuple = ()
        self.prefix = 0  # context its previous generation left in the cache, resident since (0: none to judge)
        self.placed_s = 0.0  # when a rank last took it into a task slot (as a real rank's claim)
        self.finished_s = 0.0


class RolloutRank:
    __slots__ = ("index", "engine", "tasks", "paused", "used", "num_resident", "epoch", "next_t", "acct_t",
                 "acct_state", "budget")

    def __init__(self, index: int, engine: SimEngine, t: float, budget: BudgetTracker) -> None:
        self.index = index
        self.engine = engine
        self.tasks: set[SimTask] = set()  # resident and paused-here tasks
        self.paused: set[SimTask] = set()  # paused-here tasks
        self.used = 0  # resident footprint, tokens
        self.num_resident = 0
        self.epoch = 0
        self.next_t = float("inf")
        self.acct_t = t
        self.acct_state = "idle"
        self.budget = budget  # CTB's KV budget, kept as the run's rollout worker keeps it


class RolloutSide:
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

    # -- ranks -------------------------------------------------------------------------------
    def add_rank(self, t: float, index: int, stall_s: float) -> None:
        engine = SimEngine(self.costs, self.costs.kv_capacity_tokens)
        engine.speed = self._speed
        engine.busy_until = t + stall_s
        engine.t = t
        rank = RolloutRank(index, engine, t, BudgetTracker(self.costs.kv_capacity_tokens, self.budget_limits))
        if self.ctb:
            engine.on_admit = lambda task, hit: self._judge(rank, task, hit)
        self.ranks[index] = rank
        self._account(rank, t)
        if stall_s > 0:
            self.schedule(t + stall_s, self._stall_end, rank)

    def start_engine(self, t: float, index: int, on_up: Callable[[float, int], None]) -> None:
        """Rank `index` starts its engine now; `on_up(t, index)` once it is up. On a shared host the start is
        a busy rollout rank's load on the host while it lasts, and it progresses at the host's share."""
        if self.costs.host_compute_slots is None:
            self.schedule(t + self.costs.engine_start_s, on_up, index)
            return
        self._advance_builds(t)
        self.builds[index] = [self.costs.engine_start_s, t, 0, on_up]
        self._share_host()
        self._time_build(t, index)

    def _advance_builds(self, t: float) -> None:
        for build in self.builds.values():
            build[0] -= (t - build[1]) * self._speed
            build[1] = t

    def _time_build(self, t: float, index: int) -> None:
        build = self.builds[index]
        build[2] += 1
        self.schedule(t + max(0.0, build[0]) / self._speed, self._build_done, index, build[2])

    def _build_done(self, t: float, index: int, epoch: int) -> None:
        build = self.builds.get(index)
        if build is None or build[2] != epoch:
            return
        self._advance_builds(t)
        del self.builds[index]
        self._share_host()
        build[3](t, index)

    def remove_rank(self, t: float, index: int) -> None:
        """The rank leaves rollout: its tasks become orphans, resumed elsewhere with a fresh prefill."""
        rank = self.ranks[index]
        self._account(rank, t, force=True)
        for task, ctx, left in rank.engine.flush(t, 0.0):
            task.ctx, task.gen_left = ctx, left
        self._retire(rank.engine)
        for task in list(rank.tasks):
            if task.stage is not Stage.PAUSED:
                self.env_active -= 1
            task.stage = Stage.PAUSED
            task.rank = None
            task.view = None
            task.prefix = 0
            self.orphans.append(task)
        del self.ranks[index]

    def _retire(self, engine: SimEngine) -> None:
        r = self.retired
        r["query"] += engine.query_tokens
        r["hit"] += engine.hit_tokens
        r["prefill"] += engine.prefill_tokens
        r["decode"] += engine.decode_tokens
        r["preempt"] += engine.preemptions

    def counters(self) -> dict[str, float]:
        out = dict(self.retired)
        for rank in self.ranks.values():
            e = rank.engine
            out["query"] += e.query_tokens
            out["hit"] += e.hit_tokens
            out["prefill"] += e.prefill_tokens
            out["decode"] += e.decode_tokens
            out["preempt"] += e.preemptions
        return out

    def flush_all(self, t: float, stall_s: float) -> None:
        """A weight sync: every engine drops its cache, interrupted requests are re-prefilled."""
        for rank in self.ranks.values():
            self._account(rank, t)
            for task in rank.tasks:
                task.prefix = 0  # the next turn runs on new weights: its cache is not judged (as in the run)
            for task, ctx, left in rank.engine.flush(t, stall_s):
                task.ctx, task.gen_left = ctx, left
                rank.engine.submit(t, task, ctx, left, self.ctb)
            self._reschedule(rank)
            self._account(rank, t)
            if stall_s > 0:
                self.schedule(t + stall_s, self._stall_end, rank)

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

    # -- accounting --------------------------------------------------------------------------
    def _account(self, rank: RolloutRank, t: float, force: bool = False) -> None:
        """Close the rank's current accounting interval if its state changes at t (or if forced)."""
        if self.off:
            state = "off"
        elif t < rank.engine.busy_until:
            state = "stall"
        elif rank.engine.has_work():
            state = "busy"
        else:
            state = _NO_WORK[self.blocked()][bool(rank.tasks)]
        if force or state != rank.acct_state:
            self.accounts[rank.acct_state] += t - rank.acct_t
            rank.acct_t = t
            rank.acct_state = state

    def account_all(self, t: float, force: bool = False) -> None:
        for rank in self.ranks.values():
            self._account(rank, t, force)

    def rwt_rank_s(self) -> float:
        """Rank-seconds without engine work and nothing left to claim (the simulated RWT), so far."""
        return self.accounts["rwt"] + self.accounts["rwt_held"]

    def empty_rank_s(self) -> float:
        """Rank-seconds holding no task at all, so far: what a real rollout rank counts as `rollout_idle_s`
        and ERS reads as its idle rank-seconds (a rank whose tasks wait on their environment is not idle)."""
        return self.accounts["rwt"] + self.accounts["idle"]

    # -- engine events -----------------------------------------------------------------------
    def set_trainer_busy(self, num_ranks: int) -> float:
        """The trainer starts (or ends) computing on `num_ranks` ranks; returns its speed on the host."""
        self.trainer_busy = num_ranks
        self._share_host()
        return self.costs.host_speed(self._engines_busy + len(self.builds), num_ranks)

    def _share_host(self) -> None:
        """Shared host: every busy rank runs at the same share; engines advance at the old share
        up to now, then take the new one."""
        if self.costs.host_compute_slots is None:
            return
        # A rank playing tasks keeps its processes busy (turn handling as well as engine iterations).
        self._engines_busy = sum(1 for r in self.ranks.values() if r.tasks or r.engine.has_work())
        speed = self.costs.host_speed(self._engines_busy + len(self.builds), self.trainer_busy)
        if speed == self._speed:
            return
        self._advance_builds(self.now)
        self._speed = speed
        for index in self.builds:
            self._time_build(self.now, index)
        for rank in self.ranks.values():
            rank.engine.advance(self.now)
            rank.engine.speed = speed
            self._reschedule(rank, share=False)
        if self.on_speed is not None:
            self.on_speed(self.now, speed)

    def _reschedule(self, rank: RolloutRank, share: bool = True) -> None:
        if share and self.costs.host_compute_slots is not None:
            self._share_host()
        nt = rank.engine.next_event_s()
        if nt == rank.next_t:
            return
        rank.epoch += 1
        rank.next_t = nt
        if nt < float("inf"):
            self.schedule(nt, self._tick, rank, rank.epoch)

    def _stall_end(self, t: float, rank: RolloutRank) -> None:
        if self.ranks.get(rank.index) is rank:
            self._account(rank, t)

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

    # -- CTB ---------------------------------------------------------------------------------
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
