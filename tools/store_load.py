"""Many processes hammering one run store the way a run does: rollout ranks claim tasks and
report trajectories, trainers claim ready groups and publish versions, readers query views.

Two loads, both through RunStore's public methods only:
- `run_load` (here): a fixed pool of tasks played to the end by a few writers, claimers and readers
  (tests/test_store_concurrency.py: correctness under contention).
- `run_rank_load` (tools/store_load_ranks.py): the per-tick traffic of N rollout ranks, a control plane
  and a trainer for a fixed time, first open-loop at the run's own schedule, then closed-loop flat out
  (tools/bench_store.py: commits/s, commit latency, headroom).

Each worker process writes a JSON result file. One tick's report alone, its statements and time, is
`profile_reports` (tools/store_load_profile.py).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from tiderl.config.store import StoreConfig
from tiderl.store import (
    ClaimRequest,
    FinishedTrajectory,
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
