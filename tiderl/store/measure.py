"""What the control plane measures of each finished step for ERS (`tiderl.policy.ers.StepObservation`,
through `ControlPlane._observe`): the published versions (each step's boundaries and readiness figures),
the window of a step (`StepWindow`: groups completed, task and environment seconds, rank-seconds of
the rollout and wait metrics), the stale drops, the oldest ready trajectory and the newest stage times.
Read-only, on the store's engine and transactions (`RunStore.measure`); `tiderl status` and `report`
show some of the same figures."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, func, or_, select

from tiderl.store.schema import events, metrics, task_groups, tasks, trajectories, versions
from tiderl.store.types import GroupState, StepWindow, TaskKind, TrajectoryState

if TYPE_CHECKING:
    from tiderl.store.runstore import RunStore


class StepMeasure:
    """The ERS measurement reads of a run store (`store.measure`)."""

    def __init__(self, store: RunStore) -> None:
        self.tx = store.tx

    def version_rows(self) -> list[dict[str, Any]]:
        """Every published version with its publish time and step statistics, ascending."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(versions.c.version, versions.c.created_at, versions.c.step_started_at, versions.c.duration_s,
                   versions.c.num_trajectories, versions.c.consumed_tokens, versions.c.reward_mean,
                   versions.c.success_rate, versions.c.max_staleness, versions.c.ras, versions.c.tprm_s,
                   versions.c.ra2p_mode, versions.c.loss, versions.c.turns_mean,
                   versions.c.turns_max).order_by(versions.c.version)).mappings()])

    def step_window(self, version: int, start_ts: float, end_ts: float) -> StepWindow:
        """What ERS reads of the step that published `version` (tiderl.policy.ers.StepObservation): the
        trajectory tokens it trained on and those of the groups it dropped as stale, the training groups completed in
        [start_ts, end_ts) (their tokens, creation-to-completion seconds, slowest task's environment
        seconds, tasks, and the tasks' environment seconds, seconds in a task slot and waits for one), the rank-seconds
        of the rollout and wait metrics recorded in it, by metric and role, and whether an evaluation
        group was open during it."""
        def read(c: Connection) -> StepWindow:
            rows = c.execute(
                select(task_groups.c.created_at, task_groups.c.completed_at,
                       func.sum(trajectories.c.num_tokens).label("tokens"),
                       func.max(func.coalesce(trajectories.c.env_s, 0.0)).label("env_s"),
                       func.count(trajectories.c.id).label("tasks"),
                       func.sum(func.coalesce(trajectories.c.env_s, 0.0)).label("task_env_s"),
                       # From the task's (last) claim by a rollout rank to its end: its time in a task slot.
                       func.sum(func.coalesce(trajectories.c.finished_at - tasks.c.claimed_at, 0.0)).label("slot_s"),
                       func.sum(func.coalesce(tasks.c.claimed_at - task_groups.c.created_at, 0.0)).label("wait_s"))
                .join(trajectories, trajectories.c.group_id == task_groups.c.id)
                .join(tasks, tasks.c.id == trajectories.c.task_id)
                .where(task_groups.c.kind == TaskKind.TRAIN.value, task_groups.c.completed_at >= start_ts,
                       task_groups.c.completed_at < end_ts)
                .group_by(task_groups.c.id, task_groups.c.created_at, task_groups.c.completed_at)).all()
            sums = c.execute(select(metrics.c.name, metrics.c.role, func.sum(metrics.c.value))
                             .where(metrics.c.ts >= start_ts, metrics.c.ts < end_ts,
                                    metrics.c.name.in_(("rollout_idle_s", "rollout_busy_s", "twt_s")))
                             .group_by(metrics.c.name, metrics.c.role)).all()
            consumed = c.execute(select(versions.c.trained_tokens).where(versions.c.version == version)).scalar()
            dropped = _dropped_groups(c, start_ts, end_ts)
            dropped_tokens = c.execute(select(func.sum(trajectories.c.num_tokens)).where(
                trajectories.c.group_id.in_(dropped))).scalar() if dropped else 0
            evals = c.execute(select(func.count()).select_from(task_groups).where(
                task_groups.c.kind == TaskKind.EVAL.value, task_groups.c.created_at < end_ts,
                or_(task_groups.c.state == GroupState.OPEN.value, task_groups.c.completed_at >= start_ts))).scalar()
            return StepWindow(
                evaluation=bool(evals),
                groups_completed=len(rows), produced_tokens=int(sum(r.tokens or 0 for r in rows)),
                group_latency_sum_s=sum(max(0.0, r.completed_at - r.created_at) for r in rows),
                group_env_sum_s=sum(r.env_s or 0.0 for r in rows),
                tasks_completed=int(sum(r.tasks or 0 for r in rows)),
                task_env_sum_s=sum(r.task_env_s or 0.0 for r in rows),
                task_slot_sum_s=sum(max(0.0, r.slot_s or 0.0) for r in rows),
                task_wait_sum_s=sum(max(0.0, r.wait_s or 0.0) for r in rows),
                rank_s={(name, role): float(v or 0.0) for name, role, v in sums},
                consumed_tokens=int(consumed or 0), stale_dropped_tokens=int(dropped_tokens or 0))

        return self.tx.read(read)

    def dropped_groups(self, start_ts: float | None = None, end_ts: float | None = None) -> list[int]:
        """The training groups dropped as too stale to train in [start_ts, end_ts) (all of the run's when
        unbounded): those the trainer dropped at its claim and those the control plane dropped while open."""
        return self.tx.read(lambda c: _dropped_groups(c, start_ts, end_ts))

    def oldest_ready_at(self) -> float | None:
        """When the oldest trajectory still waiting for the trainer became ready."""
        return self.tx.read(lambda c: c.execute(select(func.min(trajectories.c.ready_at)).where(
            trajectories.c.state == TrajectoryState.READY.value)).scalar())

    def latest_metrics(self, names: Iterable[str]) -> dict[str, float]:
        """The newest value of each metric in `names` that has one."""
        def read(c: Connection) -> dict[str, float]:
            out = {}
            for n in names:
                v = c.execute(select(metrics.c.value).where(metrics.c.name == n)
                              .order_by(metrics.c.id.desc()).limit(1)).scalar()
                if v is not None:
                    out[n] = float(v)
            return out

        return self.tx.read(read)


def _dropped_groups(c: Connection, start_ts: float | None, end_ts: float | None) -> list[int]:
    """Each drop (drop_claimed_groups, drop_doomed_groups) writes one `groups_dropped` event in the
    transaction that drops its groups, listing them."""
    q = select(events.c.data).where(events.c.kind == "groups_dropped")
    if start_ts is not None:
        q = q.where(events.c.ts >= start_ts)
    if end_ts is not None:
        q = q.where(events.c.ts < end_ts)
    return [g for (data,) in c.execute(q) for g in json.loads(data or "{}").get("groups", [])]
