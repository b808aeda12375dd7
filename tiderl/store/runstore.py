"""The run store: every process of a run coordinates through it.

`RunStore` holds the run's write transactions and their exactly-once rules (below), split by purpose
into mixins of their own modules, and here opening the store, its schema, the run's row and the reads
every process of the run uses:
- `rank_side.py` (`RankTransactions`): a rank's registration, heartbeats, task claims and its tick's report;
- `trainer_side.py` (`TrainerTransactions`): the trainer's claims of ready groups, its drops and its publish;
- `control_side.py` (`ControlTransactions`): the control plane's plans, feed, drops, evaluations and heartbeat
  watch (whose verdict is the pure `tiderl.store.watch.watch_verdict`);
- `shared_tx.py`: the steps inside a transaction that more than one side takes (a heartbeat, failing a
  group, giving claimed trajectories back).
Reads for one purpose live apart, on the same engine and transactions: `store.reader`
(`tiderl.store.reader.RunReader`: what `tiderl status`, `report`, the Prometheus exporter and the
TensorBoard writer read) and `store.measure` (`tiderl.store.measure.StepMeasure`: what the control plane
measures of each step for ERS).

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
  (`shared_tx.fail_group` fails only an open group; the control plane's drop skips a
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, func, insert, inspect, select, text, update
from sqlalchemy.engine import make_url

from tiderl.config.store import StoreConfig
from tiderl.store.control_side import ControlTransactions
from tiderl.store.engine import NoRunError, StoreError, Transactor, choose_journal_mode, make_engine
from tiderl.store.location import POINTER_FILE, describe, is_postgres, parse_store_url, schema_of, store_url
from tiderl.store.measure import StepMeasure
from tiderl.store.rank_side import RankTransactions
from tiderl.store.reader import RunReader
from tiderl.store.schema import VIEWS, events, metadata, ranks, runs, view_sql
from tiderl.store.shared_tx import RankDeclaredDeadError
from tiderl.store.step_figures import parse_env_figures
from tiderl.store.trainer_side import ClaimLostError, TrainerTransactions
from tiderl.store.types import (BufferState, ForkOrigin, RankRecord, RankState, Role, RunRecord, RunState,
                                TrainerGeneration)
from tiderl.store.watch import WatchState

__all__ = ["ClaimLostError", "RankDeclaredDeadError", "RunStore"]

log = logging.getLogger("tiderl.store")


class RunStore(RankTransactions, TrainerTransactions, ControlTransactions):
    """The run's store: its write transactions (here and in the sides it is made of), the reads every
    process of the run uses, and `reader` and `measure` for the monitoring and ERS reads."""

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

    def existing_tables(self) -> frozenset[str] | None:
        """The tables this store's place holds before `create_schema` makes the store there (`drop_created`
        takes back the rest): those of its PostgreSQL schema or SQLite file; None where that does not exist."""
        if self.sqlite_path is not None and not self.sqlite_path.exists():
            return None  # not connected: connecting would create the file
        schema = schema_of(self.url) if self.dialect == "postgresql" else None

        def read(c: Connection) -> frozenset[str] | None:
            if schema is not None and c.execute(text("SELECT 1 FROM pg_namespace WHERE nspname = :name"),
                                                {"name": schema}).first() is None:
                return None
            return frozenset(inspect(c).get_table_names(schema=schema))

        return self.tx.read(read)

    def drop_created(self, before: frozenset[str] | None) -> None:
        """Take back the store a run being created made here and failed to finish (a fork), given what its
        place held before (`existing_tables`): a PostgreSQL schema or SQLite file that did not exist goes whole;
        one that held none of the store's tables loses the store's tables and views, the rest of it kept; one
        that held a store already (another run's: the creation failed on it) is left as it is."""
        path = self.sqlite_path
        if before is not None and before & set(metadata.tables):
            return
        if before is None and path is not None:
            for f in (path, *(path.with_name(path.name + side) for side in ("-wal", "-shm", "-journal"))):
                f.unlink(missing_ok=True)
            return
        schema = schema_of(self.url) if self.dialect == "postgresql" else None

        def drop(c: Connection) -> None:
            if before is None and schema is not None:
                c.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
                return
            for name in VIEWS:
                c.execute(text(f"DROP VIEW IF EXISTS {name}"))
            metadata.drop_all(c)

        self.tx.write(drop)

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

    def start_fork(self, origin: ForkOrigin, changed: Sequence[Mapping[str, Any]]) -> None:
        """A fork's new store starts at the version of the source's checkpoint, in one transaction: the run's
        version, and a `forked` event naming the source, its checkpoint, its feed's count and the `--set`
        overrides (old -> new), which `fork_origin` reads back."""
        now = time.time()
        text = "".join(f"; {c['key']}: {c['old']!r} -> {c['new']!r}" for c in changed)
        data = {"run_dir": origin.run_dir, "step": origin.step, "version": origin.version,
                "source_train_groups": origin.source_train_groups, "changes": list(changed)}

        def write(c: Connection) -> None:
            c.execute(update(runs).where(runs.c.id == 1).values(version=origin.version, updated_at=now))
            c.execute(insert(events).values(ts=now, rank=None, source="launcher", kind="forked",
                                            message=f"forked from {origin.run_dir} at its checkpoint of step "
                                                    f"{origin.step} (version {origin.version}){text}",
                                            data=json.dumps(data)))

        self.tx.write(write)

    def fork_origin(self) -> ForkOrigin | None:
        """Where this run was forked from (`start_fork`); None for a run of its own."""
        raw = self.tx.read(lambda c: c.execute(select(events.c.data).where(events.c.kind == "forked")
                                               .order_by(events.c.id).limit(1)).scalar())
        if raw is None:
            return None
        data = json.loads(raw)
        return ForkOrigin(run_dir=data["run_dir"], step=int(data["step"]), version=int(data["version"]),
                          source_train_groups=int(data["source_train_groups"]))

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

    def record_event(self, source: str, kind: str, message: str, *, rank: int | None = None,
                     data: dict | None = None) -> None:
        row = dict(ts=time.time(), rank=rank, source=source, kind=kind, message=message,
                   data=json.dumps(data) if data else None)
        self.tx.write(lambda c: c.execute(insert(events).values(**row)))

    def position(self) -> tuple[RunState, int]:
        """(run state, last published version), in one read."""
        row = self._run_row(runs.c.state, runs.c.version)
        return RunState(row.state), int(row.version)

    def ranks(self) -> list[RankRecord]:
        return self.tx.read(lambda c: [
            RankRecord(rank=r.rank, role=Role(r.role), state=RankState(r.state), version=int(r.version), host=r.host,
                       pid=r.pid, started_at=r.started_at, heartbeat_at=r.heartbeat_at)
            for r in c.execute(select(ranks).order_by(ranks.c.rank))])

    # ---- reading (every process of the run) ----------------------------------------------
    def view(self, name: str) -> list[dict[str, Any]]:
        if name not in VIEWS:
            raise StoreError(f"unknown view {name!r} (views: {', '.join(VIEWS)})")
        return self.tx.read(lambda c: [dict(r) for r in c.execute(text(f"SELECT * FROM {name}")).mappings()])

    def buffer_state(self) -> BufferState:
        row = self.view("buffer_state")[0]
        return BufferState(**{f: int(row[f] or 0) for f in BufferState.__slots__})

    def steps(self) -> list[dict[str, Any]]:
        """The `step_summary` view, each step's `env_figures` read back as a dict (step_figures.py; {} in the view
        of a store an earlier TideRL made, read without upgrading it)."""
        return [s | {"env_figures": parse_env_figures(s.get("env_figures"))} for s in self.view("step_summary")]

    def recent_events(self, limit: int = 50, *, kinds: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The latest events, newest first."""
        def read(c: Connection) -> list[dict[str, Any]]:
            q = select(events.c.ts, events.c.rank, events.c.source, events.c.kind, events.c.message)
            if kinds is not None:
                q = q.where(events.c.kind.in_(list(kinds)))
            return [dict(r) for r in c.execute(q.order_by(events.c.id.desc()).limit(limit)).mappings()]

        return self.tx.read(read)

    @functools.cached_property
    def reader(self) -> RunReader:
        """The monitoring reads (`tiderl status`, `report`, the Prometheus exporter, TensorBoard)."""
        return RunReader(self)

    @functools.cached_property
    def measure(self) -> StepMeasure:
        """What the control plane measures of each step for ERS (and status and report show)."""
        return StepMeasure(self)
