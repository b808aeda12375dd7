"""The control plane's side of the run store: the plans (which the ranks read), the feed of groups,
the drop of doomed groups, evaluations, and the heartbeat watch that declares ranks dead and returns
their claims, each one transaction (the exactly-once rules are in `tiderl.store.runstore`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

from sqlalchemy import Connection, and_, func, insert, select, update

from tiderl.policy.ra2p import Ra2pMode
from tiderl.store.engine import OUTAGE_RETRY_LAG_S, Transactor
from tiderl.store.schema import control, events, ranks, runs, task_groups, tasks, trajectories
from tiderl.store.shared_tx import fail_group, return_trajectories
from tiderl.store.types import (
    GroupState,
    NewGroup,
    PlanRecord,
    RankState,
    ReclaimResult,
    Role,
    StoreTaskState,
    TaskKind,
)
from tiderl.store.watch import WatchState, watch_verdict

log = logging.getLogger("tiderl.store")


class ControlTransactions:
    """The control plane's transactions, and the reads of its plans (a mixin of `RunStore`)."""

    tx: Transactor
    _watch: WatchState  # this process's heartbeat watch (`reclaim_expired` with `control_tick`)

    # ---- plans ---------------------------------------------------------------------------
    def plan_roles(self, version: int, roles: dict[int, Role], *, ra2p_mode: Ra2pMode | str | None = None,
                   fetch_groups: int | None = None, reason: str = "") -> None:
        """Record the role of each rank from `version` on (a role switch takes effect at that sync
        boundary), with the RA2P mode and fetch size of step `version`, in one transaction."""
        now = time.time()
        mode = None if ra2p_mode is None else Ra2pMode.parse(ra2p_mode).value
        rows = [dict(version=version, rank=r, role=role.value, ra2p_mode=mode, fetch_groups=fetch_groups,
                     reason=reason, created_at=now) for r, role in sorted(roles.items())]

        def write(c: Connection) -> None:
            c.execute(control.delete().where(control.c.version == version))
            c.execute(insert(control), rows)

        self.tx.write(write)

    def roles_at(self, version: int) -> dict[int, Role]:
        """Each rank's role in force at `version`: its latest control record at or before it."""
        def read(c: Connection) -> dict[int, Role]:
            latest = (select(control.c.rank, func.max(control.c.version).label("v"))
                      .where(control.c.version <= version).group_by(control.c.rank).subquery())
            q = select(control.c.rank, control.c.role).join(
                latest, and_(control.c.rank == latest.c.rank, control.c.version == latest.c.v))
            return {r: Role(role) for r, role in c.execute(q)}

        return self.tx.read(read)

    def plan_at(self, version: int) -> PlanRecord | None:
        """The plan written for exactly `version`, or None while there is none."""
        def read(c: Connection) -> PlanRecord | None:
            rows = c.execute(select(control.c.rank, control.c.role, control.c.ra2p_mode, control.c.fetch_groups)
                             .where(control.c.version == version)).all()
            if not rows:
                return None
            return PlanRecord(version=version, roles={r.rank: Role(r.role) for r in rows},
                              ra2p_mode=Ra2pMode.parse(rows[0].ra2p_mode or Ra2pMode.COLOCATED.value),
                              fetch_groups=int(rows[0].fetch_groups or 1))

        return self.tx.read(read)

    def latest_planned_version(self) -> int | None:
        """The newest version that has a plan."""
        return self.tx.read(lambda c: c.execute(select(func.max(control.c.version))).scalar())

    # ---- groups and evaluations ----------------------------------------------------------
    def add_groups(self, groups: Sequence[NewGroup]) -> list[int]:
        """Create groups and their tasks (G tasks per group, all on the group's prompt seed)."""
        now = time.time()

        def write(c: Connection) -> list[int]:
            ids = []
            for g in groups:
                gid = c.execute(insert(task_groups).values(
                    kind=g.kind.value, prompt_seed=g.prompt_seed, size=g.size, eval_version=g.eval_version,
                    state=GroupState.OPEN.value, created_at=now)).inserted_primary_key[0]
                c.execute(insert(tasks), [dict(group_id=gid, index_in_group=i, kind=g.kind.value, seed=g.prompt_seed,
                                               state=StoreTaskState.PENDING.value, attempts=0, created_at=now,
                                               updated_at=now) for i in range(g.size)])
                ids.append(gid)
            return ids

        return self.tx.write(write)

    def drop_doomed_groups(self, oldest_version: int, reason: str) -> list[int]:
        """Never finish the open training groups that already hold a trajectory generated before
        `oldest_version` (the staleness bound of the coming step): no step may train them any more, so
        their unfinished tasks would be generated for nothing (a rollout rank would even restart the
        ones it holds, at its reload). The groups fail, their trajectories are dropped, their pending
        tasks fail; a task still running fails when its rank releases it and its late trajectory joins
        no group. One `groups_dropped` event lists them (the step's drops, as the trainer's). Returns
        the groups dropped."""
        def write(c: Connection) -> list[int]:
            doomed = sorted({g for (g,) in c.execute(select(trajectories.c.group_id).join(
                task_groups, task_groups.c.id == trajectories.c.group_id).where(
                task_groups.c.kind == TaskKind.TRAIN.value, task_groups.c.state == GroupState.OPEN.value,
                trajectories.c.min_version < oldest_version))})
            if not doomed:
                return []
            # Reports do not take the run's writer lock: a group a report completes meanwhile stays complete.
            doomed = [gid for gid in doomed if fail_group(c, gid, f"its group was dropped: {reason}")]
            if not doomed:
                return []
            c.execute(insert(events).values(ts=time.time(), rank=None, source="store", kind="groups_dropped",
                                            message=f"{len(doomed)} open groups dropped: {reason}",
                                            data=json.dumps({"groups": doomed})))
            return doomed

        return self.tx.write(write)

    def groups_by_state(self, kind: TaskKind) -> dict[GroupState, int]:
        """How many groups of `kind` are in each state (every state present, zeros included)."""
        def read(c: Connection) -> dict[GroupState, int]:
            rows = c.execute(select(task_groups.c.state, func.count()).where(task_groups.c.kind == kind.value)
                             .group_by(task_groups.c.state)).all()
            out = dict.fromkeys(GroupState, 0)
            out.update({GroupState(state): n for state, n in rows})
            return out

        return self.tx.read(read)

    def has_evaluation(self, eval_version: int) -> bool:
        return self.tx.read(lambda c: c.execute(select(func.count()).where(
            task_groups.c.kind == TaskKind.EVAL.value, task_groups.c.eval_version == eval_version)).scalar_one()) > 0

    def expire_evaluations(self, oldest_live_version: int) -> int:
        """Fail the pending evaluation tasks of versions older than `oldest_live_version`: no rank
        can hold those weights any more, so nobody could run them. Returns how many."""
        def write(c: Connection) -> int:
            old = select(task_groups.c.id).where(task_groups.c.kind == TaskKind.EVAL.value,
                                                 task_groups.c.eval_version < oldest_live_version)
            gids = sorted({g for (g,) in c.execute(select(tasks.c.group_id).where(
                tasks.c.state == StoreTaskState.PENDING.value, tasks.c.group_id.in_(old)))})
            if not gids:
                return 0
            n = c.execute(update(tasks).where(tasks.c.group_id.in_(gids), tasks.c.state == StoreTaskState.PENDING.value)
                          .values(state=StoreTaskState.FAILED.value, updated_at=time.time(),
                                  last_error=f"evaluation expired: no rank holds its weights version any more "
                                             f"(oldest live version {oldest_live_version})")).rowcount
            for gid in gids:
                fail_group(c, gid)
            c.execute(insert(events).values(ts=time.time(), rank=None, source="store", kind="eval_expired",
                                            message=f"{n} evaluation tasks of versions before {oldest_live_version} "
                                                    "expired", data=json.dumps({"groups": gids})))
            return n

        return self.tx.write(write)

    # ---- liveness ------------------------------------------------------------------------
    def declare_dead(self, rank: int, message: str) -> ReclaimResult:
        """A rank whose process is known to be gone (its launcher saw it exit): dead now, its claims
        back in the pool, without waiting for the heartbeat timeout."""
        def write(c: Connection) -> ReclaimResult:
            n_tasks, n_traj = _declare_dead(c, [rank], time.time(), {rank: message})
            return ReclaimResult([rank], n_tasks, n_traj)

        return self.tx.write(write)

    def reclaim_expired(self, timeout_s: float, *, now: float | None = None, control_tick: bool = False,
                        reason: str | None = None) -> ReclaimResult:
        """Mark ranks silent for `timeout_s` dead and return their claims to the pool. Also return
        tasks orphaned for `timeout_s` by a live rank: held by a rank that stopped or no longer
        rolls out (a rank releases its tasks when it leaves rollout; this is the safety net).
        With `control_tick` (the control plane's watch) it records the control plane's heartbeat
        in the same transaction, and a rank is declared dead for its silence only as `watch_verdict`
        allows: not when the watcher itself was away (stalled, starved, the store locked), nor most
        ranks at once before a grace period has confirmed it. `reason`: why the ranks are declared dead, where
        it is not their silence (a resume: the previous launch's processes are gone)."""
        def write(c: Connection) -> ReclaimResult:
            t = now if now is not None else time.time()
            if control_tick:
                c.execute(update(runs).where(runs.c.id == 1).values(control_seen_at=t))
            not_rolling = select(ranks.c.rank).where(
                ranks.c.state.in_([RankState.STOPPED.value, RankState.FAILED.value]) | (ranks.c.role != Role.ROLLOUT.value))
            orphans = c.execute(update(tasks).where(
                tasks.c.state == StoreTaskState.RUNNING.value, tasks.c.owner_rank.in_(not_rolling),
                tasks.c.updated_at < t - timeout_s).values(
                state=StoreTaskState.PENDING.value, owner_rank=None, claim_token=None, updated_at=t, progress=None,
                attempts=tasks.c.attempts - 1)).rowcount
            if orphans:
                c.execute(insert(events).values(ts=t, rank=None, source="store", kind="orphaned_tasks",
                                                message=f"{orphans} running tasks held by ranks that stopped or "
                                                        "left rollout returned to the pool"))
            gone_at = self.tx.unreachable_at  # set while an outage lasts, so this very retry sees it
            if gone_at is not None and t - gone_at < timeout_s + OUTAGE_RETRY_LAG_S:
                # The ranks could not beat while the store was gone: silence is counted from its return.
                watched[0] = WatchState(last_at=t, since=t) if control_tick else None
                return ReclaimResult([], orphans, 0)
            live = ranks.c.state.in_([RankState.RUNNING.value, RankState.STARTING.value])
            if control_tick:  # the continuous watcher: it judges its own watching too (`watch_verdict`)
                beats = {r: at for r, at in c.execute(select(ranks.c.rank, ranks.c.heartbeat_at).where(live))}
                dead, watched[0], note = watch_verdict(beats, t, timeout_s, self._watch)
                if note:
                    log.warning("heartbeat watch: %s", note)
                    c.execute(insert(events).values(ts=t, rank=None, source="store", kind="watch_held", message=note))
            else:
                dead = [r for (r,) in c.execute(select(ranks.c.rank).where(live, ranks.c.heartbeat_at < t - timeout_s))]
            if not dead:
                return ReclaimResult([], orphans, 0)
            why = reason or "missed heartbeats for {timeout_s:.0f} s"
            n_tasks, n_traj = _declare_dead(c, dead, t, {r: f"rank {r} {why.format(timeout_s=timeout_s)}; its claims "
                                                            "returned to the pool" for r in dead})
            return ReclaimResult(dead, n_tasks + orphans, n_traj)

        watched: list[WatchState | None] = [None]  # the watch's new state, kept once its transaction committed
        result = self.tx.write(write)
        if watched[0] is not None:
            self._watch = watched[0]
        return result

    def ranks_with_event(self, kind: str, *, since_start: bool = True) -> frozenset[int]:
        """The ranks that recorded (or were sent) an event of `kind`; with `since_start` only since their
        process registered (a restarted rank's events from before its restart do not count): `engine_up`
        gives the ranks whose engine is up."""
        def read(c: Connection) -> frozenset[int]:
            q = select(events.c.rank).distinct().where(events.c.kind == kind, events.c.rank.is_not(None))
            if since_start:
                q = q.join(ranks, ranks.c.rank == events.c.rank).where(events.c.ts >= ranks.c.started_at)
            return frozenset(int(r) for r in c.execute(q).scalars())

        return self.tx.read(read)


# ---- helpers running inside the control plane's transactions -------------------------------
def _declare_dead(c: Connection, dead: list[int], t: float, messages: dict[int, str]) -> tuple[int, int]:
    """Mark `dead` ranks dead and give their claims back: running tasks to pending, claimed
    trajectories to ready. Returns (tasks, trajectories) returned."""
    c.execute(update(ranks).where(ranks.c.rank.in_(dead)).values(state=RankState.DEAD.value))
    n_tasks = c.execute(update(tasks).where(tasks.c.owner_rank.in_(dead),
                                            tasks.c.state == StoreTaskState.RUNNING.value).values(
        state=StoreTaskState.PENDING.value, owner_rank=None, claim_token=None, updated_at=t)).rowcount
    n_traj = return_trajectories(c, dead)
    c.execute(insert(events), [dict(ts=t, rank=r, source="store", kind="rank_dead", message=messages[r])
                               for r in dead])
    return n_tasks, n_traj
