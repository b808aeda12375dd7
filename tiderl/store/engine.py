"""SQLAlchemy engines for the run store, and transactions that survive many writers.

SQLite is the default: one file in the run directory on the shared filesystem.
- Write transactions start with `BEGIN IMMEDIATE`: the write lock is taken up
  front, so two claimers can never both read "pending" and then deadlock on
  the upgrade to a write lock (the classic SQLITE_BUSY-on-commit).
- A busy timeout lets SQLite wait for the lock; past it, the whole
  transaction is retried with jittered backoff, a bounded number of times.
  Only then does `StoreBusyError` reach the caller, naming the database.
- Journal mode: WAL needs shared memory between all processes using the file,
  which network filesystems (JuiceFS, NFS, Lustre) do not give across hosts;
  there the rollback journal (`delete`) is the safe choice. `auto` picks WAL on
  local disks and `delete` on network filesystems, from /proc/mounts.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DatabaseError, OperationalError

T = TypeVar("T")

log = logging.getLogger("tiderl.store")

# Filesystem types on which SQLite's WAL shared-memory index is unsafe or slow across hosts.
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "9p")


class StoreError(RuntimeError):
    """A run-store operation failed; the message names the database."""


class StoreBusyError(StoreError):
    """The database stayed locked through every retry."""


class StoreCorruptError(StoreError):
    """The database file is not a database, or its image is damaged."""


class StoreFullError(StoreError):
    """The disk holding the database stayed full through the wait (`store.disk_full_wait_s`)."""


_CORRUPT = ("file is not a database", "malformed", "database corrupt", "disk image")


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (longest matching mount point in /proc/mounts)."""
    path = Path(os.path.realpath(path))
    best, best_type = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return "unknown"
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, best_type = mount, parts[2]
    return best_type


def is_network_filesystem(fstype: str) -> bool:
    return fstype in NETWORK_FILESYSTEMS or fstype.startswith("fuse.") or fstype == "fuse"


def choose_journal_mode(db_path: Path, requested: str) -> str:
    if requested != "auto":
        return requested
    return "delete" if is_network_filesystem(filesystem_type(db_path.parent)) else "wal"


def _is_corrupt(e: DatabaseError) -> bool:
    text = str(e.orig if e.orig is not None else e).lower()
    return any(marker in text for marker in _CORRUPT)


def _is_full(e: DatabaseError) -> bool:
    text = str(e.orig if e.orig is not None else e).lower()
    return "database or disk is full" in text or "no space left" in text


def _is_busy(e: OperationalError) -> bool:
    text = str(e.orig if e.orig is not None else e).lower()
    return "locked" in text or "busy" in text


def make_engine(url: str, *, busy_timeout_s: float) -> Engine:
    """An engine whose SQLite connections honour `BEGIN IMMEDIATE` for write transactions."""
    is_sqlite = url.startswith("sqlite")
    connect_args = {"timeout": busy_timeout_s, "check_same_thread": False} if is_sqlite else {}
    engine = create_engine(url, connect_args=connect_args, pool_pre_ping=not is_sqlite)
    if is_sqlite:

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            # Let SQLAlchemy's "begin" event, not pysqlite, decide how transactions start.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            cur.execute("PRAGMA foreign_keys = ON")
            # WAL is crash-safe with NORMAL; the rollback journal needs FULL.
            mode = cur.execute("PRAGMA journal_mode").fetchone()[0]
            cur.execute(f"PRAGMA synchronous = {'NORMAL' if mode == 'wal' else 'FULL'}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            immediate = conn.get_execution_options().get("tiderl_immediate", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


class _DiskFull(Exception):
    def __init__(self, cause: DatabaseError) -> None:
        super().__init__(str(cause))
        self.cause = cause.orig or cause


class Transactor:
    """Runs functions inside short transactions, retrying the whole function on lock contention."""

    def __init__(self, engine: Engine, *, max_retries: int, label: str, full_wait_s: float = 0.0,
                 full_retry_s: float = 1.0) -> None:
        self.engine = engine
        self.max_retries = max_retries
        self.label = label
        self.full_wait_s = full_wait_s
        self.full_retry_s = full_retry_s
        self.num_retries = 0  # observed retries, for benchmarks and diagnostics

    def write(self, fn: Callable[[Connection], T]) -> T:
        return self._run(fn, immediate=True)

    def read(self, fn: Callable[[Connection], T]) -> T:
        return self._run(fn, immediate=False)

    def _run(self, fn: Callable[[Connection], T], *, immediate: bool) -> T:
        full_since: float | None = None
        while True:
            try:
                return self._run_locked(fn, immediate=immediate)
            except _DiskFull as e:
                # The transaction rolled back whole: the same function runs again once there is room.
                now = time.monotonic()
                if full_since is None:
                    full_since = now
                    log.warning("run store %s: the disk is full (%s); retrying every %.0f s for up to %.0f s",
                                self.label, e.cause, self.full_retry_s, self.full_wait_s)
                if now - full_since >= self.full_wait_s:
                    raise StoreFullError(f"run store {self.label}: the disk is still full after "
                                         f"{self.full_wait_s:.0f} s: {e.cause}") from e.cause
                self.num_retries += 1
                time.sleep(self.full_retry_s)

    def _run_locked(self, fn: Callable[[Connection], T], *, immediate: bool) -> T:
        delay_s = 0.01
        for attempt in range(self.max_retries + 1):
            try:
                with self._connection(immediate) as conn, conn.begin():
                    return fn(conn)
            except OperationalError as e:
                if _is_full(e):
                    raise _DiskFull(e) from e
                if _is_corrupt(e):
                    raise StoreCorruptError(f"run store {self.label} is corrupt: {e.orig or e}") from e
                if not _is_busy(e):
                    raise StoreError(f"run store {self.label}: {e.orig or e}") from e
                if attempt == self.max_retries:
                    raise StoreBusyError(
                        f"run store {self.label}: still locked after {self.max_retries} retries"
                    ) from e
                self.num_retries += 1
                time.sleep(delay_s * (0.5 + random.random()))
                delay_s = min(delay_s * 2, 1.0)
            except DatabaseError as e:  # sqlite3.DatabaseError: "file is not a database", a damaged image
                if _is_full(e):
                    raise _DiskFull(e) from e
                if _is_corrupt(e):
                    raise StoreCorruptError(f"run store {self.label} is corrupt: {e.orig or e}") from e
                raise StoreError(f"run store {self.label}: {e.orig or e}") from e
        raise AssertionError("unreachable")

    @contextmanager
    def _connection(self, immediate: bool) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn.execution_options(tiderl_immediate=immediate)
