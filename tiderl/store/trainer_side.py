"""The trainer's side of the run store: claiming ready groups, dropping stale ones, publishing a
version (which consumes its trajectories only while the trainer still holds every claim), each one
transaction (the exactly-once rules are in `tiderl.store.runstore`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, func, insert, select, update

from tiderl.policy.ra2p import Ra2pMode
from tiderl.store import codec
from tiderl.store.engine import StoreError, Transactor
from tiderl.store.schema import events, microbatches, runs, task_groups, trajectories, versions
from tiderl.store.shared_tx import record_heartbeat, return_trajectories
from tiderl.store.step_figures import step_figures
from tiderl.store.types import GroupState, ReadyTrajectory, TrajectoryState, VersionRecord


class ClaimLostError(StoreError):
    """A trainer tried to publish trajectories it no longer holds (its claim expired)."""


class TrainerTransactions:
    """The trainer's transactions (a mixin of `RunStore`)."""

    tx: Transactor
    label: str

    def claim_ready_groups(self, owner: int, max_groups: int) -> list[ReadyTrajectory]:
        """Claim up to `max_groups` complete training groups (oldest first) for trainer rank `owner`."""
        token = uuid.uuid4().hex

        def write(c: Connection) -> list[ReadyTrajectory]:
            now = time.time()
            record_heartbeat(c, owner, now, tell_dead=False)
            mine = select(trajectories).where(trajectories.c.claim_token == token).order_by(
                trajectories.c.group_id, trajectories.c.id)
            if c.execute(select(trajectories.c.id).where(trajectories.c.claim_token == token).limit(1)).first():
                return [_ready(r) for r in c.execute(mine).mappings()]  # an earlier attempt of this call committed
            gids = [g for (g,) in c.execute(select(task_groups.c.id).where(
                task_groups.c.state == GroupState.READY.value).order_by(task_groups.c.completed_at,
                                                                        task_groups.c.id).limit(max_groups))]
            if not gids:
                return []
            c.execute(update(task_groups).where(task_groups.c.id.in_(gids)).values(state=GroupState.CLAIMED.value))
            c.execute(update(trajectories).where(trajectories.c.group_id.in_(gids),
                                                 trajectories.c.state == TrajectoryState.READY.value).values(
                state=TrajectoryState.CLAIMED.value, claim_owner=owner, claim_token=token, claimed_at=now))
            return [_ready(r) for r in c.execute(mine).mappings()]

        return self.tx.write(write)

    def drop_claimed_groups(self, owner: int, group_ids: Sequence[int], reason: str) -> int:
        """Never train these groups claimed by `owner` (e.g. too stale): their trajectories are
        dropped and the groups failed. Groups `owner` does not hold are left alone. Returns the
        number of groups dropped."""
        def write(c: Connection) -> int:
            held = sorted({g for (g,) in c.execute(select(trajectories.c.group_id).where(
                trajectories.c.group_id.in_(list(group_ids)), trajectories.c.claim_owner == owner,
                trajectories.c.state == TrajectoryState.CLAIMED.value))})
            if not held:
                return 0
            c.execute(update(trajectories).where(trajectories.c.group_id.in_(held),
                                                 trajectories.c.claim_owner == owner).values(
                state=TrajectoryState.DROPPED.value, claim_owner=None, claim_token=None))
            c.execute(update(task_groups).where(task_groups.c.id.in_(held)).values(state=GroupState.FAILED.value))
            c.execute(insert(events).values(ts=time.time(), rank=owner, source="store", kind="groups_dropped",
                                            message=f"{len(held)} groups dropped: {reason}",
                                            data=json.dumps({"groups": held})))
            return len(held)

        return self.tx.write(write)

    def release_claims(self, owner: int) -> int:
        """Give a trainer's claimed (unpublished) trajectories back to the pool."""
        return self.tx.write(lambda c: return_trajectories(c, [owner]))

    def publish_version(self, step: VersionRecord, *, owner: int) -> None:
        """Commit weights version `step.version` and consume its trajectories, atomically."""
        def write(c: Connection) -> None:
            ids = list(step.trajectory_ids)
            if _already_published(c, step):
                return  # an earlier attempt of this call committed before its connection was cut
            rows = c.execute(select(trajectories.c.id, trajectories.c.num_generated, trajectories.c.num_tokens,
                                    trajectories.c.reward, trajectories.c.success, trajectories.c.num_turns,
                                    trajectories.c.env, trajectories.c.min_version).where(
                trajectories.c.id.in_(ids), trajectories.c.state == TrajectoryState.CLAIMED.value,
                trajectories.c.claim_owner == owner)).all()
            if len(rows) != len(set(ids)):
                lost = sorted(set(ids) - {r.id for r in rows})
                raise ClaimLostError(f"run store {self.label}: trainer rank {owner} no longer holds trajectories "
                                     f"{lost[:10]}{'...' if len(lost) > 10 else ''}; version {step.version} "
                                     "not published")
            current = c.execute(select(runs.c.version).where(runs.c.id == 1)).scalar_one()
            if step.version != current + 1:
                raise StoreError(f"run store {self.label}: version {step.version} published after {current}")
            c.execute(update(runs).where(runs.c.id == 1).values(version=step.version, updated_at=time.time()))
            figures = step_figures(rows)
            c.execute(insert(versions).values(
                version=step.version, path=step.path, checksum=step.checksum, created_at=time.time(),
                step_started_at=step.step_started_at, duration_s=step.duration_s, num_trajectories=len(rows),
                consumed_tokens=sum(r.num_generated for r in rows), trained_tokens=sum(r.num_tokens for r in rows),
                reward_mean=figures.reward_mean, success_rate=figures.success_rate, turns_mean=figures.turns_mean,
                turns_max=figures.turns_max, env_figures=figures.env_json(),
                max_staleness=max((step.version - 1 - r.min_version for r in rows), default=None),
                ras=step.ras, tprm_s=step.tprm_s,
                ra2p_mode=None if step.ra2p_mode is None else Ra2pMode.parse(step.ra2p_mode).value, loss=step.loss))
            c.execute(update(trajectories).where(trajectories.c.id.in_(ids)).values(
                state=TrajectoryState.CONSUMED.value, consumed_version=step.version))
            gids = select(trajectories.c.group_id).where(trajectories.c.id.in_(ids)).distinct()
            c.execute(update(task_groups).where(task_groups.c.id.in_(gids)).values(state=GroupState.CONSUMED.value))

        self.tx.write(write)

    def register_initial_version(self, path: str, checksum: str) -> None:
        """Version 0: the initial weights every rank starts from."""
        row = dict(version=0, path=path, checksum=checksum, created_at=time.time(), num_trajectories=0,
                   consumed_tokens=0)
        self.tx.write(lambda c: c.execute(insert(versions).values(**row)))

    def record_microbatches(self, version: int, trainer_rank: int, batches: Sequence[dict[str, Any]]) -> None:
        rows = [dict(version=version, trainer_rank=trainer_rank, trajectory_ids=json.dumps(b["trajectory_ids"]),
                     num_tokens=b["num_tokens"], ready_at=b["ready_at"], started_at=b.get("started_at"),
                     done_at=b.get("done_at")) for b in batches]
        if rows:
            self.tx.write(lambda c: c.execute(insert(microbatches), rows))

    def version_checksum(self, version: int) -> str | None:
        """The checksum the trainer recorded when it published `version` (None: not published)."""
        return self.tx.read(lambda c: c.execute(
            select(versions.c.checksum).where(versions.c.version == version)).scalar())


