"""The run store: one SQLAlchemy schema (SQLite in the run directory by default, PostgreSQL for large runs) through which every process coordinates.

The record types and states (`tiderl.store.types`) are imported here at once: they load no SQLAlchemy, so a
pure module may take them from this package. The store and its errors (`RunStore`, `StoreError`, ...) load
SQLAlchemy, and only when first named (`from tiderl.store import RunStore`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tiderl.store.types import (
    BufferState,
    ClaimRequest,
    EventRecord,
    FinishedTrajectory,
    ForkOrigin,
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

if TYPE_CHECKING:
    from tiderl.store.engine import NoRunError, StoreBusyError, StoreError, StoreUnreachableError
    from tiderl.store.location import StoreURLError
    from tiderl.store.runstore import ClaimLostError, RankDeclaredDeadError, RunStore

_LAZY = {  # name -> the module that defines it (each loads SQLAlchemy)
    "NoRunError": "tiderl.store.engine", "StoreBusyError": "tiderl.store.engine", "StoreError": "tiderl.store.engine",
    "StoreUnreachableError": "tiderl.store.engine", "StoreURLError": "tiderl.store.location",
    "ClaimLostError": "tiderl.store.runstore", "RankDeclaredDeadError": "tiderl.store.runstore",
    "RunStore": "tiderl.store.runstore",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BufferState", "ClaimLostError", "RankDeclaredDeadError", "ClaimRequest", "EventRecord", "FinishedTrajectory", "ForkOrigin", "GroupState", "MetricPoint", "NewGroup", "PlanRecord", "RankRecord", "RankReport",
    "RankState", "ReadyTrajectory", "ReclaimResult", "Role", "RunRecord", "RunState", "RunStore", "StoreBusyError",
    "NoRunError", "StoreError", "StoreTaskState", "StoreURLError", "StoreUnreachableError", "TaskClaim", "TaskFailure", "TaskKind", "TaskWhereabouts", "TrajectoryState",
    "VersionRecord",
]
