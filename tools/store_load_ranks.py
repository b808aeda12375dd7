"""The per-tick store traffic of N rollout ranks, a control plane and a trainer, for a fixed time: first
open-loop at the run's own schedule, then closed-loop flat out (tools/bench_store.py: commits/s, commit
latency, headroom). Through RunStore's public methods only; each process writes a JSON log file."""

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

from store_load import _traj

from tiderl.config.store import StoreConfig
from tiderl.store import (
    ClaimRequest,
    GroupState,
    MetricPoint,
    NewGroup,
    RankReport,
    Role,
    RunStore,
    StoreError,
    TaskKind,
    VersionRecord,
)

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
