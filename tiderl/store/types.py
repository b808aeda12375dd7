"""Value types and states of the run store."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tiderl.policy.ra2p import Ra2pMode
from tiderl.roles import Role


class RunState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (RunState.FINISHED, RunState.FAILED, RunState.CANCELLED)


class RankState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPED = "stopped"
    DEAD = "dead"  # missed heartbeats: its claims went back to the pool
    FAILED = "failed"  # ended on an error (the `rank_failed` event says which)


@dataclass(frozen=True, slots=True)
class RunRecord:
    """The run's row (`RunStore.run_info`)."""

    name: str
    system: str
    state: RunState
    version: int
    """The last published weights version."""
    created_at: float
    updated_at: float
    finished_at: float | None
    message: str | None
    config_yaml: str
    control_seen_at: float | None
    """The control plane's last tick (its heartbeat); None before its first."""


@dataclass(frozen=True, slots=True)
class ForkOrigin:
    """Where a fork (`tiderl run --resume RUN_DIR --fork NEW_DIR`) started: the source run directory, the step and
    version of the source's checkpoint it started from, and how many training groups the source had drawn (the
    fork's feed draws its prompts after those: it trains none of the source's again). Its store's `forked` event
    holds it (`RunStore.fork_origin`)."""

    run_dir: str
    step: int
    version: int
    source_train_groups: int


@dataclass(frozen=True, slots=True)
class TrainerGeneration:
    """The trainer group's restart generation (`RunStore.trainer_generation`): 0 until its first restart."""

    number: int
    members: tuple[int, ...]
    """The actor and ref ranks the generation's restart stopped and started again (empty for 0)."""


@dataclass(frozen=True, slots=True)
class BufferState:
    """What the run's buffer holds now (`RunStore.buffer_state`, the `buffer_state` view)."""

    tasks_pending: int
    tasks_running: int
    tasks_done: int
    tasks_failed: int
    traj_waiting_group: int
    """Finished trajectories waiting for the rest of their group."""
    traj_ready: int
    traj_claimed: int
    traj_consumed: int
    ready_tokens: int
    """Tokens of the ready (trainable) trajectories."""
    groups_ready: int
    """Complete training groups waiting for the trainer."""


@dataclass(frozen=True, slots=True)
class RankRecord:
    """One rank's row (`RunStore.ranks`)."""

    rank: int
    role: Role
    state: RankState
    version: int
    """The weights version the rank runs."""
    host: str | None
    pid: int | None
    started_at: float
    heartbeat_at: float


