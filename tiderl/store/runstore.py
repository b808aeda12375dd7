"""The run store: every process of a run coordinates through it.

(Over 450 lines: every read and write transaction of a run, on one schema and one lock discipline,
is in this module so that the exactly-once rules below are checkable in one place; the schema and
views, the engine and its retries, the codec and the record types are modules of their own.)

Exactly-once rules (each enforced inside one write transaction):
- a task is owned by at most one rank: `claim_tasks` moves pending -> running
  under `BEGIN IMMEDIATE`; a finished trajectory is accepted only from the
  task's current owner (a late report of a reclaimed task is dropped);
- a trajectory is trained at most once: `claim_ready_groups` moves whole
  groups ready -> claimed for one trainer, and `publish_version` moves them
  claimed -> consumed only if that trainer still holds every claim;
- a dead rank (heartbeat older than the timeout) loses its claims:
  `reclaim_expired` returns its running tasks to pending and its claimed
  trajectories to ready, in the same transaction that marks it dead.

On PostgreSQL the same rules hold: a run's write transactions take turns there
too (an advisory lock, PostgreSQL's `BEGIN IMMEDIATE`; see `engine.py`), except
the ranks' reports and heartbeats, the bulk of a run's commits, which lock the
rows they depend on instead, so that ranks do not queue behind each other:
- a report first locks the groups of the tasks it finishes, fails or releases
  (`SELECT ... FOR UPDATE`, in id order), so a group's completion counts every
  sibling trajectory committed before it, and a group completes or fails once
  (`_fail_group` fails only an open group; the control plane's drop skips a
  group a report completed meanwhile);
- its updates of tasks name the owner and the running state, which
  PostgreSQL re-checks on a row another transaction changed (a reclaim);
- its claim's subquery locks the pending rows it picks and skips those another
  claim holds (`FOR UPDATE SKIP LOCKED`).
SQLite has one write lock per database and takes it for every write, so the
code below has one path for both backends.

Across a store outage (PostgreSQL: the server restarted), a transaction whose
COMMIT was cut off is retried not knowing whether it committed. The claims and
publishing are idempotent across that retry: a claim's token is drawn once per
call, so a retry finds the tasks or groups the first attempt claimed; a
publish finds its version already recorded with its checksum. (A retried
report's metric and event rows may then be recorded twice: numbers shown,
not claims.) After an outage, the control plane declares no rank dead until
the heartbeat timeout has passed with the store answering: the ranks could
not beat while it was gone.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Float, and_, bindparam, case, cast, func, insert, inspect, or_, select, text, update
from sqlalchemy.engine import make_url

from tiderl.advantages import group_advantages
from tiderl.policy.ra2p import Ra2pMode
from tiderl.config.store import StoreConfig
from tiderl.policy.ctb import claim_limit
from tiderl.store import codec
from tiderl.store.engine import OUTAGE_RETRY_LAG_S, NoRunError, StoreError, Transactor, choose_journal_mode, make_engine
from tiderl.store.location import POINTER_FILE, describe, is_postgres, parse_store_url, schema_of, store_url
from tiderl.store.schema import (
    VIEWS,
    view_sql,
    control,
    events,
    metadata,
    metrics,
    microbatches,
    ranks,
    runs,
    task_groups,
    tasks,
    trajectories,
    versions,
)
from tiderl.store.step_figures import parse_env_figures, step_figures
from tiderl.store.types import (
    BufferState,
    StepWindow,
    FinishedTrajectory,
    GroupState,
    ClaimRequest,
    NewGroup,
    PlanRecord,
    RankReport,
    RankRecord,
    RankState,
    ReadyTrajectory,
    ReclaimResult,
    Role,
    RunRecord,
    RunState,
    StoreTaskState,
    TaskClaim,
    TrainerGeneration,
    TaskKind,
    TrajectoryState,
    VersionRecord,
)


log = logging.getLogger("tiderl.store")


class ClaimLostError(StoreError):
    """A trainer tried to publish trajectories it no longer holds (its claim expired)."""


class RankDeclaredDeadError(StoreError):
    """This process's rank was declared dead (its heartbeats stopped past the timeout, or its launcher saw it
    gone) and its claims went to other ranks: it must leave, and a fresh start registers the rank anew."""


class RunStore:
    def __init__(self, url: str, config: StoreConfig | None = None, *, run_dir: Path | None = None) -> None:
        """`url`: SQLite or PostgreSQL (StoreURLError otherwise). `run_dir`: the run directory, where
        `create_schema` records a store that lives elsewhere (RUN_DIR/store.url)."""
        config = config or StoreConfig()
        parsed = parse_store_url(url)
        # PostgreSQL URLs take their one driver (psycopg 3); SQLite URLs stay as given (URI filenames).
        self.url = url if url.startswith("sqlite") else parsed.render_as_string(hide_password=False)
        self.config = config
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.label = describe(self.url)  # in messages: no password, the schema named plainly
        self.engine = make_engine(self.url, busy_timeout_s=config.busy_timeout_s,
                                  pg_schema=schema_of(self.url) if is_postgres(self.url) else None)
        self.tx = Transactor(self.engine, max_retries=config.max_retries, label=self.label,
                             full_wait_s=config.disk_full_wait_s, outage_wait_s=config.outage_wait_s,
                             on_outage_end=self._record_outage)
        self._beats: dict[int, float] = {}  # rank -> monotonic time of this process's last write beating it
        self._watch = WatchState()  # this process's heartbeat watch (`reclaim_expired` with `control_tick`)

    # ---- opening -------------------------------------------------------------------------
    @classmethod
    def for_run_dir(cls, run_dir: Path, config: StoreConfig | None = None, *, read_only: bool = False) -> "RunStore":
        """The run's store: the one recorded in RUN_DIR/store.url, else `config.url` (PostgreSQL: in the run's
        own schema), else RUN_DIR/run.db. `read_only`: opened so that nothing can be written (PostgreSQL:
        read-only transactions), which on SQLite also works on a run directory one may only read (another
        user's run, an archive)."""
        config = config or StoreConfig()
        url = store_url(Path(run_dir), config.url, read_only=read_only)
        if not read_only or url != f"sqlite:///{Path(run_dir) / 'run.db'}":
            store = cls(url, config, run_dir=run_dir)
            if not read_only and (Path(run_dir) / POINTER_FILE).is_file():
                # A process of a run whose store exists (a rank, the control plane, a resume) waits out an
                # outage even before its first transaction: a rank restarted mid-outage must not fail for it.
                # The commands that only look fail at once instead.
                store.tx.has_reached_store = True
            return store
        path = (Path(run_dir) / "run.db").resolve()
        # immutable=1 where the directory is not writable: SQLite could create neither a journal
        # nor WAL's shared-memory file there, and nobody can be writing through it either.
        flags = "mode=ro" if os.access(path.parent, os.W_OK) else "mode=ro&immutable=1"
        return cls(f"sqlite:///file:{urllib.parse.quote(str(path))}?{flags}&uri=true", config, run_dir=run_dir)

    @property
    def sqlite_path(self) -> Path | None:
        if not self.url.startswith("sqlite:///"):
            return None
        rest = self.url.removeprefix("sqlite:///")
        if rest.startswith("file:"):  # a URI filename (read-only opening)
            return Path(urllib.parse.unquote(rest.removeprefix("file:").partition("?")[0]))
        return Path(rest)

    @property
    def dialect(self) -> str:
        """"sqlite" or "postgresql"."""
        return self.engine.dialect.name

    def create_schema(self) -> str:
        """Create tables and views (idempotent); on PostgreSQL first the run's own schema. A store that
        is not RUN_DIR/run.db is recorded in RUN_DIR/store.url. Returns the journal mode in force."""
        mode = "n/a"
        path = self.sqlite_path
        if path is not None:
            mode = choose_journal_mode(path, self.config.journal_mode)
            # Journal mode must be set outside any transaction (raw autocommit connection);
            # it persists in the database file for every later connection.
            raw = self.engine.raw_connection()
            try:
                cur = raw.cursor()
                mode = cur.execute(f"PRAGMA journal_mode = {mode}").fetchone()[0]
                cur.close()
            finally:
                raw.close()
            # Pooled connections chose their `synchronous` level under the old journal mode.
            self.engine.dispose()

        schema = schema_of(self.url) if self.dialect == "postgresql" else None

        def create(conn: Connection) -> None:
            if schema is not None:  # the run's namespace on a shared server; search_path already names it
                conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
            metadata.create_all(conn)
            for name in VIEWS:
                conn.execute(text(f"DROP VIEW IF EXISTS {name}"))
                conn.execute(text(f"CREATE VIEW {name} AS {view_sql(name, self.dialect)}"))

        self.tx.write(create)
        self._record_location()
        return str(mode)

    def _record_location(self) -> None:
        """Write RUN_DIR/store.url for a store outside the run directory, so that every later opening of the
        run (a rank, `tiderl status`, a resume with another config) finds this store."""
        if self.run_dir is None or self.url == f"sqlite:///{self.run_dir / 'run.db'}":
            return
        pointer = self.run_dir / POINTER_FILE
        if pointer.is_file() and pointer.read_text().strip() == self.url:
            return
        tmp = pointer.with_name(pointer.name + ".tmp")
        tmp.write_text(self.url + "\n")
        if make_url(self.url).password:  # a password in the URL: for the owner's eyes only
            tmp.chmod(0o600)
        os.replace(tmp, pointer)

    def upgrade_schema(self) -> list[str]:
        """Add the nullable columns a store made by an earlier TideRL lacks (nothing else changes
        shape between versions). Returns the columns added as "table.column"; a current store
        is only read."""
        def missing(c: Connection) -> list[tuple[str, Any]]:
            out = []
            present = set(inspect(c).get_table_names())
            for table in metadata.sorted_tables:
                if table.name not in present:
                    continue  # a table create_schema makes (an empty store has none: run_info then says so)
                have = {col["name"] for col in inspect(c).get_columns(table.name)}
                out += [(table.name, col) for col in table.columns if col.name not in have]
            return out

        todo = self.tx.read(missing)
        if not todo:
            return []
        for table, col in todo:
            if not col.nullable:
                raise StoreError(f"run store {self.label}: table {table} lacks column {col.name}, which cannot be "
                                 "added to an existing store")

        def add(c: Connection) -> None:
            for table, col in todo:
                kind = col.type.compile(dialect=self.engine.dialect)
                c.execute(text(f'ALTER TABLE {table} ADD COLUMN "{col.name}" {kind}'))

        self.tx.write(add)
        self.create_schema()  # new tables and views
        return [f"{t}.{c.name}" for t, c in todo]

    def close(self) -> None:
        self.engine.dispose()

    def _record_outage(self, started_at: float, seconds: float, error: str) -> None:
        """An event for `tiderl status`: this process could not reach the store for `seconds` and waited."""
        try:
            self.record_event("store", "store_unreachable",
                              f"the run store was unreachable for {seconds:.0f} s (pid {os.getpid()} on "
                              f"{socket.gethostname()} waited and carried on): {error[:300]}",
                              data={"started_at": started_at, "seconds": round(seconds, 3), "pid": os.getpid(),
                                    "host": socket.gethostname()})
        except StoreError as e:  # gone again: the next outage's end is reported instead
            log.warning("could not record the store outage of %.0f s: %s", seconds, e)

    # ---- run -----------------------------------------------------------------------------
    def init_run(self, *, name: str, system: str, config_yaml: str) -> None:
        now = time.time()
        row = dict(id=1, name=name, system=system, state=RunState.STARTING.value, version=0,
                   created_at=now, updated_at=now, config_yaml=config_yaml)
        self.tx.write(lambda c: c.execute(insert(runs).values(**row)))

    def set_run_state(self, state: RunState, message: str | None = None) -> None:
        now = time.time()
        values: dict[str, Any] = dict(state=state.value, updated_at=now)
        if message is not None:
            values["message"] = message
        if state in (RunState.FINISHED, RunState.FAILED, RunState.CANCELLED):
            values["finished_at"] = now
        self.tx.write(lambda c: c.execute(update(runs).where(runs.c.id == 1).values(**values)))

    def change_config(self, config_yaml: str, changed: Sequence[Mapping[str, Any]], *,
                      reopen_message: str | None = None) -> None:
        """A resume's `--set` overrides, in one transaction: the run's recorded config becomes `config_yaml`, a
        `config_changed` event names each changed key (old -> new), and with `reopen_message` a finished run
        that the change extends is running again (no end time)."""
        now = time.time()
        text = "; ".join(f"{c['key']}: {c['old']!r} -> {c['new']!r}" for c in changed)
        values: dict[str, Any] = dict(config_yaml=config_yaml, updated_at=now)
        if reopen_message is not None:
            values |= dict(state=RunState.RUNNING.value, message=reopen_message, finished_at=None)

        def write(c: Connection) -> None:
            c.execute(update(runs).where(runs.c.id == 1).values(**values))
            c.execute(insert(events).values(ts=now, rank=None, source="launcher", kind="config_changed",
                                            message=f"config changed on resume: {text}",
                                            data=json.dumps({"changes": list(changed)})))

        self.tx.write(write)

    def _run_row(self, *columns: Any) -> Any:
        """The run's row (those columns, else all). NoRunError, not a bare SQL error, where the store's file
        exists but its run has not yet written the tables or the row: a look at a run that is starting."""
        query = select(*columns) if columns else select(runs)
        try:
            row = self.tx.read(lambda c: c.execute(query.where(runs.c.id == 1)).first())
        except StoreError as e:
            if type(e) is not StoreError or self.tx.read(lambda c: inspect(c).has_table(runs.name)):
                raise
            raise NoRunError(f"run store {self.label}: no run recorded yet (no tables: the run is being "
                             "created, or its creation stopped before it wrote them)") from e
        if row is None:
            raise NoRunError(f"run store {self.label}: no run recorded")
        return row

    def run_info(self) -> RunRecord:
        row = self._run_row()
        return RunRecord(name=row.name, system=row.system, state=RunState(row.state), version=int(row.version),
                         created_at=row.created_at, updated_at=row.updated_at, finished_at=row.finished_at,
                         message=row.message, config_yaml=row.config_yaml, control_seen_at=row.control_seen_at)

    def trainer_generation(self) -> TrainerGeneration:
        row = self._run_row(runs.c.trainer_generation, runs.c.trainer_members)
        return TrainerGeneration(int(row.trainer_generation or 0), tuple(json.loads(row.trainer_members or "[]")))

    def advance_trainer_generation(self, seen: int, members: Sequence[int]) -> bool:
        """Start trainer generation `seen` + 1 with these member ranks, unless the generation is no longer
        `seen` (another process started one first). True when this call started it."""
        def advance(c: Connection) -> int:
            return c.execute(update(runs).where(runs.c.id == 1, func.coalesce(runs.c.trainer_generation, 0) == seen)
                             .values(trainer_generation=seen + 1, trainer_members=json.dumps(sorted(members)),
                                     updated_at=time.time())).rowcount

        return self.tx.write(advance) == 1

    # ---- ranks and roles -----------------------------------------------------------------
    def register_rank(self, rank: int, role: Role, *, host: str | None = None, pid: int | None = None) -> None:
        now = time.time()
        values = dict(role=role.value, state=RankState.RUNNING.value, host=host or socket.gethostname(),
                      pid=pid if pid is not None else os.getpid(), started_at=now, heartbeat_at=now)

        def upsert(c: Connection) -> None:
            if c.execute(update(ranks).where(ranks.c.rank == rank).values(**values)).rowcount == 0:
                c.execute(insert(ranks).values(rank=rank, version=0, **values))

        self.tx.write(upsert)

    def heartbeat(self, rank: int) -> None:
        self.tx.write(lambda c: _heartbeat(c, rank, time.time()), run_lock=False)  # one row: its own lock
        self._beats[rank] = time.monotonic()

    def beat_age_s(self, rank: int) -> float | None:
        """Seconds since a write of this process carried `rank`'s heartbeat (`heartbeat`, or a tick's
        `report`); None: none yet. A rank's heartbeat thread skips its own write while its reports beat."""
        at = self._beats.get(rank)
        return None if at is None else time.monotonic() - at

    def declare_dead(self, rank: int, message: str) -> ReclaimResult:
        """A rank whose process is known to be gone (its launcher saw it exit): dead now, its claims
        back in the pool, without waiting for the heartbeat timeout."""
        def write(c: Connection) -> ReclaimResult:
            n_tasks, n_traj = _declare_dead(c, [rank], time.time(), {rank: message})
            return ReclaimResult([rank], n_tasks, n_traj)

        return self.tx.write(write)

    def set_rank_state(self, rank: int, state: RankState) -> None:
        self.tx.write(lambda c: c.execute(update(ranks).where(ranks.c.rank == rank).values(state=state.value)))

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

    def position(self) -> tuple[RunState, int]:
        """(run state, last published version), in one read."""
        row = self._run_row(runs.c.state, runs.c.version)
        return RunState(row.state), int(row.version)

    def ranks(self) -> list[RankRecord]:
        return self.tx.read(lambda c: [
            RankRecord(rank=r.rank, role=Role(r.role), state=RankState(r.state), version=int(r.version), host=r.host,
                       pid=r.pid, started_at=r.started_at, heartbeat_at=r.heartbeat_at)
            for r in c.execute(select(ranks).order_by(ranks.c.rank))])

    # ---- tasks ---------------------------------------------------------------------------
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

    def claim_tasks(self, rank: int, limit: int, *, kinds: Iterable[TaskKind] = tuple(TaskKind),
                    weights_version: int | None = None) -> list[TaskClaim]:
        """Take up to `limit` pending tasks for `rank`: evaluation tasks first, then whole groups,
        oldest first. With `weights_version` (the weights the rank's engine holds), only the
        evaluation tasks of exactly that version qualify: an evaluation runs on the weights it
        evaluates, never on newer ones. (A rank reporting every tick claims inside its report
        instead: `RankReport.claim`, one transaction for both.)"""
        if limit <= 0:
            return []
        request = ClaimRequest(limit=limit, kinds=tuple(kinds), weights_version=weights_version)
        token = uuid.uuid4().hex  # once per call: a retry finds what a cut-off commit claimed

        attempts = [0]  # of this call's transaction: only a retry may find an earlier attempt committed

        def write(c: Connection) -> list[TaskClaim]:
            attempts[0] += 1
            now = time.time()
            _heartbeat(c, rank, now)
            return _claim(c, rank, request, now, token, retry=attempts[0] > 1)

        return self.tx.write(write)

    def report(self, report: RankReport, *, max_attempts: int = 3, retry_backoff_s: float = 0.0) -> dict[str, Any]:
        """Apply a rank's tick in one transaction: heartbeat, finished trajectories, failures,
        releases, task whereabouts, metrics, events, and last its claim of new tasks. Returns
        `accepted` and `dropped` trajectory counts and `claims` (the tasks claimed).

        A failed task goes back to pending, claimable from `retry_backoff_s` x 2^(attempts - 1) on,
        until its `max_attempts`-th failure fails it and its group; a task of a failed group never
        goes back to pending (released or failed, it fails too)."""
        token = uuid.uuid4().hex  # of the claim; once per call: a retry finds what a cut-off commit claimed

        attempts = [0]  # of this call's transaction: only a retry may find an earlier attempt committed

        def write(c: Connection) -> dict[str, Any]:
            attempts[0] += 1
            now = time.time()
            _heartbeat(c, report.rank, now, role=report.role, version=report.version)
            touched = [t.task_id for t in report.finished] + [f.task_id for f in report.failed] + list(report.released)
            if touched and c.dialect.name == "postgresql":
                # Without the run's writer lock (below): the groups of the tasks this tick finishes, fails or
                # releases are locked first, in id order, so that a group's completion counts every sibling
                # trajectory another report committed and a group fails or completes once.
                c.execute(_LOCK_GROUPS_OF_TASKS, dict(p_ids=sorted(set(touched))))
            accepted, dropped = _accept_trajectories(c, report.rank, report.finished, now)
            for f in report.failed:
                row = c.execute(select(tasks.c.attempts, tasks.c.group_id).where(
                    tasks.c.id == f.task_id, tasks.c.owner_rank == report.rank,
                    tasks.c.state == StoreTaskState.RUNNING.value)).first()
                if row is None:
                    continue
                final = row.attempts >= max_attempts
                retry_at = now + retry_backoff_s * 2 ** max(0, row.attempts - 1) if retry_backoff_s > 0 else None
                if not c.execute(update(tasks).where(  # still its: a reclaim may have come between
                        tasks.c.id == f.task_id, tasks.c.owner_rank == report.rank,
                        tasks.c.state == StoreTaskState.RUNNING.value).values(
                        state=(StoreTaskState.FAILED if final else StoreTaskState.PENDING).value, owner_rank=None,
                        claim_token=None, last_error=f.reason[:2000], updated_at=now, retry_at=retry_at)).rowcount:
                    continue
                if final:
                    _fail_group(c, row.group_id)
            if report.released:
                c.execute(update(tasks).where(tasks.c.id.in_(report.released), tasks.c.owner_rank == report.rank,
                                              tasks.c.state == StoreTaskState.RUNNING.value).values(
                    state=StoreTaskState.PENDING.value, owner_rank=None, claim_token=None, updated_at=now,
                    attempts=tasks.c.attempts - 1, progress=None))
            if report.failed or report.released:  # a task of a group that failed meanwhile fails with it
                touched = [f.task_id for f in report.failed] + list(report.released)
                failed_groups = select(task_groups.c.id).where(task_groups.c.state == GroupState.FAILED.value)
                c.execute(update(tasks).where(tasks.c.id.in_(touched), tasks.c.state == StoreTaskState.PENDING.value,
                                              tasks.c.group_id.in_(failed_groups)).values(
                    state=StoreTaskState.FAILED.value, last_error="its group failed or was dropped meanwhile",
                    progress=None))
            handed = [dict(tid=t, prog=json.dumps(p)) for t, p in report.handed_over.items()
                      if t in set(report.released)]
            if handed:  # just released by this rank above: pending, no owner
                c.execute(update(tasks).where(tasks.c.id == bindparam("tid"), tasks.c.owner_rank.is_(None),
                                              tasks.c.state == StoreTaskState.PENDING.value).values(
                    progress=bindparam("prog")), handed)
            if report.whereabouts:
                c.execute(update(tasks).where(tasks.c.id == bindparam("tid"), tasks.c.owner_rank == report.rank,
                                              tasks.c.state == StoreTaskState.RUNNING.value).values(
                    turn=bindparam("t_turn"), phase=bindparam("t_phase"), phase_since=bindparam("t_since"),
                    env_server=bindparam("t_server")),
                    [dict(tid=w.task_id, t_turn=w.turn, t_phase=w.phase, t_since=w.phase_since,
                          t_server=w.env_server) for w in report.whereabouts])
            claims = (_claim(c, report.rank, report.claim, now, token, retry=attempts[0] > 1)
                      if report.claim is not None else [])
            # Last, after every statement that may wait on a row lock: the ids these rows draw become visible
            # a moment later (tiderl.store.cursor counts on it).
            if report.metrics:
                c.execute(_INSERT_METRICS, [dict(ts=now, version=m.version, rank=report.rank, role=m.role, name=m.name,
                                                 value=float(m.value)) for m in report.metrics])
            if report.events:
                c.execute(insert(events), [dict(ts=now, rank=report.rank, source="rank", kind=e.kind,
                                                message=e.message, data=json.dumps(e.data) if e.data else None)
                                           for e in report.events])
            return {"accepted": accepted, "dropped": dropped, "claims": claims}

        # The run's writers take turns, but a report locks the rows it depends on itself (PostgreSQL; SQLite
        # has one write lock): ranks report at once, each waiting only for reports of the same groups.
        out = self.tx.write(write, run_lock=False)
        self._beats[report.rank] = time.monotonic()
        return out

    # ---- trainer side --------------------------------------------------------------------
    def claim_ready_groups(self, owner: int, max_groups: int) -> list[ReadyTrajectory]:
        """Claim up to `max_groups` complete training groups (oldest first) for trainer rank `owner`."""
        token = uuid.uuid4().hex

        def write(c: Connection) -> list[ReadyTrajectory]:
            now = time.time()
            _heartbeat(c, owner, now, tell_dead=False)
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
            doomed = [gid for gid in doomed if _fail_group(c, gid, f"its group was dropped: {reason}")]
            if not doomed:
                return []
            c.execute(insert(events).values(ts=time.time(), rank=None, source="store", kind="groups_dropped",
                                            message=f"{len(doomed)} open groups dropped: {reason}",
                                            data=json.dumps({"groups": doomed})))
            return doomed

        return self.tx.write(write)

    def release_claims(self, owner: int) -> int:
        """Give a trainer's claimed (unpublished) trajectories back to the pool."""
        return self.tx.write(lambda c: _return_trajectories(c, [owner]))

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

    # ---- liveness ------------------------------------------------------------------------
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

    # ---- control plane side --------------------------------------------------------------
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
                _fail_group(c, gid)
            c.execute(insert(events).values(ts=time.time(), rank=None, source="store", kind="eval_expired",
                                            message=f"{n} evaluation tasks of versions before {oldest_live_version} "
                                                    "expired", data=json.dumps({"groups": gids})))
            return n

        return self.tx.write(write)

    def oldest_ready_at(self) -> float | None:
        """When the oldest trajectory still waiting for the trainer became ready."""
        return self.tx.read(lambda c: c.execute(select(func.min(trajectories.c.ready_at)).where(
            trajectories.c.state == TrajectoryState.READY.value)).scalar())

    def latest_metrics(self, names: Iterable[str]) -> dict[str, float]:
        """The newest value of each metric in `names` that has one."""
        def read(c: Connection) -> dict[str, float]:
            out = {}
            for n in names:
                v = c.execute(select(metrics.c.value).where(metrics.c.name == n)
                              .order_by(metrics.c.id.desc()).limit(1)).scalar()
                if v is not None:
                    out[n] = float(v)
            return out

        return self.tx.read(read)

    def record_event(self, source: str, kind: str, message: str, *, rank: int | None = None,
                     data: dict | None = None) -> None:
        row = dict(ts=time.time(), rank=rank, source=source, kind=kind, message=message,
                   data=json.dumps(data) if data else None)
        self.tx.write(lambda c: c.execute(insert(events).values(**row)))

    # ---- reading -------------------------------------------------------------------------
    def view(self, name: str) -> list[dict[str, Any]]:
        if name not in VIEWS:
            raise StoreError(f"unknown view {name!r} (views: {', '.join(VIEWS)})")
        return self.tx.read(lambda c: [dict(r) for r in c.execute(text(f"SELECT * FROM {name}")).mappings()])

    def step_window(self, version: int, start_ts: float, end_ts: float) -> StepWindow:
        """What ERS reads of the step that published `version` (tiderl.policy.ers.StepObservation): the
        trajectory tokens it trained on and those of the groups it dropped as stale, the training groups completed in
        [start_ts, end_ts) (their tokens, creation-to-completion seconds, slowest task's environment
        seconds, tasks, and the tasks' environment seconds, seconds in a task slot and waits for one), the rank-seconds
        of the rollout and wait metrics recorded in it, by metric and role, and whether an evaluation
        group was open during it."""
        def read(c: Connection) -> StepWindow:
            rows = c.execute(
                select(task_groups.c.created_at, task_groups.c.completed_at,
                       func.sum(trajectories.c.num_tokens).label("tokens"),
                       func.max(func.coalesce(trajectories.c.env_s, 0.0)).label("env_s"),
                       func.count(trajectories.c.id).label("tasks"),
                       func.sum(func.coalesce(trajectories.c.env_s, 0.0)).label("task_env_s"),
                       # From the task's (last) claim by a rollout rank to its end: its time in a task slot.
                       func.sum(func.coalesce(trajectories.c.finished_at - tasks.c.claimed_at, 0.0)).label("slot_s"),
                       func.sum(func.coalesce(tasks.c.claimed_at - task_groups.c.created_at, 0.0)).label("wait_s"))
                .join(trajectories, trajectories.c.group_id == task_groups.c.id)
                .join(tasks, tasks.c.id == trajectories.c.task_id)
                .where(task_groups.c.kind == TaskKind.TRAIN.value, task_groups.c.completed_at >= start_ts,
                       task_groups.c.completed_at < end_ts)
                .group_by(task_groups.c.id, task_groups.c.created_at, task_groups.c.completed_at)).all()
            sums = c.execute(select(metrics.c.name, metrics.c.role, func.sum(metrics.c.value))
                             .where(metrics.c.ts >= start_ts, metrics.c.ts < end_ts,
                                    metrics.c.name.in_(("rollout_idle_s", "rollout_busy_s", "twt_s")))
                             .group_by(metrics.c.name, metrics.c.role)).all()
            consumed = c.execute(select(versions.c.trained_tokens).where(versions.c.version == version)).scalar()
            dropped = _dropped_groups(c, start_ts, end_ts)
            dropped_tokens = c.execute(select(func.sum(trajectories.c.num_tokens)).where(
                trajectories.c.group_id.in_(dropped))).scalar() if dropped else 0
            evals = c.execute(select(func.count()).select_from(task_groups).where(
                task_groups.c.kind == TaskKind.EVAL.value, task_groups.c.created_at < end_ts,
                or_(task_groups.c.state == GroupState.OPEN.value, task_groups.c.completed_at >= start_ts))).scalar()
            return StepWindow(
                evaluation=bool(evals),
                groups_completed=len(rows), produced_tokens=int(sum(r.tokens or 0 for r in rows)),
                group_latency_sum_s=sum(max(0.0, r.completed_at - r.created_at) for r in rows),
                group_env_sum_s=sum(r.env_s or 0.0 for r in rows),
                tasks_completed=int(sum(r.tasks or 0 for r in rows)),
                task_env_sum_s=sum(r.task_env_s or 0.0 for r in rows),
                task_slot_sum_s=sum(max(0.0, r.slot_s or 0.0) for r in rows),
                task_wait_sum_s=sum(max(0.0, r.wait_s or 0.0) for r in rows),
                rank_s={(name, role): float(v or 0.0) for name, role, v in sums},
                consumed_tokens=int(consumed or 0), stale_dropped_tokens=int(dropped_tokens or 0))

        return self.tx.read(read)

    def dropped_groups(self, start_ts: float | None = None, end_ts: float | None = None) -> list[int]:
        """The training groups dropped as too stale to train in [start_ts, end_ts) (all of the run's when
        unbounded): those the trainer dropped at its claim and those the control plane dropped while open."""
        return self.tx.read(lambda c: _dropped_groups(c, start_ts, end_ts))

    def buffer_state(self) -> BufferState:
        row = self.view("buffer_state")[0]
        return BufferState(**{f: int(row[f] or 0) for f in BufferState.__slots__})

    def steps(self) -> list[dict[str, Any]]:
        """The `step_summary` view, each step's `env_figures` read back as a dict (step_figures.py; {} in the view
        of a store an earlier TideRL made, read without upgrading it)."""
        return [s | {"env_figures": parse_env_figures(s.get("env_figures"))} for s in self.view("step_summary")]

    # ---- reading for monitoring (tiderl status, tiderl report, the Prometheus exporter) ----------
    def outstanding_groups(self) -> list[dict[str, Any]]:
        """Groups not finished with (open, ready, claimed), oldest first: their finished-task count and
        their unfinished tasks (`unfinished`: pending or running task rows)."""
        live = (GroupState.OPEN.value, GroupState.READY.value, GroupState.CLAIMED.value)

        def read(c: Connection) -> list[dict[str, Any]]:
            done = (select(trajectories.c.group_id, func.count().label("n")).group_by(trajectories.c.group_id)
                    .subquery())
            groups = [dict(r) | {"unfinished": []} for r in c.execute(
                select(task_groups.c.id, task_groups.c.kind, task_groups.c.state, task_groups.c.size,
                       task_groups.c.created_at, func.coalesce(done.c.n, 0).label("num_done"))
                .outerjoin(done, done.c.group_id == task_groups.c.id)
                .where(task_groups.c.state.in_(live)).order_by(task_groups.c.id)).mappings()]
            by_id = {g["id"]: g for g in groups}
            for t in c.execute(select(tasks.c.id, tasks.c.group_id, tasks.c.state, tasks.c.owner_rank,
                                      tasks.c.claimed_at, tasks.c.attempts, tasks.c.last_error, tasks.c.turn,
                                      tasks.c.phase, tasks.c.phase_since, tasks.c.env_server)
                               .where(tasks.c.state.in_([StoreTaskState.PENDING.value, StoreTaskState.RUNNING.value]))
                               .order_by(tasks.c.id)).mappings():
                if t["group_id"] in by_id:
                    by_id[t["group_id"]]["unfinished"].append(dict(t))
            return groups

        return self.tx.read(read)

    def trainer_claims(self) -> list[dict[str, Any]]:
        """Per trainer rank holding claimed trajectories: how many groups and its latest claim time."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(trajectories.c.claim_owner.label("rank"),
                   func.count(func.distinct(trajectories.c.group_id)).label("groups"),
                   func.max(trajectories.c.claimed_at).label("latest_claimed_at"))
            .where(trajectories.c.state == TrajectoryState.CLAIMED.value)
            .group_by(trajectories.c.claim_owner)).mappings()])

    def metric_sums(self, names: Sequence[str], *, since: float | None = None) -> list[dict[str, Any]]:
        """Sum of each metric per (name, rank, role), over rows recorded at or after `since`."""
        def read(c: Connection) -> list[dict[str, Any]]:
            q = (select(metrics.c.name, metrics.c.rank, metrics.c.role, func.sum(metrics.c.value).label("value"),
                        func.count().label("count"), func.max(metrics.c.ts).label("last_ts"))
                 .where(metrics.c.name.in_(list(names))))
            if since is not None:
                q = q.where(metrics.c.ts >= since)
            return [dict(r) for r in c.execute(q.group_by(metrics.c.name, metrics.c.rank, metrics.c.role))
                    .mappings()]

        return self.tx.read(read)

    def metric_rows(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """Every recorded point of these metrics (ts, version, rank, role, name, value), in time order."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(metrics.c.ts, metrics.c.version, metrics.c.rank, metrics.c.role, metrics.c.name,
                   metrics.c.value).where(metrics.c.name.in_(list(names))).order_by(metrics.c.ts, metrics.c.id))
            .mappings()])

    def metric_rows_after(self, after_id: int, names: Sequence[str], *, limit: int = 50_000) -> list[dict[str, Any]]:
        """Points of these metrics recorded after row `after_id` (id, ts, version, rank, role, name, value), in
        id order, at most `limit`: an incremental reader keeps the last id and asks again."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(metrics.c.id, metrics.c.ts, metrics.c.version, metrics.c.rank, metrics.c.role, metrics.c.name,
                   metrics.c.value).where(metrics.c.id > after_id, metrics.c.name.in_(list(names)))
            .order_by(metrics.c.id).limit(limit)).mappings()])

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

    def recent_events(self, limit: int = 50, *, kinds: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The latest events, newest first."""
        def read(c: Connection) -> list[dict[str, Any]]:
            q = select(events.c.ts, events.c.rank, events.c.source, events.c.kind, events.c.message)
            if kinds is not None:
                q = q.where(events.c.kind.in_(list(kinds)))
            return [dict(r) for r in c.execute(q.order_by(events.c.id.desc()).limit(limit)).mappings()]

        return self.tx.read(read)

    def version_checksum(self, version: int) -> str | None:
        """The checksum the trainer recorded when it published `version` (None: not published)."""
        return self.tx.read(lambda c: c.execute(
            select(versions.c.checksum).where(versions.c.version == version)).scalar())

    def version_rows(self) -> list[dict[str, Any]]:
        """Every published version with its publish time and step statistics, ascending."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(versions.c.version, versions.c.created_at, versions.c.step_started_at, versions.c.duration_s,
                   versions.c.num_trajectories, versions.c.consumed_tokens, versions.c.reward_mean,
                   versions.c.success_rate, versions.c.max_staleness, versions.c.ras, versions.c.tprm_s,
                   versions.c.ra2p_mode, versions.c.loss, versions.c.turns_mean,
                   versions.c.turns_max).order_by(versions.c.version)).mappings()])

    def control_rows(self) -> list[dict[str, Any]]:
        """Every role record (version, rank, role, ra2p_mode, created_at), ascending by version."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(control.c.version, control.c.rank, control.c.role, control.c.ra2p_mode, control.c.created_at)
            .order_by(control.c.version, control.c.rank)).mappings()])

    def staleness_counts(self) -> list[dict[str, Any]]:
        """Trained trajectories and their generated tokens per staleness (versions between the oldest
        weights that generated a token and the weights the step trained)."""
        staleness = (trajectories.c.consumed_version - 1 - trajectories.c.min_version).label("staleness")
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(staleness, func.count().label("trajectories"),
                   func.sum(trajectories.c.num_generated).label("tokens"))
            .where(trajectories.c.state == TrajectoryState.CONSUMED.value)
            .group_by(staleness).order_by(staleness)).mappings()])

    def group_holding(self, from_version: int = 1) -> dict[str, Any]:
        """Where the trained training groups created at the publication of `from_version` or later spent
        their time in flight (a group created during the start-up waits for the engines to start), means
        per group in seconds, as the simulator's `group_holding` (docs/simulator.md): from its creation
        to its completion (the report of its last task), until the trainer's claim of its first
        trajectory, and until the publication of the version that trained it."""
        start = select(versions.c.created_at).where(versions.c.version == from_version).scalar_subquery()
        rows = self.tx.read(lambda c: c.execute(
            select(task_groups.c.created_at, task_groups.c.completed_at,
                   func.min(trajectories.c.claimed_at).label("claimed_at"),
                   versions.c.created_at.label("published_at"))
            .join(trajectories, trajectories.c.group_id == task_groups.c.id)
            .join(versions, versions.c.version == trajectories.c.consumed_version)
            .where(task_groups.c.kind == TaskKind.TRAIN.value, task_groups.c.created_at >= start)
            .group_by(task_groups.c.id, task_groups.c.created_at, task_groups.c.completed_at,
                      versions.c.created_at)).all())
        rows = [r for r in rows if r.completed_at is not None and r.claimed_at is not None]
        n = len(rows)

        def mean(values: Iterable[float]) -> float | None:
            return round(sum(values) / n, 3) if n else None

        return {"groups": n,
                "release_to_seen_s": mean(r.completed_at - r.created_at for r in rows),
                "seen_to_claim_s": mean(r.claimed_at - r.completed_at for r in rows),
                "claim_to_publish_s": mean(r.published_at - r.claimed_at for r in rows)}

    def eval_rows(self) -> list[dict[str, Any]]:
        """Per evaluated version: tasks, mean reward, success rate and the time the last task finished."""
        return self.tx.read(lambda c: [dict(r) for r in c.execute(
            select(task_groups.c.eval_version, func.count().label("num_tasks"),
                   func.avg(trajectories.c.reward).label("reward_mean"),
                   func.avg(cast(trajectories.c.success, Float)).label("success_rate"),
                   func.max(trajectories.c.finished_at).label("finished_at"))
            .join(task_groups, task_groups.c.id == trajectories.c.group_id)
            .where(task_groups.c.kind == TaskKind.EVAL.value)
            .group_by(task_groups.c.eval_version).order_by(task_groups.c.eval_version)).mappings()])


