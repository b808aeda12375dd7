"""The records of a diagnosis (`tiderl.observe.diagnose`): the snapshot of a run it reads and the findings it gives.

Pure: plain frozen dataclasses and enums, no database. `tiderl.observe.status` builds a :class:`Snapshot`
from the run store (every time is an age in seconds relative to the moment of the snapshot); the tests
build snapshots with a known story."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# The store's RunState and RankState values, as plain strings: this module imports nothing of the
# store (tests/test_diagnose.py checks that they agree).
TERMINAL_STATES = ("finished", "failed", "cancelled")
LIVE_RANK_STATES = ("starting", "running")
SLURM_ALIVE = ("RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT")
SLURM_WAITING = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED",
                 "UNKNOWN")


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class Kind(str, enum.Enum):
    RUN_ENDED = "run_ended"
    RUN_FAILED = "run_failed"
    STALLED = "stalled"
    RUN_GONE = "run_gone"  # every rank silent: the launcher or the Slurm job is gone
    CONTROL_DOWN = "control_down"  # the control plane stopped ticking: no feed, no plans, no dead-rank watch
    ACTOR_DOWN = "actor_down"  # no live actor rank: nobody trains
    REF_DOWN = "ref_down"  # a decoupled step's ref rank is dead or silent
    RANK_DEAD = "rank_dead"
    RANK_FAILED = "rank_failed"  # a rank ended on an error
    RESTARTED = "restarted"  # a process died and was restarted in place (a rank quarantined first)
    RANK_SILENT = "rank_silent"  # missed heartbeats, not yet declared dead
    RANK_MISSING = "rank_missing"  # never registered (still starting, or failed to start)
    SLOW_TASK = "slow_task"  # a task of a group the trainer waits for runs long
    NO_ROLLOUT = "no_rollout"  # tasks pending and no live rollout rank to run them
    ROLLOUT_HELD = "rollout_held"  # free slots, nothing to claim: the staleness bound holds the feed
    ROLLOUT_NO_WORK = "rollout_no_work"  # free slots, nothing to claim, below the bound (feeder behind or done)
    ROLLOUT_NOT_CLAIMING = "rollout_not_claiming"  # tasks pending, the rank holds none and records no wait
    TASK_RETRIED = "task_retried"  # tasks that failed at least once
    ORPHANED_TASKS = "orphaned_tasks"  # running tasks owned by a rank that no longer rolls out
    GROUPS_FAILED = "groups_failed"
    STALE_DROPPED = "stale_dropped"  # the trainer dropped groups as too stale
    ENV_SERVER_DOWN = "env_server_down"
    STORE_UNREACHABLE = "store_unreachable"  # a process waited out a store outage (a database server restart)
    SLURM_JOB = "slurm_job"  # a Slurm job of the run is not running
    ENGINE_MISMATCH = "engine_mismatch"  # the engine's log-probs of on-policy tokens are not the trainer's


@dataclass(frozen=True, slots=True)
class Limits:
    """The run's config values the diagnosis compares against."""

    num_ranks: int
    num_steps: int
    max_staleness: int
    groups_ideal: int
    feed_cap_groups: int  # training groups the feeder keeps outstanding at most
    max_concurrency: int  # unfinished tasks per rollout rank
    heartbeat_s: float
    heartbeat_timeout_s: float
    stall_after_s: float
    slow_task_s: float
    rwt_window_s: float  # the window `RankStatusView.rwt_recent_s` sums over
    max_on_policy_mismatch: float = 1e-3  # nats a token (monitor.max_on_policy_mismatch)


@dataclass(frozen=True, slots=True)
class RankStatusView:
    """A rank as `tiderl status` sees it in the store (CTB's view of a rank is `policy.ctb.RankView`)."""

    rank: int
    role: str
    state: str
    version: int
    heartbeat_age_s: float | None
    planned_role: str | None = None
    running_tasks: int = 0  # store tasks it owns in state running
    rwt_recent_s: float = 0.0  # rollout wait seconds recorded within the last `rwt_window_s`
    claimed_groups: int = 0  # training groups it holds as a trainer
    claimed_age_s: float | None = None  # seconds since its latest claim of a training group
    up_s: float | None = None  # seconds since the rank process (re)registered


@dataclass(frozen=True, slots=True)
class TaskView:
    task_id: int
    group_id: int
    state: str  # pending or running
    owner_rank: int | None = None
    running_s: float | None = None  # seconds since its current owner claimed it
    attempts: int = 0
    last_error: str | None = None
    # Where the task is inside its episode, when the ranks record it (None: unknown).
    turn: int | None = None
    phase: str | None = None  # "generate", "env" (waiting for an environment answer), "paused"
    phase_s: float | None = None  # seconds in the current phase
    env_server: str | None = None


@dataclass(frozen=True, slots=True)
class GroupView:
    group_id: int
    kind: str  # train or eval
    state: str  # open, ready, claimed
    size: int
    num_done: int
    unfinished: tuple[TaskView, ...] = ()


@dataclass(frozen=True, slots=True)
class EventView:
    kind: str
    age_s: float
    message: str
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class EnvServerView:
    url: str
    is_reachable: bool
    error: str | None = None
    sessions: int | None = None
    step_p99_ms: float | None = None


@dataclass(frozen=True, slots=True)
class SlurmJobView:
    job_id: str
    state: str
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    state: str
    version: int
    since_progress_s: float  # since the last version was published (or the run started)
    limits: Limits
    ranks: tuple[RankStatusView, ...] = ()
    groups: tuple[GroupView, ...] = ()  # outstanding groups: open, ready, claimed
    fetch_groups: int | None = None  # groups the current step trains on (the plan), None: groups_ideal
    ra2p_mode: str | None = None
    message: str | None = None
    failed_groups: int = 0
    events: tuple[EventView, ...] = ()  # recent events, newest first
    env_servers: tuple[EnvServerView, ...] = ()
    slurm_jobs: tuple[SlurmJobView, ...] = ()
    control_age_s: float | None = None  # since the control plane's last tick (None: never ticked)
    on_policy_mismatch: float | None = None  # the last step's logprob_mismatch_on_policy (None: not measured)


@dataclass(frozen=True, slots=True)
class Finding:
    kind: Kind
    severity: Severity
    message: str
    rank: int | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "severity": self.severity.value, "message": self.message,
                "rank": self.rank, "data": self.data}


@dataclass(frozen=True, slots=True)
class Diagnosis:
    trainer: str  # what the trainer side waits for, one sentence
    rollout: str  # what the rollout side waits for, one sentence
    findings: tuple[Finding, ...]
    is_stalled: bool
    culprit: Finding | None
    since_progress_s: float

    @property
    def needs_attention(self) -> bool:
        """What `tiderl status --check` exits 1 on: a stalled run, or any error-level finding."""
        return self.is_stalled or any(f.severity is Severity.ERROR for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {"trainer": self.trainer, "rollout": self.rollout, "is_stalled": self.is_stalled,
                "needs_attention": self.needs_attention, "since_progress_s": round(self.since_progress_s, 3),
                "culprit": self.culprit.to_dict() if self.culprit else None,
                "findings": [f.to_dict() for f in self.findings]}
