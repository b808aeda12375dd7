"""The ranks' side of the run store: a rank's registration, heartbeats, task claims and its tick's
report, each one transaction (the exactly-once rules are in `tiderl.store.runstore`)."""

from __future__ import annotations

import functools
import json
import os
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, case, func, insert, or_, select, update

from tiderl.advantages import group_advantages
from tiderl.policy.ctb import claim_limit
from tiderl.store import codec
from tiderl.store.engine import Transactor
from tiderl.store.schema import events, metrics, ranks, task_groups, tasks, trajectories
from tiderl.store.shared_tx import fail_group, record_heartbeat
from tiderl.store.types import (
    ClaimRequest,
    FinishedTrajectory,
    GroupState,
    RankReport,
    RankState,
    Role,
    StoreTaskState,
    TaskClaim,
    TaskKind,
    TrajectoryState,
)


class RankTransactions:
    """A rank's transactions (a mixin of `RunStore`)."""

    tx: Transactor
    _beats: dict[int, float]  # rank -> monotonic time of this process's last write beating it

    def register_rank(self, rank: int, role: Role, *, host: str | None = None, pid: int | None = None) -> None:
        now = time.time()
        values = dict(role=role.value, state=RankState.RUNNING.value, host=host or socket.gethostname(),
                      pid=pid if pid is not None else os.getpid(), started_at=now, heartbeat_at=now)

        def upsert(c: Connection) -> None:
            if c.execute(update(ranks).where(ranks.c.rank == rank).values(**values)).rowcount == 0:
                c.execute(insert(ranks).values(rank=rank, version=0, **values))

        self.tx.write(upsert)

    def heartbeat(self, rank: int) -> None:
        self.tx.write(lambda c: record_heartbeat(c, rank, time.time()), run_lock=False)  # one row: its own lock
        self._beats[rank] = time.monotonic()

    def beat_age_s(self, rank: int) -> float | None:
        """Seconds since a write of this process carried `rank`'s heartbeat (`heartbeat`, or a tick's
        `report`); None: none yet. A rank's heartbeat thread skips its own write while its reports beat."""
        at = self._beats.get(rank)
        return None if at is None else time.monotonic() - at

    def set_rank_state(self, rank: int, state: RankState) -> None:
        self.tx.write(lambda c: c.execute(update(ranks).where(ranks.c.rank == rank).values(state=state.value)))

    def claim_tasks(self, rank: int, limit: int, *, kinds: Iterable[TaskKind] = tuple(TaskKind),
                    weights_version: int | None = None) -> list[TaskClaim]:
        """Take up to `limit` pending tasks for `rank`: evaluation tasks first, then whole groups,
        oldest first. With `weights_version` (the weights the rank's engine holds), only the
        evaluation tasks of exactly that version qualify: an evaluation runs on the weights it
        evaluates, never on newer ones. (A rank reporting every tick claims inside its report
        instead: `RankReport.claim`, one transaction for both.)"""
        if limit <= 0:
            return []
        request = ClaimRequest(limit=limit, kinds=tuple(kinds), weights_version=weights_version)
        token = uuid.uuid4().hex  # once per call: a retry finds what a cut-off commit claimed

        attempts = [0]  # of this call's transaction: only a retry may find an earlier attempt committed

        def write(c: Connection) -> list[TaskClaim]:
            attempts[0] += 1
            now = time.time()
            record_heartbeat(c, rank, now)
            return _claim(c, rank, request, now, token, retry=attempts[0] > 1)

        return self.tx.write(write)

    def report(self, report: RankReport, *, max_attempts: int = 3, retry_backoff_s: float = 0.0) -> dict[str, Any]:
        """Apply a rank's tick in one transaction: heartbeat, finished trajectories, failures,
        releases, task whereabouts, metrics, events, and last its claim of new tasks. Returns
        `accepted` and `dropped` trajectory counts and `claims` (the tasks claimed).

        A failed task goes back to pending, claimable from `retry_backoff_s` x 2^(attempts - 1) on,
        until its `max_attempts`-th failure fails it and its group; a task of a failed group never
        goes back to pending (released or failed, it fails too)."""
        token = uuid.uuid4().hex  # of the claim; once per call: a retry finds what a cut-off commit claimed

        attempts = [0]  # of this call's transaction: only a retry may find an earlier attempt committed

        def write(c: Connection) -> dict[str, Any]:
            attempts[0] += 1
            now = time.time()
            record_heartbeat(c, report.rank, now, role=report.role, version=report.version)
            touched = [t.task_id for t in report.finished] + [f.task_id for f in report.failed] + list(report.released)
            if touched and c.dialect.name == "postgresql":
                # Without the run's writer lock (below): the groups of the tasks this tick finishes, fails or
                # releases are locked first, in id order, so that a group's completion counts every sibling
                # trajectory another report committed and a group fails or completes once.
                c.execute(_LOCK_GROUPS_OF_TASKS, dict(p_ids=sorted(set(touched))))
            accepted, dropped = _accept_trajectories(c, report.rank, report.finished, now)
            for f in report.failed:
                row = c.execute(select(tasks.c.attempts, tasks.c.group_id).where(
                    tasks.c.id == f.task_id, tasks.c.owner_rank == report.rank,
                    tasks.c.state == StoreTaskState.RUNNING.value)).first()
                if row is None:
                    continue
                final = row.attempts >= max_attempts
                retry_at = now + retry_backoff_s * 2 ** max(0, row.attempts - 1) if retry_backoff_s > 0 else None
                if not c.execute(update(tasks).where(  # still its: a reclaim may have come between
                        tasks.c.id == f.task_id, tasks.c.owner_rank == report.rank,
                        tasks.c.state == StoreTaskState.RUNNING.value).values(
                        state=(StoreTaskState.FAILED if final else StoreTaskState.PENDING).value, owner_rank=None,
                        claim_token=None, last_error=f.reason[:2000], updated_at=now, retry_at=retry_at)).rowcount:
                    continue
                if final:
                    fail_group(c, row.group_id)
            if report.released:
                c.execute(update(tasks).where(tasks.c.id.in_(report.released), tasks.c.owner_rank == report.rank,
                                              tasks.c.state == StoreTaskState.RUNNING.value).values(
                    state=StoreTaskState.PENDING.value, owner_rank=None, claim_token=None, updated_at=now,
                    attempts=tasks.c.attempts - 1, progress=None))
            if report.failed or report.released:  # a task of a group that failed meanwhile fails with it
                touched = [f.task_id for f in report.failed] + list(report.released)
                failed_groups = select(task_groups.c.id).where(task_groups.c.state == GroupState.FAILED.value)
                c.execute(update(tasks).where(tasks.c.id.in_(touched), tasks.c.state == StoreTaskState.PENDING.value,
                                              tasks.c.group_id.in_(failed_groups)).values(
                    state=StoreTaskState.FAILED.value, last_error="its group failed or was dropped meanwhile",
                    progress=None))
            handed = [dict(tid=t, prog=json.dumps(p)) for t, p in report.handed_over.items()
                      if t in set(report.released)]
            if handed:  # just released by this rank above: pending, no owner
                c.execute(update(tasks).where(tasks.c.id == bindparam("tid"), tasks.c.owner_rank.is_(None),
                                              tasks.c.state == StoreTaskState.PENDING.value).values(
                    progress=bindparam("prog")), handed)
            if report.whereabouts:
                c.execute(update(tasks).where(tasks.c.id == bindparam("tid"), tasks.c.owner_rank == report.rank,
                                              tasks.c.state == StoreTaskState.RUNNING.value).values(
                    turn=bindparam("t_turn"), phase=bindparam("t_phase"), phase_since=bindparam("t_since"),
                    env_server=bindparam("t_server")),
                    [dict(tid=w.task_id, t_turn=w.turn, t_phase=w.phase, t_since=w.phase_since,
                          t_server=w.env_server) for w in report.whereabouts])
            claims = (_claim(c, report.rank, report.claim, now, token, retry=attempts[0] > 1)
                      if report.claim is not None else [])
            # Last, after every statement that may wait on a row lock: the ids these rows draw become visible
            # a moment later (tiderl.store.cursor counts on it).
            if report.metrics:
                c.execute(_INSERT_METRICS, [dict(ts=now, version=m.version, rank=report.rank, role=m.role, name=m.name,
                                                 value=float(m.value)) for m in report.metrics])
            if report.events:
                c.execute(insert(events), [dict(ts=now, rank=report.rank, source="rank", kind=e.kind,
                                                message=e.message, data=json.dumps(e.data) if e.data else None)
                                           for e in report.events])
            return {"accepted": accepted, "dropped": dropped, "claims": claims}

        # The run's writers take turns, but a report locks the rows it depends on itself (PostgreSQL; SQLite
        # has one write lock): ranks report at once, each waiting only for reports of the same groups.
        out = self.tx.write(write, run_lock=False)
        self._beats[report.rank] = time.monotonic()
        return out


