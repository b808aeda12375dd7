"""Reading and writing the per-version plan through the run store's control and metrics tables.

The control plane writes, for every version k, one control row per rank (its
role from k on, the RA2P mode of step k) and a `fetch_groups` metric (how
many groups step k trains on). Ranks wait for the plan of a new version
before leaving the sync boundary, so every rank applies the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, func, select

from tiderl.store import RunStore
from tiderl.store.schema import control, metrics, runs
from tiderl.store.types import MetricPoint, RankReport, Role, RunState

CONTROL_RANK = -1  # the control plane's metrics rows carry this rank
FETCH_METRIC = "fetch_groups"
TERMINAL = (RunState.FINISHED.value, RunState.FAILED.value, RunState.CANCELLED.value)


@dataclass(frozen=True, slots=True)
class VersionPlan:
    version: int
    roles: dict[int, Role]
    ra2p_mode: str
    fetch_groups: int

    def ranks_with(self, role: Role) -> list[int]:
        return sorted(r for r, x in self.roles.items() if x is role)


def run_position(store: RunStore) -> tuple[str, int]:
    """(run state, last published version), in one read."""
    row = store.tx.read(lambda c: c.execute(select(runs.c.state, runs.c.version).where(runs.c.id == 1)).one())
    return str(row.state), int(row.version)


def planned_version(store: RunStore) -> int | None:
    """The newest version that has a plan."""
    return store.tx.read(lambda c: c.execute(select(func.max(control.c.version))).scalar())


def write_plan(store: RunStore, plan: VersionPlan, reason: str) -> None:
    # The fetch size first: a rank that sees the control rows must also find it.
    store.report(RankReport(rank=CONTROL_RANK, metrics=[
        MetricPoint(FETCH_METRIC, plan.fetch_groups, version=plan.version, role="control")]))
    store.plan_roles(plan.version, plan.roles, ra2p_mode=plan.ra2p_mode, reason=reason)


def read_plan(store: RunStore, version: int) -> VersionPlan | None:
    """The plan of exactly `version`, or None while the control plane has not written it."""
    def read(c: Connection) -> VersionPlan | None:
        rows = c.execute(select(control.c.rank, control.c.role, control.c.ra2p_mode)
                         .where(control.c.version == version)).all()
        if not rows:
            return None
        fetch = c.execute(select(metrics.c.value).where(metrics.c.name == FETCH_METRIC,
                                                         metrics.c.version == version)
                          .order_by(metrics.c.id.desc()).limit(1)).scalar()
        return VersionPlan(version=version, roles={r.rank: Role(r.role) for r in rows},
                           ra2p_mode=rows[0].ra2p_mode or "colocated", fetch_groups=int(fetch or 1))

    return store.tx.read(read)
