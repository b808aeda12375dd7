"""The monitoring reads of a run store: what `tiderl status` (and its diagnosis), `tiderl report`, the
Prometheus exporter (`tiderl.observe.metrics`) and the TensorBoard writer (`tiderl.observe.tboard`) read,
and no process of the run. Read-only, on the store's engine and transactions (`RunStore.reader`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Float, cast, func, select

from tiderl.store.schema import control, metrics, task_groups, tasks, trajectories, versions
from tiderl.store.types import GroupState, StoreTaskState, TaskKind, TrajectoryState

if TYPE_CHECKING:
    from tiderl.store.runstore import RunStore


class RunReader:
    """The monitoring reads of a run store (`store.reader`)."""

    def __init__(self, store: RunStore) -> None:
        self.tx = store.tx
        self.dialect = store.dialect  # "sqlite" or "postgresql" (tiderl.store.cursor.MetricCursor reads it)

    def outstanding_groups(self) -> list[dict[str, Any]]:
        """Groups not finished with (open, ready, claimed), oldest first: their finished-task count and
        their unfinished tasks (`unfinished`: pending or running task rows)."""
        live = (GroupState.OPEN.value, GroupState.READY.value, GroupState.CLAIMED.value)

        def read(c: Connection) -> list[dict[str, Any]]:
            done = (select(trajectories.c.group_id, func.count().label("n")).group_by(trajectories.c.group_id)
                    .subquery())
            groups = [dict(r) | {"unfinished": []} for r in c.execute(
                select(task_groups.c.id, task_groups.c.kind, task_groups.c.state, task_groups.c.size,
                       task_groups.c.created_at, func.coalesce(done.c.n, 0).label("num_done"))
                .outerjoin(done, done.c.group_id == task_groups.c.id)
                .where(task_groups.c.state.in_(live)).order_by(task_groups.c.id)).mappings()]
            by_id = {g["id"]: g for g in groups}
            for t in c.execute(select(tasks.c.id, tasks.c.group_id, tasks.c.state, tasks.c.owner_rank,
                                      tasks.c.claimed_at, tasks.c.attempts, tasks.c.last_error, tasks.c.turn,
                                      tasks.c.phase, tasks.c.phase_since, tasks.c.env_server)
                               .where(tasks.c.state.in_([StoreTaskState.PENDING.value, StoreTaskState.RUNNING.value]))
                               .order_by(tasks.c.id)).mappings():
                if t["group_id"] in by_id:
                    by_id[t["group_id"]]["unfinished"].append(dict(t))
            return groups

        return self.tx.read(read)

    def trainer_claims(self) -> list[dict[str, Any]]:
        """Per trainer rank holding claimed trajectories: how many groups and its latest claim time."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(trajectories.c.claim_owner.label("rank"),
                   func.count(func.distinct(trajectories.c.group_id)).label("groups"),
                   func.max(trajectories.c.claimed_at).label("latest_claimed_at"))
            .where(trajectories.c.state == TrajectoryState.CLAIMED.value)
            .group_by(trajectories.c.claim_owner)).mappings()])

    def metric_sums(self, names: Sequence[str], *, since: float | None = None) -> list[dict[str, Any]]:
        """Sum (`value`), count, largest value (`max`) and last time of each metric per (name, rank, role), over
        rows recorded at or after `since`."""
        def read(c: Connection) -> list[dict[str, Any]]:
            q = (select(metrics.c.name, metrics.c.rank, metrics.c.role, func.sum(metrics.c.value).label("value"),
                        func.count().label("count"), func.max(metrics.c.value).label("max"),
                        func.max(metrics.c.ts).label("last_ts"))
                 .where(metrics.c.name.in_(list(names))))
            if since is not None:
                q = q.where(metrics.c.ts >= since)
            return [dict(r) for r in c.execute(q.group_by(metrics.c.name, metrics.c.rank, metrics.c.role))
                    .mappings()]

        return self.tx.read(read)

    def metric_rows(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """Every recorded point of these metrics (ts, version, rank, role, name, value), in time order."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(metrics.c.ts, metrics.c.version, metrics.c.rank, metrics.c.role, metrics.c.name,
                   metrics.c.value).where(metrics.c.name.in_(list(names))).order_by(metrics.c.ts, metrics.c.id))
            .mappings()])

    def metric_rows_after(self, after_id: int, names: Sequence[str], *, limit: int = 50_000) -> list[dict[str, Any]]:
        """Points of these metrics recorded after row `after_id` (id, ts, version, rank, role, name, value), in
        id order, at most `limit`: an incremental reader keeps the last id and asks again."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(metrics.c.id, metrics.c.ts, metrics.c.version, metrics.c.rank, metrics.c.role, metrics.c.name,
                   metrics.c.value).where(metrics.c.id > after_id, metrics.c.name.in_(list(names)))
            .order_by(metrics.c.id).limit(limit)).mappings()])

    def control_rows(self) -> list[dict[str, Any]]:
        """Every role record (version, rank, role, ra2p_mode, created_at), ascending by version."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(control.c.version, control.c.rank, control.c.role, control.c.ra2p_mode, control.c.created_at)
            .order_by(control.c.version, control.c.rank)).mappings()])

    def staleness_counts(self) -> list[dict[str, Any]]:
        """Trained trajectories and their generated tokens per staleness (versions between the oldest
        weights that generated a token and the weights the step trained)."""
        staleness = (trajectories.c.consumed_version - 1 - trajectories.c.min_version).label("staleness")
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(staleness, func.count().label("trajectories"),
                   func.sum(trajectories.c.num_generated).label("tokens"))
            .where(trajectories.c.state == TrajectoryState.CONSUMED.value)
            .group_by(staleness).order_by(staleness)).mappings()])

    def group_holding(self, from_version: int = 1) -> dict[str, Any]:
        """Where the trained training groups created at the publication of `from_version` or later spent
        their time in flight (a group created during the start-up waits for the engines to start), means
        per group in seconds, as the simulator's `group_holding` (docs/simulator.md): from its creation
        to its completion (the report of its last task), until the trainer's claim of its first
        trajectory, and until the publication of the version that trained it."""
        start = select(versions.c.created_at).where(versions.c.version == from_version).scalar_subquery()
        rows = self.tx.read(lambda c: c.execute(
            select(task_groups.c.created_at, task_groups.c.completed_at,
                   func.min(trajectories.c.claimed_at).label("claimed_at"),
                   versions.c.created_at.label("published_at"))
            .join(trajectories, trajectories.c.group_id == task_groups.c.id)
            .join(versions, versions.c.version == trajectories.c.consumed_version)
            .where(task_groups.c.kind == TaskKind.TRAIN.value, task_groups.c.created_at >= start)
            .group_by(task_groups.c.id, task_groups.c.created_at, task_groups.c.completed_at,
                      versions.c.created_at)).all())
        rows = [r for r in rows if r.completed_at is not None and r.claimed_at is not None]
        n = len(rows)

        def mean(values: Iterable[float]) -> float | None:
            return round(sum(values) / n, 3) if n else None

        return {"groups": n,
                "release_to_seen_s": mean(r.completed_at - r.created_at for r in rows),
                "seen_to_claim_s": mean(r.claimed_at - r.completed_at for r in rows),
                "claim_to_publish_s": mean(r.published_at - r.claimed_at for r in rows)}

    def eval_rows(self) -> list[dict[str, Any]]:
        """Per evaluated version: tasks, mean reward, success rate and the time the last task finished."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(task_groups.c.eval_version, func.count().label("num_tasks"),
                   func.avg(trajectories.c.reward).label("reward_mean"),
                   func.avg(cast(trajectories.c.success, Float)).label("success_rate"),
                   func.max(trajectories.c.finished_at).label("finished_at"))
            .join(task_groups, task_groups.c.id == trajectories.c.group_id)
            .where(task_groups.c.kind == TaskKind.EVAL.value)
            .group_by(task_groups.c.eval_version).order_by(task_groups.c.eval_version)).mappings()])
