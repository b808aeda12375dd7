"""Many processes hammering one run store the way a run does: rollout ranks claim tasks and
report trajectories, trainers claim ready groups and publish versions, readers query views.

Two loads, both through RunStore's public methods only:
- `run_load`: a fixed pool of tasks played to the end by a few writers, claimers and readers
  (tests/test_store_concurrency.py: correctness under contention).
- `run_rank_load`: the per-tick traffic of N rollout ranks, a control plane and a trainer for a
  fixed time, first open-loop at the run's own schedule, then closed-loop flat out
  (tools/bench_store.py: commits/s, commit latency, headroom).

Each worker process writes a JSON result file.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tiderl.config.store import StoreConfig
from tiderl.store import (
    ClaimRequest,
    FinishedTrajectory,
    GroupState,
    MetricPoint,
    NewGroup,
    RankReport,
    RankState,
    Role,
    RunStore,
    StoreError,
    TaskKind,
    VersionRecord,
)


@dataclass(frozen=True)
class LoadSpec:
    run_dir: str
    num_writers: int = 4
    num_claimers: int = 2
    num_readers: int = 1
    num_groups: int = 200
    group_size: int = 2
    tasks_per_claim: int = 4
    groups_per_claim: int = 2
    crash_writer: bool = False  # writer 0 claims tasks and dies without reporting (os._exit)
    heartbeat_timeout_s: float = 2.0
    deadline_s: float = 300.0
    store_url: str | None = None  # store.url of the run (None: RUN_DIR/run.db); the workers find it in RUN_DIR


def prepare(spec: LoadSpec) -> None:
    s = RunStore.for_run_dir(Path(spec.run_dir), StoreConfig(url=spec.store_url))
    s.create_schema()
    s.init_run(name="load", system="tiderl", config_yaml="system: tiderl\n")
    s.register_initial_version("weights/v0", "0")
    s.add_groups([NewGroup(TaskKind.TRAIN, i, spec.group_size) for i in range(spec.num_groups)])
    s.close()


def _traj(task_id: int, rng: random.Random, n: int | None = None) -> FinishedTrajectory:
    n = n if n is not None else rng.randint(20, 60)
    mask = [0] * 8 + [1] * (n - 8)
    return FinishedTrajectory(task_id=task_id, token_ids=[rng.randrange(256) for _ in range(n)], loss_mask=mask,
                              logprobs=[-0.1 * m for m in mask], token_versions=[0 if m else -1 for m in mask],
                              num_turns=3, reward=float(rng.random() < 0.5), success=False)


def writer(spec: LoadSpec, rank: int, out: str) -> None:
    s = RunStore.for_run_dir(Path(spec.run_dir))
    s.register_rank(rank, Role.ROLLOUT)
    rng = random.Random(rank)
    claims = commits = 0
    start = time.time()
    held: list = []
    while time.time() - start < spec.deadline_s:
        # One transaction per tick, as a rollout rank does: the finished trajectories of the
        # tasks claimed last tick go in with the claim of the next ones.
        got = s.report(RankReport(rank=rank, finished=[_traj(c.task_id, rng) for c in held],
                                  claim=ClaimRequest(limit=spec.tasks_per_claim)))["claims"]
        commits += 1
        if spec.crash_writer and rank == 0 and got:
            os._exit(0)  # a killed rank: its claims must come back through heartbeat expiry
        held = got
        if not got:
            buf = s.buffer_state()
            if buf.tasks_pending == 0 and buf.tasks_running == 0:
                break
            time.sleep(0.05)
            continue
        claims += len(got)
    s.set_rank_state(rank, RankState.STOPPED)
    Path(out).write_text(json.dumps({"role": "writer", "rank": rank, "claims": claims, "commits": commits,
                                     "seconds": time.time() - start, "t_ready": start, "t_end": time.time(),
                                     "retries": s.tx.num_retries}))


def claimer(spec: LoadSpec, rank: int, out: str) -> None:
    s = RunStore.for_run_dir(Path(spec.run_dir))
    s.register_rank(rank, Role.ACTOR)
    claimed: list[int] = []
    published: list[int] = []
    commits = 0
    start = time.time()
    total = spec.num_groups * spec.group_size
    while time.time() - start < spec.deadline_s:
        got = s.claim_ready_groups(rank, spec.groups_per_claim)
        commits += 1
        if not got:
            buf = s.buffer_state()
            if buf.traj_consumed >= total:
                break
            time.sleep(0.02)
            s.heartbeat(rank)
            commits += 1
            continue
        ids = [t.id for t in got]
        claimed += ids
        while True:  # two trainers race for the next version number; the loser retries with the next one
            version = s.run_info().version + 1
            try:
                s.publish_version(VersionRecord(version=version, path=f"weights/v{version}", checksum="x",
                                                trajectory_ids=ids, step_started_at=start, duration_s=0.01),
                                  owner=rank)
                commits += 1
                published.append(version)
                break
            except StoreError as e:
                if "published after" not in str(e):
                    raise
    s.set_rank_state(rank, RankState.STOPPED)
    Path(out).write_text(json.dumps({"role": "claimer", "rank": rank, "claimed": claimed, "versions": published,
                                     "commits": commits, "seconds": time.time() - start, "t_ready": start,
                                     "t_end": time.time(), "retries": s.tx.num_retries}))


def reader(spec: LoadSpec, rank: int, out: str) -> None:
    s = RunStore.for_run_dir(Path(spec.run_dir))
    reads = 0
    start = time.time()
    total = spec.num_groups * spec.group_size
    while time.time() - start < spec.deadline_s:
        buf = s.buffer_state()
        s.view("rank_roles")
        s.steps()
        reads += 3
        if buf.traj_consumed >= total:
            break
        time.sleep(0.2)  # a status poller or dashboard, several times a second
    Path(out).write_text(json.dumps({"role": "reader", "reads": reads, "seconds": time.time() - start}))


def run_load(spec: LoadSpec, out_dir: Path) -> dict:
    """Run all workers to completion; the parent reclaims expired heartbeats. Returns merged results."""
    prepare(spec)
    ctx = mp.get_context("spawn")
    procs = []
    rank = 0
    for kind, n in ((writer, spec.num_writers), (claimer, spec.num_claimers), (reader, spec.num_readers)):
        for _ in range(n):
            out = str(out_dir / f"worker{rank}.json")
            procs.append((ctx.Process(target=kind, args=(spec, rank, out)), out))
            rank += 1
    start = time.time()
    if spec.crash_writer:
        # The crashing writer claims and dies before the others start: under load the others could
        # otherwise drain the pool before it is even imported, and there would be nothing to reclaim.
        procs[0][0].start()
        procs[0][0].join(timeout=spec.deadline_s)
    for p, _ in procs:
        if p.pid is None:
            p.start()
    parent = RunStore.for_run_dir(Path(spec.run_dir))
    while any(p.is_alive() for p, _ in procs):
        parent.reclaim_expired(spec.heartbeat_timeout_s)
        time.sleep(0.2)
        if time.time() - start > spec.deadline_s + 30:
            for p, _ in procs:
                p.kill()
            raise TimeoutError(f"store load did not finish within {spec.deadline_s} s")
    wall_s = time.time() - start
    results = [json.loads(Path(out).read_text()) for p, out in procs if Path(out).exists()]
    exit_codes = [p.exitcode for p, _ in procs]
    parent.close()
    return {"wall_s": wall_s, "results": results, "exit_codes": exit_codes}


# ---- the per-tick traffic of N ranks (tools/bench_store.py) ----------------------------------

CLOSED_GAP_S = 1.0  # between the open-loop and the closed-loop phase: the open phase's last transactions end
CLOSED_RAMP_S = 1.0  # the closed phase's first second is not measured: every rank thread gets going


@dataclass(frozen=True)
class RankLoadSpec:
    """N rollout ranks played by `num_workers` processes (threads in each, one per rank, each rank with its
    own RunStore: its own engine and connection), plus one control-plane and one trainer process.

    Open loop (`open_s`, after `warmup_s`): each rank ticks every `tick_s` at its own phase (one transaction:
    heartbeat, the trajectories of the tasks it claimed last tick, a metric, the claim of `tasks_per_tick`
    new tasks, as `RankReport` carries them), reads the run's position before it (as `RankContext.boundary`
    does), and beats every `heartbeat_s` on its own where no report beat for it meanwhile (a rank's
    heartbeat thread: with a tick shorter than `heartbeat_s`, never). Closed loop (`closed_s`):
    the same mix (a heartbeat every heartbeat_s / tick_s ticks) back to back, as fast as the store takes it.
    The control plane runs its tick all along: position, planned version and group counts every
    `control_tick_s`, the heartbeat watch (`reclaim_expired`, a write) once a second from when every rank
    has beaten since the start, fresh groups when few are open; the trainer claims ready groups once a
    second and publishes a version every `step_s`."""

    run_dir: str
    num_ranks: int
    num_workers: int = 32
    tick_s: float = 1.0
    heartbeat_s: float = 2.0
    tasks_per_tick: int = 1
    traj_tokens: int = 512
    group_size: int = 8
    warmup_s: float = 3.0
    open_s: float = 15.0
    closed_s: float = 10.0
    control_tick_s: float = 0.2
    step_s: float = 10.0
    heartbeat_timeout_s: float = 60.0
    store_url: str | None = None

    @property
    def open_window(self) -> tuple[float, float]:
        """Measured span of the open-loop phase, in seconds after t0."""
        return self.warmup_s, self.warmup_s + self.open_s

    @property
    def closed_window(self) -> tuple[float, float]:
        start = self.warmup_s + self.open_s + CLOSED_GAP_S
        return start + CLOSED_RAMP_S, start + self.closed_s

    @property
    def low_water_groups(self) -> int:
        """Open groups below which the control plane feeds more (enough that ranks never run dry). An open
        group may hold no pending task (its tasks running, or done and waiting for a sibling), and the
        tasks in flight can span a group per rank: twice that keeps pending tasks for every claim. (A
        quarter of it let 128 ranks flat out drain the pool between feeds: a tick that claims nothing is a
        cheaper commit, which flatters the capacity.)"""
        return max(64, 2 * self.num_ranks * self.tasks_per_tick)


def prepare_ranks(spec: RankLoadSpec) -> None:
    s = RunStore.for_run_dir(Path(spec.run_dir), StoreConfig(url=spec.store_url))
    s.create_schema()
    s.init_run(name="bench", system="tiderl", config_yaml="system: tiderl\n")
    s.register_initial_version("weights/v0", "0")
    s.add_groups([NewGroup(TaskKind.TRAIN, i, spec.group_size) for i in range(2 * spec.low_water_groups)])
    s.close()


class _Log:
    """What one thread saw: each write transaction as (end time, seconds, kind), reads, errors."""

    def __init__(self) -> None:
        self.writes: list[tuple[float, float, str]] = []
        self.lags: list[tuple[float, float]] = []  # (scheduled time, how late the tick started) in the open loop
        self.reads = 0
        self.claims = 0
        self.starved = 0
        self.errors: list[str] = []

    def timed(self, kind: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.time()
        try:
            out = fn(*args, **kwargs)
        except StoreError as e:
            self.errors.append(f"{kind}: {e}"[:300])
            return None
        end = time.time()
        self.writes.append((end, end - t, kind))
        return out

    def as_dict(self) -> dict:
        return {"writes": self.writes, "lags": self.lags, "reads": self.reads, "claims": self.claims,
                "starved": self.starved, "errors": self.errors}


def _sleep_until(t: float) -> None:
    wait = t - time.time()
    if wait > 0:
        time.sleep(wait)


def _rank_tick(s: RunStore, rank: int, spec: RankLoadSpec, held: list, rng: random.Random, log: _Log) -> list:
    try:
        s.position()  # RankContext.boundary: has a new version been published?
    except StoreError as e:
        log.errors.append(f"position: {e}"[:300])
        return held
    log.reads += 1
    report = RankReport(rank=rank, role=Role.ROLLOUT, version=0,
                        finished=[_traj(c.task_id, rng, spec.traj_tokens) for c in held],
                        claim=ClaimRequest(limit=spec.tasks_per_tick, weights_version=0),
                        metrics=[MetricPoint("rollout_busy_s", spec.tick_s, 0, "rollout")])
    out = log.timed("report", s.report, report)
    if out is None:
        return held
    log.claims += len(out["claims"])
    log.starved += not out["claims"]
    return out["claims"]


def _play_rank(s: RunStore, rank: int, spec: RankLoadSpec, t0: float, log: _Log) -> None:
    rng = random.Random(rank)
    held: list = []
    next_tick = t0 + rng.random() * spec.tick_s
    next_beat = t0 + rng.random() * spec.heartbeat_s
    open_end = t0 + spec.warmup_s + spec.open_s
    # Open loop: at the rank's own schedule, late ticks not skipped (a store that cannot keep up falls behind,
    # and what is still due at the phase's end is dropped).
    while min(next_tick, next_beat) < open_end and time.time() < open_end:
        if next_tick <= next_beat:
            _sleep_until(next_tick)
            log.lags.append((next_tick, time.time() - next_tick))
            held = _rank_tick(s, rank, spec, held, rng, log)
            next_tick += spec.tick_s
        else:
            _sleep_until(next_beat)
            _beat_if_due(s, rank, spec, log)
            next_beat += spec.heartbeat_s
    closed_start = open_end + CLOSED_GAP_S
    closed_end = t0 + spec.closed_window[1]
    beat_every = max(1, round(spec.heartbeat_s / spec.tick_s))
    _sleep_until(closed_start)
    n = 0
    while time.time() < closed_end:  # closed loop: the same mix, flat out
        held = _rank_tick(s, rank, spec, held, rng, log)
        n += 1
        if n % beat_every == 0:
            _beat_if_due(s, rank, spec, log)


def _beat_if_due(s: RunStore, rank: int, spec: RankLoadSpec, log: _Log) -> None:
    """A rank's heartbeat thread: it writes only when no report beat for it within `heartbeat_s`
    (`tiderl.run.rank._heartbeats`)."""
    age = s.beat_age_s(rank)
    if age is None or age >= spec.heartbeat_s:
        log.timed("heartbeat", s.heartbeat, rank)


def _wait_go(ready, go, t0_box) -> float:  # type: ignore[no-untyped-def]
    ready.put(os.getpid())
    go.wait()
    return t0_box.value


def rank_worker(spec: RankLoadSpec, ranks: list[int], ready, go, t0_box,  # type: ignore[no-untyped-def]
                out: str) -> None:
    stores = {r: RunStore.for_run_dir(Path(spec.run_dir)) for r in ranks}
    for r, s in stores.items():
        s.register_rank(r, Role.ROLLOUT)
    logs = {r: _Log() for r in ranks}
    t0 = _wait_go(ready, go, t0_box)
    threads = [threading.Thread(target=_play_rank, args=(stores[r], r, spec, t0, logs[r]), daemon=True)
               for r in ranks]
    for t in threads:
        t.start()
    for t in threads:  # a rank stuck in a lock wait past the end is cut off, not waited for
        t.join(timeout=max(1.0, t0 + spec.closed_window[1] + 60 - time.time()))
    Path(out).write_text(json.dumps({"role": "ranks", "ranks": ranks, "logs": [logs[r].as_dict() for r in ranks],
                                     "retries": sum(s.tx.num_retries for s in stores.values())}))
    os._exit(0)  # threads still inside a transaction do not hold the result up


def control_worker(spec: RankLoadSpec, rank: int, ready, go, t0_box, out: str) -> None:  # type: ignore[no-untyped-def]
    """The control plane's store traffic (tiderl.run.control.ControlPlane.tick), without its policies."""
    s = RunStore.for_run_dir(Path(spec.run_dir))
    log = _Log()
    t0 = _wait_go(ready, go, t0_box)
    end = t0 + spec.closed_window[1]
    # The watch starts once every rank has beaten since t0: before, a rank's heartbeat_at dates from its
    # registration, which is longer ago than the timeout when hundreds of ranks take minutes to set up
    # (real ranks beat from their start on).
    next_tick, next_watch, seed, watching = t0, t0, 1_000_000, False
    while next_tick < end:
        _sleep_until(next_tick)
        try:
            if not watching:
                watching = all(r.heartbeat_at >= t0 for r in s.ranks() if r.rank < spec.num_ranks)
                log.reads += 1
            s.position()
            s.latest_planned_version()
            open_groups = s.groups_by_state(TaskKind.TRAIN)[GroupState.OPEN]
            s.groups_by_state(TaskKind.EVAL)
            log.reads += 4
        except StoreError as e:
            log.errors.append(str(e)[:300])
            open_groups = spec.low_water_groups
        if watching and time.time() >= next_watch:
            log.timed("watch", s.reclaim_expired, spec.heartbeat_timeout_s, control_tick=True)
            next_watch = max(next_watch + 1.0, time.time() + 0.5)
        if open_groups < spec.low_water_groups:
            n = spec.low_water_groups
            log.timed("feed", s.add_groups, [NewGroup(TaskKind.TRAIN, seed + i, spec.group_size) for i in range(n)])
            seed += n
        next_tick = max(next_tick + spec.control_tick_s, time.time())
    Path(out).write_text(json.dumps({"role": "control", "logs": [log.as_dict()], "retries": s.tx.num_retries}))