class TaskKind(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class StoreTaskState(str, enum.Enum):
    """A task's state in the run store (`tasks.state`); CTB's per-rank view is `policy.ctb.TaskState`."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # gave up after too many attempts


class GroupState(str, enum.Enum):
    OPEN = "open"  # some tasks not done yet
    READY = "ready"  # all tasks done, advantages written (train groups)
    CLAIMED = "claimed"  # a trainer holds it
    CONSUMED = "consumed"  # trained on
    EVALUATED = "evaluated"  # an evaluation group, complete
    FAILED = "failed"  # a task failed for good: the group is never trained


class TrajectoryState(str, enum.Enum):
    WAITING = "waiting"  # its group is not complete yet
    READY = "ready"
    CLAIMED = "claimed"
    CONSUMED = "consumed"
    EVAL = "eval"  # evaluation trajectory: recorded, never trained
    DROPPED = "dropped"  # its group failed


@dataclass(frozen=True, slots=True)
class NewGroup:
    kind: TaskKind
    prompt_seed: int
    size: int
    eval_version: int | None = None


@dataclass(frozen=True, slots=True)
class TaskClaim:
    task_id: int
    group_id: int
    index_in_group: int
    kind: TaskKind
    seed: int
    attempts: int
    eval_version: int | None
    progress: dict | None = None  # handed over by the rank that released it (rollout's TaskProgress JSON)


@dataclass(frozen=True, slots=True)
class StepWindow:
    """One step as the store saw it, for ERS (StepMeasure.step_window, `store.measure`)."""

    groups_completed: int
    produced_tokens: int  # trajectory tokens of the training groups completed in the step
    group_latency_sum_s: float  # sum of their creation-to-completion seconds
    group_env_sum_s: float  # sum of their slowest task's environment seconds
    rank_s: dict[tuple[str, str], float]  # (metric, role) -> seconds summed over ranks
    consumed_tokens: int  # trajectory tokens the step trained on
    evaluation: bool = False  # an evaluation group was open during the step
    stale_dropped_tokens: int = 0  # trajectory tokens of the groups the trainer dropped as stale in the step
    tasks_completed: int = 0  # tasks (trajectories) of the training groups completed in the step
    task_env_sum_s: float = 0.0  # sum of those tasks' environment seconds
    task_slot_sum_s: float = 0.0  # sum of those tasks' seconds from their (last) claim to their end
    task_wait_sum_s: float = 0.0  # sum of those tasks' seconds from their group's creation to that claim


CUT_FINISHES = frozenset({"max_turns", "max_context"})  # the agent loop's finish reasons of a task its limits cut


@dataclass(frozen=True, slots=True)
class FinishedTrajectory:
    task_id: int
    token_ids: list[int]
    loss_mask: list[int]  # 1: generated by the model (trained), 0: prompt or environment
    logprobs: list[float]  # rollout logprobs; 0.0 where loss_mask is 0
    token_versions: list[int]  # policy version that generated each token; -1 where loss_mask is 0
    num_turns: int
    reward: float
    success: bool
    env_s: float | None = None  # seconds the task waited on its environment (start and steps); None: not measured
    finish: str | None = None  # how the task ended: "done", or cut (CUT_FINISHES); None: not recorded
    images: tuple[bytes, ...] = ()  # the task's PNG images, in order (one image placeholder id each)
    prunes: tuple[tuple[int, int], ...] = ()  # where the sliding image window split it (rollout.trajectory.Prune)
    env: str | None = None  # the environment the task played (TaskSpec.env; step_figures reports per environment)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "token_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory of task {self.task_id}: {name} has {len(getattr(self, name))} entries, "
                    f"token_ids has {n}"
                )


@dataclass(frozen=True, slots=True)
class TaskFailure:
    task_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class MetricPoint:
    name: str
    value: float
    version: int | None = None
    role: str | None = None


@dataclass(frozen=True, slots=True)
class EventRecord:
    kind: str
    message: str
    data: dict | None = None


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """Up to `limit` pending tasks of `kinds`; with `weights_version`, evaluation tasks of that
    version only (see `RunStore.claim_tasks`)."""

    limit: int
    kinds: tuple[TaskKind, ...] = tuple(TaskKind)
    weights_version: int | None = None
    spread: bool = False
    """Claim at most the rank's share of the tasks in flight (`tiderl.policy.ctb.claim_limit`), so that a
    release spreads over the rollout ranks instead of going to whichever claims first."""


@dataclass(frozen=True, slots=True)
class TaskWhereabouts:
    """Where a running task is in its episode: turn, phase and since when, its env server."""

    task_id: int
    turn: int
    phase: str
    phase_since: float
    env_server: str | None = None


@dataclass(slots=True)
class RankReport:
    """Everything a rank has to tell the store since its last tick: written in ONE transaction.

    Batching per tick (not per token or per turn) is what keeps the store's
    commit rate within what SQLite on a network filesystem sustains.
    """

    rank: int
    finished: list[FinishedTrajectory] = field(default_factory=list)
    failed: list[TaskFailure] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # task ids given back to the pool
    handed_over: dict[int, dict] = field(default_factory=dict)  # released task id -> its progress, to carry on
    whereabouts: list[TaskWhereabouts] = field(default_factory=list)  # running tasks of this rank
    claim: ClaimRequest | None = None  # claim new tasks in the same transaction (after the releases)
    metrics: list[MetricPoint] = field(default_factory=list)
    events: list[EventRecord] = field(default_factory=list)
    role: Role | None = None
    version: int | None = None

    def is_empty(self) -> bool:
        return not (self.finished or self.failed or self.released or self.metrics or self.events
                    or self.whereabouts or self.claim is not None)


@dataclass(frozen=True, slots=True)
class ReadyTrajectory:
    id: int
    group_id: int
    rank: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    token_versions: list[int]
    reward: float
    advantage: float
    num_tokens: int
    num_generated: int
    min_version: int
    ready_at: float
    finish: str | None = None
    """How the task ended (FinishedTrajectory.finish)."""
    images: tuple[bytes, ...] = ()
    """The context's PNG images, in order (FinishedTrajectory.images)."""
    prunes: tuple[tuple[int, int], ...] = ()
    """Where the sliding image window split it (FinishedTrajectory.prunes)."""


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """What a trainer publishes with weights version `version` (the result of step version-1 -> version)."""

    version: int
    path: str
    checksum: str
    trajectory_ids: list[int]
    step_started_at: float
    duration_s: float
    ras: int | None = None
    tprm_s: float | None = None
    ra2p_mode: Ra2pMode | None = None
    loss: float | None = None


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """The control plane's plan of one version: each rank's role from it on, the RA2P mode
    and the number of groups the step trains on."""

    version: int
    roles: dict[int, Role]
    ra2p_mode: Ra2pMode
    fetch_groups: int

    def ranks_with(self, role: Role) -> list[int]:
        return sorted(r for r, x in self.roles.items() if x is role)


@dataclass(frozen=True, slots=True)
class ReclaimResult:
    dead_ranks: list[int]
    tasks_returned: int
    trajectories_returned: int
