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

PostgreSQL (`store.url: postgresql+psycopg://...`) serves runs that outgrow one
SQLite file (no filesystem locking, readers never wait, no shared-filesystem
commit latency). The store's transactions read rows and then update them
(claim, publish, reclaim) and are correct when writers take turns, as SQLite's
`BEGIN IMMEDIATE` makes them. PostgreSQL gets the same:
- a write transaction first takes a transaction-scoped advisory lock, one per
  run (keyed by the run's schema), then runs READ COMMITTED: writers of one run
  take turns, each seeing everything committed before it; runs sharing a server
  do not wait for each other. A write that locks the rows it depends on itself
  (`write(fn, run_lock=False)`: the ranks' reports and heartbeats, runstore.py)
  skips the run's lock. SERIALIZABLE instead was tried and measured: the
  claim query reads the whole pending set, so 4 writers aborted each other
  (SQLSTATE 40001) past every retry;
- read transactions run REPEATABLE READ: one snapshot for all their statements,
  as a SQLite read transaction sees, and they never wait for a writer;
- serialization failures (40001), deadlocks (40P01) and lock waits past
  `store.busy_timeout_s` (`lock_timeout`, 55P03) are retried whole with
  backoff, like SQLite's busy errors.

A PostgreSQL server that stops answering (restarted, failed over, the network
down) is waited out: a process that has reached the store before retries the
whole transaction with backoff for up to `store.outage_wait_s`, then carries on,
and reports the outage once it is over (`on_outage_end`). A transaction whose
COMMIT was cut off may have committed; the store's claims and publishing are
idempotent across such a retry (see runstore.py). A process that never reached
the store and does not know it exists (a wrong host in a new job, `tiderl
status` during an outage) fails at once, naming the server.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DatabaseError, DBAPIError, OperationalError

T = TypeVar("T")

log = logging.getLogger("tiderl.store")

# Filesystem types on which SQLite's WAL shared-memory index is unsafe or slow across hosts.
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "9p")


class StoreError(RuntimeError):
    """A run-store operation failed; the message names the database (`store`, where known: the file of a
    SQLite store, the server and schema of a PostgreSQL one)."""

    def __init__(self, message: str, *, store: str | None = None) -> None:
        super().__init__(message)
        self.store = store


class NoRunError(StoreError):
    """The store holds no run yet: its file exists but the run that makes it has not yet written its tables
    or its run row (a look at a run that is starting), or never did."""


class StoreBusyError(StoreError):
    """The database stayed locked through every retry."""


class StoreUnreachableError(StoreError):
    """The database server did not answer (refused, unknown host, timed out); the message names it."""


class StoreCorruptError(StoreError):
    """The database file is not a database, or its image is damaged."""

    def __init__(self, message: str, *, store: str | None = None, detail: str = "") -> None:
        super().__init__(message, store=store)
        self.detail = detail  # SQLite's (or PostgreSQL's) own words: "database disk image is malformed"


# What a person can do about a damaged store: said with every report of one (`failure_line`).
CORRUPT_ADVICE = ("restore the file from a copy, or save what SQLite can still read "
                  "(`sqlite3 FILE .recover | sqlite3 recovered.db`) and start a new run")


def corrupt_line(store: str, detail: str) -> str:
    """The one line that reports a damaged store: which file, SQLite's words, what to do."""
    return f"{store} is corrupt ({detail}): {CORRUPT_ADVICE.replace('FILE', store)}"


def failure_line(e: BaseException) -> str | None:
    """The one line a command prints (exit 2) for a store it cannot read: damaged, or holding no run;
    None for any other error, which is the command's own to report."""
    if isinstance(e, StoreCorruptError):
        return corrupt_line(e.store or "the run store", e.detail or str(e))
    if isinstance(e, NoRunError):
        return str(e)
    return None


class StoreFullError(StoreError):
    """The disk holding the database stayed full through the wait (`store.disk_full_wait_s`)."""


_CORRUPT = ("file is not a database", "malformed", "database corrupt", "disk image")

# PostgreSQL SQLSTATEs. Retried like SQLite's "database is locked": serialization_failure,
# deadlock_detected, lock_not_available (lock_timeout). Disk full: disk_full. Damage: data_corrupted,
# index_corrupted.
PG_RETRY_STATES = ("40001", "40P01", "55P03")
PG_FULL_STATES = ("53100",)
PG_CORRUPT_STATES = ("XX001", "XX002")
# The server is gone or going (no answer at all has no SQLSTATE): connection_exception (class 08),
# admin_shutdown, crash_shutdown, cannot_connect_now (starting up or shutting down).
PG_GONE_STATES = ("57P01", "57P02", "57P03")
PG_CONNECT_TIMEOUT_S = 10  # a server that does not answer in this long is reported unreachable
OUTAGE_FIRST_RETRY_S = 0.25  # backoff while the store is unreachable: doubling from this...
OUTAGE_MAX_RETRY_S = 2.0  # ...to at most this (a restarted server is used within seconds)
# The longest a process waiting out an outage sleeps between tries (the backoff's jitter is 0.5x-1.5x):
# after the store is back, its processes beat again within this, so silence counts from then on.
OUTAGE_RETRY_LAG_S = 1.5 * OUTAGE_MAX_RETRY_S


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


def _sqlstate(e: DatabaseError) -> str | None:
    """PostgreSQL's SQLSTATE of the error (psycopg sets it); None for SQLite and for errors with no server answer."""
    return getattr(e.orig, "sqlstate", None)


def _is_corrupt(e: DatabaseError) -> bool:
    if _sqlstate(e) in PG_CORRUPT_STATES:
        return True
    text = str(e.orig if e.orig is not None else e).lower()
    return any(marker in text for marker in _CORRUPT)


def _is_full(e: DatabaseError) -> bool:
    if _sqlstate(e) in PG_FULL_STATES:
        return True
    text = str(e.orig if e.orig is not None else e).lower()
    return "database or disk is full" in text or "no space left" in text


def _is_busy(e: OperationalError) -> bool:
    state = _sqlstate(e)
    if state is not None:
        return state in PG_RETRY_STATES
    text = str(e.orig if e.orig is not None else e).lower()
    return "locked" in text or "busy" in text


def _is_unreachable(e: DBAPIError, engine: Engine) -> bool:
    """No PostgreSQL server answers: refused, unknown host, timed out, connection lost (no SQLSTATE at all),
    a connection exception (08xxx), or the server shutting down or starting up."""
    if engine.dialect.name != "postgresql":
        return False
    state = _sqlstate(e)
    return state is None or state.startswith("08") or state in PG_GONE_STATES


def make_engine(url: str, *, busy_timeout_s: float, pg_schema: str | None = None) -> Engine:
    """An engine whose SQLite connections honour `BEGIN IMMEDIATE` for write transactions, and whose
    PostgreSQL write transactions take the writer lock of the run in `pg_schema` first, waiting on any
    lock at most `busy_timeout_s`."""
    if url.startswith("postgresql"):
        return _postgres_engine(url, busy_timeout_s=busy_timeout_s, lock_key=writer_lock_key(pg_schema))
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


def writer_lock_key(schema: str | None) -> int:
    """The advisory-lock key of a run's writers: a signed 64-bit hash of its schema (pg_advisory_xact_lock's
    bigint), so that each run on a shared server serializes only its own writers."""
    digest = hashlib.sha1(f"tiderl-run-store:{schema or 'public'}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _postgres_engine(url: str, *, busy_timeout_s: float, lock_key: int) -> Engine:
    # pool_pre_ping: a connection the server dropped (restart, idle timeout) is replaced, not handed out.
    engine = create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
        # A row lock held by a stuck writer fails the wait (55P03, retried) instead of blocking forever,
        # as SQLite's busy timeout does.
        with dbapi_conn.cursor() as cur:
            cur.execute(f"SET lock_timeout = {int(busy_timeout_s * 1000)}")
        dbapi_conn.commit()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get("tiderl_run_lock", False):
            # PostgreSQL's BEGIN IMMEDIATE: the run's writers take turns (waits past lock_timeout: 55P03, retried).
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({lock_key})")

    return engine


class _DiskFull(Exception):
    def __init__(self, cause: DatabaseError) -> None:
        super().__init__(str(cause))
        self.cause = cause.orig or cause


class _Unreachable(Exception):
    def __init__(self, cause: DBAPIError) -> None:
        super().__init__(str(cause))
        self.cause = cause.orig or cause


class Transactor:
    """Runs functions inside short transactions, retrying the whole function on lock contention."""

    def __init__(self, engine: Engine, *, max_retries: int, label: str, full_wait_s: float = 0.0,
                 full_retry_s: float = 1.0, outage_wait_s: float = 0.0,
                 on_outage_end: Callable[[float, float, str], None] | None = None) -> None:
        self.engine = engine
        self.max_retries = max_retries
        self.label = label
        self.full_wait_s = full_wait_s
        self.full_retry_s = full_retry_s
        self.outage_wait_s = outage_wait_s
        # Called (start wall time, seconds, last error) after a transaction got through an outage.
        self.on_outage_end = on_outage_end
        self.num_retries = 0  # observed retries, for benchmarks and diagnostics
        # A transaction got through (or the caller knows the store exists): from then on an outage is waited out.
        self.has_reached_store = False
        self.outage_ended_at: float | None = None  # wall time the last outage this process saw ended
        self.unreachable_at: float | None = None  # wall time this process last found the store unreachable
        self._outage_lock = threading.Lock()

    def write(self, fn: Callable[[Connection], T], *, run_lock: bool = True) -> T:
        """Run `fn` in a write transaction. `run_lock=False` (PostgreSQL): without the run's writer lock,
        for a transaction that locks the rows it depends on itself (the rank's report and heartbeat,
        runstore.py); SQLite has one write lock per database and takes it either way."""
        return self._run(fn, immediate=True, run_lock=run_lock)

    def read(self, fn: Callable[[Connection], T]) -> T:
        return self._run(fn, immediate=False)

    def _run(self, fn: Callable[[Connection], T], *, immediate: bool, run_lock: bool = True) -> T:
        full_since: float | None = None
        down_since: float | None = None
        down_wall = 0.0
        delay_s = OUTAGE_FIRST_RETRY_S
        last_error = ""
        while True:
            try:
                result = self._run_locked(fn, immediate=immediate, run_lock=run_lock)
            except _Unreachable as e:
                # Whatever the transaction did was rolled back, or (COMMIT cut off) committed: the store's
                # writes are idempotent across this retry.
                now = time.monotonic()
                self.unreachable_at = time.time()
                last_error = str(e.cause).strip()
                if not self.has_reached_store or self.outage_wait_s <= 0:
                    raise StoreUnreachableError(f"run store {self.label} is unreachable: {last_error}") from e.cause
                if down_since is None:
                    down_since, down_wall = now, time.time()
                    log.warning("run store %s is unreachable (%s); retrying for up to %.0f s",
                                self.label, last_error, self.outage_wait_s)
                if now - down_since >= self.outage_wait_s:
                    raise StoreUnreachableError(f"run store {self.label} is still unreachable after "
                                                f"{now - down_since:.0f} s: {last_error}") from e.cause
                self.num_retries += 1
                time.sleep(delay_s * (0.5 + random.random()))
                delay_s = min(delay_s * 2, OUTAGE_MAX_RETRY_S)
                continue
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
                continue
            self.has_reached_store = True
            if down_since is not None:
                self._outage_over(down_wall, time.time() - down_wall, last_error)
            return result

    def _outage_over(self, started_at: float, seconds: float, error: str) -> None:
        """Note the end of an outage, and report it once per process (threads of one process that waited
        through the same outage report it once)."""
        with self._outage_lock:
            already = self.outage_ended_at is not None and self.outage_ended_at >= started_at
            self.outage_ended_at = time.time()
        log.warning("run store %s answers again after %.1f s", self.label, seconds)
        if not already and self.on_outage_end is not None:
            self.on_outage_end(started_at, seconds, error)

    def _run_locked(self, fn: Callable[[Connection], T], *, immediate: bool, run_lock: bool = True) -> T:
        delay_s = 0.01
        for attempt in range(self.max_retries + 1):
            try:
                with self._connection(immediate, run_lock) as conn, conn.begin():
                    return fn(conn)
            except OperationalError as e:
                if _is_full(e):
                    raise _DiskFull(e) from e
                if _is_corrupt(e):
                    raise StoreCorruptError(f"run store {self.label} is corrupt: {e.orig or e}", store=self.label,
                                            detail=str(e.orig or e)) from e
                if _is_unreachable(e, self.engine):
                    raise _Unreachable(e) from e
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
                    raise StoreCorruptError(f"run store {self.label} is corrupt: {e.orig or e}", store=self.label,
                                            detail=str(e.orig or e)) from e
                if _is_unreachable(e, self.engine) and _sqlstate(e) is None:
                    raise _Unreachable(e) from e
                raise StoreError(f"run store {self.label}: {e.orig or e}") from e
            except DBAPIError as e:  # psycopg's InterfaceError: a connection that was closed under us
                if _is_unreachable(e, self.engine):
                    raise _Unreachable(e) from e
                raise StoreError(f"run store {self.label}: {e.orig or e}") from e
        raise AssertionError("unreachable")

    @contextmanager
    def _connection(self, immediate: bool, run_lock: bool = True) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            if self.engine.dialect.name == "postgresql":
                # Writers take turns (the begin event's advisory lock) and see every commit before theirs;
                # readers see one snapshot.
                yield conn.execution_options(isolation_level="READ COMMITTED" if immediate else "REPEATABLE READ",
                                             tiderl_immediate=immediate, tiderl_run_lock=immediate and run_lock)
            else:
                yield conn.execution_options(tiderl_immediate=immediate)