# ---- helpers running inside a transaction ----------------------------------------------------
def _heartbeat(c: Connection, rank: int, now: float, *, role: Role | None = None, version: int | None = None,
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


# Statements of every tick, built once (building one and its cache key is much of a report's CPU).
_MARK_DONE = update(tasks).where(
    tasks.c.id.in_(bindparam("p_ids", expanding=True)), tasks.c.owner_rank == bindparam("p_rank"),
    tasks.c.state == StoreTaskState.RUNNING.value).values(
    state=StoreTaskState.DONE.value, updated_at=bindparam("p_now")).returning(
    tasks.c.id, tasks.c.group_id, tasks.c.kind)
_INSERT_TRAJECTORIES = insert(trajectories)
_LOCK_GROUPS_OF_TASKS = select(task_groups.c.id).where(task_groups.c.id.in_(
    select(tasks.c.group_id).where(tasks.c.id.in_(bindparam("p_ids", expanding=True))))).order_by(
    task_groups.c.id).with_for_update()
_INSERT_METRICS = insert(metrics)
_counts = (select(trajectories.c.group_id, func.count().label("n"))
           .where(trajectories.c.group_id.in_(bindparam("p_gids", expanding=True)))
           .group_by(trajectories.c.group_id).subquery())
_COMPLETE_GROUPS = select(task_groups.c.id, task_groups.c.kind).join(
    _counts, _counts.c.group_id == task_groups.c.id).where(
    task_groups.c.state == GroupState.OPEN.value, _counts.c.n >= task_groups.c.size)


def _accept_trajectories(c: Connection, rank: int, finished: Sequence[FinishedTrajectory], now: float) -> tuple[int, int]:
    """Insert the trajectories of tasks `rank` still owns; drop the rest (reclaimed meanwhile)."""
    if not finished:
        return 0, 0
    # One statement finds the tasks `rank` still owns and marks them done (writers of a run take turns, and
    # the WHERE is re-checked under the row lock: a task reclaimed meanwhile is not returned).
    owned = {r.id: r for r in c.execute(_MARK_DONE, dict(p_ids=sorted({t.task_id for t in finished}), p_rank=rank,
                                                         p_now=now))}
    rows = []
    for t in finished:
        task = owned.pop(t.task_id, None)  # pop: a task reported twice in one tick counts once
        if task is None:
            continue
        gen_versions = [v for v, m in zip(t.token_versions, t.loss_mask) if m]
        rows.append(dict(
            task_id=t.task_id, group_id=task.group_id, kind=task.kind, rank=rank, state=TrajectoryState.WAITING.value,
            token_ids=codec.pack_ints(t.token_ids), loss_mask=codec.pack_mask(t.loss_mask),
            logprobs=codec.pack_floats(t.logprobs), token_versions=codec.pack_ints(t.token_versions),
            num_tokens=len(t.token_ids), num_generated=len(gen_versions), num_turns=t.num_turns,
            reward=float(t.reward), success=int(bool(t.success)), min_version=min(gen_versions, default=0),
            max_version=max(gen_versions, default=0), finished_at=now, env_s=t.env_s, finish=t.finish, env=t.env,
            images=codec.pack_blobs(t.images) if t.images else None,
            prunes=json.dumps([list(p) for p in t.prunes]) if t.prunes else None))
    if rows:
        c.execute(_INSERT_TRAJECTORIES, rows)
        _complete_groups(c, {r["group_id"] for r in rows}, now)
    # Not owned any more, yet recorded from this rank: this call's earlier attempt committed (a retry).
    redone = {t for (t,) in c.execute(select(trajectories.c.task_id).where(
        trajectories.c.task_id.in_([t.task_id for t in finished if t.task_id not in {r["task_id"] for r in rows}]),
        trajectories.c.rank == rank))} if len(rows) < len(finished) else set()
    accepted = len(rows) + len(redone)
    return accepted, len({t.task_id for t in finished}) - accepted


def _complete_groups(c: Connection, gids: set[int], now: float) -> None:
    """Groups among `gids` whose every task has a trajectory: write advantages, mark them ready."""
    complete = c.execute(_COMPLETE_GROUPS, dict(p_gids=sorted(gids))).all()
    ready_rows = []
    for gid, kind in complete:
        if kind == TaskKind.EVAL.value:
            c.execute(update(trajectories).where(trajectories.c.group_id == gid).values(
                state=TrajectoryState.EVAL.value, ready_at=now))
            state = GroupState.EVALUATED
        else:
            rows = c.execute(select(trajectories.c.id, trajectories.c.reward).where(trajectories.c.group_id == gid)
                             .order_by(trajectories.c.id)).all()
            advantages = group_advantages([r for _, r in rows])
            ready_rows += [{"tid": tid, "adv": adv} for (tid, _), adv in zip(rows, advantages)]
            state = GroupState.READY
        c.execute(update(task_groups).where(task_groups.c.id == gid).values(state=state.value, completed_at=now))
    if ready_rows:
        c.execute(update(trajectories).where(trajectories.c.id == bindparam("tid")).values(
            advantage=bindparam("adv"), state=TrajectoryState.READY.value, ready_at=now), ready_rows)


def _claim(c: Connection, rank: int, request: ClaimRequest, now: float, token: str, *,
           retry: bool = True) -> list[TaskClaim]:
    """Claim per `request` with `token`, in one statement: the oldest claimable tasks (evaluation tasks
    first, then whole groups) go to running and come back. `retry`: an earlier attempt of this call may
    have committed (its COMMIT cut off); then what it claimed is returned, nothing more. A first attempt
    (`retry=False`) cannot have committed anything, so it skips that look-up."""
    if request.limit <= 0:
        return []
    if retry and c.execute(select(tasks.c.id).where(tasks.c.claim_token == token).limit(1)).first() is not None:
        return _claimed(c, token)  # this call's earlier attempt committed before its connection was cut
    claim, counts = _claim_statements(tuple(k.value for k in request.kinds), request.weights_version is not None)
    params = dict(p_now=now, p_rank=rank, p_token=token, p_wv=request.weights_version)
    limit = request.limit
    if request.spread:  # `tiderl.policy.ctb.claim_limit` with the store's counts, in one statement
        n_running, n_claimable, held, alive = c.execute(counts, params).one()
        limit = claim_limit(limit, held, n_running + n_claimable, alive)
        if limit <= 0:
            return []
    # The tasks the UPDATE's subquery picks are still pending when it updates them: SQLite's writers take
    # turns; PostgreSQL's subquery locks the rows it picks and passes over those another claim holds.
    rows = sorted(c.execute(claim, params | {"p_lim": limit}), key=lambda r: r.id)
    carried = [r.id for r in rows if r.progress is not None]
    if carried:  # progress is carried on once: if this claimer dies, the session may have moved past it
        c.execute(update(tasks).where(tasks.c.id.in_(carried)).values(progress=None))
    return [_task_claim(r) for r in rows]


@functools.lru_cache(maxsize=64)
def _claim_statements(kinds: tuple[str, ...], pinned: bool) -> tuple[Any, Any]:
    """The claim, built once per (kinds, pinned to a weights version) and reused, its cache key with it (the
    Python work of building a statement is much of a report's CPU): one UPDATE ... RETURNING whose subquery
    picks the oldest claimable tasks (evaluation tasks first, then by id: whole groups first), and the
    counts a spread claim needs (tasks running on any rank or claimable now, the rank's running tasks, the
    rollout ranks alive). Parameters: p_now, p_rank, p_token, p_wv (weights version), p_lim."""
    is_eval = tasks.c.kind == TaskKind.EVAL.value
    where = [tasks.c.state == StoreTaskState.PENDING.value, tasks.c.kind.in_(list(kinds)),
             or_(tasks.c.retry_at.is_(None), tasks.c.retry_at <= bindparam("p_now"))]
    if pinned:
        where.append(~is_eval | tasks.c.group_id.in_(
            select(task_groups.c.id).where(task_groups.c.eval_version == bindparam("p_wv"))))
    # Its own FROM tasks, not the UPDATE's row. SKIP LOCKED (PostgreSQL): reports claim without the run's
    # writer lock, each passing over the pending rows another claim is taking.
    # A CTE, evaluated once: PostgreSQL may run an IN subquery with LIMIT ... FOR UPDATE more than once.
    picked = select(select(tasks.c.id).where(*where).order_by(case((is_eval, 0), else_=1), tasks.c.id)
                    .limit(bindparam("p_lim")).with_for_update(skip_locked=True).cte("picked").c.id)
    eval_version = (select(task_groups.c.eval_version).where(task_groups.c.id == tasks.c.group_id)
                    .correlate(tasks).scalar_subquery())
    claim = update(tasks).where(tasks.c.id.in_(picked), tasks.c.state == StoreTaskState.PENDING.value).values(
        state=StoreTaskState.RUNNING.value, owner_rank=bindparam("p_rank"), claim_token=bindparam("p_token"),
        claimed_at=bindparam("p_now"), updated_at=bindparam("p_now"), attempts=tasks.c.attempts + 1, turn=None,
        phase=None, phase_since=None, env_server=None).returning(
        tasks.c.id, tasks.c.group_id, tasks.c.index_in_group, tasks.c.kind, tasks.c.seed, tasks.c.attempts,
        tasks.c.progress, eval_version.label("eval_version"))
    running = tasks.c.state == StoreTaskState.RUNNING.value
    counts = select(
        select(func.count()).select_from(tasks).where(running).scalar_subquery(),
        select(func.count()).select_from(tasks).where(*where).scalar_subquery(),
        select(func.count()).select_from(tasks).where(running, tasks.c.owner_rank == bindparam("p_rank"))
        .scalar_subquery(),
        select(func.count()).select_from(ranks).where(
            ranks.c.role == Role.ROLLOUT.value,
            ranks.c.state.in_([RankState.STARTING.value, RankState.RUNNING.value])).scalar_subquery())
    return claim, counts


def _claimed(c: Connection, token: str) -> list[TaskClaim]:
    """The tasks claimed with `token` that their claimer still holds."""
    q = (select(tasks, task_groups.c.eval_version).join(task_groups, task_groups.c.id == tasks.c.group_id)
         .where(tasks.c.claim_token == token, tasks.c.state == StoreTaskState.RUNNING.value).order_by(tasks.c.id))
    return [_task_claim(r) for r in c.execute(q)]


def _task_claim(r: Any) -> TaskClaim:
    return TaskClaim(task_id=r.id, group_id=r.group_id, index_in_group=r.index_in_group, kind=TaskKind(r.kind),
                     seed=r.seed, attempts=r.attempts, eval_version=r.eval_version,
                     progress=json.loads(r.progress) if r.progress else None)


def _already_published(c: Connection, step: VersionRecord) -> bool:
    """`step` is recorded already, with its weights and its trajectories (a retry after a cut-off commit)."""
    row = c.execute(select(versions.c.path, versions.c.checksum).where(versions.c.version == step.version)).first()
    if row is None or (row.path, row.checksum) != (step.path, step.checksum):
        return False
    ids = list(step.trajectory_ids)
    consumed = c.execute(select(func.count()).where(trajectories.c.id.in_(ids),
                                                   trajectories.c.consumed_version == step.version)).scalar_one()
    return consumed == len(set(ids))


def _dropped_groups(c: Connection, start_ts: float | None, end_ts: float | None) -> list[int]:
    """Each drop (drop_claimed_groups, drop_doomed_groups) writes one `groups_dropped` event in the
    transaction that drops its groups, listing them."""
    q = select(events.c.data).where(events.c.kind == "groups_dropped")
    if start_ts is not None:
        q = q.where(events.c.ts >= start_ts)
    if end_ts is not None:
        q = q.where(events.c.ts < end_ts)
    return [g for (data,) in c.execute(q) for g in json.loads(data or "{}").get("groups", [])]


def _fail_group(c: Connection, gid: int, reason: str = "another task of its group failed for good") -> bool:
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


# ---- the heartbeat watch: whom a watcher may declare dead ----------------------------------------
WATCH_GAP_FRACTION = 0.5  # a watch more than this share of the timeout after the previous one starts afresh,
WATCH_GAP_MIN_S = 3.0  # but not one this close: the control plane watches every second; a slow tick is no gap
MASS_GRACE_FRACTION = 0.5  # most ranks silent at once: declared only if still so this share of the timeout later


@dataclass(frozen=True)
class WatchState:
    """What a heartbeat watcher remembers between two of its watches, all on its own clock: in memory
    (a new watcher, such as a restarted control plane, starts afresh and so gives every rank a fresh
    timeout)."""
    last_at: float | None = None  # its previous watch
    since: float | None = None  # the start of its current stretch of watching without a gap
    held_at: float | None = None  # when it first held back a verdict that most ranks were dead


def watch_verdict(beats: Mapping[int, float], now: float, timeout_s: float,
                  state: WatchState) -> tuple[list[int], WatchState, str]:
    """Which live ranks a heartbeat watch at `now` declares dead: (ranks, the watcher's new state,
    a note when it held back a verdict, else ""). `beats`: each live rank's last heartbeat time.

    Invariant: a rank is declared dead only when (1) it has been silent for more than `timeout_s`
    counted from the later of its last beat and the start of the watcher's current stretch of
    continuous watching (a stretch ends when two watches are more than `WATCH_GAP_FRACTION` x
    `timeout_s` and more than `WATCH_GAP_MIN_S` apart, or the clock went back), and (2) if that
    would declare at least two ranks and more than half of the live ones at once, the verdict held
    at the watches of a grace period (`MASS_GRACE_FRACTION` x `timeout_s`) of continuous watching
    after it was first reached.

    Why: the ranks write their beats, the watcher compares them with its own clock. A watcher that
    was itself away (a starved or paused process or machine, a store lock it waited on) finds every
    beat old when it wakes, although the ranks may have been just as stalled as it was or beating
    into a store it could not read; by (1) it starts a fresh timeout from its wake-up instead. The
    gap is measured between the watcher's own watches, on its own clock, never against a rank's.
    A rank truly gone (one silent, the others beating) under a watcher that watched throughout is
    declared at the first watch past its last beat + `timeout_s`: within the timeout and one watch
    interval."""
    gap = None if state.last_at is None else now - state.last_at
    continuous = gap is not None and 0.0 <= gap <= max(WATCH_GAP_FRACTION * timeout_s, WATCH_GAP_MIN_S)
    since = state.since if continuous and state.since is not None else now
    silent = sorted(r for r, beat in beats.items() if now - max(beat, since) > timeout_s)
    note = ""
    if gap is not None and not continuous:
        old = sorted(r for r, beat in beats.items() if now - beat > timeout_s)
        if old:
            note = (f"the watch resumed {gap:.0f} s after the previous one (the watcher itself was away): ranks "
                    f"{old} look silent past the {timeout_s:.0f} s timeout, but each gets a fresh timeout from now")
    held_at = None
    if len(silent) >= 2 and 2 * len(silent) > len(beats):
        grace = MASS_GRACE_FRACTION * timeout_s
        if state.held_at is None or not continuous:
            held_at = now
            note = (f"ranks {silent} ({len(silent)} of {len(beats)}) look dead at once: held back, declared only "
                    f"if still silent {grace:.0f} s from now")
            silent = []
        elif now - state.held_at < grace:
            held_at, silent = state.held_at, []
    return silent, WatchState(last_at=now, since=since, held_at=held_at), note


def _declare_dead(c: Connection, dead: list[int], t: float, messages: dict[int, str]) -> tuple[int, int]:
    """Mark `dead` ranks dead and give their claims back: running tasks to pending, claimed
    trajectories to ready. Returns (tasks, trajectories) returned."""
    c.execute(update(ranks).where(ranks.c.rank.in_(dead)).values(state=RankState.DEAD.value))
    n_tasks = c.execute(update(tasks).where(tasks.c.owner_rank.in_(dead),
                                            tasks.c.state == StoreTaskState.RUNNING.value).values(
        state=StoreTaskState.PENDING.value, owner_rank=None, claim_token=None, updated_at=t)).rowcount
    n_traj = _return_trajectories(c, dead)
    c.execute(insert(events), [dict(ts=t, rank=r, source="store", kind="rank_dead", message=messages[r])
                               for r in dead])
    return n_tasks, n_traj


def _return_trajectories(c: Connection, owners: list[int]) -> int:
    claimed = select(trajectories.c.group_id).where(trajectories.c.claim_owner.in_(owners),
                                                    trajectories.c.state == TrajectoryState.CLAIMED.value).distinct()
    c.execute(update(task_groups).where(task_groups.c.id.in_(claimed)).values(state=GroupState.READY.value))
    return c.execute(update(trajectories).where(trajectories.c.claim_owner.in_(owners),
                                                trajectories.c.state == TrajectoryState.CLAIMED.value).values(
        state=TrajectoryState.READY.value, claim_owner=None, claim_token=None, claimed_at=None)).rowcount


def _ready(r: Any) -> ReadyTrajectory:
    return ReadyTrajectory(
        id=r["id"], group_id=r["group_id"], rank=r["rank"], token_ids=codec.unpack_ints(r["token_ids"]),
        loss_mask=codec.unpack_mask(r["loss_mask"]), logprobs=codec.unpack_floats(r["logprobs"]),
        token_versions=codec.unpack_ints(r["token_versions"]), reward=r["reward"], advantage=r["advantage"],
        num_tokens=r["num_tokens"], num_generated=r["num_generated"], min_version=r["min_version"],
        ready_at=r["ready_at"], finish=r["finish"], images=tuple(codec.unpack_blobs(r["images"])) if r["images"] else (),
        prunes=tuple((int(at), int(d)) for at, d in json.loads(r["prunes"])) if r["prunes"] else ())
