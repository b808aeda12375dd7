"""`store:` section: the run store (SQLAlchemy; SQLite in the run directory by default)."""

from __future__ import annotations

from typing import Literal

from tiderl.config.schema import option, section


@section
class StoreConfig:
    url: str | None = option(
        None, help="SQLAlchemy URL of the run store. null: sqlite:///RUN_DIR/run.db."
    )
    journal_mode: Literal["auto", "wal", "delete"] = option(
        "auto",
        help="SQLite journal: `wal` (fast; needs shared memory, so local disks only), `delete` "
        "(rollback journal; safe on network filesystems), `auto` (wal on local disks, delete on "
        "network filesystems such as JuiceFS, NFS, Lustre).",
    )
    busy_timeout_s: float = option(30.0, gt=0, help="How long SQLite waits on a locked database per attempt.")
    max_retries: int = option(8, ge=0, help="Retries of a transaction that still found the database locked.")
    disk_full_wait_s: float = option(
        60.0,
        ge=0,
        help="A write that finds the disk full (the run store's 'database or disk is full'; ENOSPC or EDQUOT "
        "writing weights, checkpoints and step markers in the run directory) is retried every second for "
        "this long before it fails: a filesystem that fills for a moment (a checkpoint, another job's files) "
        "costs a wait, not the run. 0: fail at once.",
    )
