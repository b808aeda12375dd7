"""Steps inside a write transaction that more than one side of the store takes (`rank_side`,
`trainer_side`, `control_side`): a rank's heartbeat, failing a group, giving claimed trajectories back."""

from __future__ import annotations

import os
import socket
from typing import Any

from sqlalchemy import Connection, select, update

from tiderl.store.engine import StoreError
from tiderl.store.schema import ranks, task_groups, tasks, trajectories
from tiderl.store.types import GroupState, RankState, Role, StoreTaskState, TrajectoryState


class RankDeclaredDeadError(StoreError):
    """This process's rank was declared dead (its heartbeats stopped past the timeout, or its launcher saw it
    gone) and its claims went to other ranks: it must leave, and a fresh start registers the rank anew."""


def record_heartbeat(c: Connection, rank: int, now: float, *, role: Role | None = None, version: int | None = None,
                     tell_dead: bool = True) -> None:
    """The rank's heartbeat (and role and version). A rank declared dead stays dead; the very process
    that was (`tell_dead`) gets RankDeclaredDeadError. A trainer is not told here: what it claimed went
    back, so its publish fails with ClaimLostError."""
    values: dict[str, Any] = dict(heartbeat_at=now)
    if role is not None:
        values["role"] = role.value
    if version is not None:
        values["version"] = version
    if c.execute(update(ranks).where(ranks.c.rank == rank, ranks.c.state != RankState.DEAD.value)
                 .values(**values)).rowcount:
        return
    row = c.execute(select(ranks.c.state, ranks.c.pid, ranks.c.host, ranks.c.heartbeat_at)
                    .where(ranks.c.rank == rank)).first()
    # Only the very process that was declared dead is told: a restarted rank beats before it registers.
    if tell_dead and row is not None and row.pid == os.getpid() and row.host == socket.gethostname():
        raise RankDeclaredDeadError(f"rank {rank} (pid {row.pid} on {row.host}) was declared dead while away (its "
                                    f"last heartbeat got through {now - (row.heartbeat_at or now):.0f} s ago) "
                                    "and its claims went to other ranks")


def fail_group(c: Connection, gid: int, reason: str = "another task of its group failed for good") -> bool:
    """Fail the group `gid` if it is still open (its row locked until the commit: a report completing it
    waits, then finds it failed); its trajectories are dropped, its pending tasks fail. Returns whether it
    was open."""
    if not c.execute(update(task_groups).where(task_groups.c.id == gid, task_groups.c.state == GroupState.OPEN.value)
                     .values(state=GroupState.FAILED.value)).rowcount:
        return False
    c.execute(update(trajectories).where(trajectories.c.group_id == gid).values(state=TrajectoryState.DROPPED.value))
    c.execute(update(tasks).where(tasks.c.group_id == gid, tasks.c.state == StoreTaskState.PENDING.value).values(
        state=StoreTaskState.FAILED.value, last_error=reason))
    return True


def return_trajectories(c: Connection, owners: list[int]) -> int:
    claimed = select(trajectories.c.group_id).where(trajectories.c.claim_owner.in_(owners),
                                                    trajectories.c.state == TrajectoryState.CLAIMED.value).distinct()
    c.execute(update(task_groups).where(task_groups.c.id.in_(claimed)).values(state=GroupState.READY.value))
    return c.execute(update(trajectories).where(trajectories.c.claim_owner.in_(owners),
                                                trajectories.c.state == TrajectoryState.CLAIMED.value).values(
        state=TrajectoryState.READY.value, claim_owner=None, claim_token=None, claimed_at=None)).rowcount
