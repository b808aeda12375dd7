"""The run store's tables and the SQL views people query with the sqlite3 shell (or psql).

Times are Unix seconds (REAL; double precision on PostgreSQL). Token arrays are
little-endian packed BLOBs (bytea on PostgreSQL; see `codec.py`); their lengths
are kept in plain columns so SQL can sum them. Only dialect-neutral types are
used, so one schema serves SQLite and PostgreSQL; the views differ in one
expression, the current time (`VIEW_NOW_S`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    UniqueConstraint,
)
from sqlalchemy import Text
from sqlalchemy.types import TypeDecorator

metadata = MetaData()


class SafeText(TypeDecorator[str]):
    """TEXT whose NUL characters are escaped on the way in: PostgreSQL refuses NUL in text, and error
    messages and reasons (a model's output, an environment's answer) may carry one."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return value.replace("\x00", "\\x00") if isinstance(value, str) else value

runs = Table(
    "runs",
    metadata,
    Column("id", Integer, primary_key=True),  # one row per run store: id 1
    Column("name", String, nullable=False),
    Column("system", String, nullable=False),
    Column("state", String, nullable=False),  # RunState
    Column("version", Integer, nullable=False, default=0),  # last published weights version
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("finished_at", Float),
    Column("message", SafeText),
    Column("config_yaml", SafeText, nullable=False),
    Column("control_seen_at", Float),  # the control plane's last tick (its heartbeat)
    # The trainer group's restart generation (None: 0) and the ranks its last restart stopped (JSON list):
    # each generation's trainer steps meet in rendezvous/g{N}/ (tiderl.run.supervise).
    Column("trainer_generation", Integer),
    Column("trainer_members", String),
)

ranks = Table(
    "ranks",
    metadata,
    Column("rank", Integer, primary_key=True),
    Column("role", String, nullable=False),  # Role
    Column("state", String, nullable=False),  # RankState
    Column("version", Integer, nullable=False, default=0),  # weights version the rank runs
    Column("host", String),
    Column("pid", Integer),
    Column("started_at", Float, nullable=False),
    Column("heartbeat_at", Float, nullable=False),
)

control = Table(
    "control",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("version", Integer, nullable=False),  # the role holds from this version on
    Column("rank", Integer, nullable=False),
    Column("role", String, nullable=False),
    Column("ra2p_mode", String),
    Column("fetch_groups", Integer),  # groups step `version` trains on (ERS adaptive data retention)
    Column("reason", SafeText),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("version", "rank", name="uq_control_version_rank"),
)

task_groups = Table(
    "task_groups",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("kind", String, nullable=False),  # TaskKind
    Column("prompt_seed", Integer, nullable=False),
    Column("size", Integer, nullable=False),
    Column("eval_version", Integer),  # for evaluation groups: the version they evaluate
    Column("state", String, nullable=False),  # GroupState
    Column("created_at", Float, nullable=False),
    Column("completed_at", Float),
    Index("ix_groups_state", "state", "completed_at"),
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("group_id", Integer, ForeignKey("task_groups.id"), nullable=False),
    Column("index_in_group", Integer, nullable=False),
    Column("kind", String, nullable=False),
    Column("seed", Integer, nullable=False),
    Column("state", String, nullable=False),  # StoreTaskState
    Column("owner_rank", Integer),
    Column("claim_token", String),
    Column("claimed_at", Float),
    Column("attempts", Integer, nullable=False, default=0),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("last_error", SafeText),
    Column("retry_at", Float),  # a task that failed an attempt is claimable again from then (backoff)
    # A task released at a turn boundary with its env session kept (JSON of rollout's
    # TaskProgress): the next claimer carries it on; the claim takes it out.
    Column("progress", SafeText),
    # Where a running task is in its episode, as its rank last reported (every few seconds).
    Column("turn", Integer),
    Column("phase", String),  # generate | env (waiting for the environment) | paused | starting
    Column("phase_since", Float),
    Column("env_server", String),
    Index("ix_tasks_state", "state", "id"),
    Index("ix_tasks_owner", "owner_rank", "state"),
    Index("ix_tasks_claim", "claim_token"),
)

trajectories = Table(
    "trajectories",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("task_id", Integer, ForeignKey("tasks.id"), nullable=False, unique=True),
    Column("group_id", Integer, ForeignKey("task_groups.id"), nullable=False),
    Column("kind", String, nullable=False),
    Column("rank", Integer, nullable=False),  # rollout rank that produced it
    Column("state", String, nullable=False),  # TrajectoryState
    Column("token_ids", LargeBinary, nullable=False),
    Column("loss_mask", LargeBinary, nullable=False),
    Column("logprobs", LargeBinary, nullable=False),
    Column("token_versions", LargeBinary, nullable=False),
    Column("num_tokens", Integer, nullable=False),
    Column("num_generated", Integer, nullable=False),
    Column("num_turns", Integer, nullable=False),
    Column("env", String),  # the environment the task played (TaskSpec.env; null: a store of an earlier TideRL)
    Column("reward", Float, nullable=False),
    Column("success", Integer, nullable=False),
    Column("advantage", Float),
    Column("min_version", Integer, nullable=False),
    Column("max_version", Integer, nullable=False),
    Column("finished_at", Float, nullable=False),
    Column("env_s", Float),  # seconds the task waited on its environment (session start and steps)
    Column("finish", String),  # how the task ended: done | max_turns | max_context (null: not recorded)
    Column("images", LargeBinary),  # the task's PNG images in order (codec.pack_blobs; null: none)
    Column("prunes", String),  # JSON [[at, dropped], ...]: where the sliding image window split it (null: never)
    Column("ready_at", Float),
    Column("claim_owner", Integer),
    Column("claim_token", String),
    Column("claimed_at", Float),
    Column("consumed_version", Integer),
    Index("ix_traj_state", "state", "group_id"),
    Index("ix_traj_group", "group_id"),
    Index("ix_traj_claim", "claim_token"),
)