def trainer_worker(spec: RankLoadSpec, rank: int, ready, go, t0_box, out: str) -> None:  # type: ignore[no-untyped-def]
    """A trainer's store traffic: claim ready groups once a second, publish a version every `step_s`."""
    s = RunStore.for_run_dir(Path(spec.run_dir))
    s.register_rank(rank, Role.ACTOR)
    log = _Log()
    t0 = _wait_go(ready, go, t0_box)
    end = t0 + spec.closed_window[1]
    claimed: list[int] = []
    version, step_at, next_claim = 0, t0 + spec.step_s, t0
    while next_claim < end:
        _sleep_until(next_claim)
        got = log.timed("trainer_claim", s.claim_ready_groups, rank, 64)
        claimed += [t.id for t in got or []]
        if time.time() >= step_at and claimed:
            record = VersionRecord(version=version + 1, path=f"weights/v{version + 1}", checksum="x",
                                   trajectory_ids=claimed, step_started_at=step_at - spec.step_s,
                                   duration_s=spec.step_s)
            failed = len(log.errors)
            log.timed("publish", s.publish_version, record, owner=rank)
            if len(log.errors) == failed:
                version, claimed = version + 1, []
            step_at += spec.step_s
        next_claim = max(next_claim + 1.0, time.time())
    Path(out).write_text(json.dumps({"role": "trainer", "logs": [log.as_dict()], "retries": s.tx.num_retries}))


