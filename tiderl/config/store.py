"""`store:` section: the run store (SQLAlchemy; SQLite in the run directory by default, PostgreSQL for large runs)."""

from __future__ import annotations

from typing import Literal

from tiderl.config.schema import option, section

# URL schemes of the backends the run store runs on (tiderl.store.location parses the rest of the URL).
STORE_URL_SCHEMES = ("sqlite", "sqlite+pysqlite", "postgresql", "postgresql+psycopg", "postgres")


@section
class StoreConfig:
    url: str | None = option(
        None,
        help="SQLAlchemy URL of the run store. null: sqlite:///RUN_DIR/run.db. PostgreSQL, for runs that outgrow "
        "one SQLite file: postgresql+psycopg://USER@HOST:PORT/DB (password from ~/.pgpass or PGPASSWORD); each run "
        "gets its own schema in that database, named after its run directory, and RUN_DIR/store.url records it.",
    )
    journal_mode: Literal["auto", "wal", "delete"] = option(
        "auto",
        help="SQLite journal: `wal` (fast; needs shared memory, so local disks only), `delete` "
        "(rollback journal; safe on network filesystems), `auto` (wal on local disks, delete on "
        "network filesystems such as JuiceFS, NFS, Lustre).",
    )
    busy_timeout_s: float = option(
        30.0, gt=0, help="How long SQLite waits on a locked database, and PostgreSQL on a lock (the run's "
        "writer lock, a row; its lock_timeout), per attempt."
    )
    max_retries: int = option(
        8, ge=0, help="Retries of a transaction that still found the database locked (SQLite), or that PostgreSQL "
        "aborted as a serialization failure or deadlock."
    )
    disk_full_wait_s: float = option(
        60.0,
        ge=0,
        help="A write that finds the disk full (the run store's 'database or disk is full'; ENOSPC or EDQUOT "
        "writing weights, checkpoints and step markers in the run directory) is retried every second for "
        "this long before it fails: a filesystem that fills for a moment (a checkpoint, another job's files) "
        "costs a wait, not the run. 0: fail at once.",
    )
    outage_wait_s: float = option(
        120.0,
        ge=0,
        help="PostgreSQL: a process that has reached the store waits out a server that stops answering "
        "(restarted, failed over, network down), retrying each transaction with backoff for this long before "
        "it fails; the control plane declares no rank dead until launch.heartbeat_timeout_s after the store "
        "answers again, and `tiderl status` reports the outage. Creating a run, and `tiderl status`/`report`, fail "
        "at once instead. 0: fail at once.",
    )

    def __post_init__(self) -> None:
        if self.url is not None:
            scheme, sep, rest = self.url.partition("://")
            if not sep or not rest or scheme not in STORE_URL_SCHEMES:
                raise ValueError(
                    f"url: {scheme if sep else self.url!r} is not a run-store backend; want sqlite:///PATH or "
                    "postgresql+psycopg://USER@HOST:PORT/DB (null: sqlite in the run directory)"
                )