# ---- helpers running inside a rank's transactions ------------------------------------------
# Statements of every tick, built once (building one and its cache key is much of a report's CPU).
_MARK_DONE = update(tasks).where(
    tasks.c.id.in_(bindparam("p_ids", expanding=True)), tasks.c.owner_rank == bindparam("p_rank"),
    tasks.c.state == StoreTaskState.RUNNING.value).values(
    state=StoreTaskState.DONE.value, updated_at=bindparam("p_now")).returning(
    tasks.c.id, tasks.c.group_id, tasks.c.kind)
_INSERT_TRAJECTORIES = insert(trajectories)
_LOCK_GROUPS_OF_TASKS = select(task_groups.c.id).where(task_groups.c.id.in_(
    select(tasks.c.group_id).where(tasks.c.id.in_(bindparam("p_ids", expanding=True))))).order_by(
    task_groups.c.id).with_for_update()
_INSERT_METRICS = insert(metrics)
_counts = (select(trajectories.c.group_id, func.count().label("n"))
           .where(trajectories.c.group_id.in_(bindparam("p_gids", expanding=True)))
           .group_by(trajectories.c.group_id).subquery())
_COMPLETE_GROUPS = select(task_groups.c.id, task_groups.c.kind).join(
    _counts, _counts.c.group_id == task_groups.c.id).where(
    task_groups.c.state == GroupState.OPEN.value, _counts.c.n >= task_groups.c.size)