def run_rank_load(spec: RankLoadSpec, out_dir: Path, *, setup_timeout_s: float = 600.0) -> dict:
    """Prepare the store, start every process, start them together once all are set up (imports,
    engines, rank rows: process start-up is not store traffic), collect their logs. `t0` is the
    common start (wall time); windows in the spec are relative to it."""
    prepare_ranks(spec)
    ctx = mp.get_context("spawn")
    ready, go, t0_box = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    workers = max(1, min(spec.num_workers, spec.num_ranks))
    procs = []
    for w in range(workers):
        ranks = list(range(w, spec.num_ranks, workers))
        out = str(out_dir / f"ranks{w}.json")
        procs.append((ctx.Process(target=rank_worker, args=(spec, ranks, ready, go, t0_box, out)), out))
    for i, kind in enumerate((control_worker, trainer_worker)):
        out = str(out_dir / f"{kind.__name__}.json")
        procs.append((ctx.Process(target=kind, args=(spec, spec.num_ranks + i, ready, go, t0_box, out)), out))
    for p, _ in procs:
        p.start()
    setup_start = time.time()
    num_ready = 0
    while num_ready < len(procs):
        try:
            ready.get(timeout=1.0)
            num_ready += 1
        except queue.Empty:
            dead = [p.exitcode for p, _ in procs if p.exitcode is not None]
            if dead or time.time() - setup_start > setup_timeout_s:
                for p, _ in procs:
                    p.kill()
                raise RuntimeError(f"rank load: {len(procs) - num_ready} of {len(procs)} processes not set up "
                                   f"after {time.time() - setup_start:.0f} s (exit codes of those gone: {dead})")
    setup_s = time.time() - setup_start
    t0_box.value = time.time() + 0.5
    go.set()
    deadline = t0_box.value + spec.closed_window[1] + 120
    for p, _ in procs:
        p.join(timeout=max(1.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
    results = [json.loads(Path(out).read_text()) for _, out in procs if Path(out).exists()]
    return {"t0": t0_box.value, "setup_s": setup_s, "results": results, "exit_codes": [p.exitcode for p, _ in procs],
            "num_workers": workers}


# ---- the cost of one tick's report (tools/bench_store.py --profile) ----------------------------------


def profile_reports(run_dir: Path, store_url: str | None, *, reports: int = 200, tokens: int = 512,
                    spread: bool = False, warmup: int = 10) -> dict:
    """What one typical `RunStore.report` costs, one process alone on a fresh store: a rank's tick with one
    finished trajectory of `tokens` tokens (the task it claimed the tick before), a metric, its heartbeat,
    the claim of one task (`spread`: as a real rollout rank claims, with `ClaimRequest.spread`).

    Counts the SQL statements the store sends (SQLAlchemy's `before_cursor_execute`: an executemany is one;
    SQLite's `BEGIN IMMEDIATE` and PostgreSQL's writer lock, `SELECT pg_advisory_xact_lock`, are among them;
    the driver's own BEGIN and COMMIT and the pool's connection check on PostgreSQL are not) and times each
    report: wall and this process's CPU (the client's Python, SQLAlchemy and driver work; the server's own
    CPU is not in it)."""
    from sqlalchemy import event

    run_dir.mkdir(parents=True, exist_ok=True)
    s = RunStore.for_run_dir(run_dir, StoreConfig(url=store_url))
    s.create_schema()
    s.init_run(name="profile", system="tiderl", config_yaml="system: tiderl\n")
    s.register_initial_version("weights/v0", "0")
    s.register_rank(0, Role.ROLLOUT)
    s.set_rank_state(0, RankState.RUNNING)
    group_size = 8
    s.add_groups([NewGroup(TaskKind.TRAIN, i, group_size) for i in range(-(-(reports + warmup + 2) // group_size))])
    statements: list[str] = []

    @event.listens_for(s.engine, "before_cursor_execute")
    def _count(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        statements.append(statement.split(None, 1)[0].upper())

    rng = random.Random(0)
    held: list = []
    walls: list[float] = []
    cpus: list[float] = []
    per_report: list[int] = []
    kinds: dict[str, int] = {}
    claimed = 0
    for i in range(warmup + reports):
        report = RankReport(rank=0, role=Role.ROLLOUT, version=0,
                            finished=[_traj(c.task_id, rng, tokens) for c in held],
                            claim=ClaimRequest(limit=1, weights_version=0, spread=spread),
                            metrics=[MetricPoint("rollout_busy_s", 1.0, 0, "rollout")])
        del statements[:]
        w0, c0 = time.perf_counter(), time.process_time()
        out = s.report(report)
        w1, c1 = time.perf_counter(), time.process_time()
        held = out["claims"]
        if i < warmup:
            continue
        claimed += len(held)
        walls.append(w1 - w0)
        cpus.append(c1 - c0)
        per_report.append(len(statements))
        for k in statements:
            kinds[k] = kinds.get(k, 0) + 1
    s.close()
    walls.sort()
    cpus.sort()
    n = len(walls)
    return {
        "reports": n, "tokens": tokens, "spread": spread, "claimed": claimed,
        "statements_per_report": round(sum(per_report) / n, 2),
        "statements_min_max": [min(per_report), max(per_report)],
        "statement_kinds_per_report": {k: round(v / n, 2) for k, v in sorted(kinds.items())},
        "wall_ms_mean": round(1000 * sum(walls) / n, 2), "wall_ms_p50": round(1000 * walls[n // 2], 2),
        "cpu_ms_mean": round(1000 * sum(cpus) / n, 2), "cpu_ms_p50": round(1000 * cpus[n // 2], 2),
    }