microbatches = Table(
    "microbatches",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("version", Integer, nullable=False),  # the version this step produced
    Column("trainer_rank", Integer, nullable=False),
    Column("trajectory_ids", SafeText, nullable=False),  # JSON list
    Column("num_tokens", Integer, nullable=False),
    Column("ready_at", Float, nullable=False),
    Column("started_at", Float),
    Column("done_at", Float),
)

versions = Table(
    "versions",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("path", SafeText, nullable=False),
    Column("checksum", String, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("step_started_at", Float),
    Column("duration_s", Float),
    Column("num_trajectories", Integer, nullable=False, default=0),
    Column("consumed_tokens", Integer, nullable=False, default=0),  # generated tokens trained on
    Column("trained_tokens", Integer),  # every token of the trajectories trained on (prompt, generated, env)
    Column("reward_mean", Float),  # this and the next four: the trained trajectories' (store/step_figures.py)
    Column("success_rate", Float),
    Column("turns_mean", Float),  # agent turns per trained task
    Column("turns_max", Integer),
    Column("env_figures", SafeText),  # JSON {env: {num_trajectories, reward_mean, success_rate}} (null: none recorded)
    Column("max_staleness", Integer),
    Column("ras", Integer),
    Column("tprm_s", Float),
    Column("ra2p_mode", String),
    Column("loss", Float),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("ts", Float, nullable=False),
    Column("rank", Integer),
    Column("source", String, nullable=False),  # control, rank, trainer, store, ...
    Column("kind", String, nullable=False),
    Column("message", SafeText, nullable=False),
    Column("data", SafeText),  # JSON
    Index("ix_events_ts", "ts"),
)

metrics = Table(
    "metrics",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("ts", Float, nullable=False),
    Column("version", Integer),
    Column("rank", Integer),
    Column("role", String),
    Column("name", String, nullable=False),
    Column("value", Float, nullable=False),
    Index("ix_metrics_name", "name", "ts"),
)

# The current time in Unix seconds, per dialect: the one expression the views cannot share.
VIEW_NOW_S = {
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
    "postgresql": "CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)",
}

# SQL views: `sqlite3 RUN_DIR/run.db 'select * from step_summary'`. Documented in docs/run-store.md.
# `{now_s}` stands for VIEW_NOW_S of the store's dialect. Averages of integer columns are taken over
# DOUBLE PRECISION (REAL affinity on SQLite): PostgreSQL's avg(integer) is an exact numeric.
VIEWS: dict[str, str] = {
    "step_summary": """
        SELECT v.version, v.duration_s, v.num_trajectories, v.consumed_tokens,
               CASE WHEN v.duration_s > 0 THEN v.consumed_tokens / v.duration_s END AS goodput_tok_s,
               v.reward_mean, v.success_rate, v.max_staleness, v.ras, v.tprm_s, v.ra2p_mode, v.loss,
               v.turns_mean, v.turns_max, v.env_figures
        FROM versions v WHERE v.version > 0 ORDER BY v.version""",
    "rank_roles": """
        SELECT r.rank, r.role, r.state, r.version, r.host, r.pid,
               {now_s} - r.heartbeat_at AS heartbeat_age_s,
               (SELECT c.role FROM control c WHERE c.rank = r.rank ORDER BY c.version DESC LIMIT 1)
                   AS planned_role,
               (SELECT c.version FROM control c WHERE c.rank = r.rank ORDER BY c.version DESC LIMIT 1)
                   AS planned_from_version
        FROM ranks r ORDER BY r.rank""",
    "buffer_state": """
        SELECT
          (SELECT count(*) FROM tasks WHERE state = 'pending') AS tasks_pending,
          (SELECT count(*) FROM tasks WHERE state = 'running') AS tasks_running,
          (SELECT count(*) FROM tasks WHERE state = 'done') AS tasks_done,
          (SELECT count(*) FROM tasks WHERE state = 'failed') AS tasks_failed,
          (SELECT count(*) FROM trajectories WHERE state = 'waiting') AS traj_waiting_group,
          (SELECT count(*) FROM trajectories WHERE state = 'ready') AS traj_ready,
          (SELECT count(*) FROM trajectories WHERE state = 'claimed') AS traj_claimed,
          (SELECT count(*) FROM trajectories WHERE state = 'consumed') AS traj_consumed,
          (SELECT coalesce(sum(num_tokens), 0) FROM trajectories WHERE state = 'ready') AS ready_tokens,
          (SELECT count(*) FROM task_groups WHERE state = 'ready') AS groups_ready""",
    "eval_summary": """
        SELECT g.eval_version, count(*) AS num_tasks, avg(t.reward) AS reward_mean,
               avg(CAST(t.success AS DOUBLE PRECISION)) AS success_rate
        FROM trajectories t JOIN task_groups g ON g.id = t.group_id
        WHERE g.kind = 'eval' GROUP BY g.eval_version ORDER BY g.eval_version""",
}


def view_sql(name: str, dialect: str) -> str:
    """The SELECT of view `name` for a dialect ("sqlite" or "postgresql")."""
    return VIEWS[name].format(now_s=VIEW_NOW_S[dialect])
