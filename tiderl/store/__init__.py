"""The run store: one SQLAlchemy schema (SQLite in the run directory by default, PostgreSQL for large runs) through which every process coordinates."""

from tiderl.store.engine import NoRunError, StoreBusyError, StoreError, StoreUnreachableError
from tiderl.store.location import StoreURLError
from tiderl.store.runstore import ClaimLostError, RankDeclaredDeadError, RunStore
from tiderl.store.types import (
    BufferState,
    ClaimRequest,
    EventRecord,
    FinishedTrajectory,
    GroupState,
    MetricPoint,
    NewGroup,
    PlanRecord,
    RankRecord,
    RankReport,
    RankState,
    ReadyTrajectory,
    ReclaimResult,
    Role,
    RunRecord,
    RunState,
    StoreTaskState,
    TaskClaim,
    TaskFailure,
    TaskKind,
    TaskWhereabouts,
    TrajectoryState,
    VersionRecord,
)

__all__ = [
    "BufferState", "ClaimLostError", "RankDeclaredDeadError", "ClaimRequest", "EventRecord", "FinishedTrajectory", "GroupState", "MetricPoint", "NewGroup", "PlanRecord", "RankRecord", "RankReport",
    "RankState", "ReadyTrajectory", "ReclaimResult", "Role", "RunRecord", "RunState", "RunStore", "StoreBusyError",
    "NoRunError", "StoreError", "StoreTaskState", "StoreURLError", "StoreUnreachableError", "TaskClaim", "TaskFailure", "TaskKind", "TaskWhereabouts", "TrajectoryState",
    "VersionRecord",
]