def _accept_trajectories(c: Connection, rank: int, finished: Sequence[FinishedTrajectory], now: float) -> tuple[int, int]:
    """Insert the trajectories of tasks `rank` still owns; drop the rest (reclaimed meanwhile)."""
    if not finished:
        return 0, 0
    # One statement finds the tasks `rank` still owns and marks them done (writers of a run take turns, and
    # the WHERE is re-checked under the row lock: a task reclaimed meanwhile is not returned).
    owned = {r.id: r for r in c.execute(_MARK_DONE, dict(p_ids=sorted({t.task_id for t in finished}), p_rank=rank,
                                                         p_now=now))}
    rows = []
    for t in finished:
        task = owned.pop(t.task_id, None)  # pop: a task reported twice in one tick counts once
        if task is None:
            continue
        gen_versions = [v for v, m in zip(t.token_versions, t.loss_mask) if m]
        rows.append(dict(
            task_id=t.task_id, group_id=task.group_id, kind=task.kind, rank=rank, state=TrajectoryState.WAITING.value,
            token_ids=codec.pack_ints(t.token_ids), loss_mask=codec.pack_mask(t.loss_mask),
            logprobs=codec.pack_floats(t.logprobs), token_versions=codec.pack_ints(t.token_versions),
            num_tokens=len(t.token_ids), num_generated=len(gen_versions), num_turns=t.num_turns,
            reward=float(t.reward), success=int(bool(t.success)), min_version=min(gen_versions, default=0),
            max_version=max(gen_versions, default=0), finished_at=now, env_s=t.env_s, finish=t.finish, env=t.env,
            images=codec.pack_blobs(t.images) if t.images else None,
            prunes=json.dumps([list(p) for p in t.prunes]) if t.prunes else None))
    if rows:
        c.execute(_INSERT_TRAJECTORIES, rows)
        _complete_groups(c, {r["group_id"] for r in rows}, now)
    # Not owned any more, yet recorded from this rank: this call's earlier attempt committed (a retry).
    redone = {t for (t,) in c.execute(select(trajectories.c.task_id).where(
        trajectories.c.task_id.in_([t.task_id for t in finished if t.task_id not in {r["task_id"] for r in rows}]),
        trajectories.c.rank == rank))} if len(rows) < len(finished) else set()
    accepted = len(rows) + len(redone)
    return accepted, len({t.task_id for t in finished}) - accepted


