"""The simulated tasks and their groups: a task's stage, its turn state (context, tokens left to
generate, footprint, what the cache holds of it) and the rank it runs on; a group's tasks, the ones
not yet started, and its life in flight (released, seen by the trainer, claimed, dropped).
"""

from __future__ import annotations

import enum
from collections import deque
from typing import TYPE_CHECKING

from tiderl.policy.ctb import CtbTask
from tiderl.sim.workload import TaskPlan

if TYPE_CHECKING:
    from tiderl.sim.rollout_ranks import RolloutRank


class Stage(enum.Enum):
    QUEUED = 0
    STARTING = 1
    ACTIVE = 2
    WAITING_ENV = 3
    PAUSED = 4
    DONE = 5


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