# ---- helpers running inside the trainer's transactions -------------------------------------
def _already_published(c: Connection, step: VersionRecord) -> bool:
    """`step` is recorded already, with its weights and its trajectories (a retry after a cut-off commit)."""
    row = c.execute(select(versions.c.path, versions.c.checksum).where(versions.c.version == step.version)).first()
    if row is None or (row.path, row.checksum) != (step.path, step.checksum):
        return False
    ids = list(step.trajectory_ids)
    consumed = c.execute(select(func.count()).where(trajectories.c.id.in_(ids),
                                                   trajectories.c.consumed_version == step.version)).scalar_one()
    return consumed == len(set(ids))


def _ready(r: Any) -> ReadyTrajectory:
    return ReadyTrajectory(
        id=r["id"], group_id=r["group_id"], rank=r["rank"], token_ids=codec.unpack_ints(r["token_ids"]),
        loss_mask=codec.unpack_mask(r["loss_mask"]), logprobs=codec.unpack_floats(r["logprobs"]),
        token_versions=codec.unpack_ints(r["token_versions"]), reward=r["reward"], advantage=r["advantage"],
        num_tokens=r["num_tokens"], num_generated=r["num_generated"], min_version=r["min_version"],
        ready_at=r["ready_at"], finish=r["finish"], images=tuple(codec.unpack_blobs(r["images"])) if r["images"] else (),
        prunes=tuple((int(at), int(d)) for at, d in json.loads(r["prunes"])) if r["prunes"] else ())