def _complete_groups(c: Connection, gids: set[int], now: float) -> None:
    """Groups among `gids` whose every task has a trajectory: write advantages, mark them ready."""
    complete = c.execute(_COMPLETE_GROUPS, dict(p_gids=sorted(gids))).all()
    ready_rows = []
    for gid, kind in complete:
        if kind == TaskKind.EVAL.value:
            c.execute(update(trajectories).where(trajectories.c.group_id == gid).values(
                state=TrajectoryState.EVAL.value, ready_at=now))
            state = GroupState.EVALUATED
        else:
            rows = c.execute(select(trajectories.c.id, trajectories.c.reward).where(trajectories.c.group_id == gid)
                             .order_by(trajectories.c.id)).all()
            advantages = group_advantages([r for _, r in rows])
            ready_rows += [{"tid": tid, "adv": adv} for (tid, _), adv in zip(rows, advantages)]
            state = GroupState.READY
        c.execute(update(task_groups).where(task_groups.c.id == gid).values(state=state.value, completed_at=now))
    if ready_rows:
        c.execute(update(trajectories).where(trajectories.c.id == bindparam("tid")).values(
            advantage=bindparam("adv"), state=TrajectoryState.READY.value, ready_at=now), ready_rows)


def _claim(c: Connection, rank: int, request: ClaimRequest, now: float, token: str, *,
           retry: bool = True) -> list[TaskClaim]:
    """Claim per `request` with `token`, in one statement: the oldest claimable tasks (evaluation tasks
    first, then whole groups) go to running and come back. `retry`: an earlier attempt of this call may
    have committed (its COMMIT cut off); then what it claimed is returned, nothing more. A first attempt
    (`retry=False`) cannot have committed anything, so it skips that look-up."""
    if request.limit <= 0:
        return []
    if retry and c.execute(select(tasks.c.id).where(tasks.c.claim_token == token).limit(1)).first() is not None:
        return _claimed(c, token)  # this call's earlier attempt committed before its connection was cut
    claim, counts = _claim_statements(tuple(k.value for k in request.kinds), request.weights_version is not None)
    params = dict(p_now=now, p_rank=rank, p_token=token, p_wv=request.weights_version)
    limit = request.limit
    if request.spread:  # `tiderl.policy.ctb.claim_limit` with the store's counts, in one statement
        n_running, n_claimable, held, alive = c.execute(counts, params).one()
        limit = claim_limit(limit, held, n_running + n_claimable, alive)
        if limit <= 0:
            return []
    # The tasks the UPDATE's subquery picks are still pending when it updates them: SQLite's writers take
    # turns; PostgreSQL's subquery locks the rows it picks and passes over those another claim holds.
    rows = sorted(c.execute(claim, params | {"p_lim": limit}), key=lambda r: r.id)
    carried = [r.id for r in rows if r.progress is not None]
    if carried:  # progress is carried on once: if this claimer dies, the session may have moved past it
        c.execute(update(tasks).where(tasks.c.id.in_(carried)).values(progress=None))
    return [_task_claim(r) for r in rows]


