"""The simulated rollout ranks (a part of :class:`tiderl.sim.rollout.RolloutSide`): each rank's
engine (:class:`~tiderl.sim.engine.SimEngine`) and CTB budget, ranks joining and leaving rollout
(a leaving rank's tasks orphaned), engine starts, weight syncs (cache flushed, interrupted requests
re-prefilled), the shared host's speed, and the accounting of each rank's time (busy, stalled, idle,
RWT).
"""

from __future__ import annotations

from collections.abc import Callable

from tiderl.policy.ctb_budget import BudgetLimits, BudgetTracker
from tiderl.sim.costs import Costs
from tiderl.sim.engine import SimEngine
from tiderl.sim.tasks import SimTask, Stage

Schedule = Callable[..., None]

# A rank without engine work: [nothing left to claim][holding tasks (on their environment, paused)].
_NO_WORK = (("idle", "idle_held"), ("rwt", "rwt_held"))


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


class RankEngines:
    """The rollout ranks' engines, the host they share and their accounting (a mixin of `RolloutSide`)."""

    costs: Costs
    schedule: Schedule
    ctb: bool
    budget_limits: BudgetLimits | None
    ranks: dict[int, RolloutRank]
    orphans: list[SimTask]
    env_active: int
    accounts: dict[str, float]
    off: bool
    retired: dict[str, float]
    now: float
    trainer_busy: int
    builds: dict[int, list]
    _engines_busy: int
    _speed: float
    on_speed: Callable[[float, float], None] | None
    blocked: Callable[[], bool]
    _judge: Callable[[RolloutRank, SimTask, float], None]
    _tick: Callable[[float, RolloutRank, int], None]

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