@functools.lru_cache(maxsize=64)
def _claim_statements(kinds: tuple[str, ...], pinned: bool) -> tuple[Any, Any]:
    """The claim, built once per (kinds, pinned to a weights version) and reused, its cache key with it (the
    Python work of building a statement is much of a report's CPU): one UPDATE ... RETURNING whose subquery
    picks the oldest claimable tasks (evaluation tasks first, then by id: whole groups first), and the
    counts a spread claim needs (tasks running on any rank or claimable now, the rank's running tasks, the
    rollout ranks alive). Parameters: p_now, p_rank, p_token, p_wv (weights version), p_lim."""
    is_eval = tasks.c.kind == TaskKind.EVAL.value
    where = [tasks.c.state == StoreTaskState.PENDING.value, tasks.c.kind.in_(list(kinds)),
             or_(tasks.c.retry_at.is_(None), tasks.c.retry_at <= bindparam("p_now"))]
    if pinned:
        where.append(~is_eval | tasks.c.group_id.in_(
            select(task_groups.c.id).where(task_groups.c.eval_version == bindparam("p_wv"))))
    # Its own FROM tasks, not the UPDATE's row. SKIP LOCKED (PostgreSQL): reports claim without the run's
    # writer lock, each passing over the pending rows another claim is taking.
    # A CTE, evaluated once: PostgreSQL may run an IN subquery with LIMIT ... FOR UPDATE more than once.
    picked = select(select(tasks.c.id).where(*where).order_by(case((is_eval, 0), else_=1), tasks.c.id)
                    .limit(bindparam("p_lim")).with_for_update(skip_locked=True).cte("picked").c.id)
    eval_version = (select(task_groups.c.eval_version).where(task_groups.c.id == tasks.c.group_id)
                    .correlate(tasks).scalar_subquery())
    claim = update(tasks).where(tasks.c.id.in_(picked), tasks.c.state == StoreTaskState.PENDING.value).values(
        state=StoreTaskState.RUNNING.value, owner_rank=bindparam("p_rank"), claim_token=bindparam("p_token"),
        claimed_at=bindparam("p_now"), updated_at=bindparam("p_now"), attempts=tasks.c.attempts + 1, turn=None,
        phase=None, phase_since=None, env_server=None).returning(
        tasks.c.id, tasks.c.group_id, tasks.c.index_in_group, tasks.c.kind, tasks.c.seed, tasks.c.attempts,
        tasks.c.progress, eval_version.label("eval_version"))
    running = tasks.c.state == StoreTaskState.RUNNING.value
    counts = select(
        select(func.count()).select_from(tasks).where(running).scalar_subquery(),
        select(func.count()).select_from(tasks).where(*where).scalar_subquery(),
        select(func.count()).select_from(tasks).where(running, tasks.c.owner_rank == bindparam("p_rank"))
        .scalar_subquery(),
        select(func.count()).select_from(ranks).where(
            ranks.c.role == Role.ROLLOUT.value,
            ranks.c.state.in_([RankState.STARTING.value, RankState.RUNNING.value])).scalar_subquery())
    return claim, counts


def _claimed(c: Connection, token: str) -> list[TaskClaim]:
    """The tasks claimed with `token` that their claimer still holds."""
    q = (select(tasks, task_groups.c.eval_version).join(task_groups, task_groups.c.id == tasks.c.group_id)
         .where(tasks.c.claim_token == token, tasks.c.state == StoreTaskState.RUNNING.value).order_by(tasks.c.id))
    return [_task_claim(r) for r in c.execute(q)]


def _task_claim(r: Any) -> TaskClaim:
    return TaskClaim(task_id=r.id, group_id=r.group_id, index_in_group=r.index_in_group, kind=TaskKind(r.kind),
                     seed=r.seed, attempts=r.attempts, eval_version=r.eval_version,
                     progress=json.loads(r.progress) if r.progress else None)
